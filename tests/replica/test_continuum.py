"""The continuum policy: a program's finished turn keeps its blocks pinned for the next turn."""
from replica.request import Request, RequestStatus, SamplingParams
from replica.scheduler import PinStats, Scheduler
from replica.scheduler.pins import PROGRAMS_REMEMBERED, Pins, ToolGapEstimator
from replica.scheduler.request_queue import ContinuumRequestQueue

from .scheduler_helpers import FakeClock, fake_model_output, make_scheduler, step

BLOCK_SIZE = 4


def continuum(num_blocks: int = 20, **config) -> tuple[FakeClock, Scheduler]:
    clock = FakeClock()
    return clock, make_scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE, clock=clock, policy="continuum",
                                 **{"pin_ttl_default_s": 2.0} | config)


def turn(request_id: str, prompt: list[int], session_id: str | None = "p", max_tokens: int = 1, **kwargs) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   session_id=session_id, **kwargs)


def run_to_completion(scheduler, *requests: Request) -> list[str]:
    """Adds the requests, then steps until nothing is left: the ids in the order they finished."""
    for request in requests:
        scheduler.add_request(request)
    finished = []
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler)
        finished += [output.request_id for output in outputs if output.finished]
    return finished


def num_free(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_finished_turn_stays_pinned_until_its_ttl():
    clock, scheduler = continuum()
    assert run_to_completion(scheduler, turn("p/1", list(range(8)))) == ["p/1"]
    assert num_free(scheduler) == 17  # 19 usable, 2 pinned
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=2, num_releasable_blocks=2, pinned=1)
    clock.now = 1.9
    scheduler.expire_pins()  # what the engine does while it idles
    assert num_free(scheduler) == 17
    clock.now = 2.0
    scheduler.expire_pins()
    assert num_free(scheduler) == 19
    assert scheduler.make_stats().pins == PinStats(pinned=1, expired=1)


def test_a_pinned_block_that_a_running_request_shares_is_not_releasable():
    _, scheduler = continuum()
    run_to_completion(scheduler, turn("p/1", list(range(8))))
    scheduler.add_request(turn("x", list(range(8)) + [90, 91, 92, 93], session_id=None, max_tokens=8))
    step(scheduler)  # x takes p/1's 2 pinned blocks as its prefix, and 1 block of its own
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=2, num_releasable_blocks=0, pinned=1)
    run_to_completion(scheduler)
    assert scheduler.make_stats().pins.num_releasable_blocks == 2


def test_a_block_two_pins_share_is_pinned_once_and_releasable():
    _, scheduler = continuum()
    run_to_completion(scheduler, turn("p/1", list(range(8))))
    run_to_completion(scheduler, turn("q/1", list(range(4)) + [50, 51, 52, 53], session_id="q"))
    # p's 2 blocks and q's second; q's first is p's first, from the prefix cache
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=3, num_releasable_blocks=3, pinned=2)


def test_fcfs_frees_a_finished_turn_of_a_program():
    scheduler = make_scheduler(num_blocks=20, block_size=BLOCK_SIZE, policy="fcfs")
    run_to_completion(scheduler, turn("p/1", list(range(8))))
    assert num_free(scheduler) == 19
    assert scheduler.make_stats().pins == PinStats()


def test_the_next_turn_hits_its_pinned_history_and_its_own_pin_replaces_the_first():
    clock, scheduler = continuum()
    run_to_completion(scheduler, turn("p/1", list(range(8))))
    clock.now = 1.5
    scheduler.add_request(turn("p/2", list(range(8)) + [7, 50, 51, 52]))  # history, answer, tool result
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"p/2": 4}  # the 8 pinned tokens were not recomputed
    run_to_completion(scheduler)
    stats = scheduler.make_stats().pins
    assert stats == PinStats(num_pinned_blocks=3, num_releasable_blocks=3, pinned=2, hits=1, next_turn_queries=12,
                             next_turn_hits=8)
    assert num_free(scheduler) == 16
    clock.now = 3.4  # the gap observed was 1.5 s, but 3 are needed before the default gives way
    scheduler.schedule()
    assert num_free(scheduler) == 16
    clock.now = 3.5
    scheduler.schedule()
    assert num_free(scheduler) == 19


def test_a_last_turn_and_an_abort_end_the_programs_pin():
    _, scheduler = continuum()
    run_to_completion(scheduler, *(turn(f"{session}/1", [ord(session)] * 8, session_id=session) for session in "pq"))
    assert num_free(scheduler) == 15
    run_to_completion(scheduler, turn("p/2", [ord("p")] * 8 + [7, 1], last_turn=True))
    assert num_free(scheduler) == 17
    scheduler.add_request(turn("q/2", [ord("q")] * 8 + [7, 1], session_id="q"))
    scheduler.finish_requests("q/2", RequestStatus.FINISHED_ABORTED)
    assert num_free(scheduler) == 19
    assert scheduler.make_stats().pins == PinStats(pinned=2, hits=1, next_turn_queries=10, next_turn_hits=8)


