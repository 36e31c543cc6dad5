import random

import pytest

from router import Candidate, PolicyConfig, ReplicaLoad, RoutingDecision, make_policy


def prefix_policy(**config):
    return make_policy(PolicyConfig(**config), random.Random(0))


def test_prefix_hit_wins_over_a_small_load_difference():
    # a: 1.0 overlap - 3 * 0.05 = 0.85; b: 0 - 0 = 0
    candidates = [Candidate("b"), Candidate("a", matched_blocks=8, num_requests=3)]
    assert prefix_policy().choose(8, candidates) == RoutingDecision("a", 8, "prefix_hit")


def test_longer_prefix_wins_between_equal_loads():
    candidates = [Candidate("a", matched_blocks=2, num_requests=1), Candidate("b", matched_blocks=6, num_requests=1)]
    assert prefix_policy().choose(8, candidates) == RoutingDecision("b", 6, "prefix_hit")


def test_kv_pressure_outweighs_a_partial_prefix():
    # a: 4/8 - (4 * 0.05 + 0.9 * 0.5) = -0.15; b: 0 - 0.05 = -0.05
    candidates = [Candidate("a", matched_blocks=4, num_requests=4, kv_usage=0.9), Candidate("b", num_requests=1)]
    assert prefix_policy().choose(8, candidates) == RoutingDecision("b", 0, "no_hit")
    # with half the usage a keeps it: 0.5 - 0.2 - 0.225 = 0.075
    candidates[0] = Candidate("a", matched_blocks=4, num_requests=4, kv_usage=0.45)
    assert prefix_policy().choose(8, candidates) == RoutingDecision("a", 4, "prefix_hit")


def test_recent_preemptions_flip_a_full_hit():
    # 5 preemptions * 0.25 outweigh the whole prefix: 1.0 - 1.25 < 0
    preempting = Candidate("a", matched_blocks=8, recent_preemptions=5)
    assert prefix_policy().choose(8, [preempting, Candidate("b")]) == RoutingDecision("b", 0, "no_hit")
    calm = Candidate("a", matched_blocks=8, recent_preemptions=3)
    assert prefix_policy().choose(8, [calm, Candidate("b")]) == RoutingDecision("a", 8, "prefix_hit")


def test_no_hit_goes_to_the_least_pressured():
    candidates = [Candidate("a", num_requests=3), Candidate("b", num_requests=1),
                  Candidate("c", kv_usage=0.9)]  # c: 0.45 pressure against b's 0.05
    assert prefix_policy().choose(8, candidates) == RoutingDecision("b", 0, "no_hit")


def test_request_without_full_blocks_goes_to_the_least_pressured():
    candidates = [Candidate("a", num_requests=2), Candidate("b", num_requests=1)]
    assert prefix_policy().choose(0, candidates) == RoutingDecision("b", 0, "no_hit")


def test_hot_prefix_spills_to_the_best_replica_that_is_not_too_busy():
    # a: 10 outstanding, 9 above the least loaded (> 8) and more than 1.5x it
    hot = Candidate("a", matched_blocks=8, num_requests=10)
    candidates = [hot, Candidate("b", num_requests=2), Candidate("c", num_requests=1)]
    assert prefix_policy().choose(8, candidates) == RoutingDecision("c", 0, "spill")
    # among those not too busy, a partial prefix still counts
    candidates[1] = Candidate("b", matched_blocks=4, num_requests=2)
    assert prefix_policy().choose(8, candidates) == RoutingDecision("b", 4, "spill")


def test_no_spill_within_either_threshold():
    hot = Candidate("a", matched_blocks=8, num_requests=9)
    # 8 above the least loaded is not more than spill_abs_threshold
    assert prefix_policy().choose(8, [hot, Candidate("b", num_requests=1)]).outcome == "prefix_hit"
    # 9 above, but 27 is not more than 1.5 * 18
    assert prefix_policy().choose(
        8, [Candidate("a", matched_blocks=8, num_requests=27), Candidate("b", num_requests=18)]
    ) == RoutingDecision("a", 8, "prefix_hit")
    assert prefix_policy(spill_abs_threshold=7).choose(8, [hot, Candidate("b", num_requests=1)]) == (
        RoutingDecision("b", 0, "spill"))


def test_round_robin_takes_candidates_in_turn():
    policy = make_policy(PolicyConfig(policy="round_robin"), random.Random(0))
    candidates = [Candidate("a", matched_blocks=8), Candidate("b"), Candidate("c")]
    chosen = [policy.choose(8, candidates) for _ in range(4)]
    assert [decision.replica_id for decision in chosen] == ["a", "b", "c", "a"]
    assert {decision.outcome for decision in chosen} == {"round_robin"}
    assert chosen[0].matched_blocks == 8


def test_least_loaded_picks_the_lighter_of_two_sampled():
    policy = make_policy(PolicyConfig(policy="least_loaded"), random.Random(0))
    candidates = [Candidate("a", num_requests=5), Candidate("b", num_requests=2)]
    assert {policy.choose(8, candidates) for _ in range(10)} == {RoutingDecision("b", 0, "least_loaded")}


def test_least_loaded_is_reproducible_with_a_seeded_rng():
    candidates = [Candidate(name, num_requests=load) for name, load in zip("abcd", [3, 0, 2, 1])]

    def run(seed: int) -> list[str]:
        policy = make_policy(PolicyConfig(policy="least_loaded"), random.Random(seed))
        return [policy.choose(8, candidates).replica_id for _ in range(8)]

    assert run(0) == ["b", "b", "b", "b", "d", "b", "b", "b"]
    assert run(0) == run(0)
    assert "a" not in run(1) + run(2)  # the most loaded never wins a pair
    assert make_policy(PolicyConfig(policy="least_loaded"), random.Random(0)).choose(
        8, [Candidate("only", num_requests=9)]) == RoutingDecision("only", 0, "least_loaded")


def test_bad_configuration_and_loads_raise_value_error():
    with pytest.raises(ValueError, match="policy"):
        PolicyConfig(policy="random")
    with pytest.raises(ValueError, match="spill_rel_threshold"):
        PolicyConfig(spill_rel_threshold=0.5)
    with pytest.raises(ValueError, match="no_such_knob"):
        PolicyConfig(no_such_knob=1)
    with pytest.raises(ValueError, match="kv_usage"):
        ReplicaLoad(kv_usage=1.5)
    with pytest.raises(ValueError, match="counts"):
        ReplicaLoad(num_waiting=-1)


def test_every_tunable_is_documented():
    assert all(field.description for field in PolicyConfig.model_fields.values())
