"""Triton: silu(gate) * up over the fused [gate | up] projection (see kernels/activation.py)."""
import torch
import triton
import triton.language as tl

from kernels.layout import check_last_dim_contiguous

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, size, stride_gate_up, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(gate_up_ptr + row * stride_gate_up + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gate_up + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as torch's
    tl.store(out_ptr + row * stride_out + cols, silu * up, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    check_last_dim_contiguous(gate_up=gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even last dimension, got shape {tuple(gate_up.shape)}")
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, BLOCK))](
            gate_up, out, size, gate_up.stride(0), out.stride(0), BLOCK=BLOCK)
    return out
