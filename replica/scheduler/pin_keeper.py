"""PinKeeper: the scheduler's side of continuum's pins (pins.py): when a finished turn is pinned
instead of freed, when pins end, and what happened to them (PinStats). Under other queue policies
it pins nothing and frees every finished request."""
import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Callable

from replica.kv_cache import KVCacheManager
from replica.request import Request, RequestStatus
from replica.scheduler.compute_rate import ComputeRate
from replica.scheduler.config import SchedulerConfig
from replica.scheduler.output import PinStats
from replica.scheduler.pins import PROGRAMS_REMEMBERED, Pin, Pins, ToolGapEstimator
from replica.scheduler.trace import SchedulerTrace

_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class PinKeeper:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, clock: Callable[[], float],
                 trace: SchedulerTrace | None):
        self.pins = Pins()
        self.stats = PinStats()
        self._config = config
        self._kv = kv_cache_manager
        self._clock = clock
        self._trace = trace
        continuum = config.policy == "continuum"
        self._tool_gaps = ToolGapEstimator(config.pin_ttl_default_s, config.pin_ttl_max_s) if continuum else None
        # what a pin's recompute costs; the scheduler reports its steps to it under continuum only
        self.compute_rate = ComputeRate(clock) if continuum else None
        self._next_turns: set[str] = set()  # waiting requests whose program's previous turn finished here
        self._arrived_at: dict[str, float] = {}  # unfinished request -> when it arrived here
        self._program_started: OrderedDict[str, float] = OrderedDict()  # program -> its earliest turn's arrival here

    def arrived(self, request: Request) -> None:
        if (pinned_session := self.pins.session_of(request.request_id)) is not None:
            self._end(self.pins.pop(pinned_session), "reused")  # the id of a finished, pinned turn, used again
        if self._tool_gaps is None:
            return
        now = self._arrived_at[request.request_id] = self._clock()
        if request.session_id is None:
            return
        if request.session_id not in self._program_started:
            self._program_started[request.session_id] = now
            if len(self._program_started) > PROGRAMS_REMEMBERED:
                self._program_started.popitem(last=False)
        if self._tool_gaps.turn_arrived(request.session_id, now):
            self._next_turns.add(request.request_id)
            self.pins.next_turn_arrived(request.session_id, now)

    def rank(self, request: Request) -> tuple[bool, bool, float, float]:
        """Continuum's order of the waiting requests, lowest first: those that waited pin_max_wait_s, pinned
        programs' turns, then by their program's earliest turn here (program-level FCFS: a program that came first
        finishes first, and the histories of programs that came later wait rather than evict each other), then by
        their own arrival."""
        arrived_at = self._arrived_at[request.request_id]
        return not self._waited_too_long(request), request.session_id not in self.pins, \
            self._program_started.get(request.session_id, arrived_at), arrived_at

    def _waited_too_long(self, request: Request) -> bool:
        return self._waited(request) >= self._config.pin_max_wait_s

    def _waited(self, request: Request) -> float:
        """Since it arrived (a preempted request: since it first arrived), not since it reached the queue's head:
        requests held back one after the other would add up their waits."""
        return self._clock() - self._arrived_at[request.request_id]

    def expire(self) -> None:
        for pin in self.pins.pop_expired(self._clock()):
            self._end(pin, "expired")
            if not pin.hit:
                self._count("expired", pin.request.request_id)

    def admitted(self, request: Request, num_computed_tokens: int) -> None:
        if request.request_id in self._next_turns:
            self._next_turns.remove(request.request_id)
            self.stats.next_turn_queries += request.num_tokens
            self.stats.next_turn_hits += num_computed_tokens
            if (pin := self.pins.get(request.session_id)) is not None and not pin.hit:
                pin.hit = True
                self._count("hits", request.request_id)

    def release_to_admit(self, request: Request, anything_running: bool) -> bool:
        """Free a pin so that the waiting request fits; False when none may go. While the replica runs something,
        an admission waits for pins to expire or for their programs' next turns, which go first: under memory
        pressure, releasing pins for new programs evicts the histories the pinned programs come back for, and both
        recompute (benchmarks/results/agents.md). With nothing running, waiting would leave the replica idle
        through the tool gaps. Programs that keep coming back renew their pins, so a request that has waited
        pin_max_wait_s takes the pins whose recompute would not take longer than it has waited: it waits no longer
        than releasing would cost the pin's program (a 30k-token history recomputes for minutes on a CPU)."""
        if not self.pins:
            return False
        if not anything_running:
            return self.release_one_for(request)
        waited = self._waited(request)
        if waited < self._config.pin_max_wait_s:
            return False
        recompute_s = self.compute_rate.seconds
        return self._release_first(request, lambda pin: recompute_s(pin.request.num_computed_tokens) <= waited)

    def release_one_for(self, request: Request) -> bool:
        """Free the pin of the program that came last, other than the request's own program's: under program-level
        FCFS it is the one to wait longest anyway. Pins go before any preemption."""
        return self._release_first(request)

    def _release_first(self, request: Request, eligible: Callable[[Pin], bool] | None = None) -> bool:
        pin = self.pins.pop_first(key=self._came_last_first, keep=request.session_id, eligible=eligible)
        if pin is None:
            return False
        self._end(pin, "released")
        self._count("released", pin.request.request_id)
        return True

    def finished(self, request: Request) -> None:
        """Free the finished request's blocks, or pin them for its program's next turn."""
        self._arrived_at.pop(request.request_id, None)
        self._next_turns.discard(request.request_id)
        if request.session_id is None or self._tool_gaps is None:
            self._kv.free(request)
        elif request.last_turn or request.status not in _PINNABLE:  # the program ended, or was aborted
            self._kv.free(request)
            self._tool_gaps.forget(request.session_id)
            self._program_started.pop(request.session_id, None)
            if (pin := self.pins.pop(request.session_id)) is not None:
                self._end(pin, "ended")
        else:
            self._pin(request)

    def _came_last_first(self, pin: Pin) -> float:
        return -self._program_started.get(pin.request.session_id, pin.pinned_at)

    def release_all(self) -> None:
        for pin in self.pins.pop_all():
            self._end(pin, "reset")

    def snapshot(self) -> PinStats:
        """Every step's: a block with one reference is its pin's alone (most are); a shared one is releasable only
        if pins hold all its references."""
        alone, shared = 0, Counter()
        for pin in self.pins:
            for block in self._kv.get_blocks(pin.request.request_id):
                if block.ref_cnt == 1:
                    alone += 1
                else:
                    shared[block.block_id] += 1
        blocks = self._kv.block_pool.blocks
        releasable = alone + sum(1 for block_id, num_pins in shared.items() if blocks[block_id].ref_cnt == num_pins)
        return dataclasses.replace(self.stats, num_pinned_blocks=alone + len(shared), num_releasable_blocks=releasable)

    def _pin(self, request: Request) -> None:
        """Hold the finished turn's blocks for the program's next turn, replacing its previous pin."""
        now = self._clock()
        ttl = self._tool_gaps.ttl(request.session_id)
        self._tool_gaps.turn_finished(request.session_id, now)
        if ttl <= 0:
            self._kv.free(request)
            return
        previous = self.pins.add(request, now, now + ttl)
        if previous is not None:
            self._end(previous, "replaced")
        self._count("pinned", request.request_id)

    def _end(self, pin: Pin, end: str) -> None:
        self._kv.free(pin.request)
        if self._trace is not None:
            self._trace.pin_ended(pin, end, self._clock())

    def _count(self, kind: str, request_id: str) -> None:
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        if self._trace is not None:
            self._trace.pin_event(kind, request_id)
