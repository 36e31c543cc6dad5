import gc

import pytest

from replica.kv_cache import AllBlocksCleared, BlockStored
from replica.request import Request, SamplingParams
from replica.scheduler import PinStats, SchedulerStats
from router import FinishedRequest, PolicyConfig, Router, RoutingDecision
from router.messages import PoolServed, PullSource
from router.policy import PrefixPolicy, RequestShape

from tests.replica.scheduler_helpers import FakeClock, make_scheduler, step

from .chains import BLOCK_SIZE, chain, stored, tokens


def stats(num_running: int = 0, num_waiting: int = 0, num_preemptions: int = 0, pending: int = 0,
          free_blocks: int = 1000) -> SchedulerStats:
    return SchedulerStats(num_running=num_running, num_waiting=num_waiting, kv_usage=0.0,
                          num_preemptions=num_preemptions, prefix_cache_queries=0, prefix_cache_hits=0,
                          num_prefill_tokens_pending=pending, num_free_blocks=free_blocks)


# The weights these tests work their cost arithmetic with, whatever the defaults are tuned to.
ARITHMETIC_WEIGHTS = {"uncached_token_weight": 2.0, "context_token_weight": 0.0}


def make_router(clock: FakeClock | None = None, seed: int = 0, **config) -> Router:
    return Router(PolicyConfig(**ARITHMETIC_WEIGHTS | config), BLOCK_SIZE, clock=clock or FakeClock(), seed=seed)


def publish(router: Router, replica_id: str, seq: int, events=(), finished=(), **load) -> bool:
    return router.publish(replica_id, seq, list(events), stats(**load), list(finished))


def test_batches_apply_in_sequence_from_one():
    router = make_router()
    assert publish(router, "a", 1, [stored(chain(1, 2))])
    assert publish(router, "a", 2, [stored(chain(1, 2, 3)[2:])])
    assert router.index.match(chain(1, 2, 3)) == {"a": 3}


def test_gap_is_refused_until_a_resync():
    router = make_router()
    assert publish(router, "a", 1, [stored(chain(1))], num_running=1)
    assert not publish(router, "a", 3, [AllBlocksCleared()], num_running=1)
    assert not publish(router, "a", 1, [AllBlocksCleared()], num_running=1)  # a repeated batch too
    assert router.index.match(chain(1)) == {"a": 1}  # the refused batches changed no block
    assert router.choose("r1", chain(5), ["a", "b"]).replica_id == "b"  # a still counts its running request

    router.resync("a", 3, chain(7, 8), stats(), [])
    assert router.index.match(chain(1)) == {}
    assert router.index.match(chain(7, 8)) == {"a": 2}
    assert not publish(router, "a", 3)
    assert publish(router, "a", 4, [stored(chain(1))])
    assert router.index.num_blocks("a") == 3


def test_unknown_replica_needs_a_resync_unless_it_starts_at_one():
    router = make_router()
    assert not publish(router, "late", 5, [stored(chain(1))])
    assert router.index.num_blocks("late") == 0
    assert publish(router, "new", 1, [stored(chain(1))])
    assert router.index.match(chain(1)) == {"new": 1}


def test_prefix_hit_wins_and_books_the_request_until_it_finishes():
    router = make_router()
    publish(router, "a", 1, [stored(chain(*range(40)))], num_running=1)
    publish(router, "b", 1)
    assert router.choose("r1", chain(*range(41)), ["b", "a"]) == RoutingDecision("a", 40, "prefix_hit")
    assert (router.num_in_flight("a"), router.num_in_flight("b")) == (1, 0)
    publish(router, "a", 2, finished=[FinishedRequest("r1", 16)])
    publish(router, "a", 3, finished=[FinishedRequest("r1", 16)])  # a repeated finish changes nothing
    assert router.num_in_flight("a") == 0
    replica = router.snapshot().replicas["a"]
    assert (replica.predicted_cached_tokens, replica.actual_cached_tokens) == (160, 16)


def test_no_hit_alternates_and_bookings_count_before_reports():
    router = make_router(assume_routed_prefix_cached=False)
    for replica_id in "ab":
        publish(router, replica_id, 1)
    picks = [router.choose(f"r{i}", chain(1, 2), ["a", "b"]) for i in range(4)]
    assert [decision.replica_id for decision in picks] == ["a", "b", "a", "b"]
    assert {decision.outcome for decision in picks} == {"no_hit"}
    # a report of more requests than we booked (another router's) wins over our count
    publish(router, "a", 2, num_running=1, num_waiting=4)
    assert router.choose("r5", chain(1, 2), ["a", "b"]).replica_id == "b"


