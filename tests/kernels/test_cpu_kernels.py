"""What only the CPU (C++) kernels do: bf16 and every head dim they take, their input checks, and
the library cache. Their agreement with the references on small shapes is in test_kernels.py."""
import shutil
import subprocess
import sys

import pytest
import torch

from kernels import get_ops
from kernels.cpu import library
from kernels.cpu.attention import kernel_args
from tests.kernels.paged_batch import make_paged_batch

pytestmark = pytest.mark.skipif(not library.available(), reason="no C++ compiler to build the CPU kernels")
cpu_ops = get_ops("cpu")
torch_ops = get_ops("torch")


@pytest.mark.parametrize("head_dim", library.HEAD_DIMS)
def test_paged_attention_every_head_dim_matches_float64(head_dim):
    batch = make_paged_batch([1, 9, 1], [40, 30, 17], 6, 2, head_dim=head_dim, seed=head_dim)
    torch.testing.assert_close(cpu_ops.paged_attention(*batch.args()).double(), batch.dense_attention(),
                               atol=2e-6, rtol=0)


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paged_attention_bf16_decodes_and_chunks_match_reference(block_size):
    # the engine's case: bf16, group 3, long decodes, a chunk on a cached prefix, several query tiles
    batch = make_paged_batch([1, 1, 40, 1], [300, 77, 150, 1], 9, 3, block_size=block_size, head_dim=64,
                             dtype=torch.bfloat16)
    out = cpu_ops.paged_attention(*batch.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), batch.dense_attention(), atol=1.6e-2, rtol=0)


@pytest.mark.parametrize("head_dim", library.HEAD_DIMS)
@pytest.mark.parametrize("num_heads", [3, 9, 12])
def test_paged_attention_bf16_prefill_chunks_match_float64(head_dim, num_heads):
    # chunks of many tokens over cached contexts (in bf16 with AVX512-BF16, rows in the lanes): one and two
    # vectors of rows, a tile of 2 tokens (below the row count where they start), odd context lengths,
    # contexts ending mid-block and mid-chunk, beside decodes
    batch = make_paged_batch([64, 2, 3, 1, 40, 33], [576, 40, 301, 300, 40, 100], num_heads, 3, head_dim=head_dim,
                             dtype=torch.bfloat16, seed=num_heads)
    torch.testing.assert_close(cpu_ops.paged_attention(*batch.args()).double(), batch.dense_attention(),
                               atol=1.6e-2, rtol=0)


def test_paged_attention_bf16_gives_a_token_the_same_output_whatever_chunk_it_is_in():
    # a prefix cache hit splits a prompt's tokens into other chunks than a recompute does: 40 tokens at
    # once, or 15 and then 25 over the same blocks, attend bit for bit alike
    batch = make_paged_batch([40], [300], 9, 3, head_dim=64, dtype=torch.bfloat16, seed=3)
    whole = cpu_ops.paged_attention(*batch.args())
    split = cpu_ops.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                    batch.block_tables.repeat(2, 1), torch.tensor([0, 15, 40], dtype=torch.int32),
                                    torch.tensor([275, 300], dtype=torch.int32), batch.scale)
    assert torch.equal(whole, split)


def test_paged_attention_many_decodes_beside_a_chunk_match_float64():
    # 64 decodes of different lengths and a chunk whose context starts mid-block, in shuffled blocks
    query_lens, seq_lens = [1] * 64 + [25], [5 + 7 * i for i in range(64)] + [61]
    batch = make_paged_batch(query_lens, seq_lens, 9, 3, block_size=16, head_dim=64, seed=7)
    torch.testing.assert_close(cpu_ops.paged_attention(*batch.args()).double(), batch.dense_attention(),
                               atol=2e-6, rtol=0)


