"""What crosses the wire to and from the router: Ray-free, so engines, the ingress, simulators and
tests share the exact types the router actor takes and returns."""
from dataclasses import dataclass, field

from replica.kv_cache import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from replica.scheduler import SchedulerStats

__all__ = ["AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "FinishedRequest", "KVEvent",
           "PoolServed", "PullSource", "ReplicaSnapshot", "ReplicaState", "RouterSnapshot", "RoutingDecision", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    request_id: str
    num_cached_tokens: int | None  # prompt tokens found in the prefix cache; None if never scheduled


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    replica_id: str
    matched_blocks: int
    outcome: str  # "prefix_hit", "no_hit", "spill", "round_robin", "least_loaded", "directed", "fallback" or "booked"


@dataclass(frozen=True, slots=True)
class PoolServed:
    """Where a replica serves its node's pool, and which pool that is (the replicas of a node share one)."""
    address: tuple[str, int]
    pool: str


@dataclass(frozen=True, slots=True)
class PullSource:
    """Where a replica pulls the blocks of a chain its node lacks from: the pool server of another node."""
    address: tuple[str, int]
    start: int       # the chain's first block to pull: the replica's node holds those before it
    num_blocks: int


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """A replica as a router knows it from its reports: resync(replica_id, seq, block_hashes, stats) rebuilds it."""
    replica_id: str
    seq: int
    block_hashes: list[BlockHash]
    stats: SchedulerStats
    host_block_hashes: list[BlockHash] = field(default_factory=list)  # its node pool's, as it sees it


@dataclass(slots=True)
class ReplicaSnapshot:
    stats: SchedulerStats
    index_blocks: int = 0
    num_in_flight: int = 0            # routed here and not finished yet
    predicted_cached_tokens: int = 0  # summed over finished requests the router chose a replica for
    actual_cached_tokens: int = 0     # what the replicas reported for those same requests
    num_parked_sessions: int = 0      # sessions between turns (within session_ttl_s) last served here
    index_host_blocks: int = 0        # blocks of its node's pool, as the index mirrors them


@dataclass(slots=True)
class RouterSnapshot:
    policy: str
    replicas: dict[str, ReplicaSnapshot] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # outcome -> count