def test_a_burst_follows_the_first_request_before_the_replica_reports():
    router = make_router(request_cost_tokens=32)
    first = router.choose("r1", chain(*range(40)), ["a", "b"])
    second = router.choose("r2", chain(*range(41)), ["a", "b"])
    assert (first, second) == (RoutingDecision("a", 0, "no_hit"), RoutingDecision("a", 40, "prefix_hit"))


def test_a_request_routed_to_a_replica_goes_there_over_a_lighter_one_while_it_is_a_candidate():
    router = make_router()
    publish(router, "a", 1, [stored(chain(*range(4)))], num_running=30, pending=4000)
    publish(router, "b", 1)
    assert router.choose("r1", chain(*range(5)), ["a", "b"]).replica_id == "b"  # the load outweighs the hit
    assert router.choose("r2", chain(*range(5)), ["a", "b"], route_to="a") == RoutingDecision("a", 4, "directed")
    assert router.num_in_flight("a") == 1  # booked like any routed request
    assert router.choose("r3", chain(*range(5)), ["b"], route_to="a").replica_id == "b"  # a is gone: routed
    assert router.snapshot().decisions == {"spill": 1, "directed": 1, "prefix_hit": 1}


def test_another_routers_booking_counts_as_if_this_router_had_routed_it():
    router = make_router(request_cost_tokens=32)
    router.book("r1", chain(*range(40)), "a")
    assert (router.num_in_flight("a"), router.index.match(chain(*range(40)))) == (1, {"a": 40})
    # the burst follows it as it follows this router's own first request
    assert router.choose("r2", chain(*range(41)), ["a", "b"]) == RoutingDecision("a", 40, "prefix_hit")
    assert router.snapshot().decisions == {"prefix_hit": 1}  # a booking is no decision of this router's
    publish(router, "a", 1, finished=[FinishedRequest("r1", 0), FinishedRequest("r2", 0)])
    assert (router.num_in_flight("a"), router.index.match(chain(*range(40)))) == (0, {})
    router.remove_replica("gone")
    router.book("r3", chain(1), "gone")
    assert (router.num_in_flight("gone"), router.index.match(chain(1))) == (0, {})


def test_routed_prefill_counts_as_queued_until_the_replica_reports_it():
    router = make_router(request_cost_tokens=0, step_overhead_tokens=0)
    publish(router, "a", 1, [stored(chain(1, 2))])
    publish(router, "b", 1)
    # 24 tokens each, the first 8 cached on a (or booked on b once a request went there); uncached
    # tokens cost 2: a: 32; then 16 queued + 32 against b's 48, equal, to the one with fewer requests;
    # then 16 + 32 against 24 queued + 32
    decisions = [router.choose(f"r{i}", chain(1, 2, 10 + i, 20 + i, 30 + i, 40 + i), ["a", "b"]) for i in range(3)]
    assert [decision.replica_id for decision in decisions] == ["a", "b", "a"]
    assert router.choose("r8", chain(1, 2, 8), ["a", "b"]).replica_id == "b"  # 32 + 8 against 24 + 8
    # two reports later a's own count (nothing pending) replaces what we routed there
    publish(router, "a", 2)
    publish(router, "a", 3)
    assert router.choose("r9", chain(1, 2, 9), ["a", "b"]).replica_id == "a"


def test_a_waiting_turn_counts_only_the_prefill_its_replica_lacks():
    # A replica reports a waiting request's whole prompt as pending, its cached history too (it looks
    # the prefix up only at admission); the router booked the 4 tokens the replica lacked.
    router = make_router(request_cost_tokens=0, step_overhead_tokens=0)
    publish(router, "a", 1, [stored(chain(*range(1, 41))), stored(chain(*range(100, 110)))])
    publish(router, "b", 1)
    assert router.choose("s1/2", chain(*range(1, 42)), ["a", "b"]).replica_id == "a"
    publish(router, "a", 2, num_waiting=1, pending=41 * BLOCK_SIZE)
    publish(router, "a", 3, num_waiting=1, pending=41 * BLOCK_SIZE)
    # another session's next turn: 4 + 2 * 4 on a, against 2 * 44 on b
    assert router.choose("s2/2", chain(*range(100, 111)), ["a", "b"]) == RoutingDecision("a", 10, "prefix_hit")


def test_hot_prefix_spreads_once_its_replica_is_loaded_then_both_serve_it():
    router = make_router()
    publish(router, "a", 1, [stored(chain(1, 2, 3, 4))])
    publish(router, "b", 1)
    decisions = [router.choose(f"r{i}", chain(1, 2, 3, 4), ["a", "b"]) for i in range(4)]
    # a saves 30 (15 tokens), but a second request there costs 32; b then has 16 tokens queued
    assert [(decision.replica_id, decision.outcome) for decision in decisions] == [
        ("a", "prefix_hit"), ("b", "spill"), ("a", "prefix_hit"), ("b", "prefix_hit")]
    assert router.index.match(chain(1, 2, 3, 4)) == {"a": 4, "b": 4}


