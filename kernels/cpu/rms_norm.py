"""CPU: RMSNorm with an optional fused residual add (csrc/rms_norm.cpp)."""
import torch

from kernels.cpu.library import dtype_code, load
from kernels.layout import check_last_dim_contiguous, check_on_cpu, dense_like


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [H] -> out; with residual: (norm(x + residual), x + residual)."""
    inputs = {"x": x, "weight": weight} | ({} if residual is None else {"residual": residual})
    check_on_cpu(**inputs)
    check_last_dim_contiguous(**inputs)
    code = dtype_code(*inputs.values())
    if weight.shape != x.shape[1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)} do not match")
    num_tokens, hidden_size = x.shape
    out = dense_like(x)
    new_residual = None if residual is None else dense_like(x)
    load().rms_norm(
        dtype=code, out=out, new_residual=new_residual, x=x, residual=residual, weight=weight, num_tokens=num_tokens,
        hidden_size=hidden_size, stride_x=x.stride(0), stride_residual=0 if residual is None else residual.stride(0),
        eps=eps)
    return out if residual is None else (out, new_residual)