def pin_two_programs(clock: FakeClock, scheduler) -> None:
    """p's pin expires at 2.0 s, q's at 3.0 s; 2 blocks each."""
    for start, session in ((0.0, "p"), (1.0, "q")):
        clock.now = start
        run_to_completion(scheduler, turn(f"{session}/1", [ord(session)] * 8, session_id=session))


def test_a_pin_outlives_its_ttl_once_the_next_turn_arrived_and_waits():
    clock, scheduler = continuum(max_num_seqs=1)
    run_to_completion(scheduler, turn("p/1", [ord("p")] * 8))  # pinned until 2.0
    scheduler.add_request(turn("x", list(range(100, 104)), session_id=None, max_tokens=8))
    step(scheduler)
    clock.now = 1.5
    scheduler.add_request(turn("p/2", [ord("p")] * 8 + [7, 1]))  # waits for x's seat
    clock.now = 2.5
    step(scheduler)
    assert "p" in scheduler.pins and num_free(scheduler) == 15  # x: 2 blocks, p's pin: 2
    assert run_to_completion(scheduler) == ["x", "p/2"]
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=3, num_releasable_blocks=3, pinned=2, hits=1,
                                                   next_turn_queries=10, next_turn_hits=8)


def test_with_nothing_running_an_admission_takes_the_pin_of_the_program_that_came_last():
    clock, scheduler = continuum(num_blocks=10)
    pin_two_programs(clock, scheduler)
    assert num_free(scheduler) == 5
    scheduler.add_request(turn("r", list(range(100, 124)), session_id=None))  # 6 blocks
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"r": 24}
    assert [pin.request.request_id for pin in scheduler.pins] == ["p/1"]  # p's has less time left, but p came first
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=2, num_releasable_blocks=2, pinned=2, released=1)


def test_while_a_request_runs_an_admission_waits_for_pins_to_expire():
    clock, scheduler = continuum(num_blocks=12)
    pin_two_programs(clock, scheduler)
    scheduler.add_request(turn("running", list(range(200, 208)), session_id=None, max_tokens=50))  # 2 blocks
    step(scheduler)
    assert num_free(scheduler) == 5
    scheduler.add_request(turn("r", list(range(100, 124)), session_id=None))  # 6 blocks
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"running": 1}
    clock.now = 2.0  # p's pin expires
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"running": 1, "r": 24}
    assert [pin.request.request_id for pin in scheduler.pins] == ["q/1"]
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=2, num_releasable_blocks=2, pinned=2, expired=1)


def test_pins_are_released_before_a_running_request_is_preempted():
    _, scheduler = continuum(num_blocks=10)
    scheduler.add_request(turn("r", list(range(100, 115)), session_id=None, max_tokens=20))  # 4 blocks
    step(scheduler)
    scheduler.add_request(turn("p/1", [ord("p")] * 16))
    _, outputs = step(scheduler)
    assert [output.request_id for output in outputs if output.finished] == ["p/1"]
    assert num_free(scheduler) == 1  # r holds 4, p's pin 4
    step(scheduler)  # r's 17th token takes the last free block
    assert (num_free(scheduler), len(scheduler.pins)) == (0, 1)
    for _ in range(4):  # its 21st needs one more
        step(scheduler)
    assert scheduler.make_stats().num_preemptions == 0
    assert num_free(scheduler) == 3  # p's pin: 4 blocks, one of them taken
    assert len(scheduler.pins) == 0 and scheduler.make_stats().pins.released == 1


def test_a_victim_is_chosen_among_programs_without_a_pin():
    _, scheduler = continuum(num_blocks=7)
    run_to_completion(scheduler, turn("p/1", [ord("p")] * 8))
    scheduler.add_request(turn("b", list(range(100, 109)), session_id=None, max_tokens=10))  # 3 blocks
    step(scheduler)
    scheduler.add_request(turn("p/2", [ord("p")] * 8 + [7, 1, 2, 3], max_tokens=10))  # 1 block beyond the pin
    step(scheduler)
    assert [request.request_id for request in scheduler.running] == ["b", "p/2"]
    assert num_free(scheduler) == 0
    # p/2's 13th token needs a 4th block; p/2 is the latest admitted, but its program holds a pin
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"b"}
    assert output.num_scheduled_tokens == {"p/2": 1}
    assert "p" in scheduler.pins