def test_a_shared_first_block_does_not_pin_light_load_to_one_replica():
    router = make_router()
    for replica_id in "ab":
        router.resync(replica_id, 1, [], stats(), [])
    # every request starts with the same system-prompt block, then its own text
    decisions = [router.choose(f"r{i + 1}", chain(1, 100 + i, 200 + i), ["a", "b"]) for i in range(10)]
    assert [decision.replica_id for decision in decisions].count("a") == 5
    assert [decision.matched_blocks for decision in decisions] == [0, 0] + [1] * 8


def test_a_booking_that_does_not_run_where_routed_is_rolled_back():
    router = make_router()
    publish(router, "a", 1)
    publish(router, "b", 1)
    assert router.choose("r1", chain(1, 2, 3), ["a", "b"]).replica_id == "a"
    router.routed("r1", "b")  # Serve's second tier sent it to b
    assert router.index.match(chain(1, 2, 3)) == {"b": 3}
    assert (router.num_in_flight("a"), router.num_in_flight("b")) == (0, 1)
    publish(router, "b", 2, finished=[FinishedRequest("r1", None)])  # b never scheduled it
    assert router.index.match(chain(1, 2, 3)) == {}
    assert router.choose("r2", chain(7), ["a", "b"]).replica_id == "a"
    router.release("r2")  # the caller left before it reached a replica
    assert router.index.match(chain(7)) == {}
    assert router.num_in_flight("a") == 0


def test_a_stored_block_outlives_the_booking_that_predicted_it():
    router = make_router()
    router.choose("r1", chain(1, 2), ["a"])
    publish(router, "a", 1, [stored(chain(1, 2))], finished=[FinishedRequest("r1", 0)])
    assert router.index.match(chain(1, 2)) == {"a": 2}
    assert router.index.num_blocks("a") == 2


def test_routing_a_request_again_moves_its_booking():
    router = make_router()
    router.choose("r1", chain(1, 2), ["a"])
    assert router.choose("r1", chain(1, 2), ["b"]) == RoutingDecision("b", 0, "no_hit")
    assert router.index.match(chain(1, 2)) == {"b": 2}
    assert (router.num_in_flight("a"), router.num_in_flight("b")) == (0, 1)


def test_bookings_whose_finish_never_comes_expire():
    clock = FakeClock()
    router = make_router(clock, booking_ttl_s=60.0)
    router.choose("r1", chain(1), ["a"])
    clock.now = 59.0
    router.choose("r2", chain(2), ["a"])
    clock.now = 61.0
    router.choose("r3", chain(3), ["b"])
    assert (router.num_in_flight("a"), router.index.match(chain(1)), router.index.match(chain(2))) == (
        1, {}, {"a": 1})


def test_the_context_routed_requests_attend_to_counts_until_they_finish():
    router = make_router(request_cost_tokens=0, step_overhead_tokens=0, context_token_weight=0.25,
                         assume_routed_prefix_cached=False)
    publish(router, "b", 1, num_running=2)  # short decodes
    assert router.choose("long", chain(*range(100, 150)), ["a", "b"]).replica_id == "a"  # 200 tokens
    for seq in (1, 2):  # a's reports now cover its prefill: nothing queued, one request decoding
        publish(router, "a", seq, num_running=1)
    # a: 2 x 8 uncached + 0.25 x 200 in flight, against 2 x 8 on b (without the context, a: fewer requests)
    assert router.choose("r1", chain(1, 1), ["a", "b"]).replica_id == "b"
    router.release("r1")
    publish(router, "a", 3, finished=[FinishedRequest("long", 0)])
    assert router.choose("r2", chain(1, 1), ["a", "b"]).replica_id == "a"


def finish(router: Router, replica_id: str, seq: int, request_id: str, block_hashes) -> None:
    """The replica ran the request, caching its blocks."""
    publish(router, replica_id, seq, [stored(block_hashes)], finished=[FinishedRequest(request_id, 0)])


SYSTEM_PROMPT = (1, 2, 3)


