"""The routers a simulation can drive, by name: prefixserve's router.Router and the baselines."""
import random
from collections.abc import Callable, Sequence

from replica.kv_cache import BlockHash
from router import PolicyConfig, Router

from .baselines import ConsistentHashRouter, RayPrefixAffinityRouter, SGLangCacheAwareRouter
from .replica import Publication


class CoreRouter:
    """router.Router fed the replicas' publications, as the router actor is."""

    def __init__(self, config: PolicyConfig, replica_ids: Sequence[str], block_size: int,
                 clock: Callable[[], float], seed: int):
        self.router = Router(config, block_size, clock=clock, seed=seed)
        self.replica_ids = list(replica_ids)

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int,
               session_id: str) -> str:
        return self.router.choose(request_id, block_hashes, self.replica_ids, num_prompt_tokens=num_prompt_tokens,
                                  session_id=session_id).replica_id

    def book(self, request_id: str, block_hashes: Sequence[BlockHash], replica_id: str, num_prompt_tokens: int,
             session_id: str) -> None:
        """Another router routed the request to replica_id."""
        self.router.book(request_id, block_hashes, replica_id, num_prompt_tokens=num_prompt_tokens,
                         session_id=session_id)

    def deliver(self, replica_id: str, publication: Publication) -> None:
        # Delivery is in order and lossless here, so a refused batch is a bug, not a resync.
        if not self.router.publish(replica_id, publication.seq, publication.events, publication.stats,
                                   publication.finished):
            raise RuntimeError(f"router refused batch {publication.seq} of {replica_id}")

    def finished(self, replica_id: str, request_id: str) -> None:
        """The router learns of finishes from publications."""


CORE_POLICIES = ("prefix", "round_robin", "least_loaded")  # router.Router's: the ones that run as K routers
POLICIES = (*CORE_POLICIES, "consistent_hash", "sglang", "ray")


def make_router(policy: str, replica_ids: Sequence[str], block_size: int, clock: Callable[[], float],
                seed: int, config: PolicyConfig | None = None):
    match policy:
        case _ if policy in CORE_POLICIES:
            config = config or PolicyConfig()
            return CoreRouter(config.model_copy(update={"policy": policy}), replica_ids, block_size, clock, seed)
        case "consistent_hash":
            return ConsistentHashRouter(replica_ids)
        case "sglang":
            return SGLangCacheAwareRouter(replica_ids, block_size, random.Random(seed))
        case "ray":
            return RayPrefixAffinityRouter(replica_ids, block_size, random.Random(seed))
    raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
