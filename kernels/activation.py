"""SwiGLU's activation over the fused [gate | up] projection: silu(gate) * up."""
import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]; silu's output is rounded to
    the input dtype before the product, as two torch ops round it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
