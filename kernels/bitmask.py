"""Constrained decoding's token bitmask applied to logits: bit j % 32 of word j // 32 set means token j
is allowed (the layout llguidance and xgrammar fill); every other token's logit becomes -inf."""
import torch


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: torch.Tensor) -> None:
    """logits [R, V] fp32, in place: mask row m [W] int32 applies to logits row logit_rows[m]; tokens at or past
    32 * W are disallowed. Rows not listed are left alone."""
    if not len(logit_rows):
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [M, 32 W]
    vocab_size = logits.shape[1]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    rows = logits[logit_rows]
    logits[logit_rows] = rows.masked_fill(~allowed[:, :vocab_size], float("-inf"))
