"""RMSNorm with an optional fused residual add (Llama's pre-norm blocks)."""
import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [H] -> out; with residual: (norm(x + residual), x + residual).

    Normalizes in fp32 and casts back before scaling by weight, as HF Llama does.
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = normed.to(x.dtype) * weight
    return out if residual is None else (out, x)
