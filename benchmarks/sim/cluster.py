"""The discrete-event simulation: programs arrive, a router routes, simulated replicas step.

Events, in simulated seconds: a turn arrives (routed at once and queued on its replica); a
replica's step ends (tokens sampled, finished turns schedule their program's next turn after its
gap, the replica publishes); a publication reaches the router publish_lag_s later.
"""
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from replica.kv_cache import hash_token_blocks
from replica.scheduler import SchedulerOutput

from .replica import Publication, SimReplica
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
    def __init__(self, programs: list[Program], replicas: list[SimReplica], make_router: Callable,
                 block_size: int, clock: SimClock, publish_lag_s: float = 0.01):
        self.clock = clock
        self.programs = {program.session_id: program for program in programs}
        self.replicas = {replica.replica_id: replica for replica in replicas}
        self.router = make_router(list(self.replicas), clock)
        self.block_size = block_size
        self.publish_lag_s = publish_lag_s
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
        replica_id = self.router.choose(request_id, block_hashes, len(turn.prompt), program.session_id)
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
        self._at(self.now + self.publish_lag_s, self._deliver, replica.replica_id, publication)
        self._start_step(replica)

    def _finish(self, replica: SimReplica, record: RequestRecord) -> None:
        record.finished_s = self.now
        self.router.finished(replica.replica_id, record.request_id)
        session_id, turn_index = record.request_id.rsplit("/", 1)
        program = self.programs[session_id]
        next_index = int(turn_index) + 1
        if next_index < len(program.turns):
            self._at(self.now + program.turns[next_index].gap_s, self._arrive, program, next_index)

    def _deliver(self, replica_id: str, publication: Publication) -> None:
        for finished in publication.finished:
            self.records[finished.request_id].num_cached_tokens = finished.num_cached_tokens or 0
        self.router.deliver(replica_id, publication)