def test_waiting_turns_of_pinned_programs_are_admitted_first():
    _, scheduler = continuum(max_num_seqs=1)
    run_to_completion(scheduler, turn("p/1", [ord("p")] * 8))
    scheduler.add_request(turn("x", list(range(100, 110)), session_id=None))
    scheduler.add_request(turn("q/1", [ord("q")] * 8, session_id="q"))
    scheduler.add_request(turn("p/2", [ord("p")] * 8 + [7, 1]))
    assert run_to_completion(scheduler) == ["p/2", "x", "q/1"]


def test_waiting_turns_go_by_their_programs_first_arrival():
    """Program-level FCFS: q's turn waits behind p's though it arrived first, because p came first."""
    clock, scheduler = continuum(max_num_seqs=1)
    for start, session in ((0.0, "p"), (1.0, "q")):
        clock.now = start
        run_to_completion(scheduler, turn(f"{session}/1", [ord(session)] * 8, session_id=session))
    clock.now = 10.0  # both pins expired
    scheduler.add_request(turn("x", list(range(100, 104)), session_id=None, max_tokens=4))
    step(scheduler)
    scheduler.add_request(turn("q/2", [ord("q")] * 8 + [7, 1], session_id="q"))
    clock.now = 11.0
    scheduler.add_request(turn("p/2", [ord("p")] * 8 + [7, 1]))
    assert len(scheduler.pins) == 0
    assert run_to_completion(scheduler) == ["x", "p/2", "q/2"]


def test_resetting_the_prefix_cache_ends_every_pin():
    _, scheduler = continuum()
    run_to_completion(scheduler, turn("p/1", list(range(8))))
    assert scheduler.kv_cache_manager.reset_prefix_cache() is False
    assert scheduler.reset_prefix_cache() is True
    assert num_free(scheduler) == 19 and len(scheduler.pins) == 0


def test_the_tool_gap_estimate_is_a_quantile_of_the_programs_own_gaps_then_everyones_capped():
    estimator = ToolGapEstimator(default_s=2.0, max_s=10.0)
    gaps = {"a": [1.0, 2.0, 3.0], "b": [20.0, 20.0, 20.0]}
    assert estimator.ttl("a") == 2.0
    for session_id, session_gaps in gaps.items():
        now = 0.0
        for gap in session_gaps:
            estimator.turn_finished(session_id, now)
            assert estimator.turn_arrived(session_id, now + gap)
            now += gap + 1
    assert estimator.ttl("a") == 2.8  # the 0.9 quantile of 1, 2, 3
    assert estimator.ttl("b") == 10.0  # capped
    assert estimator.ttl("new") == 10.0  # everyone's: the 0.9 quantile of 1, 2, 3, 20, 20, 20 is 20
    assert not estimator.turn_arrived("new", 5.0)


def test_the_estimator_forgets_the_finish_of_programs_that_never_come_back_oldest_first():
    estimator = ToolGapEstimator(default_s=2.0, max_s=10.0)
    for program in range(PROGRAMS_REMEMBERED + 1):
        estimator.turn_finished(f"program {program}", float(program))
    assert not estimator.turn_arrived("program 0", 5000.0)  # aged out: its next turn counts no gap
    assert estimator.turn_arrived("program 1", 5000.0)

def test_a_request_that_waited_pin_max_wait_s_takes_pins():
    clock, scheduler = continuum(num_blocks=12, pin_max_wait_s=3.0)
    run_to_completion(scheduler, turn("p/1", [ord("p")] * 8))  # pinned until 2.0
    scheduler.add_request(turn("running", list(range(200, 208)), session_id=None, max_tokens=50))  # 2 blocks
    step(scheduler)
    clock.now = 0.2
    scheduler.add_request(turn("r", list(range(100, 128)), session_id=None))  # 7 blocks, 6 free
    step(scheduler)
    clock.now = 1.5  # p comes back within its pin, goes first, and pins its longer history until 3.5
    scheduler.add_request(turn("p/2", [ord("p")] * 8 + [7, 1, 2, 3]))
    assert step(scheduler)[0].num_scheduled_tokens == {"running": 1, "p/2": 4}
    assert scheduler.pins.get("p").expires_at == 3.5
    clock.now = 3.1
    assert step(scheduler)[0].num_scheduled_tokens == {"running": 1}
    clock.now = 3.2  # r waited 3 s: p's pin goes, though it has 0.3 s left
    assert step(scheduler)[0].num_scheduled_tokens == {"running": 1, "r": 28}
    assert scheduler.make_stats().pins == PinStats(pinned=2, hits=1, released=1, next_turn_queries=12,
                                                   next_turn_hits=8)


