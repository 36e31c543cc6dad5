"""ClusterConfig: everything the Serve app is built from (the CLI's flags, the Helm chart's args)."""
import os
from typing import Literal

import pydantic

from cluster.autoscaling import AutoscalingSettings
from replica.config import EngineConfig
from router.policy import PolicyConfig

API_KEY_ENV = "PREFIXSERVE_API_KEY"
# Several ingress replicas' routers learn of each other's decisions only at their next sync: drawn with this
# temperature, they spread a burst that all of them would send to the one cheapest replica
# (benchmarks/results/routing-sim-routers.md, "Choice temperature").
SEVERAL_ROUTERS_CHOICE_TEMPERATURE_TOKENS = 16.0
# Each streamed output costs an ingress replica about half a millisecond of CPU (benchmarks/results/front-door.md,
# "Streamed responses"): 16 requests streaming 60 tokens a second each keep about half a core busy.
INGRESS_TARGET_ONGOING_REQUESTS = 16.0


class IngressAutoscaling(pydantic.BaseModel):
    """Serve's own autoscaling of the ingress deployment on its replicas' ongoing requests (AutoscalingConfig's
    fields of the same names); it starts at ClusterConfig.ingress_replicas."""
    model_config = pydantic.ConfigDict(extra="forbid")

    min_replicas: pydantic.PositiveInt = 1
    max_replicas: pydantic.PositiveInt = 4
    target_ongoing_requests: pydantic.PositiveFloat = INGRESS_TARGET_ONGOING_REQUESTS
    upscale_delay_s: pydantic.NonNegativeFloat = 30.0  # Serve's defaults
    downscale_delay_s: pydantic.NonNegativeFloat = 600.0


class ClusterConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    engine: EngineConfig = pydantic.Field(default_factory=EngineConfig)
    num_replicas: int = pydantic.Field(2, ge=1)
    ingress_replicas: int = pydantic.Field(1, ge=1)  # HTTP ingress replicas, each routing in its own process
    ingress_autoscaling: IngressAutoscaling | None = None  # None: a fixed ingress_replicas, else where it starts
    autoscaling: AutoscalingSettings | None = None  # None: a fixed num_replicas
    routing: Literal["prefix", "round_robin", "least_loaded"] = "prefix"  # how the router picks a replica
    api_key: str | None = None  # None: PREFIXSERVE_API_KEY from the ingress's environment, if set
    # What one engine replica reserves from Ray, all its tensor-parallel ranks together: each rank's bundle of
    # the replica's placement group takes an equal share (engine.tensor_parallel_size > 1).
    replica_num_cpus: float = pydantic.Field(1.0, ge=0)
    replica_num_gpus: float = pydantic.Field(0.0, ge=0)
    # How a replica's rank bundles are placed: STRICT_PACK keeps them on one node (NCCL over NVLink / PCIe).
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # The least time between two of an ingress replica's syncs of its routing view with the router feed (engines'
    # reports, others' bookings); a sync with nothing new is held until there is news.
    router_sync_interval_s: float = pydantic.Field(0.02, gt=0)
    # The least time between two of an engine replica's reports (KV events, stats) to the router feed: each costs
    # both sides a fixed 0.1-0.2 ms of CPU (router/wire.py), so a busy engine's steps go out coalesced.
    publish_interval_s: float = pydantic.Field(0.01, gt=0)
    # The least time between two of a request's outputs from its engine replica (0: each step's as it comes). Each
    # output crosses two hops (engine -> ingress -> proxy) that cost about a millisecond of CPU whatever it
    # carries; the tokens of the steps in between go out as one. The first and the last are never held back.
    stream_interval_s: float = pydantic.Field(0.0, ge=0)
    # How an ingress replica calls the engine replicas: "grpc", Ray Serve's gRPC channel straight to the replica (the
    # handles of its throughput-optimized mode), or "ray", Ray actor tasks whose outputs come back as object refs.
    # gRPC costs less CPU per request (benchmarks/results/front-door.md); "ray" where the replicas' gRPC ports
    # (any free port of their node) cannot be reached from the other nodes, or for prompts over about 790k tokens
    # (gRPC takes messages of up to 4 MiB, Serve's RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH).
    engine_transport: Literal["grpc", "ray"] = "grpc"
    # Where an engine replica steps its engine core: "process", a process of its own that sends one message per
    # step (its interpreter free of the replica's Ray and Serve machinery), or "thread", a thread of the replica's
    # process. A tensor-parallel replica steps in a thread: its ranks are Ray actors that the replica creates.
    engine_core: Literal["process", "thread"] = "process"
    # How requests reach the engines: "ingress", through Serve's proxy to ingress replicas that route each to an
    # engine replica and relay its tokens (two hops a token, and migration off a lost replica); "direct", through
    # HAProxy, which asks a router replica where each goes and forwards it to that engine replica's own HTTP
    # port (tokens stream straight back; a lost replica ends its streams). Direct needs Ray Serve's HAProxy mode
    # in every Ray process (cluster.direct_ingress), which the CLI sets for the clusters it starts.
    front_door: Literal["ingress", "direct"] = "ingress"
    # PolicyConfig.choice_temperature_tokens of every ingress replica's router; None: 0 with one ingress replica,
    # SEVERAL_ROUTERS_CHOICE_TEMPERATURE_TOKENS with more (at most: max_ingress_replicas).
    router_choice_temperature_tokens: float | None = pydantic.Field(None, ge=0)
    # Requests an engine replica takes beyond its running set (max_num_seqs); more wait in the ingress.
    max_waiting_requests: int = pydantic.Field(256, ge=0)
    # Requests the ingress holds while no engine replica has room; more get 429 with Retry-After.
    max_queued_requests: int = pydantic.Field(1024, ge=1)
    # Larger request bodies get 413.
    max_request_body_bytes: int = pydantic.Field(4 * 2**20, ge=1)
    # The longest an engine replica waits for blocks it pulls from another node's pool (engine.cache.host_pool_gib);
    # past it, or on any failure, it computes them.
    pull_timeout_s: float = pydantic.Field(5.0, gt=0)
    # Times a request may move to another replica when its own dies mid-request; then it fails (0: never moves).
    max_migrations: int = pydantic.Field(2, ge=0)

    @pydantic.model_validator(mode="after")
    def _ingress_starts_within_bounds(self) -> "ClusterConfig":
        scaling = self.ingress_autoscaling
        if scaling is not None and not scaling.min_replicas <= self.ingress_replicas <= scaling.max_replicas:
            raise ValueError("ingress autoscaling needs min_replicas <= ingress_replicas <= max_replicas, got "
                             f"{scaling.min_replicas}, {self.ingress_replicas}, {scaling.max_replicas}")
        return self

    @pydantic.model_validator(mode="after")
    def _ingress_options_need_the_ingress(self) -> "ClusterConfig":
        if self.front_door == "direct" and (self.ingress_replicas != 1 or self.ingress_autoscaling is not None):
            raise ValueError("ingress replicas and their autoscaling belong to the ingress front door; the direct "
                             "one runs a router replica per node")
        return self

    @property
    def max_ingress_replicas(self) -> int:
        return self.ingress_replicas if self.ingress_autoscaling is None else self.ingress_autoscaling.max_replicas

    @property
    def routing_config(self) -> PolicyConfig:
        """The router's policy; what it assumes of the engines is read from their config, never restated."""
        temperature = self.router_choice_temperature_tokens
        if temperature is None:
            temperature = SEVERAL_ROUTERS_CHOICE_TEMPERATURE_TOKENS if self.max_ingress_replicas > 1 else 0.0
        return PolicyConfig(policy=self.routing,
                            step_token_budget=self.engine.scheduler.max_num_batched_tokens,
                            assume_routed_prefix_cached=self.engine.cache.enable_prefix_caching,
                            choice_temperature_tokens=temperature)

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None
