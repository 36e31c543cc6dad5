"""RoPE inverse frequencies, scaled as transformers scales them: linear (position interpolation) and
llama3 (Llama 3.1-3.3)."""
import math

import torch

from kernels.rotary import rotary_inv_freq
from replica.executor.config import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary inverse frequencies [head_dim / 2], fp32."""
    base = rotary_inv_freq(head_dim, theta, device)
    if scaling is None:
        return base
    if scaling.rope_type == "linear":
        return base / scaling.factor
    return _llama3(base, scaling)


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
