"""build_app (the Serve application builder the Helm chart names), the engine deployment's options and the
ingress's client of it."""
import asyncio
from types import SimpleNamespace

import grpc
import pydantic
import pytest
from ray.serve import Application
from ray.serve.config import BackpressureConfig
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

from cluster.app import INGRESS_MAX_ONGOING_REQUESTS, build_app, engine_options, ingress_options
from cluster.config import ClusterConfig
from cluster.engine_client import EnginesBusy, ReplicaLost
from cluster.engine_replica import replica_engine_config
from cluster.ingress import ServeEngineClient
from router.serve_router import PrefixAwareRequestRouter


def test_build_app_takes_cluster_config_fields():
    assert isinstance(build_app({"num_replicas": 3, "routing": "round_robin", "engine": {"block_size": 32}}),
                      Application)
    with pytest.raises(pydantic.ValidationError, match="routing\n"):
        build_app({"routing": "random"})
    with pytest.raises(pydantic.ValidationError, match="num_replica\n"):
        build_app({"num_replica": 3})


def test_engine_deployment_routes_through_the_prefix_aware_router():
    config = ClusterConfig(num_replicas=3, routing="least_loaded", engine={"block_size": 32},
                           replica_num_cpus=2, replica_num_gpus=1, router_sync_interval_s=0.5)
    options = engine_options(config)
    assert options["num_replicas"] == 3
    assert "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    router_config = options["request_router_config"]
    assert router_config.get_request_router_class() is PrefixAwareRequestRouter
    assert router_config.request_router_kwargs == {
        "policy": config.routing_config.model_dump(), "block_size": 32, "sync_interval_s": 0.5}
    assert router_config.request_router_kwargs["policy"]["policy"] == "least_loaded"


def test_a_tensor_parallel_replica_is_a_placement_group_of_one_bundle_per_rank():
    options = engine_options(ClusterConfig(engine={"tensor_parallel_size": 2}, replica_num_cpus=4, replica_num_gpus=2))
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["ray_actor_options"] == {"num_cpus": 0, "num_gpus": 0}  # the replica's actor sits beside rank 0
    cpu_only = engine_options(ClusterConfig(engine={"tensor_parallel_size": 4}, placement_strategy="SPREAD"))
    assert (cpu_only["placement_group_bundles"], cpu_only["placement_group_strategy"]) == ([{"CPU": 0.25}] * 4,
                                                                                         "SPREAD")
    assert "placement_group_bundles" not in engine_options(ClusterConfig())


def test_a_tensor_parallel_replica_on_gpus_computes_on_its_ranks_gpus_though_its_own_actor_has_none():
    assert replica_engine_config(ClusterConfig(engine={"tensor_parallel_size": 2}, replica_num_gpus=2)).device == "cuda"
    assert replica_engine_config(ClusterConfig(engine={"tensor_parallel_size": 2})).device is None  # CPU: as resolved
    assert replica_engine_config(ClusterConfig(replica_num_gpus=1)).device is None  # its own actor has the GPU


def test_the_router_assumes_what_the_engine_config_says():
    def router_policy(**engine) -> dict:
        return engine_options(ClusterConfig(engine=engine))["request_router_config"].request_router_kwargs["policy"]

    policy = router_policy(max_num_batched_tokens=1024, enable_prefix_caching=False)
    assert (policy["step_token_budget"], policy["assume_routed_prefix_cached"]) == (1024, False)
    policy = router_policy()
    assert (policy["step_token_budget"], policy["assume_routed_prefix_cached"]) == (8192, True)


def test_autoscaling_replaces_the_fixed_replica_count():
    config = ClusterConfig(autoscaling={"min_replicas": 1, "max_replicas": 4})
    options = engine_options(config)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == config.autoscaling.to_serve_config()
    assert options["autoscaling_config"]["policy"]["policy_function"] == "cluster.autoscaling:preemption_policy"


def test_the_ingress_runs_a_fixed_count_or_autoscales_from_it_on_ongoing_requests():
    fixed = ingress_options(ClusterConfig(ingress_replicas=3))
    assert (fixed["num_replicas"], fixed["max_ongoing_requests"], fixed["ray_actor_options"]) == (
        3, INGRESS_MAX_ONGOING_REQUESTS, {"num_cpus": 0})
    assert "autoscaling_config" not in fixed
    scaling = ingress_options(ClusterConfig(ingress_replicas=2, ingress_autoscaling={"max_replicas": 5,
                                                                                     "target_ongoing_requests": 32}))
    assert "num_replicas" not in scaling
    assert scaling["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 5, "initial_replicas": 2,
                                             "target_ongoing_requests": 32, "upscale_delay_s": 30.0,
                                             "downscale_delay_s": 600.0}
    with pytest.raises(pydantic.ValidationError, match="min_replicas <= ingress_replicas <= max_replicas, got 1, 5, 4"):
        ClusterConfig(ingress_replicas=5, ingress_autoscaling={"max_replicas": 4})


def test_engine_deployment_bounds_what_each_replica_and_the_ingress_hold():
    options = engine_options(ClusterConfig(engine={"max_num_seqs": 8}, max_waiting_requests=4, max_queued_requests=16))
    assert (options["max_ongoing_requests"], options["max_queued_requests"]) == (8 + 4, 16)
    assert options["backpressure_config"] == BackpressureConfig(status_code=429, retry_after_s=1.0)


def queue_full() -> BackPressureError:
    return BackPressureError(num_queued_requests=16, max_queued_requests=16, status_code=429, retry_after_s=1.0)


class FullQueue:
    """What the engine handle streams once the ingress holds max_queued_requests already: the error, again
    on cancel()."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise queue_full()

    def cancel(self) -> None:
        raise queue_full()


class BrokenStream:
    """What the engine handle streams when the call fails: the error in place of the next output."""

    def __init__(self, error: Exception):
        self.error = error
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self) -> None:
        self.cancelled = True


def engine_handle(responses, options: dict | None = None) -> SimpleNamespace:
    """A stand-in for the engine deployment's handle whose streaming calls all return responses; the options the
    client set go into options."""
    options = {} if options is None else options

    def with_options(**given):
        options.update(given)
        return SimpleNamespace(generate=SimpleNamespace(remote=lambda request: responses))
    return SimpleNamespace(options=with_options)


@pytest.mark.parametrize("by_reference", [False, True])
def test_the_client_streams_over_grpc_unless_told_to_go_by_reference(by_reference):
    options = {}
    ServeEngineClient(engine_handle(None, options), by_reference=by_reference)
    assert options == {"stream": True, "_by_reference": by_reference}


def test_serves_backpressure_reaches_the_ingress_as_engines_busy():
    with pytest.raises(EnginesBusy) as busy:
        asyncio.run(anext(ServeEngineClient(engine_handle(FullQueue())).generate(None)))
    assert busy.value.retry_after_s == 1.0


@pytest.mark.parametrize("error, raised", [
    (ActorDiedError(), ReplicaLost),
    (ActorUnavailableError("Actor is unavailable.", None), ReplicaLost),
    (ReplicaUnavailableError("engine#abc"), ReplicaLost),
    (grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "stream removed"),
     ReplicaLost),
    (RayTaskError("generate", "traceback", ValueError("bad request")), ValueError),  # the engine's own: no move
])
def test_a_lost_replica_reaches_the_ingress_as_replica_lost(error, raised):
    stream = BrokenStream(error)
    with pytest.raises(raised):
        asyncio.run(anext(ServeEngineClient(engine_handle(stream)).generate(None)))
    assert stream.cancelled  # should the replica still be alive after all, it aborts the request
