"""Routing policies: which of the candidate replicas gets a request.

"prefix" estimates, per replica and in tokens of prefill work, what the request would cost there:
the prefill already queued on the replica plus this request's tokens its cache lacks, the steps
that takes, the requests the replica already serves, and the risk of having to evict or preempt
to make room. The cheapest wins, so a cached prefix is worth exactly the prefill it saves, and
equal savings go to the less loaded replica. "round_robin" and "least_loaded" ignore the cache:
they are the baselines prefix routing is measured against.
"""
import math
import random
from dataclasses import dataclass
from typing import Literal, Protocol

import pydantic

from router.messages import RoutingDecision


class PolicyConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    policy: Literal["prefix", "round_robin", "least_loaded"] = "prefix"
    """prefix: the cheapest replica by the token cost model; round_robin: in turn; least_loaded: power of
    two choices on outstanding requests."""
    uncached_token_weight: float = pydantic.Field(3.0, ge=1)
    """Cost per token of this request the replica does not cache. Queued tokens cost 1 (time waited);
    the request's own uncached tokens are time waited too, and work the cluster spends on it, which
    near capacity delays every later request. 3 from benchmarks/sim_cluster.py at load 0.9: at 2 a
    replica busy with one long prefill copied its system prompts onto idle replicas, and at 8
    replicas the cluster cached 75% of prompt tokens against 87% for a router that never spreads."""
    step_token_budget: int = pydantic.Field(8192, ge=1)
    """The engines' max_num_batched_tokens (ClusterConfig sets it from theirs): queued prefill beyond it
    takes more steps."""
    step_overhead_tokens: float = pydantic.Field(64.0, ge=0)
    """A step's fixed cost (launch, sampling, scheduling) in tokens of prefill it would take as long to compute."""
    request_cost_tokens: float = pydantic.Field(64.0, ge=0)
    """Cost of every request already running or queued on the replica: the decode work the new request
    shares each step with. 64 from benchmarks/sim_cluster.py (benchmarks/results/routing-sim.md): at
    256, chats left their history's replica for a few requests' difference and recomputed it. Not
    counted for a later turn of a session (nor context_token_weight): its first turn chose the
    replica it lives on, and only queued prefill, memory and preemptions move it from there."""
    context_token_weight: float = pydantic.Field(0.1, ge=0)
    """Cost per token of context that the requests routed to the replica attend to: every decode step
    reads them all, so a replica decoding long documents takes longer over each step the request
    waits through. 0.1 from the simulator's document-qa workload (TTFT p50 halved against 0)."""
    occupancy_weight: float = pydantic.Field(1.0, ge=0)
    """Cost per token the request must place in new KV blocks on the replica (computed, or loaded from a pool),
    times the share of the replica's cache that requests hold, as a share of computing a token: a replica whose
    running requests fill its cache admits the next request only as memory frees, and a device hit takes no new
    block. 0: memory counts only once blocks run short (memory_weight). 1 from the simulator: system prompts'
    TTFT p50 0.62-0.75x that of 0 at N = 8 and 16 over seeds 0-2, 0.89x over all four workloads
    (benchmarks/results/routing-sim.md)."""
    memory_weight: float = pydantic.Field(1.0, ge=0)
    """Cost per token of KV cache the replica lacks for this request (free and evictable blocks below
    its uncached blocks): what it must preempt and later recompute."""
    preemption_cost_tokens: float = pydantic.Field(512.0, ge=0)
    """Cost per preemption within the window: a preempting replica recomputes work and is about to
    evict the very blocks that make it look attractive."""
    preemption_window_s: float = pydantic.Field(10.0, gt=0)
    """How far back preemptions count, in seconds."""
    assume_routed_prefix_cached: bool = True
    """Count a request's blocks as cached on its replica from the moment it is routed there, so a
    burst sharing a prefix follows the first request before the replica reports the blocks stored.
    Off for replicas without prefix caching (ClusterConfig sets it from their enable_prefix_caching)."""
    session_weight: float = pydantic.Field(16.0, ge=0)
    """For a session's first turn, which picks the replica its later turns follow it to: cost per token
    that the sessions the replica hosts are expected to bring per turn (in flight as a later turn, or
    parked between turns: as many uncached tokens as its last turn, times the share of parked
    sessions that came back, router/sessions.py). A replica hosting many
    conversations or agent programs looks idle between their turns; the new session would share its
    every turn with them."""
    choice_temperature_tokens: float = pydantic.Field(0.0, ge=0)
    """0: always the cheapest replica. Above 0, a replica whose cost is c tokens above the cheapest's is
    chosen with weight exp(-c / this), as Dynamo's router temperature does: several routers (ingress
    replicas) that see the same replicas but not each other's last decisions then spread a burst
    instead of all sending it to the one cheapest replica (benchmarks/results/routing-sim-routers.md)."""
    host_hit_credit: float | None = pydantic.Field(None, ge=0, le=1)
    """None: a token a replica would load from its node's pool costs what the replica measured loading a token
    to cost against computing one (bytes over its load bandwidth, against its recent compute rate), besides the
    memory it takes (occupancy_weight). A number: a fixed credit instead, as llm-d (0.8) and Dynamo (0.75) give a
    host-tier hit: loading a token costs 1 minus it of computing one.
    benchmarks/results/kv-tiers.md compares the two."""
    unmeasured_load_token_cost: float = pydantic.Field(0.25, ge=0, le=1)
    """A loaded token's cost on a replica that has not measured it (no load, or none lately) while no replica has: once
    some have, their median (router.core.PeerLoadCosts)."""
    unmeasured_pull_token_cost: float = pydantic.Field(0.5, ge=0, le=1)
    """A token pulled from another node's pool costs the pulling replica this share of computing it until it has
    measured both (its pulls' time per token against its recent compute rate)."""
    session_ttl_s: float = pydantic.Field(30.0, gt=0)
    """How long a session parked between turns keeps counting on its replica."""
    booking_ttl_s: float = pydantic.Field(60.0, gt=0)
    """A routed request whose finish never comes back (its caller left before it reached a replica)
    stops counting on that replica after this long."""