def test_requests_held_back_together_wait_pin_max_wait_s_from_their_arrival_not_one_after_the_other():
    clock, scheduler = continuum(num_blocks=9, pin_max_wait_s=3.0, pin_ttl_default_s=10.0)
    pin_two_programs(clock, scheduler)  # 2 blocks each, until 10.0 and 11.0
    scheduler.add_request(turn("running", list(range(200, 205)), session_id=None, max_tokens=50))  # 2 blocks
    step(scheduler)
    clock.now = 1.5
    for request_id in ("r1", "r2"):  # 3 blocks each, 2 free
        scheduler.add_request(turn(request_id, [ord(request_id[1])] * 12, session_id=None))
    assert step(scheduler)[0].num_scheduled_tokens == {"running": 1}
    clock.now = 4.5  # both waited 3 s: each takes a pin
    assert step(scheduler)[0].num_scheduled_tokens == {"running": 1, "r1": 12, "r2": 12}
    assert len(scheduler.pins) == 0


def test_a_turn_that_waited_pin_max_wait_s_goes_ahead_of_pinned_programs():
    clock, scheduler = continuum(max_num_seqs=1, pin_max_wait_s=3.0, pin_ttl_default_s=10.0)
    run_to_completion(scheduler, turn("p/1", [ord("p")] * 8))
    scheduler.add_request(turn("x", list(range(100, 104)), session_id=None, max_tokens=8))
    step(scheduler)
    scheduler.add_request(turn("q/1", [ord("q")] * 8, session_id="q"))
    clock.now = 3.5
    scheduler.add_request(turn("p/2", [ord("p")] * 8 + [7, 1]))
    assert run_to_completion(scheduler) == ["x", "q/1", "p/2"]


def test_pins_whose_next_turn_arrived_never_expire():
    pins = Pins()
    for session, expires_at in (("p", 2.0), ("q", 3.0), ("r", 4.0)):
        pins.add(turn(f"{session}/1", [1], session_id=session), 0.0, expires_at)
    pins.next_turn_arrived("p", 1.0)
    assert [pin.request.request_id for pin in pins.pop_expired(3.0)] == ["q/1"]
    assert pins.pop_first(key=lambda pin: pin.expires_at, keep="p").request.request_id == "r/1"
    assert pins.pop_first(key=lambda pin: pin.expires_at, keep="p") is None
    assert pins.pop_expired(100.0) == [] and pins.pop_first(key=lambda pin: 0, keep=None).request.request_id == "p/1"


def test_the_continuum_queue_pops_the_request_its_peek_found_though_the_ranks_moved_since():
    ranks = {"a": (1,), "b": (2,)}
    queue = ContinuumRequestQueue(lambda request: ranks[request.request_id])
    first, second = turn("a", [1]), turn("b", [2])
    queue.add(first)
    queue.add(second)
    assert queue.peek() is first
    ranks["b"] = (0,)  # b waited past pin_max_wait_s while a was being admitted
    assert queue.pop() is first
    assert queue.peek() is second and len(queue) == 1


def paced_step(clock: FakeClock, scheduler, seconds_per_token: float = 0.125):
    """A step that takes seconds_per_token for each token it computes."""
    output = scheduler.schedule()
    clock.now += seconds_per_token * output.total_num_scheduled_tokens
    return output, scheduler.update_from_output(output, fake_model_output(scheduler, output))


def test_a_request_that_waited_pin_max_wait_s_takes_only_pins_it_waited_longer_for_than_their_recompute():
    clock, scheduler = continuum(num_blocks=16, pin_max_wait_s=3.0, pin_ttl_default_s=100.0)
    for session, num_tokens in (("p", 8), ("q", 32)):  # 1 s and 4 s of compute at 0.125 s a token
        scheduler.add_request(turn(f"{session}/1", [ord(session)] * num_tokens, session_id=session))
        paced_step(clock, scheduler)
    assert num_free(scheduler) == 5  # p pins 2 blocks, q 8
    clock.now = 10.0
    scheduler.add_request(turn("running", list(range(200, 203)), session_id=None, max_tokens=50))
    paced_step(clock, scheduler)
    scheduler.add_request(turn("r", list(range(100, 128)), session_id=None))  # 7 blocks, arrives at 10.375
    assert paced_step(clock, scheduler)[0].num_scheduled_tokens == {"running": 1}
    clock.now = 13.4  # r waited 3 s: p's recompute (1 s) is shorter, q's (4 s) longer, though q came last
    assert paced_step(clock, scheduler)[0].num_scheduled_tokens == {"running": 1}
    assert "p" not in scheduler.pins and "q" in scheduler.pins
    clock.now = 14.4  # r waited longer than q's recompute
    assert paced_step(clock, scheduler)[0].num_scheduled_tokens == {"running": 1, "r": 28}
    assert scheduler.make_stats().pins == PinStats(num_pinned_blocks=0, pinned=2, released=2)
