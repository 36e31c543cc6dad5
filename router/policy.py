"""Routing policies: which of the candidate replicas gets a request.

"prefix" scores each replica by the fraction of the request's blocks it already caches against
its pressure (outstanding requests, KV usage, recent preemptions), and spills a prefix too hot
for one replica onto another. "round_robin" and "least_loaded" ignore the cache: they are the
baselines prefix routing is measured against.
"""
import random
from dataclasses import dataclass
from typing import Literal, Protocol

import pydantic

from router.messages import RoutingDecision


@dataclass(slots=True)
class ReplicaLoad:
    """What a replica last reported about its load."""
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0  # cumulative since the replica started

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be within [0, 1], got {self.kv_usage}")
        if min(self.num_running, self.num_waiting, self.num_preemptions) < 0:
            raise ValueError(f"request and preemption counts must be >= 0, got {self}")


class PolicyConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    policy: Literal["prefix", "round_robin", "least_loaded"] = "prefix"
    """prefix: cache overlap against pressure; round_robin: in turn; least_loaded: power of two choices."""
    prefix_weight: float = pydantic.Field(1.0, ge=0)
    """Score of a replica caching every block of the request; a partial prefix earns its fraction."""
    request_weight: float = pydantic.Field(0.05, ge=0)
    """Pressure per outstanding request (running, waiting, or routed and not yet reported)."""
    kv_usage_weight: float = pydantic.Field(0.5, ge=0)
    """Pressure of a replica whose KV cache is fully in use (scaled by its usage)."""
    preemption_weight: float = pydantic.Field(0.25, ge=0)
    """Pressure per preemption within the window: a preempting replica is about to evict the very
    blocks that make it look attractive."""
    preemption_window_s: float = pydantic.Field(10.0, gt=0)
    """How far back preemptions count, in seconds."""
    spill_abs_threshold: int = pydantic.Field(8, ge=0)
    """A replica is too busy for prefix affinity when it has more than this many outstanding
    requests above the least loaded candidate..."""
    spill_rel_threshold: float = pydantic.Field(1.5, ge=1.0)
    """...and more than this many times the least loaded candidate's. Its request then goes to the
    best replica that is not too busy, which caches the prefix as well."""
    assume_routed_prefix_cached: bool = True
    """Count a request's blocks as cached on its replica from the moment it is routed there, so a
    burst sharing a prefix follows the first request before the replica reports the blocks stored.
    Turn off for replicas without prefix caching."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A replica as a policy sees it when routing one request."""
    replica_id: str
    matched_blocks: int = 0      # leading blocks of the request's chain it caches
    num_requests: int = 0        # outstanding requests on it
    kv_usage: float = 0.0
    recent_preemptions: int = 0  # within the last preemption_window_s
    num_cached_blocks: int = 0   # everything it caches, this request's prefix or not


class Policy(Protocol):
    def choose(self, num_blocks: int, candidates: list[Candidate]) -> RoutingDecision: ...


class PrefixPolicy:
    """Highest score wins, unless it is too busy: then spill.

    Ties go to the replica caching the fewest blocks, so prefixes new to every replica spread out
    instead of piling onto the first candidate; then to the earlier candidate.
    """

    def __init__(self, config: PolicyConfig):
        self.config = config

    def choose(self, num_blocks: int, candidates: list[Candidate]) -> RoutingDecision:
        least_requests = min(candidate.num_requests for candidate in candidates)

        def score(candidate: Candidate) -> tuple[float, int]:
            return self.score(candidate, num_blocks), -candidate.num_cached_blocks

        best = max(candidates, key=score)
        if not self.is_too_busy(best, least_requests):
            return _decide(best, "prefix_hit" if best.matched_blocks else "no_hit")
        calm = [candidate for candidate in candidates if not self.is_too_busy(candidate, least_requests)]
        return _decide(max(calm, key=score), "spill")

    def score(self, candidate: Candidate, num_blocks: int) -> float:
        overlap = candidate.matched_blocks / num_blocks if num_blocks else 0.0
        return self.config.prefix_weight * overlap - self.pressure(candidate)

    def pressure(self, candidate: Candidate) -> float:
        config = self.config
        return (config.request_weight * candidate.num_requests
                + config.kv_usage_weight * candidate.kv_usage
                + config.preemption_weight * candidate.recent_preemptions)

    def is_too_busy(self, candidate: Candidate, least_requests: int) -> bool:
        return (candidate.num_requests - least_requests > self.config.spill_abs_threshold
                and candidate.num_requests > self.config.spill_rel_threshold * least_requests)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, num_blocks: int, candidates: list[Candidate]) -> RoutingDecision:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return _decide(chosen, "round_robin")


class LeastLoadedPolicy:
    """Power of two choices: the one with fewer outstanding requests of two sampled at random."""

    def __init__(self, rng: random.Random):
        self._rng = rng

    def choose(self, num_blocks: int, candidates: list[Candidate]) -> RoutingDecision:
        sampled = self._rng.sample(candidates, min(2, len(candidates)))
        return _decide(min(sampled, key=lambda candidate: candidate.num_requests), "least_loaded")


def make_policy(config: PolicyConfig, rng: random.Random) -> Policy:
    match config.policy:
        case "prefix":
            return PrefixPolicy(config)
        case "round_robin":
            return RoundRobinPolicy()
        case "least_loaded":
            return LeastLoadedPolicy(rng)


def _decide(candidate: Candidate, outcome: str) -> RoutingDecision:
    return RoutingDecision(candidate.replica_id, candidate.matched_blocks, outcome)