@dataclass(slots=True)  # not frozen: built for every replica on every decision, and frozen inits are slow
class Candidate:
    """A replica as a policy sees it when routing one request."""
    replica_id: str
    matched_blocks: int = 0             # leading blocks of the request's chain it caches
    num_requests: int = 0               # outstanding requests on it (running, waiting, or routed since)
    num_prefill_tokens_pending: int = 0  # prefill queued on it: its report plus what was routed since
    num_free_blocks: int | None = None  # free and evictable blocks, less those routed since; None: unknown
    recent_preemptions: int = 0         # within the last preemption_window_s
    num_cached_blocks: int = 0          # everything it caches, this request's prefix or not
    num_session_tokens: float = 0       # what the sessions it hosts are expected to bring per turn
    num_context_tokens: int = 0         # prompt tokens of the requests routed to it and not finished
    loadable_blocks: int = 0            # blocks of the chain past matched_blocks its node's pool holds
    load_token_cost: float | None = None  # its measured cost of loading a token, in tokens computed; None: unknown
    kv_usage: float = 0.0               # the share of its KV cache that requests hold (not free, not evictable)
    pullable_blocks: int = 0            # blocks past those it would pull from another node's pool, and then load
    pull_token_cost: float = 0.0        # its cost of pulling a token, in tokens computed


@dataclass(slots=True)
class RequestShape:
    num_blocks: int          # full blocks in the request's chain
    num_prompt_tokens: int
    block_size: int
    session_turn: int = 0    # which turn of its session it is (1 = the first); 0: no session

    @property
    def follows_its_session(self) -> bool:
        """A later turn of a session: its first turn chose where the session lives."""
        return self.session_turn >= 2

    def num_loaded_tokens(self, matched_blocks: int, loadable_blocks: int) -> int:
        """Tokens a replica would load from its node's pool (pulled there first or not) rather than compute."""
        return self.num_uncached_tokens(matched_blocks) - self.num_uncached_tokens(matched_blocks + loadable_blocks)

    def num_uncached_tokens(self, matched_blocks: int) -> int:
        # The engine recomputes at least the last prompt token, even on a full hit.
        return self.num_prompt_tokens - min(matched_blocks * self.block_size, self.num_prompt_tokens - 1)


class Policy(Protocol):
    def choose(self, request: RequestShape, candidates: list[Candidate]) -> RoutingDecision: ...


