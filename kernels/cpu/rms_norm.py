"""CPU: RMSNorm with an optional fused residual add (csrc/rms_norm.cpp)."""
import torch

from kernels.cpu.library import load, operand_dtype_code
from kernels.layout import dense_like


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [H] -> out; with residual: (norm(x + residual), x + residual)."""
    operands = {"x": x, "weight": weight}
    if residual is not None:
        operands["residual"] = residual
    code = operand_dtype_code(operands)
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
