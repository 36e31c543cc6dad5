"""CPU: silu(gate) * up over the fused [gate | up] projection (csrc/activation.cpp)."""
import torch

from kernels.cpu.library import load, operand_dtype_code


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    code = operand_dtype_code({"gate_up": gate_up})
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even last dimension, got shape {tuple(gate_up.shape)}")
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, size, dtype=gate_up.dtype)
    load().silu_and_mul(
        dtype=code, out=out, gate_up=gate_up, num_tokens=num_tokens, size=size,
        stride_token=gate_up.stride(0))
    return out
