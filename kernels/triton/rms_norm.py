"""Triton: RMSNorm with an optional fused residual add (see kernels/rms_norm.py)."""
import torch
import triton
import triton.language as tl

from kernels.layout import check_last_dim_contiguous


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, hidden_size, eps,
                     stride_x, stride_residual, stride_out, stride_new_residual,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x += residual.to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)        # the sum is rounded as torch's x + residual is
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden_size + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, normed * weight, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [H] -> out; with residual: (norm(x + residual), x + residual)."""
    check_last_dim_contiguous(x=x, weight=weight)
    num_tokens, hidden_size = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    has_residual = residual is not None
    if has_residual:
        check_last_dim_contiguous(residual=residual)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:   # placeholders the kernel does not touch
        residual = new_residual = x
    if num_tokens:
        block_h = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, new_residual, hidden_size, eps,
            x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0),
            HAS_RESIDUAL=has_residual, BLOCK_H=block_h, num_warps=min(max(block_h // 256, 1), 8))
    return (out, new_residual) if has_residual else out
