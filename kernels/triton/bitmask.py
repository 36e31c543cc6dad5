"""Triton: constrained decoding's token bitmask applied to fp32 logits (see kernels/bitmask.py)."""
import torch
import triton
import triton.language as tl

from kernels.layout import check_last_dim_contiguous

BLOCK = 1024


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, logit_rows_ptr, vocab_size, stride_logits, num_words,
                                BLOCK: tl.constexpr):
    mask_row = tl.program_id(0).to(tl.int64)
    logits_row = tl.load(logit_rows_ptr + mask_row)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(bitmask_ptr + mask_row * num_words + tokens // 32, mask=tokens // 32 < num_words, other=0)
    disallowed = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + logits_row * stride_logits + tokens, float("-inf"),
             mask=(tokens < vocab_size) & disallowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: torch.Tensor) -> None:
    """logits [R, V] fp32, in place: mask row m [W] int32 applies to logits row logit_rows[m]."""
    check_last_dim_contiguous(logits=logits)
    if len(logit_rows):
        bitmask, logit_rows = bitmask.contiguous(), logit_rows.contiguous()
        _apply_token_bitmask_kernel[(len(logit_rows), triton.cdiv(logits.shape[1], BLOCK))](
            logits, bitmask, logit_rows, logits.shape[1], logits.stride(0), bitmask.shape[1], BLOCK=BLOCK)
