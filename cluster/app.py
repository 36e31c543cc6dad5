"""The Serve application, by its front door. "ingress": HTTP ingress replicas behind Serve's proxy in front of the
engine deployment, each routing in its own process. "direct": the engine replicas serve HTTP themselves behind
HAProxy, which asks the router deployment where each request goes."""
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.schema import LoggingConfig

from cluster import front_router
from cluster.config import ClusterConfig
from cluster.engine_replica import RETRY_AFTER_S, DirectEngineReplica, EngineReplica
from cluster.ingress import Ingress
from router.serve_router import PrefixAwareRequestRouter

APP_NAME = "prefixserve"
INGRESS_MAX_ONGOING_REQUESTS = 4096
ROUTING_STATS_PERIOD_S = 2.0
# Serve's proxy logs every HTTP request already; a replica's own line per request (an ingress's, and an
# engine's per handle call) repeats it at a few percent of the replica's CPU.
REPLICA_LOGGING = LoggingConfig(enable_access_log=False)


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder ("cluster.app:build_app"): args are ClusterConfig's fields."""
    return build(ClusterConfig.model_validate(args))


def build(config: ClusterConfig) -> Application:
    if config.front_door == "direct":
        return build_direct(config)
    engine = serve.deployment(EngineReplica, name="engine").options(**engine_options(config))
    ingress = serve.deployment(Ingress, name="ingress").options(**ingress_options(config))
    return ingress.bind(engine.bind(config), config)


def build_direct(config: ClusterConfig) -> Application:
    """Needs Serve's direct ingress (cluster.direct_ingress) in the processes that run it."""
    options = engine_options(config) | {"max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
                                        "max_queued_requests": -1}  # the replica counts its requests itself
    engine = serve.deployment(DirectEngineReplica, name="engine").options(**options).bind(config)
    router = serve.deployment(front_router.FrontRouter, name=front_router.DEPLOYMENT_NAME).options(
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0},
        logging_config=REPLICA_LOGGING)
    return engine._with_ingress_request_router(router.bind(engine, config))


def ingress_options(config: ClusterConfig) -> dict[str, Any]:
    options = {"max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS, "ray_actor_options": {"num_cpus": 0},
               "logging_config": REPLICA_LOGGING}
    if config.ingress_autoscaling is None:
        options["num_replicas"] = config.ingress_replicas
    else:
        options["autoscaling_config"] = config.ingress_autoscaling.model_dump() | {
            "initial_replicas": config.ingress_replicas}
    return options


def engine_options(config: ClusterConfig) -> dict[str, Any]:
    router_config = RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,
        request_router_kwargs={"policy": config.routing_config.model_dump(),
                               "block_size": config.engine.cache.block_size,
                               "sync_interval_s": config.router_sync_interval_s},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    options = {
        "max_ongoing_requests": config.engine.scheduler.max_num_seqs + config.max_waiting_requests,
        "max_queued_requests": config.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        "ray_actor_options": {"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus},
        "request_router_config": router_config,
        "logging_config": REPLICA_LOGGING,
    }
    if config.engine.tensor_parallel_size > 1:
        options.update(placement_options(config))
    if config.autoscaling is None:
        options["num_replicas"] = config.num_replicas
    else:
        options["autoscaling_config"] = config.autoscaling.to_serve_config()
    return options


def placement_options(config: ClusterConfig) -> dict[str, Any]:
    """A tensor-parallel replica: a placement group of one bundle per rank, each an equal share of the replica's
    CPUs and GPUs. The replica's own actor sits in the first bundle beside rank 0 and reserves nothing itself."""
    size = config.engine.tensor_parallel_size
    bundle = {"CPU": config.replica_num_cpus / size}
    if config.replica_num_gpus:
        bundle["GPU"] = config.replica_num_gpus / size
    return {"placement_group_bundles": [dict(bundle) for _ in range(size)],
            "placement_group_strategy": config.placement_strategy,
            "ray_actor_options": {"num_cpus": 0, "num_gpus": 0}}