def test_rms_norm_and_silu_bf16_round_like_torch():
    x, residual = torch.randn(8, 576).bfloat16(), torch.randn(8, 576).bfloat16()
    weight = torch.randn(576).bfloat16()
    out, new_residual = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected, expected_residual = torch_ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, expected_residual)
    # the same roundings in the same places: at most one bf16 step apart, and rarely
    assert (out.float() - expected.float()).abs().le(expected.float().abs() * 2 ** -7).all()
    gate_up = (torch.randn(8, 2 * 1536) * 3).bfloat16()
    diff = cpu_ops.silu_and_mul(gate_up).float() - torch_ops.silu_and_mul(gate_up).float()
    assert diff.ne(0).float().mean().item() < 0.01


def test_paged_attention_rejects_unsupported_head_dim_and_mixed_dtypes():
    batch = make_paged_batch([1], [5], 2, 1, head_dim=48)
    with pytest.raises(ValueError, match="head_dim in"):
        cpu_ops.paged_attention(*batch.args())
    batch = make_paged_batch([1], [5], 2, 1, head_dim=32)
    batch.query = batch.query.double()
    with pytest.raises(ValueError, match="one dtype"):
        cpu_ops.paged_attention(*batch.args())


def test_rms_norm_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="do not match"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)


def test_kernels_name_the_operand_they_reject():
    with pytest.raises(ValueError, match=r"x must be contiguous in its last dimension, got strides \(1, 2\)"):
        cpu_ops.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="the CPU kernels take CPU tensors; gate_up is on meta"):
        cpu_ops.silu_and_mul(torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match=r"one dtype .* got \{'x': 'torch.float32', 'weight': 'torch.float64'\}"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.randn(8).double(), 1e-5)


def test_library_builds_once_per_cache_dir(tmp_path):
    code = ("from kernels.cpu import library; import sys; library.load(); "
            "print(sorted(p.name for p in library._cache_dir().iterdir()))")
    env = {"PREFIXSERVE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            for _ in range(2)]
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("libprefixserve_cpu-") and built[0].suffix == ".so"
    assert runs[0].stdout == runs[1].stdout == f"{[built[0].name]}\n"


def test_another_checkouts_kernels_load_beside_these(tmp_path, monkeypatch):
    # a benchmark's baseline: other sources built into a library of their own, bound as these are
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copytree(library.SOURCE_DIR, tmp_path / "csrc")
    other = library.load(tmp_path / "csrc")
    assert other is not library.load() and len(list((tmp_path / "cache" / "kernels").iterdir())) == 1
    batch = make_paged_batch([5, 1], [40, 17], 6, 2, head_dim=64, seed=2)
    args = kernel_args(*batch.args())
    other.paged_attention(**args)
    assert torch.equal(args["out"], cpu_ops.paged_attention(*batch.args()))


def test_no_compiler_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    library.load.cache_clear()
    try:
        with pytest.raises(library.BuildError):
            library.load()
    finally:
        library.load.cache_clear()


def test_bindings_follow_the_cpp_declarations_and_take_named_arguments():
    kernels = library.load()
    assert kernels.silu_and_mul.arg_names == ["dtype", "out", "gate_up", "num_tokens", "size", "stride_token"]
    declared = library.declarations(sorted(library.SOURCE_DIR.glob("*.cpp")))
    assert set(declared) == set(vars(kernels)) == {"paged_attention", "write_kv_cache", "rms_norm",
                                                   "apply_rotary", "silu_and_mul", "apply_token_bitmask", "linear",
                                                   "pack_linear_weight", "packed_linear_size", "linear_max_rows",
                                                   "decoder_layers"}
    assert kernels.linear_max_rows.arg_names == ["dtype"]  # one parameter: called like the others
    assert kernels.linear_max_rows(dtype=0) >= 1
    with pytest.raises(TypeError, match=r"missing \['stride_token'\], unknown \['stride'\]"):
        kernels.silu_and_mul(dtype=0, out=None, gate_up=None, num_tokens=0, size=0, stride=0)
    with pytest.raises(TypeError, match="no ctypes binding for the C type 'double'"):
        library._split_param("const double scale")
