"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds; logprobs of the chosen tokens."""
from dataclasses import dataclass
from typing import NamedTuple

import torch

from replica.request import SamplingParams

CDF_BLOCK = 1024  # random_sample's first level: the entries a block of the cumulative sums covers


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step's logits."""
    temperatures: torch.Tensor         # [R] fp32; 0 = greedy
    top_ks: torch.Tensor | None        # [R] int64, vocab size where off; None if off for every row
    top_ps: torch.Tensor | None        # [R] fp32; None if 1 for every row
    generators: dict[int, torch.Generator]  # row -> the seeded request's own generator
    all_greedy: bool
    any_greedy: bool
    needs_logprobs: bool
    max_top_logprobs: int  # the most any row asks for

    @classmethod
    def from_params(cls, params: list[SamplingParams], generators: dict[int, torch.Generator],
                    vocab_size: int, device: torch.device) -> "SamplingMetadata":
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_ks=None if all(k == vocab_size for k in top_ks) else torch.tensor(top_ks, device=device),
            top_ps=None if all(p == 1.0 for p in top_ps) else torch.tensor(top_ps, device=device),
            generators=generators,
            all_greedy=all(p.temperature == 0 for p in params),
            any_greedy=any(p.temperature == 0 for p in params),
            needs_logprobs=any(p.logprobs for p in params),
            max_top_logprobs=max((p.top_logprobs for p in params), default=0),
        )


class Sampled(NamedTuple):
    token_ids: torch.Tensor                # [R]
    logprobs: torch.Tensor | None          # [R]: of the sampled tokens under the raw logits; None if not asked
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # ([R, k] logprobs, [R, k] token ids), likeliest first


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> Sampled:
    """logits [R, V] fp32 -> the sampled tokens, and the logprobs asked for (k: the most any row asks)."""
    if metadata.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = random_sample(target_probs(logits, metadata), metadata.generators)
        if metadata.any_greedy:  # the argmax is a pass over the logits as long as the softmax
            token_ids = torch.where(metadata.temperatures == 0, logits.argmax(dim=-1), token_ids)
    return with_logprobs(logits, token_ids, metadata)


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """[R, V]: the distribution each random row samples from (after temperature, top-k and top-p)."""
    temperatures = metadata.temperatures
    scaled = logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    return apply_top_k_top_p(scaled, metadata.top_ks, metadata.top_ps).softmax(dim=-1)


def with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, metadata: SamplingMetadata) -> Sampled:
    """The chosen tokens with their logprobs (and the top ones) under the raw logits, if any row asks."""
    if not metadata.needs_logprobs:
        return Sampled(token_ids, None, None)
    all_logprobs = logits.log_softmax(dim=-1)
    top = None
    if metadata.max_top_logprobs:
        top_ids = top_tokens(logits, metadata.max_top_logprobs)
        top = (all_logprobs.gather(1, top_ids), top_ids)
    return Sampled(token_ids, all_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1), top)


def top_tokens(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k]: the k highest-logit tokens, highest first, the lowest id first among equal logits: the rule
    of argmax (the greedy token), so a greedy token heads its top logprobs, ties included (topk's order
    among equals is unspecified)."""
    kth = logits.topk(k, dim=-1).values[:, -1:]
    width = int((logits >= kth).sum(dim=-1).max())  # takes in every token tied with a row's k-th
    ids = logits.topk(width, dim=-1).indices.sort(dim=-1).values
    order = logits.gather(1, ids).sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return ids.gather(1, order)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                      top_ps: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top k and its top-p nucleus."""
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_ks is not None:
        kth_largest = sorted_logits.gather(1, (logits.shape[1] - top_ks).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_ps is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= 1 - top_ps.unsqueeze(1)
        outside[:, -1] = False  # the most likely token always stays
        sorted_logits.masked_fill_(outside, float("-inf"))
    return logits.scatter(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Inverse-CDF sampling: each row's token is where one uniform draw lands in its cumulative
    probabilities, each seeded row drawing with its own generator; probs need not be normalised. One
    draw a row, where Gumbel-max's exponentials (one per vocabulary entry) took 14% of a CPU decode step
    at 64 rows. The cumulative sums in two levels: over blocks of CDF_BLOCK entries, then inside the one
    block the draw lands in (a whole row's cumsum took 1.7 ms of a 64-row CPU step, 49,152 entries a row)."""
    num_rows, vocab_size = probs.shape
    padding = -vocab_size % CDF_BLOCK  # none for the default model's 49,152: no copy of the probs then
    padded = torch.nn.functional.pad(probs, (0, padding)) if padding else probs
    blocks = padded.reshape(num_rows, -1, CDF_BLOCK)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)
    uniform = uniform_per_row(num_rows, generators, probs.device).unsqueeze(1)
    block, point = _land(block_cdf, uniform * block_cdf[:, -1:])
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner_cdf = blocks[torch.arange(num_rows, device=probs.device), block.squeeze(1)].cumsum(dim=-1)
    offset, _ = _land(inner_cdf, point - before)
    return (block * CDF_BLOCK + offset).squeeze(1)


def _land(cdf: torch.Tensor, point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, 1] index of the first entry of each row's cdf above point, which is first held strictly below the
    row's total: that entry's probability is above zero, whatever the rounding; and the point so held."""
    total = cdf[:, -1:]
    point = torch.minimum(point, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True), point


def uniform_per_row(num_rows: int, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; seeded rows draw from their own generator."""
    uniform = torch.empty(num_rows, device=device)
    if len(generators) < num_rows:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, generator=generator, device=device)[0]
    return uniform