def session_that_came_back(clock: FakeClock) -> Router:
    """Session s1 ran two turns on a: from its second turn on it has shown that it comes back."""
    router = make_router(clock, request_cost_tokens=0, step_overhead_tokens=0, session_weight=4, session_ttl_s=30.0)
    for replica_id in "ab":
        publish(router, replica_id, 1)
    assert router.choose("s1/1", chain(*SYSTEM_PROMPT, 4, 5), ["a", "b"], session_id="s1").replica_id == "a"
    finish(router, "a", 2, "s1/1", chain(*SYSTEM_PROMPT, 4, 5))
    # the second turn brings 2 uncached blocks (8 tokens): while s1 is parked, a expects 8 more from it
    assert router.choose("s1/2", chain(*SYSTEM_PROMPT, 4, 5, 6, 7), ["a", "b"], session_id="s1") == \
        RoutingDecision("a", 5, "prefix_hit")
    finish(router, "a", 3, "s1/2", chain(*SYSTEM_PROMPT, 4, 5, 6, 7))
    return router


def test_a_new_session_avoids_the_replica_its_parked_sessions_will_come_back_to():
    router = session_that_came_back(FakeClock())
    # a new session shares the system prompt with s1: 2 x 4 + 4 x 8 on a, against 2 x 16 on b
    shared = chain(*SYSTEM_PROMPT, 60)
    assert router.choose("s2/1", shared, ["a", "b"], session_id="s2") == RoutingDecision("b", 0, "spill")
    # without a session, or for s1's own next turn (no longer parked once it arrives), a is cheaper
    assert router.choose("r1", shared, ["a", "b"]).replica_id == "a"
    router.release("r1")
    assert router.choose("s1/3", chain(*SYSTEM_PROMPT, 4, 5, 6, 7, 8), ["a", "b"], session_id="s1") == \
        RoutingDecision("a", 7, "prefix_hit")


def test_a_session_counts_on_its_replica_while_its_first_turn_runs():
    router = session_that_came_back(FakeClock())  # 1 of 2 sessions came back after their first turn
    assert router.choose("s2/1", chain(*SYSTEM_PROMPT, 60), ["a", "b"], session_id="s2").replica_id == "b"
    # s2's first turn runs on b: 16 queued + 2 x 4 + 4 x 16 x 0.5 on b, against 2 x 4 + 4 x 8 on a
    assert router.choose("s3/1", chain(*SYSTEM_PROMPT, 61), ["a", "b"], session_id="s3") == \
        RoutingDecision("a", 3, "prefix_hit")


def test_a_parked_session_stops_counting_after_its_ttl():
    clock = FakeClock()
    router = session_that_came_back(clock)
    new_session = chain(*SYSTEM_PROMPT, 60)
    assert router.choose("s2/1", new_session, ["a", "b"], session_id="s2").replica_id == "b"
    router.release("s2/1")
    assert router.snapshot().replicas["a"].num_parked_sessions == 1
    clock.now = 30.0
    assert router.choose("s3/1", new_session, ["a", "b"], session_id="s3").replica_id == "a"
    assert router.snapshot().replicas["a"].num_parked_sessions == 0


def test_a_later_turn_stays_with_its_session_through_decode_load():
    router = make_router(request_cost_tokens=64, step_overhead_tokens=0)
    publish(router, "b", 1)
    history = chain(*range(1, 11))
    assert router.choose("s/1", history, ["a"], session_id="s").replica_id == "a"
    finish(router, "a", 1, "s/1", history)
    publish(router, "a", 2, num_running=20)  # busy decoding, nothing queued
    turn = chain(*range(1, 12))
    # without a session: 2 x 4 + 64 x 20 on a against 2 x 44 on b; the session's turn: 8 against 88
    assert router.choose("r", turn, ["a", "b"]) == RoutingDecision("b", 0, "spill")
    router.release("r")
    assert router.choose("s/2", turn, ["a", "b"], session_id="s") == RoutingDecision("a", 10, "prefix_hit")


def test_a_turn_that_outlives_its_booking_leaves_its_next_turn_with_its_session():
    clock = FakeClock()
    router = make_router(clock, request_cost_tokens=64, step_overhead_tokens=0, booking_ttl_s=60.0)
    publish(router, "b", 1)
    history = chain(*range(1, 11))
    assert router.choose("s/1", history, ["a"], session_id="s").replica_id == "a"
    clock.now = 61.0  # s/1 still waits in a's queue when the next routing expires its booking
    router.choose("r", chain(50), ["b"])
    finish(router, "a", 1, "s/1", history)
    publish(router, "a", 2, num_running=20)
    clock.now = 64.0
    # still the session's second turn: 8 on a against 88 on b (as a first turn: 8 + 64 x 20 on a)
    assert router.choose("s/2", chain(*range(1, 12)), ["a", "b"], session_id="s") == \
        RoutingDecision("a", 10, "prefix_hit")


