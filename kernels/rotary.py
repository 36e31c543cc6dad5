"""Rotary position embedding, rotate-half layout (GPT-NeoX / HF Llama).

The cos/sin cache is [max_position, head_dim]: cos in the first half of each row, sin in the
second, as vLLM lays it out.
"""
import torch


def rotary_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """The plain RoPE inverse frequencies [head_dim / 2], fp32."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rotary_cos_sin(head_dim: int, max_position: int, theta: float,
                   dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """cos_sin_cache [max_position, head_dim], computed in fp32 and cast to dtype; inv_freq [head_dim / 2]
    replaces the frequencies theta gives (scaled RoPE)."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if inv_freq is None:
        inv_freq = rotary_inv_freq(head_dim, theta, device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def apply_rotary_ref(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hkv, D], positions [T] -> new rotated (query, key), fp32 math."""
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
