"""The CPU kernels' small-batch linear (kernels/cpu/linear.py) against float64 matmuls, and PackedLinear
taking it for the batches it is faster at."""
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import library
from kernels.cpu.linear import linear, pack_linear_weight, small_batch_rows
from replica.executor import packed_linear
from replica.executor.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(not library.available(), reason="no C++ compiler to build the CPU kernels")
# sums of up to 100 products: fp32 accumulates them within a few ulp; a 16-bit output rounds once
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-3, 2 ** -8), torch.float16: (1e-3, 2 ** -11)}


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (17, 3), (40, 33), (160, 96)])
def test_linear_matches_float64_at_every_row_count(dtype, out_features, in_features):
    # row counts around the 4-row tiles, padding outputs and an odd input count (bf16's pairs)
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    packed = pack_linear_weight(weight)
    atol, rtol = TOLERANCE[dtype]
    for rows in [1, 2, 3, 4, 5, 7, 9, 16]:
        x = torch.randn(rows, in_features + 5).to(dtype)[:, 2:2 + in_features]  # rows strided apart
        for b in (None, bias):
            out = linear(x, packed, b)
            assert out.shape == (rows, out_features) and out.dtype == dtype
            torch.testing.assert_close(out.double(), exact(x, weight, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_both_threads_covers_every_output(dtype):
    # enough work to run in parallel: several panels of outputs per thread, the last one partial
    torch.manual_seed(1)
    weight = torch.randn(1000, 96).to(dtype)
    x = torch.randn(6, 96).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(linear(x, pack_linear_weight(weight)).double(), exact(x, weight, None),
                               atol=atol, rtol=rtol)


def test_linear_rejects_what_does_not_fit_its_weight():
    packed = pack_linear_weight(torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"x \(2, 5\) and bias None do not fit a weight of 8 x 6"):
        linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match=r"bias \(7,\)"):
        linear(torch.randn(2, 6), packed, torch.randn(7))
    with pytest.raises(ValueError, match="one dtype"):
        linear(torch.randn(2, 6).bfloat16(), packed)
    with pytest.raises(ValueError, match="one dtype"):
        small_batch_rows(torch.int32)


@pytest.mark.skipif(not packed_linear.can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16")
def test_packed_linear_takes_the_small_batch_kernel_up_to_its_rows():
    torch.manual_seed(2)
    weight, bias = torch.randn(160, 96).bfloat16(), torch.randn(160).bfloat16()
    layer = PackedLinear(weight, bias, small_batch=True)
    rows = small_batch_rows(torch.bfloat16)
    assert layer.small_batch_rows == rows >= 1
    small, large = torch.randn(rows, 96).bfloat16(), torch.randn(rows + 1, 96).bfloat16()
    assert torch.equal(layer(small), linear(small, pack_linear_weight(weight), bias))
    assert torch.equal(layer(large), F.linear(large, weight, bias))  # oneDNN's, bit for bit
    assert PackedLinear(weight, bias).small_batch_rows == 0
