"""RouterState: everything the router knows about its replicas, and the routing decision made from it.

Per replica: its cached blocks (in the BlockIndex), the last event batch number applied, its last
reported load, the requests routed to it and not yet finished, and its recent preemptions.
Replicas number their event batches 1, 2, 3...; a batch that does not follow the last one applied
(lost, repeated, or from a restarted or never seen replica) is refused and the caller resyncs.
"""
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from replica.kv_cache import BlockHash, KVEvent
from router.index import BlockIndex
from router.policy import Candidate, PolicyConfig, ReplicaLoad, RoutingDecision, make_policy


class PreemptionWindow:
    """Preemptions within the last window_s seconds, from a cumulative counter sampled at each report.

    The oldest sample kept is the last one at or before the window's start: the baseline the
    newest count is compared with.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def record(self, now: float, num_preemptions: int) -> None:
        if self._samples and num_preemptions < self._samples[-1][1]:
            self._samples.clear()  # the counter restarted with the replica
        self._samples.append((now, num_preemptions))
        self._forget_before(now)

    def count(self, now: float) -> int:
        self._forget_before(now)
        return self._samples[-1][1] - self._samples[0][1] if self._samples else 0

    def _forget_before(self, now: float) -> None:
        start = now - self.window_s
        while len(self._samples) > 1 and self._samples[1][0] <= start:
            self._samples.popleft()


@dataclass(slots=True)
class _Replica:
    preemptions: PreemptionWindow
    last_seq: int = 0
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    num_in_flight: int = 0  # routed here and not released yet

    @property
    def num_requests(self) -> int:
        # Our own count is fresher than the report for what we routed; the report also covers
        # requests other routers sent. Each undercounts, so take the larger.
        return max(self.load.num_running + self.load.num_waiting, self.num_in_flight)


class RouterState:
    def __init__(self, config: PolicyConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        self.config = config or PolicyConfig()
        self.index = BlockIndex()
        self._clock = clock
        self._policy = make_policy(self.config, rng or random.Random())
        self._replicas: dict[str, _Replica] = {}

    def update(self, replica_id: str, seq: int, events: list[KVEvent], load: ReplicaLoad) -> bool:
        """Apply a replica's next event batch and load; False (nothing applied) means: resync it."""
        replica = self._replicas.get(replica_id)
        if seq != (replica.last_seq if replica else 0) + 1:
            return False
        self.index.apply(replica_id, events)
        self._report(replica_id, seq, load)
        return True

    def resync(self, replica_id: str, seq: int, block_hashes: Sequence[BlockHash], load: ReplicaLoad) -> None:
        """Replace a replica's state with a full snapshot; its next batch is expected as seq + 1."""
        self.index.resync(replica_id, block_hashes)
        self._report(replica_id, seq, load)

    def choose(self, block_hashes: Sequence[BlockHash], candidates: Sequence[str]) -> RoutingDecision:
        """Pick the replica for a request with this block-hash chain, and book the request on it."""
        if not candidates:
            raise ValueError("no candidate replicas to route to")
        matched = self.index.match(block_hashes)
        now = self._clock()
        decision = self._policy.choose(
            len(block_hashes), [self._candidate(replica_id, matched.get(replica_id, 0), now)
                                for replica_id in candidates])
        self._replica(decision.replica_id).num_in_flight += 1
        if self.config.assume_routed_prefix_cached:
            self.index.add(decision.replica_id, block_hashes[decision.matched_blocks:])
        return decision

    def release(self, replica_id: str) -> None:
        """A request routed to replica_id finished; a replica removed meanwhile is ignored."""
        replica = self._replicas.get(replica_id)
        if replica is not None and replica.num_in_flight > 0:
            replica.num_in_flight -= 1

    def remove_replica(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)
        self.index.remove_replica(replica_id)

    def num_in_flight(self, replica_id: str) -> int:
        replica = self._replicas.get(replica_id)
        return replica.num_in_flight if replica else 0

    def _report(self, replica_id: str, seq: int, load: ReplicaLoad) -> None:
        replica = self._replica(replica_id)
        replica.last_seq = seq
        replica.load = load
        replica.preemptions.record(self._clock(), load.num_preemptions)

    def _replica(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica(PreemptionWindow(self.config.preemption_window_s))
        return replica

    def _candidate(self, replica_id: str, matched_blocks: int, now: float) -> Candidate:
        replica = self._replicas.get(replica_id)
        if replica is None:
            return Candidate(replica_id, matched_blocks)
        return Candidate(replica_id, matched_blocks, replica.num_requests, replica.load.kv_usage,
                         replica.preemptions.count(now), self.index.num_blocks(replica_id))
