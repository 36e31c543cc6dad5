"""CPU: constrained decoding's token bitmask applied to fp32 logits (csrc/bitmask.cpp)."""
import torch

from kernels.cpu.library import load
from kernels.layout import check_last_dim_contiguous, check_on_cpu


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: torch.Tensor) -> None:
    """logits [R, V] fp32, in place: mask row m [W] int32 applies to logits row logit_rows[m]."""
    check_on_cpu(logits=logits, bitmask=bitmask, logit_rows=logit_rows)
    check_last_dim_contiguous(logits=logits)
    _check_mask(logits, bitmask, logit_rows)
    bitmask, logit_rows = bitmask.contiguous(), logit_rows.contiguous()
    load().apply_token_bitmask(logits=logits, bitmask=bitmask, logit_rows=logit_rows, num_rows=len(logit_rows),
                               vocab_size=logits.shape[1], stride_logits=logits.stride(0),
                               num_words=bitmask.shape[1])


def _check_mask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: torch.Tensor) -> None:
    if logits.dtype != torch.float32 or bitmask.dtype != torch.int32 or logit_rows.dtype != torch.int64:
        raise ValueError(f"apply_token_bitmask takes fp32 logits, an int32 bitmask and int64 rows, got "
                         f"{logits.dtype}, {bitmask.dtype}, {logit_rows.dtype}")
    if bitmask.dim() != 2 or len(bitmask) != len(logit_rows):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} needs one row per logits row listed ({len(logit_rows)})")
