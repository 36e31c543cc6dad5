"""Linear layers whose weights are packed once into oneDNN's blocked layout (CPU).

torch's F.linear hands oneDNN a plain weight on every call, which it reorders each time; packing it
once at load time ran decode-sized matmuls (64 rows) 1.4-1.5x faster and prefill-sized ones
1.06-1.3x faster on this project's CPU machine (benchmarks/results/offline.md). These are the
mkldnn ops that torch's own CPU inductor uses for frozen linear weights.

Up to a hundred rows or so (kernels/cpu/linear.py's small_batch_rows), the CPU kernels' own linear on a
second packed copy of the weight beats oneDNN, whose fixed cost per call is most of a decode step's matmul at
a few rows. On the default model in bf16 that holds the projections and LM head twice (270 MB more); its
projections and LM head at 1 row take 5.5 ms a step against 7.4, its projections at 64 rows 17.8 against 19.9
(benchmarks/results/step.md).
"""
import os

import torch
from torch import nn

from kernels.cpu import linear as cpu_linear

BATCH_SIZE_HINT = 64  # oneDNN picks the blocking for this many rows; any row count still works
# A packed call costs some 30-50 us more than F.linear's whatever the shape (fp32, AVX2): below about
# this many weights that is more than the matmul itself takes at 1-64 rows.
MIN_PACKED_WEIGHTS = 1 << 18


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def small_batch_copy_fits(model: nn.Module) -> bool:
    """Whether a second copy of the model's weights (for the small-batch linear) takes at most a quarter of the
    machine's memory: 270 MB for the default model in bf16, but an 8B model's would be another 16 GB."""
    weight_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
    return 4 * weight_bytes <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def worth_packing(weight: torch.Tensor) -> bool:
    return weight.numel() >= MIN_PACKED_WEIGHTS


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed; the plain weight is not kept. With small_batch, calls of up to
    small_batch_rows rows run the CPU kernels' linear on a copy packed for it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, small_batch: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()
        self.small_batch_weight = cpu_linear.pack_linear_weight(weight.detach()) if small_batch else None
        self.small_batch_rows = cpu_linear.small_batch_rows(weight.dtype) if small_batch else 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, small_batch: bool = False) -> "PackedLinear":
        return cls(linear.weight, linear.bias, small_batch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_batch_rows:
            return cpu_linear.linear(x, self.small_batch_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"small_batch_rows={self.small_batch_rows}")