class PrefixPolicy:
    """Cheapest replica by the token cost model; ties go to fewer requests, then to the replica caching
    fewer blocks (new prefixes spread out), then to the earlier candidate. With a choice temperature,
    a draw that favours the cheapest (PolicyConfig.choice_temperature_tokens)."""

    def __init__(self, config: PolicyConfig, rng: random.Random):
        self.config = config
        self._rng = rng

    def choose(self, request: RequestShape, candidates: list[Candidate]) -> RoutingDecision:
        temperature = self.config.choice_temperature_tokens
        if temperature > 0:
            costs = [self.cost(request, candidate) for candidate in candidates]
            lowest = min(costs)
            best = self._rng.choices(candidates, [math.exp((lowest - cost) / temperature) for cost in costs])[0]
        else:
            best = min(candidates, key=lambda candidate: (self.cost(request, candidate), candidate.num_requests,
                                                           candidate.num_cached_blocks))
        if best.matched_blocks < max(candidate.matched_blocks for candidate in candidates):
            return _decide(best, "spill")  # a longer cached prefix was not worth its replica's load
        return _decide(best, "prefix_hit" if best.matched_blocks else "no_hit")

    def cost(self, request: RequestShape, candidate: Candidate) -> float:
        """Tokens of prefill-equivalent work the request waits for and causes on this replica."""
        config = self.config
        matched = candidate.matched_blocks
        loaded = request.num_loaded_tokens(matched, candidate.loadable_blocks + candidate.pullable_blocks)
        pulled = request.num_loaded_tokens(matched + candidate.loadable_blocks, candidate.pullable_blocks)
        uncached = request.num_uncached_tokens(matched) - loaded
        queued = candidate.num_prefill_tokens_pending
        num_steps = max(1.0, (queued + uncached) / max(config.step_token_budget - candidate.num_requests, 1))
        fetch_cost = self._load_token_cost(candidate) * loaded + candidate.pull_token_cost * pulled
        occupancy = config.occupancy_weight * candidate.kv_usage * (uncached + loaded)
        cost = (queued + config.uncached_token_weight * (uncached + fetch_cost + occupancy)
                + num_steps * config.step_overhead_tokens + config.preemption_cost_tokens * candidate.recent_preemptions)
        if not request.follows_its_session:
            cost += (config.request_cost_tokens * candidate.num_requests
                     + config.context_token_weight * candidate.num_context_tokens)
        if request.session_turn == 1:
            cost += config.session_weight * candidate.num_session_tokens
        if candidate.num_free_blocks is not None:
            block_size = request.block_size
            short_blocks = -(-(uncached + loaded) // block_size) - candidate.num_free_blocks
            if short_blocks > 0:
                cost += config.memory_weight * short_blocks * block_size
        return cost

    def _load_token_cost(self, candidate: Candidate) -> float:
        """A loaded token's cost as a share of a computed one's: the replica's measured one, or a fixed one."""
        config = self.config
        if config.host_hit_credit is not None:
            return 1.0 - config.host_hit_credit
        measured = candidate.load_token_cost
        return config.unmeasured_load_token_cost if measured is None else min(measured, 1.0)


def pull_token_cost(config: PolicyConfig, pull_seconds_per_token: float | None,
                    compute_seconds_per_token: float | None) -> float:
    """A pulled token's cost as a share of a computed one's on the pulling replica."""
    if not pull_seconds_per_token or not compute_seconds_per_token:
        return config.unmeasured_pull_token_cost
    return pull_seconds_per_token / compute_seconds_per_token


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RequestShape, candidates: list[Candidate]) -> RoutingDecision:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return _decide(chosen, "round_robin")


class LeastLoadedPolicy:
    """Power of two choices: the one with fewer outstanding requests of two sampled at random."""

    def __init__(self, rng: random.Random):
        self._rng = rng

    def choose(self, request: RequestShape, candidates: list[Candidate]) -> RoutingDecision:
        sampled = self._rng.sample(candidates, min(2, len(candidates)))
        return _decide(min(sampled, key=lambda candidate: candidate.num_requests), "least_loaded")


def make_policy(config: PolicyConfig, rng: random.Random) -> Policy:
    match config.policy:
        case "prefix":
            return PrefixPolicy(config, rng)
        case "round_robin":
            return RoundRobinPolicy()
        case "least_loaded":
            return LeastLoadedPolicy(rng)


def _decide(candidate: Candidate, outcome: str) -> RoutingDecision:
    return RoutingDecision(candidate.replica_id, candidate.matched_blocks, outcome)
