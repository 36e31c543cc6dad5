"""The discrete-event simulation: programs arrive, a router routes, simulated replicas step.

Events, in simulated seconds: a turn arrives (routed at once and queued on its replica); a
replica's step ends (tokens sampled, finished turns schedule their program's next turn after its
gap, the replica publishes); a publication reaches the router publish_lag_s later.

K routers stand for K ingress replicas, each routing with its own view: turns are dealt to them
in turn, as a load balancer in front of them would. A lone router is today's router actor, fed
directly; with several, everything a router learns from elsewhere takes sync_delay_s more: every
publication reaches each of them publish_lag_s + sync_delay_s after its step, and with shared
bookings a router's booking reaches the others booking_delay_s (by default sync_delay_s) after it routed.
"""
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from replica.kv_cache import hash_token_blocks
from replica.scheduler import SchedulerOutput

from .replica import SimReplica
from .workloads import Program


@dataclass
class RequestRecord:
    request_id: str
    session_id: str
    replica_id: str
    arrival_s: float
    num_prompt_tokens: int
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    num_cached_tokens: int = 0


class SimClock:
    """Simulated seconds, read by the router and by the replicas' schedulers (pin expiry)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation:
    def __init__(self, programs: list[Program], replicas: list[SimReplica], routers: Sequence, block_size: int,
                 clock: SimClock, publish_lag_s: float = 0.01, sync_delay_s: float = 0.0,
                 shared_bookings: bool = True, booking_delay_s: float | None = None):
        self.clock = clock
        self.programs = {program.session_id: program for program in programs}
        self.replicas = {replica.replica_id: replica for replica in replicas}
        self.routers = list(routers)
        self.block_size = block_size
        self.publication_lag_s = publish_lag_s + (sync_delay_s if len(self.routers) > 1 else 0.0)
        self.booking_delay_s = sync_delay_s if booking_delay_s is None else booking_delay_s
        self.shared_bookings = shared_bookings
        self._next_router = itertools.cycle(self.routers)
        self.records: dict[str, RequestRecord] = {}
        self._events: list = []
        self._order = itertools.count()

    def run(self) -> list[RequestRecord]:
        for program in self.programs.values():
            self._at(program.start_s, self._arrive, program, 0)
        while self._events:
            self.clock.now, _, action, args = heapq.heappop(self._events)
            action(*args)
        return list(self.records.values())

    @property
    def now(self) -> float:
        return self.clock.now

    def _at(self, when: float, action, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def _arrive(self, program: Program, turn_index: int) -> None:
        turn = program.turns[turn_index]
        request_id = f"{program.session_id}/{turn_index}"
        block_hashes = hash_token_blocks(turn.prompt, self.block_size)
        router = next(self._next_router)
        replica_id = router.choose(request_id, block_hashes, len(turn.prompt), program.session_id)
        if self.shared_bookings:
            for other in self.routers:
                if other is not router:
                    self._at(self.now + self.booking_delay_s, other.book, request_id, block_hashes, replica_id,
                             len(turn.prompt), program.session_id)
        self.records[request_id] = RequestRecord(request_id, program.session_id, replica_id, self.now,
                                                 len(turn.prompt))
        replica = self.replicas[replica_id]
        replica.add(request_id, turn.prompt, block_hashes, turn.output, self.now, program.session_id,
                    turn_index == len(program.turns) - 1)
        if not replica.busy:
            self._start_step(replica)

    def _start_step(self, replica: SimReplica) -> None:
        output, seconds = replica.schedule()
        replica.busy = output.total_num_scheduled_tokens > 0
        if not replica.busy:
            return
        for new_request in output.scheduled_new_reqs:
            record = self.records[new_request.req_id]
            if record.scheduled_s is None:
                record.scheduled_s = self.now
        self._at(self.now + seconds, self._end_step, replica, output)

    def _end_step(self, replica: SimReplica, output: SchedulerOutput) -> None:
        for result in replica.complete(output):
            record = self.records[result.request_id]
            if record.first_token_s is None:
                record.first_token_s = self.now
            if result.finished:
                self._finish(replica, record)
        publication = replica.publish()
        for finished in publication.finished:
            self.records[finished.request_id].num_cached_tokens = finished.num_cached_tokens or 0
        for router in self.routers:
            self._at(self.now + self.publication_lag_s, router.deliver, replica.replica_id, publication)
        self._start_step(replica)

    def _finish(self, replica: SimReplica, record: RequestRecord) -> None:
        record.finished_s = self.now
        for router in self.routers:
            router.finished(replica.replica_id, record.request_id)
        session_id, turn_index = record.request_id.rsplit("/", 1)
        program = self.programs[session_id]
        next_index = int(turn_index) + 1
        if next_index < len(program.turns):
            self._at(self.now + program.turns[next_index].gap_s, self._arrive, program, next_index)

