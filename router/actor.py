"""RouterActor: the one Ray actor per Serve app that owns the app's RouterState.

Engine replicas publish to it after every step (numbered KV event batches, stats, the requests
that finished); the request router in the ingress asks it where each request goes. Its methods
are synchronous and short, so Ray runs them one at a time in the order each caller sent them:
a replica's batches arrive in sequence.

The actor is named after the Serve app and its routing config, and created by whichever process
asks first (get_if_exists). It dies with that process, so it never outlives the app; when it dies
earlier (its creator was a replica that a rolling update replaced), the next caller creates a
fresh one and every replica resyncs into it.
"""
import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray
import xxhash
from ray.actor import ActorHandle

from replica.kv_cache import BlockHash, KVEvent
from replica.scheduler import SchedulerStats
from router.messages import FinishedRequest, ReplicaSnapshot, RouterSnapshot, RoutingDecision
from router.policy import PolicyConfig, ReplicaLoad
from router.state import RouterState

NAMESPACE = "prefixserve"


@dataclass(frozen=True, slots=True)
class _Routed:
    replica_id: str
    predicted_cached_tokens: int
    routed_at: float


class RouterActor:
    # A booking stands for a request until its replica's own report counts it, seconds later; one
    # whose finish never comes back (the caller left before the request reached a replica)
    # expires so that it does not weigh on the replica for ever.
    booking_ttl_s = 60.0

    def __init__(self, config: PolicyConfig, block_size: int, *, clock: Callable[[], float] = time.monotonic):
        self._state = RouterState(config, clock=clock)
        self._clock = clock
        self._block_size = block_size
        self._replicas: dict[str, ReplicaSnapshot] = {}
        self._routed: dict[str, _Routed] = {}  # request id -> where it was sent, until it finishes
        self._removed: set[str] = set()
        self._decisions: Counter[str] = Counter()

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash],
               candidates: Sequence[str]) -> RoutingDecision:
        now = self._clock()
        self._expire_bookings(now)
        previous = self._routed.pop(request_id, None)
        if previous is not None:  # routed again after the first replica refused it
            self._state.release(previous.replica_id)
        decision = self._state.choose(block_hashes, candidates)
        self._routed[request_id] = _Routed(decision.replica_id, decision.matched_blocks * self._block_size, now)
        self._decisions[decision.outcome] += 1
        return decision

    def publish(self, replica_id: str, seq: int, events: list[KVEvent], stats: SchedulerStats,
                finished: list[FinishedRequest]) -> bool:
        """A replica's next event batch; False means the router lost track and wants a resync."""
        if replica_id in self._removed:
            return True  # a replica on its way out; it stays forgotten
        self._record(replica_id, stats, finished)
        return self._state.update(replica_id, seq, events, _load(stats))

    def resync(self, replica_id: str, seq: int, block_hashes: list[BlockHash], stats: SchedulerStats,
               finished: list[FinishedRequest]) -> None:
        if replica_id in self._removed:
            return
        self._record(replica_id, stats, finished)
        self._state.resync(replica_id, seq, block_hashes, _load(stats))

    def remove_replica(self, replica_id: str) -> None:
        self._removed.add(replica_id)
        self._state.remove_replica(replica_id)
        self._replicas.pop(replica_id, None)
        self._routed = {request_id: routed for request_id, routed in self._routed.items()
                        if routed.replica_id != replica_id}

    def snapshot(self) -> RouterSnapshot:
        for replica_id, replica in self._replicas.items():
            replica.index_blocks = self._state.index.num_blocks(replica_id)
            replica.num_in_flight = self._state.num_in_flight(replica_id)
        return RouterSnapshot(self._state.config.policy, dict(self._replicas), dict(self._decisions))

    def _expire_bookings(self, now: float) -> None:
        while self._routed:
            request_id, routed = next(iter(self._routed.items()))  # the oldest: dicts keep insertion order
            if now - routed.routed_at < self.booking_ttl_s:
                return
            del self._routed[request_id]
            self._state.release(routed.replica_id)

    def _record(self, replica_id: str, stats: SchedulerStats, finished: list[FinishedRequest]) -> None:
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = ReplicaSnapshot(stats)
        replica.stats = stats
        for request in finished:
            routed = self._routed.pop(request.request_id, None)
            if routed is None:
                continue  # routed without asking us (fallback), or already forgotten
            self._state.release(routed.replica_id)
            if request.num_cached_tokens is not None:
                replica.predicted_cached_tokens += routed.predicted_cached_tokens
                replica.actual_cached_tokens += request.num_cached_tokens


def _load(stats: SchedulerStats) -> ReplicaLoad:
    return ReplicaLoad(kv_usage=stats.kv_usage, num_running=stats.num_running, num_waiting=stats.num_waiting,
                       num_preemptions=stats.num_preemptions)


def router_actor_name(app_name: str, config: PolicyConfig, block_size: int) -> str:
    # A redeploy with another policy or block size gets its own actor: the old one, which the
    # old replicas still feed, goes away with them.
    fingerprint = xxhash.xxh3_64_hexdigest(f"{config.model_dump_json()}|{block_size}".encode())
    return f"router:{app_name}:{fingerprint}"


def get_or_create_router(app_name: str, config: PolicyConfig, block_size: int) -> ActorHandle:
    """The app's RouterActor handle, creating the actor if nobody has yet. Blocks on Ray's GCS."""
    return ray.remote(RouterActor).options(
        name=router_actor_name(app_name, config, block_size), namespace=NAMESPACE, get_if_exists=True,
        num_cpus=0, max_restarts=-1,
    ).remote(config, block_size)


class RouterClient:
    """The app's RouterActor, found (or created) on first use and again after reset()."""

    def __init__(self, app_name: str, config: PolicyConfig, block_size: int):
        self._args = (app_name, config, block_size)
        self._lookup: asyncio.Future | None = None

    async def get(self) -> ActorHandle:
        if self._lookup is None:
            self._lookup = asyncio.ensure_future(asyncio.to_thread(get_or_create_router, *self._args))
        try:
            return await asyncio.shield(self._lookup)  # a caller timing out leaves the lookup running
        except Exception:
            if self._lookup.done():
                self._lookup = None
            raise

    def reset(self) -> None:
        """A call failed because the actor died (with the process that created it): look again next time."""
        self._lookup = None
