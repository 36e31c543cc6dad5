"""oneDNN-packed linear layers against F.linear, and the model packing its projections and head."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import get_ops
from kernels.cpu import library
from replica.executor import packed_linear
from replica.executor.config import ModelConfig
from replica.executor.model import LlamaForCausalLM
from replica.executor.packed_linear import PackedLinear

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packed_linear.can_pack(CPU, torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(PackedLinear.from_linear(linear)(x), F.linear(x, linear.weight, linear.bias),
                               atol=1e-5, rtol=1e-5)
    if packed_linear.can_pack(CPU, torch.bfloat16):  # bf16: the same oneDNN kernel as F.linear, bit for bit
        weight, x16 = linear.weight.detach().bfloat16(), x.bfloat16()
        assert torch.equal(PackedLinear(weight)(x16), F.linear(x16, weight))


def test_can_pack_only_cpu_float_dtypes():
    assert not packed_linear.can_pack(torch.device("cuda"), torch.float32)
    assert not packed_linear.can_pack(CPU, torch.float16)


def small_model(tied: bool) -> LlamaForCausalLM:
    """Weights: qkv 64 x 32, o 32 x 32, gate_up 96 x 32, down 32 x 48, head 50 x 32."""
    config = ModelConfig(architecture="llama", vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position=64, tie_word_embeddings=tied, attention_bias=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, get_ops("torch"), CPU)
    for param in model.parameters():
        param.data.normal_()
    return model


def projections(*names: str) -> list[str]:
    return sorted(f"model.layers.{layer}.{name}" for layer in (0, 1) for name in names)


@pytest.mark.parametrize("small_batch", [False, pytest.param(True, marks=pytest.mark.skipif(
    not library.available(), reason="no C++ compiler to build the CPU kernels"))])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("min_weights, packed_projections, head_packed", [
    (0, projections("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"), True),
    # a packed call's fixed cost outweighs a small matmul: o (1024), down (1536) and the head (1600) stay plain
    (2048, projections("self_attn.qkv_proj", "mlp.gate_up_proj"), False),
])
def test_model_packs_the_weights_worth_it_and_keeps_its_logits(tied, min_weights, packed_projections, head_packed,
                                                               small_batch, monkeypatch):
    monkeypatch.setattr(packed_linear, "MIN_PACKED_WEIGHTS", min_weights)
    model = small_model(tied)
    hidden = torch.randn(5, 32)
    expected = model.compute_logits(hidden)
    model.pack_linear_weights(small_batch)
    packed = sorted(name for name, module in model.named_modules()
                    if isinstance(module, PackedLinear) and name.startswith("model."))
    assert packed == packed_projections
    assert isinstance(model.packed_lm_head, PackedLinear) == head_packed
    packed_layers = [module for module in model.modules() if isinstance(module, PackedLinear)]
    assert all((layer.small_batch_weight is not None) == small_batch for layer in packed_layers)
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=1e-5)


def test_small_batch_copy_only_where_it_takes_at_most_a_quarter_of_memory(monkeypatch):
    model = nn.Linear(256, 256, bias=False)  # 262,144 bytes of fp32 weights
    for physical_bytes, fits in [(4 * 262_144, True), (4 * 262_144 - 4096, False)]:
        monkeypatch.setattr(packed_linear.os, "sysconf", {"SC_PAGE_SIZE": 4096,
                                                          "SC_PHYS_PAGES": physical_bytes // 4096}.__getitem__)
        assert packed_linear.small_batch_copy_fits(model) == fits
