import math

import pytest
import torch

from replica.executor.sampler import CDF_BLOCK, SamplingMetadata, _land, random_sample, sample
from replica.request import SamplingParams

PROBS = [0.5, 0.3, 0.2]


def logits_rows(num_rows: int) -> torch.Tensor:
    return torch.tensor([PROBS] * num_rows).log()


def run(logits: torch.Tensor, params: list[SamplingParams], seeds: dict[int, int] | None = None):
    generators = {row: torch.Generator().manual_seed(seed) for row, seed in (seeds or {}).items()}
    metadata = SamplingMetadata.from_params(params, generators, logits.shape[1], torch.device("cpu"))
    return sample(logits, metadata)[:2]  # token ids, logprobs


def frequencies(token_ids: torch.Tensor) -> list[float]:
    return (torch.bincount(token_ids, minlength=len(PROBS)) / len(token_ids)).tolist()


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -1.0, 0.0]])
    token_ids, logprobs = run(logits, [SamplingParams(temperature=0, logprobs=True)] * 2)
    assert token_ids.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_no_logprobs_unless_asked():
    assert run(logits_rows(1), [SamplingParams(temperature=0)])[1] is None


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.5), [p ** 2 / sum(q ** 2 for q in PROBS) for p in PROBS]),  # low: sharper
    # top_k and top_p renormalize over what they keep
    (SamplingParams(top_k=2), [0.625, 0.375, 0.0]),
    (SamplingParams(top_p=0.7), [0.625, 0.375, 0.0]),   # 0.5 alone is short of 0.7; 0.5 + 0.3 covers it
    (SamplingParams(top_p=0.4), [1.0, 0.0, 0.0]),
    (SamplingParams(top_k=1), [1.0, 0.0, 0.0]),
])
def test_samples_follow_the_distribution_after_temperature_top_k_and_top_p(params, expected):
    torch.manual_seed(0)
    token_ids, _ = run(logits_rows(20000), [params] * 20000)
    assert frequencies(token_ids) == pytest.approx(expected, abs=0.015)


def test_mixed_batch_keeps_each_rows_rule():
    torch.manual_seed(0)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2), SamplingParams(top_p=0.4)] * 1000
    token_ids, _ = run(logits_rows(3000), params)
    assert set(token_ids[0::3].tolist()) == {0}
    assert set(token_ids[1::3].tolist()) == {0, 1}
    assert set(token_ids[2::3].tolist()) == {0}


def test_a_draw_lands_on_the_token_a_whole_rows_cumulative_sum_gives_across_blocks_and_never_on_a_zero():
    vocab_size = 2 * CDF_BLOCK + 5  # a last block mostly padding
    probs = torch.zeros(1, vocab_size)
    probs[0, [0, 7, CDF_BLOCK - 1, CDF_BLOCK, vocab_size - 1]] = torch.tensor([1.0, 2.0, 1.0, 4.0, 2.0])
    cdf = probs.cumsum(dim=-1)
    drawn = []
    for seed in range(400):
        uniform = torch.rand(1, generator=torch.Generator().manual_seed(seed))
        expected = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).item()
        drawn.append(random_sample(probs, {0: torch.Generator().manual_seed(seed)}).item())
        assert drawn[-1] == expected
    assert set(drawn) == {0, 7, CDF_BLOCK - 1, CDF_BLOCK, vocab_size - 1}


def test_a_point_past_the_total_by_rounding_lands_on_the_last_token_with_a_probability():
    index, held = _land(torch.tensor([[1.0, 1.0, 3.0, 3.0]]), torch.tensor([[3.0000002]]))
    assert index.tolist() == [[2]] and held.item() < 3.0


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [run(logits, [params], {0: 7})[0].item() for _ in range(2)]
    batch = torch.cat([torch.randn(3, 1000), logits])
    in_batch = run(batch, [SamplingParams()] * 3 + [params], {3: 7})[0][3].item()
    assert draws[0] == draws[1] == in_batch
    other_seeds = {run(logits, [params], {0: seed})[0].item() for seed in range(8, 16)}
    assert len(other_seeds) > 1


def test_logprobs_are_of_the_raw_distribution_even_when_sampling():
    torch.manual_seed(0)
    token_ids, logprobs = run(logits_rows(50), [SamplingParams(temperature=0.3, logprobs=True)] * 50)
    assert logprobs.tolist() == pytest.approx([math.log(PROBS[t]) for t in token_ids.tolist()], abs=1e-6)


def test_top_logprobs_are_the_likeliest_tokens_of_the_raw_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, -1.0, 0.0]])
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=2), SamplingParams(temperature=0)]
    values, token_ids = sample(logits, SamplingMetadata.from_params(params, {}, 3, torch.device("cpu"))).top_logprobs
    assert token_ids.tolist() == [[1, 2], [0, 2]]
    torch.testing.assert_close(values, logits.log_softmax(-1)[[[0, 0], [1, 1]], [[1, 2], [0, 2]]])


def test_top_logprobs_need_logprobs_and_stop_at_twenty():
    assert SamplingParams(logprobs=True, top_logprobs=20).top_logprobs == 20
    for bad in [{"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1}]:
        with pytest.raises(ValueError, match="top_logprobs must be in"):
            SamplingParams(**bad)


def test_greedy_token_heads_the_top_logprobs_and_ties_go_to_the_lowest_id():
    logits = torch.full((2, 1000), -5.0)
    logits[0, [0, 612]] = 1.0
    logits[1, [3, 7, 9]] = 2.0
    logits[1, 5] = 1.0
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=3)] * 2
    sampled = sample(logits, SamplingMetadata.from_params(params, {}, 1000, torch.device("cpu")))
    assert sampled.token_ids.tolist() == [0, 3]
    assert sampled.top_logprobs[1].tolist() == [[0, 612, 1], [3, 7, 9]]
