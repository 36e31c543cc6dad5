import random

import pytest

from replica.kv_cache import AllBlocksCleared, BlockStored
from router import PolicyConfig, ReplicaLoad, RouterState, RoutingDecision

from .chains import BLOCK_SIZE, chain


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(block_hashes) -> BlockStored:
    return BlockStored(list(block_hashes), None, [], BLOCK_SIZE)


def make_state(clock: FakeClock | None = None, **config) -> RouterState:
    return RouterState(PolicyConfig(**config), clock=clock or FakeClock(), rng=random.Random(0))


def test_batches_apply_in_sequence_from_one():
    state = make_state()
    assert state.update("a", 1, [stored(chain(1, 2))], ReplicaLoad())
    assert state.update("a", 2, [stored(chain(1, 2, 3)[2:])], ReplicaLoad())
    assert state.index.match(chain(1, 2, 3)) == {"a": 3}


def test_gap_is_refused_until_a_resync():
    state = make_state()
    assert state.update("a", 1, [stored(chain(1))], ReplicaLoad(num_running=1))
    assert not state.update("a", 3, [AllBlocksCleared()], ReplicaLoad(num_running=9))
    assert not state.update("a", 1, [AllBlocksCleared()], ReplicaLoad())  # a repeated batch too
    assert state.index.match(chain(1)) == {"a": 1}  # the refused batches changed nothing
    assert state.choose(chain(5), ["a", "b"]).replica_id == "b"  # a still counts its 1 running request

    state.resync("a", 3, chain(7, 8), ReplicaLoad())
    assert state.index.match(chain(1)) == {}
    assert state.index.match(chain(7, 8)) == {"a": 2}
    assert not state.update("a", 3, [], ReplicaLoad())
    assert state.update("a", 4, [stored(chain(1))], ReplicaLoad())
    assert state.index.num_blocks("a") == 3


def test_unknown_replica_needs_a_resync_unless_it_starts_at_one():
    state = make_state()
    assert not state.update("late", 5, [stored(chain(1))], ReplicaLoad())
    assert state.index.num_blocks("late") == 0
    assert state.update("new", 1, [stored(chain(1))], ReplicaLoad())
    assert state.index.match(chain(1)) == {"new": 1}


def test_prefix_hit_wins_and_books_the_request():
    state = make_state()
    state.update("a", 1, [stored(chain(1, 2, 3, 4))], ReplicaLoad(num_running=3))
    state.update("b", 1, [], ReplicaLoad())
    assert state.choose(chain(1, 2, 3, 4, 5), ["b", "a"]) == RoutingDecision("a", 4, "prefix_hit")
    assert (state.num_in_flight("a"), state.num_in_flight("b")) == (1, 0)
    state.release("a")
    state.release("a")  # more releases than bookings never go below zero
    assert state.num_in_flight("a") == 0


def test_no_hit_goes_to_the_least_loaded_and_bookings_count_before_reports():
    state = make_state(assume_routed_prefix_cached=False)
    for replica_id in "ab":
        state.update(replica_id, 1, [], ReplicaLoad())
    picks = [state.choose(chain(1, 2), ["a", "b"]) for _ in range(4)]
    assert [decision.replica_id for decision in picks] == ["a", "b", "a", "b"]
    assert {decision.outcome for decision in picks} == {"no_hit"}
    # a report of more requests than we booked (another router's) wins over our count
    state.update("a", 2, [], ReplicaLoad(num_running=1, num_waiting=4))
    assert state.choose(chain(1, 2), ["a", "b"]).replica_id == "b"


def test_a_burst_follows_the_first_request_before_the_replica_reports():
    state = make_state()
    first = state.choose(chain(1, 2), ["a", "b"])
    second = state.choose(chain(1, 2, 3), ["a", "b"])
    assert (first, second) == (RoutingDecision("a", 0, "no_hit"), RoutingDecision("a", 2, "prefix_hit"))


def test_hot_prefix_spills_then_both_replicas_serve_it():
    state = make_state()
    state.update("a", 1, [stored(chain(1, 2))], ReplicaLoad())
    decisions = [state.choose(chain(1, 2), ["a", "b"]) for _ in range(11)]
    # a takes 9 requests; with 9 outstanding against b's 0 it is too busy: b gets one and caches the
    # prefix; then b's 1 outstanding beats a's 9
    assert [decision.outcome for decision in decisions] == ["prefix_hit"] * 9 + ["spill", "prefix_hit"]
    assert [decision.replica_id for decision in decisions] == ["a"] * 9 + ["b", "b"]
    assert decisions[9].matched_blocks == 0
    assert state.index.match(chain(1, 2)) == {"a": 2, "b": 2}


