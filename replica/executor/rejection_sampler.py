"""Verifying speculative drafts against the target model's logits of one forward pass.

An n-gram draft has no distribution of its own (it puts all its mass on the draft token x), so
speculative rejection sampling reduces to: accept x with probability p(x) under the distribution
the sampler would draw from; on rejection draw from p with x removed (renormalised); after the last
draft of a request, draw a bonus token from p. Greedy rows accept a draft while it is the argmax.
Either way each emitted token is distributed exactly as sampling one token at a time would make it.
"""
import torch

from replica.executor.sampler import (Sampled, SamplingMetadata, random_sample, target_probs, uniform_per_row,
                                      with_logprobs)


def rejection_sample(logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     metadata: SamplingMetadata) -> tuple[Sampled, torch.Tensor]:
    """logits [N, V]: for each request verified, the rows of its draft positions and then one more;
    draft_token_ids [N]: the draft each row verifies, -1 on a request's last row.

    Returns per row the token it emits if reached (its draft when accepted), with the logprobs asked
    for, and whether it accepted its draft."""
    has_draft = draft_token_ids >= 0
    greedy = logits.argmax(dim=-1)
    if metadata.all_greedy:
        token_ids, accepted = greedy, greedy == draft_token_ids
    else:
        probs = target_probs(logits, metadata)
        rows = has_draft.nonzero().squeeze(1)
        drafts = draft_token_ids[rows]
        random_accepted = torch.zeros_like(has_draft)
        uniform = uniform_per_row(probs.shape[0], metadata.generators, probs.device)
        random_accepted[rows] = uniform[rows] < probs[rows, drafts]
        probs[rows, drafts] = 0.0  # where the draft is rejected, the next token is anything but it
        is_random = metadata.temperatures > 0
        token_ids = torch.where(is_random, random_sample(probs, metadata.generators), greedy)
        accepted = torch.where(is_random, random_accepted, greedy == draft_token_ids)
    accepted &= has_draft
    token_ids = torch.where(accepted, draft_token_ids, token_ids)
    return with_logprobs(logits, token_ids, metadata), accepted


def num_emitted(accepted: list[bool], num_drafts: list[int]) -> list[int]:
    """Per request (num_drafts[i] draft rows, then its last row, in order): how many of its rows' tokens
    it emits: the drafts accepted before the first rejection, and one more."""
    counts, start = [], 0
    for count in num_drafts:
        num_accepted = next((i for i in range(count) if not accepted[start + i]), count)
        counts.append(num_accepted + 1)
        start += count + 1
    return counts

