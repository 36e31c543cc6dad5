"""Baseline routers from other projects, re-implemented from their sources' documented defaults.

They see what those routers see: the requests they routed and which of them finished (a proxy sees
a response end), never the replicas' KV events. Prompts are matched as chains of token-block
hashes instead of characters (SGLang, Ray Serve) or token ids: one node per 16-token block, so a
match is rounded down to a whole block and the prompt's last partial block never matches.

- consistent-hash: a ketama ring (160 points per replica, as nginx's `hash ... consistent`) on the
  session id.
- sglang: sgl-router's cache_aware policy (sgl-router/src/policies/cache_aware.rs) with the
  launcher's defaults (sglang_router/router_args.py): cache_threshold 0.3, balance_abs_threshold
  64, balance_rel_threshold 1.5, max_tree_size 2**26 (never reached here: no eviction). Load is
  the requests in flight per worker. Imbalanced (max - min > abs and max > rel * min): the least
  loaded worker. Else the approximate tree's deepest match: above cache_threshold of the prompt,
  a worker holding that node (the first one the map yields: here one at random); else the
  worker with the smallest tree. The prompt is inserted for the chosen worker either way.
- ray: Ray Serve's PrefixCacheAffinityRouter (ray/llm/_internal/serve/routing_policies/
  prefix_aware/) with its defaults: imbalanced_threshold inf (never imbalanced),
  match_rate_threshold 0.1, no eviction. Candidates are the replicas holding the deepest match
  if it covers at least 10% of the prompt, else the replicas with the smallest trees; of those
  the one with the shortest queue (requests in flight), ties at random. Prompts (not answers)
  are inserted after routing. Serve's max_ongoing_requests back-pressure is not modelled.
"""
import bisect
import random
from collections.abc import Sequence

import xxhash

from replica.kv_cache import BlockHash

KETAMA_POINTS = 160


class InFlight:
    """Requests routed to each replica whose response has not ended."""

    def __init__(self, replica_ids: Sequence[str]):
        self.replica_ids = list(replica_ids)
        self.counts = dict.fromkeys(replica_ids, 0)

    def finished(self, replica_id: str, request_id: str) -> None:
        self.counts[replica_id] -= 1

    def deliver(self, replica_id: str, publication) -> None:
        """KV events and stats are not theirs to see."""

    def _routed(self, replica_id: str) -> str:
        self.counts[replica_id] += 1
        return replica_id


class ConsistentHashRouter(InFlight):
    def __init__(self, replica_ids: Sequence[str]):
        super().__init__(replica_ids)
        points = sorted((_hash64(f"{replica_id}-{i}"), replica_id)
                        for replica_id in replica_ids for i in range(KETAMA_POINTS))
        self._keys = [key for key, _ in points]
        self._owners = [owner for _, owner in points]

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int,
               session_id: str) -> str:
        index = bisect.bisect(self._keys, _hash64(session_id)) % len(self._keys)
        return self._routed(self._owners[index])


class TenantTree:
    """A multi-tenant approximate prefix tree over block-hash chains: block hash -> replicas.

    Hashes are chained, so a block's hash names its whole prefix: a dict of nodes is the tree.
    """

    def __init__(self, replica_ids: Sequence[str], block_size: int):
        self.block_size = block_size
        self._tenants: dict[BlockHash, set[str]] = {}
        self.size = dict.fromkeys(replica_ids, 0)  # tokens inserted per replica

    def insert(self, block_hashes: Sequence[BlockHash], replica_id: str) -> None:
        for block_hash in block_hashes:
            tenants = self._tenants.setdefault(block_hash, set())
            if replica_id not in tenants:
                tenants.add(replica_id)
                self.size[replica_id] += self.block_size

    def match(self, block_hashes: Sequence[BlockHash]) -> tuple[int, list[str]]:
        """Tokens of the deepest node any replica holds, and the replicas holding it (sorted)."""
        depth, holders = 0, set()
        for block_hash in block_hashes:
            tenants = self._tenants.get(block_hash)
            if not tenants:
                break
            depth, holders = depth + 1, tenants
        return depth * self.block_size, sorted(holders)

    def smallest(self) -> list[str]:
        least = min(self.size.values())
        return [replica_id for replica_id, size in self.size.items() if size == least]


class SGLangCacheAwareRouter(InFlight):
    def __init__(self, replica_ids: Sequence[str], block_size: int, rng: random.Random, *,
                 cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5):
        super().__init__(replica_ids)
        self.tree = TenantTree(replica_ids, block_size)
        self._rng = rng
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int,
               session_id: str) -> str:
        chosen = self._least_loaded() if self._imbalanced() else self._cache_aware(block_hashes, num_prompt_tokens)
        self.tree.insert(block_hashes, chosen)
        return self._routed(chosen)

    def _imbalanced(self) -> bool:
        loads = self.counts.values()
        most, least = max(loads), min(loads)
        return most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold

    def _least_loaded(self) -> str:
        return min(self.replica_ids, key=self.counts.__getitem__)  # the first of equals, as min_by_key

    def _cache_aware(self, block_hashes: Sequence[BlockHash], num_prompt_tokens: int) -> str:
        matched_tokens, holders = self.tree.match(block_hashes)
        if matched_tokens / num_prompt_tokens > self.cache_threshold:
            return self._rng.choice(holders)
        return self._rng.choice(self.tree.smallest())


class RayPrefixAffinityRouter(InFlight):
    def __init__(self, replica_ids: Sequence[str], block_size: int, rng: random.Random, *,
                 imbalanced_threshold: float = float("inf"), match_rate_threshold: float = 0.1):
        super().__init__(replica_ids)
        self.tree = TenantTree(replica_ids, block_size)
        self._rng = rng
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold

    def choose(self, request_id: str, block_hashes: Sequence[BlockHash], num_prompt_tokens: int,
               session_id: str) -> str:
        chosen = self._shortest_queue(self._candidates(block_hashes, num_prompt_tokens))
        self.tree.insert(block_hashes, chosen)
        return self._routed(chosen)

    def _candidates(self, block_hashes: Sequence[BlockHash], num_prompt_tokens: int) -> list[str]:
        loads = self.counts.values()
        if max(loads) - min(loads) > self.imbalanced_threshold:
            return self._rng.sample(self.replica_ids, min(2, len(self.replica_ids)))  # power of two
        matched_tokens, holders = self.tree.match(block_hashes)
        if matched_tokens / num_prompt_tokens < self.match_rate_threshold or not holders:
            return self.tree.smallest()
        return holders

    def _shortest_queue(self, candidates: list[str]) -> str:
        least = min(self.counts[replica_id] for replica_id in candidates)
        return self._rng.choice([replica_id for replica_id in candidates if self.counts[replica_id] == least])


def _hash64(key: str) -> int:
    return xxhash.xxh64_intdigest(key.encode())
