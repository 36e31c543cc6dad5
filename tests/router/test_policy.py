import random

import pytest

from router import Candidate, PolicyConfig, RequestShape, RoutingDecision, make_policy
from router.policy import PrefixPolicy

from .test_core import ARITHMETIC_WEIGHTS

BLOCK = 16
PROMPT = RequestShape(num_blocks=8, num_prompt_tokens=8 * BLOCK + 5, block_size=BLOCK)  # 133 tokens


def prefix_policy(**config) -> PrefixPolicy:
    return make_policy(PolicyConfig(**ARITHMETIC_WEIGHTS | config), random.Random(0))


def test_cost_adds_queued_prefill_uncached_tokens_steps_requests_and_risk():
    policy = prefix_policy(step_token_budget=100, step_overhead_tokens=10, request_cost_tokens=3,
                           memory_weight=2, preemption_cost_tokens=7, session_weight=0.5,
                           context_token_weight=0.25)
    idle = Candidate("a")
    assert policy.cost(PROMPT, idle) == pytest.approx(2 * 133 + 1.33 * 10)  # more prefill than one step's budget
    busy = Candidate("a", matched_blocks=2, num_requests=4, num_prefill_tokens_pending=200, num_free_blocks=3,
                      recent_preemptions=1, num_session_tokens=40, num_context_tokens=1000)
    # prefill 200 + 101 over 96 decode room: 3.135 steps; 7 uncached blocks against 3 free: 4 short
    without_decode_load = 200 + 2 * 101 + 301 / 96 * 10 + 2 * 4 * BLOCK + 7
    decode_load = 4 * 3 + 0.25 * 1000
    assert policy.cost(PROMPT, busy) == pytest.approx(without_decode_load + decode_load)
    # a session's first turn also pays for the sessions it would live with; a later turn follows
    # its session and pays for neither them nor the decode load
    first_turn, later_turn = (RequestShape(8, 8 * BLOCK + 5, BLOCK, session_turn=turn) for turn in (1, 2))
    assert policy.cost(first_turn, busy) == pytest.approx(without_decode_load + decode_load + 0.5 * 40)
    assert policy.cost(later_turn, busy) == pytest.approx(without_decode_load)


def test_a_full_hit_still_computes_the_last_prompt_token():
    exact = RequestShape(num_blocks=2, num_prompt_tokens=2 * BLOCK, block_size=BLOCK)
    assert (exact.num_uncached_tokens(2), exact.num_uncached_tokens(1), exact.num_uncached_tokens(0)) == (1, 16, 32)


def test_prefix_hit_wins_over_a_few_requests():
    # a: 2 * 5 uncached + 64 + 3 * 32 = 170; b: 2 * 133 + 64 = 330
    candidates = [Candidate("b"), Candidate("a", matched_blocks=8, num_requests=3)]
    assert prefix_policy(request_cost_tokens=32).choose(PROMPT, candidates) == RoutingDecision("a", 8, "prefix_hit")
    # with 9 requests a costs 362
    candidates[1] = Candidate("a", matched_blocks=8, num_requests=9)
    assert prefix_policy(request_cost_tokens=32).choose(PROMPT, candidates) == RoutingDecision("b", 0, "spill")


def test_longer_prefix_wins_between_equal_loads():
    candidates = [Candidate("a", matched_blocks=2, num_requests=1), Candidate("b", matched_blocks=6, num_requests=1)]
    assert prefix_policy().choose(PROMPT, candidates) == RoutingDecision("b", 6, "prefix_hit")


def test_a_choice_temperature_draws_replicas_by_exp_of_minus_their_extra_cost_over_it():
    # b costs 64 * ln 3 = 70.3 tokens more than a (its requests): weights 1 and 1/3
    policy = prefix_policy(choice_temperature_tokens=64, request_cost_tokens=70.3111 / 2)
    candidates = [Candidate("a"), Candidate("b", num_requests=2)]
    chosen = [policy.choose(PROMPT, candidates).replica_id for _ in range(4000)]
    assert (chosen.count("a"), chosen.count("b")) == (2982, 1018)  # the seeded draw; 3000 and 1000 expected
    assert prefix_policy(request_cost_tokens=70.3111 / 2).choose(PROMPT, candidates).replica_id == "a"  # off


