"""RoPE frequencies scaled as transformers scales them (linear, llama3, YaRN) or as vLLM does (dynamic
NTK, fixed at the scaled context), and llama.cpp's per-frequency factors from a GGUF's rope_freqs."""
import math

import torch

from kernels.rotary import rotary_cos_sin, rotary_inv_freq
from replica.executor.config import ModelConfig, RopeScaling


def cos_sin_cache(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """The model's cos/sin cache [max_position, head_dim], fp32."""
    scaling = config.rope_scaling
    cache = rotary_cos_sin(config.head_dim, config.max_position, config.rope_theta, device=device,
                           inv_freq=inv_freq(config.head_dim, config.rope_theta, scaling, device))
    return cache * scaling.attention_factor if scaling else cache


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2], fp32."""
    if scaling is not None and scaling.rope_type == "dynamic":
        return rotary_inv_freq(head_dim, _dynamic_ntk_theta(head_dim, theta, scaling.factor), device)
    base = rotary_inv_freq(head_dim, theta, device)
    if scaling is None:
        return base
    if scaling.rope_type == "linear":
        return base / scaling.factor
    if scaling.rope_type == "freq_factors":
        return base / torch.tensor(scaling.freq_factors, dtype=torch.float32, device=device)
    if scaling.rope_type == "yarn":
        return _yarn(base, head_dim, theta, scaling)
    return _llama3(base, scaling)


def _dynamic_ntk_theta(head_dim: int, theta: float, factor: float) -> float:
    """transformers' dynamic NTK base at a sequence as long as the scaled context, which it reaches only
    there (it recomputes per forward pass); fixed, so a token's rotation never depends on its batch."""
    return theta * (factor * factor - factor + 1) ** (head_dim / (head_dim - 2))


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """High frequencies stay (extrapolated), low ones are divided by the factor (interpolated), and a linear
    ramp over the dimensions between beta_fast and beta_slow rotations in the original context blends them."""
    def dimension(rotations: float) -> float:
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Long wavelengths slow down by the factor, short ones stay, and the band between blends the two."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
