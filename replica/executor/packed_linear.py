"""Linear layers whose weights are packed once into oneDNN's blocked layout (CPU).

torch's F.linear hands oneDNN a plain weight on every call, which it reorders each time; packing it
once at load time ran decode-sized matmuls (64 rows) 1.4-1.5x faster and prefill-sized ones
1.06-1.3x faster on this project's CPU machine (benchmarks/results/offline.md). These are the
mkldnn ops that torch's own CPU inductor uses for frozen linear weights.
"""
import torch
from torch import nn

BATCH_SIZE_HINT = 64  # oneDNN picks the blocking for this many rows; any row count still works
# A packed call costs some 30-50 us more than F.linear's whatever the shape (fp32, AVX2): below about
# this many weights that is more than the matmul itself takes at 1-64 rows.
MIN_PACKED_WEIGHTS = 1 << 18


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def worth_packing(weight: torch.Tensor) -> bool:
    return weight.numel() >= MIN_PACKED_WEIGHTS


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed; the plain weight is not kept."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
