import pytest
import torch

from replica.executor.rejection_sampler import num_emitted, rejection_sample
from replica.executor.sampler import SamplingMetadata
from replica.request import SamplingParams

PROBS = [0.5, 0.3, 0.2]


def verify(logits: torch.Tensor, draft_token_ids: list[int], params: list[SamplingParams],
           generators: dict[int, torch.Generator] | None = None):
    metadata = SamplingMetadata.from_params(params, generators or {}, logits.shape[1], torch.device("cpu"))
    return rejection_sample(logits, torch.tensor(draft_token_ids), metadata)


def test_greedy_accepts_drafts_while_they_are_the_argmax():
    # request 1: drafts 2, 0, 1 against argmaxes 2, 0, 3 (and 1 after); request 2: draft 1, argmax 1 then 0
    argmaxes = [2, 0, 3, 1, 1, 0]
    logits = torch.nn.functional.one_hot(torch.tensor(argmaxes), 4).float()
    sampled, accepted = verify(logits, [2, 0, 1, -1, 1, -1], [SamplingParams(temperature=0, logprobs=True)] * 6)
    assert accepted.tolist() == [True, True, False, False, True, False]
    assert sampled.token_ids.tolist() == argmaxes
    assert num_emitted(accepted.tolist(), [3, 1]) == [3, 2]  # 2, 0 then 3 in place of 1; 1 and the bonus 0
    torch.testing.assert_close(sampled.logprobs, logits.log_softmax(-1)[range(6), argmaxes])


def test_num_emitted_counts_accepted_drafts_up_to_the_first_rejection():
    assert num_emitted([False, True, False], [2]) == [1]
    assert num_emitted([False, True, True, False], [0, 3]) == [1, 3]


@pytest.mark.parametrize("params, draft, expected", [
    (SamplingParams(temperature=1.0), 1, PROBS),
    (SamplingParams(temperature=1.0), 0, PROBS),
    (SamplingParams(temperature=0.5), 2, [p ** 2 / sum(q ** 2 for q in PROBS) for p in PROBS]),
    (SamplingParams(top_k=2), 2, [0.625, 0.375, 0.0]),  # a draft outside the top k is always rejected
    (SamplingParams(top_p=0.7), 1, [0.625, 0.375, 0.0]),
])
def test_emitted_tokens_follow_the_target_distribution(params, draft, expected):
    """One draft per request: its first token (the draft, or what replaces it) and, when the draft
    was accepted, the bonus token after it are both distributed as the sampler's target."""
    torch.manual_seed(0)
    num_requests = 20000
    logits = torch.tensor([PROBS] * (2 * num_requests)).log()
    sampled, accepted = verify(logits, [draft, -1] * num_requests, [params] * (2 * num_requests))
    token_ids = sampled.token_ids.view(num_requests, 2)
    first = torch.bincount(token_ids[:, 0], minlength=3) / num_requests
    assert first.tolist() == pytest.approx(expected, abs=0.015)
    was_accepted = accepted.view(num_requests, 2)[:, 0]
    assert was_accepted.float().mean().item() == pytest.approx(expected[draft], abs=0.015)
    bonus = torch.bincount(token_ids[was_accepted, 1], minlength=3) / int(was_accepted.sum())
    if expected[draft]:
        assert bonus.tolist() == pytest.approx(expected, abs=0.03)


def test_seeded_requests_verify_the_same_way_wherever_they_are_in_the_batch():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)
    generator = torch.Generator().manual_seed(7)  # one per request, drawn from row by row
    alone = verify(logits, [3, -1], [params] * 2, {0: generator, 1: generator})
    noise = torch.randn(3, 50)
    generator = torch.Generator().manual_seed(7)
    batched = verify(torch.cat([noise, logits]), [5, -1, 9, 3, -1], [SamplingParams()] * 3 + [params] * 2,
                     {3: generator, 4: generator})
    assert batched[0].token_ids[3:].tolist() == alone[0].token_ids.tolist()
    assert batched[1][3:].tolist() == alone[1].tolist()