def test_preemptions_within_the_window_turn_requests_away():
    clock = FakeClock()
    state = make_state(clock, preemption_window_s=10.0, assume_routed_prefix_cached=False)
    state.update("a", 1, [stored(chain(1, 2))], ReplicaLoad(num_preemptions=40))  # old preemptions
    state.update("b", 1, [], ReplicaLoad())
    assert state.choose(chain(1, 2), ["a", "b"]).outcome == "prefix_hit"
    state.release("a")

    clock.now = 1.0
    state.update("a", 2, [], ReplicaLoad(num_preemptions=45))  # 5 new: 1.25 pressure > the full hit
    assert state.choose(chain(1, 2), ["a", "b"]) == RoutingDecision("b", 0, "no_hit")
    state.release("b")

    clock.now = 10.5  # the 5 happened between t=0 and t=1, partly within the window
    assert state.choose(chain(1, 2), ["a", "b"]).replica_id == "b"
    state.release("b")
    clock.now = 11.5  # all of them are older than the window now
    assert state.choose(chain(1, 2), ["a", "b"]) == RoutingDecision("a", 2, "prefix_hit")


def test_preemptions_count_from_a_restarted_counter():
    clock = FakeClock()
    state = make_state(clock)
    state.update("a", 1, [], ReplicaLoad(num_preemptions=100))
    state.update("b", 1, [], ReplicaLoad(num_running=1))
    clock.now = 1.0
    state.resync("a", 1, [], ReplicaLoad(num_preemptions=2))  # restarted: its counter began again
    assert state.choose(chain(1), ["a", "b"]).replica_id == "a"
    state.release("a")
    clock.now = 2.0
    state.update("a", 2, [], ReplicaLoad(num_preemptions=7))  # 5 since the restart
    assert state.choose(chain(2), ["a", "b"]) == RoutingDecision("b", 0, "no_hit")


def test_remove_replica_forgets_everything_about_it():
    state = make_state()
    state.update("a", 1, [stored(chain(1, 2))], ReplicaLoad(num_running=5))
    state.choose(chain(1, 2), ["a"])
    state.remove_replica("a")
    state.release("a")  # a request finishing after its replica left
    assert state.index.match(chain(1, 2)) == {}
    assert state.num_in_flight("a") == 0
    assert not state.update("a", 2, [], ReplicaLoad())  # back to needing seq 1 or a resync
    assert state.update("a", 1, [], ReplicaLoad())
    state.remove_replica("never-seen")


def test_candidates_never_reported_count_as_idle():
    state = make_state()
    state.update("a", 1, [], ReplicaLoad(num_running=2))
    assert state.choose(chain(1), ["a", "fresh"]) == RoutingDecision("fresh", 0, "no_hit")


def test_baseline_policies_through_the_state():
    round_robin = make_state(policy="round_robin")
    assert [round_robin.choose(chain(1), ["a", "b", "c"]).replica_id for _ in range(4)] == ["a", "b", "c", "a"]
    least_loaded = make_state(policy="least_loaded")
    least_loaded.update("a", 1, [], ReplicaLoad(num_waiting=3))
    assert least_loaded.choose(chain(1), ["a", "b"]) == RoutingDecision("b", 0, "least_loaded")


def test_choose_without_candidates_raises_value_error():
    with pytest.raises(ValueError, match="no candidate"):
        make_state().choose(chain(1), [])


def test_new_prefixes_spread_over_equally_loaded_replicas():
    state = make_state()
    for replica_id in ("a", "b"):
        state.resync(replica_id, 1, [], ReplicaLoad())
    first = state.choose(chain(1, 2), ["a", "b"])
    state.release(first.replica_id)
    second = state.choose(chain(7, 8), ["a", "b"])
    state.release(second.replica_id)
    assert [first.replica_id, second.replica_id] == ["a", "b"]  # b caches fewer blocks once a has 1, 2
    assert state.choose(chain(1, 2, 3), ["a", "b"]) == RoutingDecision("a", 2, "prefix_hit")