def test_a_turn_sent_before_its_last_turns_finish_is_reported_stays_with_its_session():
    router = make_router(request_cost_tokens=64, step_overhead_tokens=0)
    publish(router, "b", 1)
    history = chain(*range(1, 11))
    assert router.choose("s/1", history, ["a"], session_id="s").replica_id == "a"
    publish(router, "a", 1, [stored(history)], num_running=20)  # s/1 computed; its finish not reported yet
    # the client has s/1's answer and sends the next turn: 8 on a against 88 on b (as a first turn, 8 + 64 x 20)
    assert router.choose("s/2", chain(*range(1, 12)), ["a", "b"], session_id="s") == \
        RoutingDecision("a", 10, "prefix_hit")
    # s/1's finish, reported now, leaves the session's turns counted from s/2
    publish(router, "a", 2, finished=[FinishedRequest("s/1", 0)], num_running=20)
    assert router.snapshot().replicas["a"].num_parked_sessions == 0
    assert router.choose("s/3", chain(*range(1, 13)), ["a", "b"], session_id="s") == \
        RoutingDecision("a", 10, "prefix_hit")


def test_preemptions_within_the_window_turn_requests_away():
    clock = FakeClock()
    router = make_router(clock, preemption_window_s=10.0, assume_routed_prefix_cached=False)
    publish(router, "a", 1, [stored(chain(*range(1, 41)))], num_preemptions=40)  # old preemptions
    publish(router, "b", 1)
    long_chain = chain(*range(1, 41))  # 160 tokens: a saves 159
    assert router.choose("r1", long_chain, ["a", "b"]).outcome == "prefix_hit"
    router.release("r1")

    clock.now = 1.0
    publish(router, "a", 2, num_preemptions=41)  # 1 new: 512 > the hit's savings
    assert router.choose("r2", long_chain, ["a", "b"]) == RoutingDecision("b", 0, "spill")
    router.release("r2")

    clock.now = 10.5  # it happened between t=0 and t=1, possibly within the window
    assert router.choose("r3", long_chain, ["a", "b"]).replica_id == "b"
    router.release("r3")
    clock.now = 11.5  # older than the window now
    assert router.choose("r4", long_chain, ["a", "b"]) == RoutingDecision("a", 40, "prefix_hit")


def test_preemptions_count_from_a_restarted_counter():
    clock = FakeClock()
    router = make_router(clock)
    publish(router, "a", 1, num_preemptions=100)
    publish(router, "b", 1, num_running=1)
    clock.now = 1.0
    router.resync("a", 1, [], stats(num_preemptions=2), [])  # restarted: its counter began again
    assert router.choose("r1", chain(1), ["a", "b"]).replica_id == "a"
    router.release("r1")
    clock.now = 2.0
    publish(router, "a", 2, num_preemptions=7)  # 5 since the restart
    assert router.choose("r2", chain(2), ["a", "b"]) == RoutingDecision("b", 0, "no_hit")


def test_remove_replica_forgets_everything_about_it():
    router = make_router()
    publish(router, "a", 1, [stored(chain(1, 2))], num_running=5)
    router.choose("r1", chain(1, 2), ["a"])
    router.remove_replica("a")
    router.release("r1")  # a request finishing after its replica left
    assert router.index.match(chain(1, 2)) == {}
    assert router.num_in_flight("a") == 0
    assert publish(router, "a", 2, [stored(chain(3))])  # a replica on its way out stays forgotten
    assert router.index.match(chain(3)) == {}
    assert "a" not in router.snapshot().replicas
    router.remove_replica("never-seen")


def test_candidates_never_reported_count_as_idle():
    router = make_router()
    publish(router, "a", 1, num_running=2)
    assert router.choose("r1", chain(1), ["a", "fresh"]) == RoutingDecision("fresh", 0, "no_hit")


def test_baseline_policies_through_the_router():
    round_robin = make_router(policy="round_robin")
    assert [round_robin.choose(f"r{i}", chain(1), ["a", "b", "c"]).replica_id for i in range(4)] == [
        "a", "b", "c", "a"]
    least_loaded = make_router(policy="least_loaded")
    publish(least_loaded, "a", 1, num_waiting=3)
    assert least_loaded.choose("r1", chain(1), ["a", "b"]) == RoutingDecision("b", 0, "least_loaded")