def test_queued_prefill_counts_in_tokens_not_requests():
    # one 100k-token prompt still prefilling weighs more than four short decodes
    prefilling = Candidate("a", num_requests=1, num_prefill_tokens_pending=100_000)
    decoding = Candidate("b", num_requests=4)
    assert prefix_policy().choose(PROMPT, [prefilling, decoding]) == RoutingDecision("b", 0, "no_hit")


def test_a_replica_short_of_kv_blocks_pays_for_the_shortage():
    # a saves 96 tokens but lacks 2 of its 3 blocks: 170 with 32 tokens of shortage against b's 330
    short = Candidate("a", matched_blocks=6, num_free_blocks=1)
    assert prefix_policy().choose(PROMPT, [short, Candidate("b", num_free_blocks=100)]).replica_id == "a"
    assert prefix_policy(memory_weight=8).choose(
        PROMPT, [short, Candidate("b", num_free_blocks=100)]) == RoutingDecision("b", 0, "spill")


def test_recent_preemptions_flip_a_full_hit():
    preempting = Candidate("a", matched_blocks=8, recent_preemptions=1)  # 10 + 64 + 512 > 330
    assert prefix_policy().choose(PROMPT, [preempting, Candidate("b")]) == RoutingDecision("b", 0, "spill")
    assert prefix_policy(preemption_cost_tokens=100).choose(
        PROMPT, [preempting, Candidate("b")]) == RoutingDecision("a", 8, "prefix_hit")


def test_equal_savings_go_to_the_less_loaded_then_to_fewer_cached_blocks():
    candidates = [Candidate("a", matched_blocks=1, num_requests=2), Candidate("b", matched_blocks=1, num_requests=1)]
    assert prefix_policy().choose(PROMPT, candidates) == RoutingDecision("b", 1, "prefix_hit")
    candidates = [Candidate("a", num_cached_blocks=9), Candidate("b", num_cached_blocks=3),
                  Candidate("c", num_cached_blocks=3)]
    assert prefix_policy().choose(PROMPT, candidates) == RoutingDecision("b", 0, "no_hit")


def test_round_robin_takes_candidates_in_turn():
    policy = make_policy(PolicyConfig(policy="round_robin"), random.Random(0))
    candidates = [Candidate("a", matched_blocks=8), Candidate("b"), Candidate("c")]
    chosen = [policy.choose(PROMPT, candidates) for _ in range(4)]
    assert [decision.replica_id for decision in chosen] == ["a", "b", "c", "a"]
    assert {decision.outcome for decision in chosen} == {"round_robin"}
    assert chosen[0].matched_blocks == 8


def test_least_loaded_picks_the_lighter_of_two_sampled():
    policy = make_policy(PolicyConfig(policy="least_loaded"), random.Random(0))
    candidates = [Candidate("a", num_requests=5), Candidate("b", num_requests=2)]
    assert {policy.choose(PROMPT, candidates) for _ in range(10)} == {RoutingDecision("b", 0, "least_loaded")}


def test_least_loaded_is_reproducible_with_a_seeded_rng():
    candidates = [Candidate(name, num_requests=load) for name, load in zip("abcd", [3, 0, 2, 1])]

    def run(seed: int) -> list[str]:
        policy = make_policy(PolicyConfig(policy="least_loaded"), random.Random(seed))
        return [policy.choose(PROMPT, candidates).replica_id for _ in range(8)]

    assert run(0) == ["b", "b", "b", "b", "d", "b", "b", "b"]
    assert run(2) == ["d", "b", "b", "b", "b", "c", "b", "d"]  # the seed decides which pairs are drawn
    assert "a" not in run(1) + run(2)  # the most loaded never wins a pair
    assert make_policy(PolicyConfig(policy="least_loaded"), random.Random(0)).choose(
        PROMPT, [Candidate("only", num_requests=9)]) == RoutingDecision("only", 0, "least_loaded")


def test_bad_configuration_raises_value_error():
    with pytest.raises(ValueError, match="policy"):
        PolicyConfig(policy="random")
    with pytest.raises(ValueError, match="step_token_budget"):
        PolicyConfig(step_token_budget=0)
    with pytest.raises(ValueError, match="no_such_knob"):
        PolicyConfig(no_such_knob=1)


def test_every_tunable_is_documented():
    assert all(field.description for field in PolicyConfig.model_fields.values())
