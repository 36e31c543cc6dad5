"""Small CPU batches through the decoder layers in one C++ call: the same hidden states and KV cache,
bit for bit, as the layers' forward one module at a time, and only where the model allows it."""
import pytest
import torch

from kernels import get_ops
from kernels.cpu import library
from replica.executor import packed_linear
from replica.executor.config import ModelConfig
from replica.executor.fused_decoder import FusedDecoder
from replica.executor.model import AttentionGroup, AttentionMetadata, LlamaForCausalLM
from replica.executor.paged_cache import allocate_kv_caches

CPU = torch.device("cpu")
BLOCK_SIZE = 16
pytestmark = pytest.mark.skipif(not (library.available() and packed_linear.can_pack(CPU, torch.float32)),
                                reason="needs the CPU kernels and oneDNN")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed_linear.can_pack(CPU, torch.bfloat16), reason="no oneDNN bf16"))]


def make_model(dtype: torch.dtype, *, backend: str = "cpu", bias: bool = False, qk_norm: bool = False,
               small_batch: bool = True) -> LlamaForCausalLM:
    config = ModelConfig(architecture="llama", vocab_size=70, hidden_size=64, intermediate_size=96, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position=256, tie_word_embeddings=True, attention_bias=bias, qk_norm=qk_norm)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, get_ops(backend), CPU)
    for param in model.parameters():
        param.data.normal_(0, 0.3)
    model = model.to(dtype)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed_linear, "MIN_PACKED_WEIGHTS", 0)  # the toy's projections take the packed path
        model.pack_linear_weights(small_batch)
    return model


def batch(query_lens: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata for requests (single tokens first) whose blocks lie shuffled in a 40-block
    cache; as the runner does, the single tokens attend in one group and the rest in another."""
    generator = torch.Generator().manual_seed(len(query_lens))
    block_tables = torch.randperm(40, generator=generator)[:len(query_lens) * 4].view(len(query_lens), 4)
    positions = torch.cat([torch.arange(seq - query, seq) for query, seq in zip(query_lens, seq_lens)])
    request = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = block_tables[request, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    num_single = query_lens.count(1)
    bounds = [0, num_single, len(query_lens)] if 0 < num_single < len(query_lens) else [0, len(query_lens)]
    groups = [AttentionGroup(int(starts[first]), int(starts[end]), block_tables[first:end].to(torch.int32),
                             (starts[first:end + 1] - starts[first]).to(torch.int32),
                             torch.tensor(seq_lens[first:end], dtype=torch.int32))
              for first, end in zip(bounds, bounds[1:])]
    return positions, AttentionMetadata(slot_mapping=slots, groups=groups)


def forward(model: LlamaForCausalLM, positions: torch.Tensor, metadata: AttentionMetadata, caches):
    input_ids = torch.arange(len(positions)) * 7 % model.config.vocab_size
    with torch.inference_mode():
        return model(input_ids, positions, caches, metadata)


def random_caches(model: LlamaForCausalLM, dtype: torch.dtype):
    caches = allocate_kv_caches(model.config, 40, BLOCK_SIZE, dtype, CPU)
    torch.manual_seed(1)
    for key, value in caches:  # earlier tokens' K/V, as a cache holds them
        key.normal_(), value.normal_()
    return caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias, qk_norm", [(False, False), (True, False), (False, True)])  # Llama, Qwen2, Qwen3
def test_fused_layers_match_the_modules_bit_for_bit(dtype, bias, qk_norm):
    model = make_model(dtype, bias=bias, qk_norm=qk_norm)
    fused = model.fused_decoder
    assert fused is not None and fused.max_rows == packed_linear.cpu_linear.small_batch_rows(dtype)
    # decodes deep into their blocks beside a chunk of three tokens (a second group); AVX2 takes 4 rows in fp32
    query_lens = [1, 1, 3] if fused.max_rows >= 5 else [1, 3]
    positions, metadata = batch(query_lens, [37, 5, 60][:len(query_lens)])
    assert fused.takes(len(positions)) and len(metadata.groups) == 2
    caches, expected_caches = random_caches(model, dtype), random_caches(model, dtype)
    out = forward(model, positions, metadata, caches)
    model.fused_decoder = None
    expected = forward(model, positions, metadata, expected_caches)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert all(torch.equal(a, b) for pair, expected_pair in zip(caches, expected_caches)
               for a, b in zip(pair, expected_pair))


def test_fused_decoder_leaves_larger_batches_to_the_modules(monkeypatch):
    model = make_model(torch.float32)
    fused = model.fused_decoder
    positions, metadata = batch([fused.max_rows + 1], [fused.max_rows + 9])  # a chunk one row too many
    assert not fused.takes(len(positions))
    monkeypatch.setattr(FusedDecoder, "__call__", lambda *args: pytest.fail("not a batch for the fused layers"))
    forward(model, positions, metadata, random_caches(model, torch.float32))


@pytest.mark.parametrize("kwargs", [{"backend": "torch"}, {"small_batch": False}])
def test_no_fused_decoder_where_the_chain_does_not_fit(kwargs):
    assert make_model(torch.float32, **kwargs).fused_decoder is None