def test_least_loaded_is_reproducible_from_the_seed():
    def run(seed: int) -> list[str]:
        router = make_router(seed=seed, policy="least_loaded", assume_routed_prefix_cached=False)
        return [router.choose(f"r{i}", chain(i), ["a", "b", "c", "d"]).replica_id for i in range(12)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_snapshot_counts_decisions_and_bookings():
    router = make_router()
    publish(router, "a", 1, [stored(chain(1))])
    router.choose("r1", chain(1, 2), ["a"])
    router.choose("r2", chain(5), ["a"])
    snapshot = router.snapshot()
    assert (snapshot.policy, snapshot.decisions) == ("prefix", {"prefix_hit": 1, "no_hit": 1})
    assert (snapshot.replicas["a"].index_blocks, snapshot.replicas["a"].num_in_flight) == (1, 2)


def test_bad_requests_raise_value_error():
    with pytest.raises(ValueError, match="no candidate"):
        make_router().choose("r1", chain(1), [])
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        make_router().choose("r1", chain(1, 2), ["a"], num_prompt_tokens=5)
    with pytest.raises(ValueError, match="block_size"):
        Router(PolicyConfig(), 0)


def test_the_index_holds_no_container_per_cached_block():
    router = make_router()
    gc.collect()
    tracked_before = len(gc.get_objects())
    publish(router, "a", 1, [stored(chain(*range(5000)))])
    publish(router, "b", 1, [stored(chain(*range(5000)))])
    gc.collect()
    assert len(gc.get_objects()) - tracked_before < 50
    assert router.index.match(chain(*range(5000)))["b"] == 5000


def test_a_restarted_router_learns_a_pinned_history_from_the_resync_and_sends_the_next_turn_there():
    clock = FakeClock()
    replicas = {replica_id: make_scheduler(num_blocks=64, block_size=BLOCK_SIZE, policy="continuum", clock=clock)
                for replica_id in "ab"}
    a = replicas["a"]
    a.add_request(Request("p/1", tokens(*range(1, 41)), SamplingParams(max_tokens=1, ignore_eos=True), session_id="p"))
    a.add_request(Request("other", tokens(*range(50, 52)), SamplingParams(max_tokens=100, ignore_eos=True)))
    step(a)  # p/1 finishes and its 40 blocks are pinned; "other" runs on
    a.add_request(Request("x", tokens(*range(70, 94)), SamplingParams(max_tokens=1, ignore_eos=True)))
    step(a)  # x's 24 blocks would evict p's history; with a request running, it waits for the pin instead
    assert [request.request_id for request in a.waiting] == ["x"] and "p" in a.pins
    router = make_router(clock)  # restarted: knows no replica, no session
    for replica_id, scheduler in replicas.items():
        router.resync(replica_id, 1, scheduler.kv_cache_manager.cached_block_hashes(), scheduler.make_stats(), [])
    next_turn = chain(*range(1, 41), 98, 99)
    assert router.choose("p/2", next_turn, ["a", "b"], session_id="p") == RoutingDecision("a", 40, "prefix_hit")


def host_stored(block_hashes) -> BlockStored:
    return BlockStored(list(block_hashes), None, [], BLOCK_SIZE, "host")


def test_a_prefix_in_a_replicas_node_pool_is_priced_at_its_measured_load_cost():
    router = make_router()
    load_stats = stats()
    load_stats.host_load_token_cost = 0.05
    router.publish("a", 1, [host_stored(chain(1, 2, 3, 4))], load_stats, [])
    publish(router, "b", 1)
    request = RequestShape(4, 16, BLOCK_SIZE)
    [a, b] = [router._candidate(replica_id, chain(1, 2, 3, 4), 0, 0.0) for replica_id in "ab"]
    assert (a.loadable_blocks, a.load_token_cost, b.loadable_blocks) == (4, 0.05, 0)
    policy = PrefixPolicy(router.config, None)
    # a: 2 x (1 computed + 0.05 x 15 loaded) + one step's 64; b: 2 x 16 computed + 64
    assert (policy.cost(request, a), policy.cost(request, b)) == (2 * (1 + 0.05 * 15) + 64, 2 * 16 + 64)
    assert router.choose("r1", chain(1, 2, 3, 4), ["a", "b"], num_prompt_tokens=16).replica_id == "a"
    router.release("r1")
    load_stats.num_running = 1  # a request's 64 more on a: computing it all on b is cheaper
    assert router.choose("r2", chain(1, 2, 3, 4), ["a", "b"], num_prompt_tokens=16).replica_id == "b"


def test_a_token_placed_in_a_new_block_also_costs_the_share_of_the_replicas_cache_that_requests_hold():
    router = make_router()
    load_stats = stats(free_blocks=50)
    load_stats.num_blocks, load_stats.host_load_token_cost = 100, 0.05
    router.publish("a", 1, [host_stored(chain(1, 2, 3, 4))], load_stats, [])
    request = RequestShape(4, 16, BLOCK_SIZE)
    a = router._candidate("a", chain(1, 2, 3, 4), 0, 0.0)
    assert a.kv_usage == 0.5
    # 15 loaded at 0.05 for the copy, the last token computed, and all 16 at 0.5 for the memory they take
    assert PrefixPolicy(router.config, None).cost(request, a) == pytest.approx(2 * (1 + 0.05 * 15 + 0.5 * 16) + 64)
    router.publish("a", 2, [stored(chain(1, 2, 3, 4))], load_stats, [])  # now on its device: no new block
    a = router._candidate("a", chain(1, 2, 3, 4), 4, 0.0)
    assert PrefixPolicy(router.config, None).cost(request, a) == pytest.approx(2 * (1 + 0.5 * 1) + 64)
    router.choose("r1", chain(7, 8, 9, 10, 11), ["a"], num_prompt_tokens=20)  # 5 blocks routed there since
    assert router._candidate("a", chain(1, 2, 3, 4), 0, 0.0).kv_usage == 0.55


def test_blocks_that_only_pins_hold_do_not_count_as_the_memory_requests_hold():
    router = make_router()
    pinned_stats = stats(free_blocks=50)
    pinned_stats.num_blocks = 100
    pinned_stats.pins = PinStats(num_pinned_blocks=30, num_releasable_blocks=20)  # 10 shared with running requests
    router.publish("a", 1, [], pinned_stats, [])
    assert router._candidate("a", chain(1), 0, 0.0).kv_usage == pytest.approx(0.3)


def test_a_replica_that_has_not_measured_loading_is_priced_at_the_median_of_those_that_have():
    router = make_router()
    for replica_id, cost in (("a", 0.05), ("b", 0.01), ("c", None)):
        replica_stats = stats()
        replica_stats.host_load_token_cost = cost
        router.publish(replica_id, 1, [host_stored(chain(1, 2))], replica_stats, [])
    assert router._candidate("c", chain(1, 2), 0, 0.0).load_token_cost == pytest.approx(0.03)
    assert router._candidate("c", chain(3), 0, 0.0).load_token_cost is None  # nothing to load
    router.remove_replica("a")
    assert router._candidate("c", chain(1, 2), 0, 0.0).load_token_cost == 0.01
    router.remove_replica("b")
    request = RequestShape(2, 8, BLOCK_SIZE)
    candidate = router._candidate("c", chain(1, 2), 0, 0.0)
    assert PrefixPolicy(router.config, None).cost(request, candidate) == 2 * (1 + 0.25 * 7) + 64  # none measured


def test_a_booking_counts_what_its_replica_loads_from_the_pool_as_taking_blocks_but_no_prefill():
    router = make_router(assume_routed_prefix_cached=False)
    router.publish("a", 1, [stored(chain(1)), host_stored(chain(1, 2, 3))], stats(free_blocks=10), [])
    router.choose("r1", chain(1, 2, 3, 4), ["a"], num_prompt_tokens=18)
    candidate = router._candidate("a", chain(7), 0, 0.0)
    # 18 tokens, 1 block on a's device, 2 more in its pool: 4 + 2 computed (block 4 and the partial one);
    # 4 new device blocks (the pool's 2, block 4 and the partial one)
    assert (candidate.num_prefill_tokens_pending, candidate.num_free_blocks) == (6, 6)


def test_a_fixed_host_hit_credit_replaces_the_measured_cost():
    router = make_router(host_hit_credit=0.8)
    load_stats = stats()
    load_stats.host_load_token_cost = 0.01
    router.publish("a", 1, [host_stored(chain(1, 2))], load_stats, [])
    candidate = router._candidate("a", chain(1, 2), 0, 0.0)
    assert PrefixPolicy(router.config, None).cost(RequestShape(2, 8, BLOCK_SIZE), candidate) == pytest.approx(
        2 * (1 + 0.2 * 7) + 64)


def test_the_node_pools_blocks_reach_followers_through_replica_states():
    router = make_router()
    router.publish("a", 1, [stored(chain(1)), host_stored(chain(1, 2))], stats(), [])
    [state] = router.replica_states()
    follower = make_router()
    follower.resync(state.replica_id, state.seq, state.block_hashes, state.stats, [], state.host_block_hashes)
    assert follower.index.stored_hashes("a", "host") == chain(1, 2)
    assert follower.snapshot().replicas["a"].index_host_blocks == 2


def pool_stats(compute_seconds_per_token: float | None = None, pull_seconds_per_token: float | None = None,
               **load) -> SchedulerStats:
    replica_stats = stats(**load)
    replica_stats.compute_seconds_per_token = compute_seconds_per_token
    replica_stats.pull_seconds_per_token = pull_seconds_per_token
    return replica_stats


def pull_router(compute_seconds_per_token: float | None = None, pull_seconds_per_token: float | None = None) -> Router:
    """a and b on one node (one pool), c on another whose pool holds blocks 1-4 of the chain; a caches block 1
    on its device and its node's pool holds block 2."""
    router = make_router()
    router.publish("a", 1, [stored(chain(1)), host_stored(chain(1, 2))],
                   pool_stats(compute_seconds_per_token, pull_seconds_per_token), [])
    router.publish("b", 1, [host_stored(chain(1, 2))], stats(), [])
    router.publish("c", 1, [host_stored(chain(1, 2, 3, 4))], stats(), [])
    for replica_id, port, node in (("a", 1, "n1"), ("b", 2, "n1"), ("c", 3, "n2")):
        router.serve_pool(replica_id, PoolServed(("10.0.0.1", port), node))
    return router


def test_a_replica_pulls_what_neither_it_nor_its_node_holds_from_the_pool_holding_most_of_it():
    router = pull_router()
    assert router.pull_source("a", chain(1, 2, 3, 4, 5)) == PullSource(("10.0.0.1", 3), 2, 2)
    assert router.pull_source("a", chain(1, 2)) is None  # its node holds it all
    assert router.pull_source("a", chain(9, 10)) is None  # nobody does
    router.publish("b", 2, [host_stored(chain(1, 2, 3, 4, 5)[2:])], stats(), [])  # a's node: a's pool, seen late
    assert router.pull_source("a", chain(1, 2, 3, 4, 5)) == PullSource(("10.0.0.1", 3), 2, 2)


def test_pools_elsewhere_are_those_of_other_nodes_while_their_replicas_last():
    router = pull_router()
    assert [router.pools_elsewhere(replica_id) for replica_id in "abcd"] == [True, True, True, False]  # d: none
    router.remove_replica("c")
    assert [router.pools_elsewhere(replica_id) for replica_id in "abc"] == [False, False, False]


def test_a_pull_happens_only_while_a_pulled_token_costs_less_than_a_computed_one():
    assert pull_router(0.002, 0.0019).pull_source("a", chain(1, 2, 3, 4)) == PullSource(("10.0.0.1", 3), 2, 2)
    assert pull_router(0.002, 0.002).pull_source("a", chain(1, 2, 3, 4)) is None
    router = pull_router(0.002, 0.0001)
    router.remove_replica("c")
    assert router.pull_source("a", chain(1, 2, 3, 4)) is None


def test_a_prefix_another_nodes_pool_holds_is_priced_at_the_replicas_pull_cost_and_booked_as_not_computed():
    router = pull_router(compute_seconds_per_token=0.002, pull_seconds_per_token=0.0002)
    candidate = router._candidate("a", chain(1, 2, 3, 4), 1, 0.0, router._pool_depths(chain(1, 2, 3, 4)))
    assert (candidate.loadable_blocks, candidate.pullable_blocks, candidate.pull_token_cost) == (1, 2, 0.1)
    # 16 tokens: block 1 on a's device; 11 loaded (block 2 from its node's pool, blocks 3-4 and 3 tokens of the
    # last block pulled first), 7 of them pulled; the last token computed. None measured loading: 0.25 a token.
    request = RequestShape(4, 16, BLOCK_SIZE)
    assert PrefixPolicy(router.config, None).cost(request, candidate) == pytest.approx(
        2 * (1 + 0.25 * 11 + 0.1 * 7) + 64)
    router.choose("r", chain(1, 2, 3, 4), ["a"], num_prompt_tokens=16)
    assert router._candidate("a", chain(9), 0, 0.0).num_prefill_tokens_pending == 1


def test_a_replica_whose_node_lacks_a_prefix_is_chosen_for_a_pull_while_pulling_beats_computing():
    def route(pull_seconds_per_token: float) -> str:
        router = make_router()
        router.publish("a", 1, [host_stored(chain(1, 2, 3, 4))], pool_stats(free_blocks=0), [])
        router.publish("b", 1, [], pool_stats(0.002, pull_seconds_per_token), [])
        for replica_id, node in (("a", "n1"), ("b", "n2")):
            router.serve_pool(replica_id, PoolServed(("10.0.0.1", 1), node))
        return router.choose("r", chain(1, 2, 3, 4), ["a", "b"], num_prompt_tokens=16).replica_id

    # a, its cache full: 2 x (1 + 0.25 x 15 loaded) + 64 + 4 blocks short x 4 = 89.5; b computing: 2 x 16 + 64 = 96;
    # b pulling at 0.1 of computing: 2 x (1 + 0.25 x 15 + 0.1 x 15) + 64 = 76.5
    assert route(pull_seconds_per_token=0.0002) == "b"
    assert route(pull_seconds_per_token=0.002) == "a"


def test_a_request_routed_to_a_replica_does_not_count_as_held_there_when_it_asks_to_pull():
    router = pull_router()
    router.choose("r", chain(1, 2, 3, 4), ["a"], num_prompt_tokens=16)
    assert router.pull_source("a", chain(1, 2, 3, 4)) == PullSource(("10.0.0.1", 3), 2, 2)
