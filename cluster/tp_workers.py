"""RayExecutor: the tensor-parallel ranks of an engine replica as Ray actors, one in each bundle of the
replica's placement group (cluster.app.placement_options). The actors belong to the replica: when Serve
replaces it, they go with it.

A replica that loses a rank mid-step is lost: its process ends, as if its node were gone, so that Serve routes
nothing more to it at once, the ingress moves its requests to other replicas (migration) and Serve starts a
replacement with ranks of its own. A rank lost between steps fails the replica's health check instead.
"""
import logging
import os
import socket

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replica.executor.parallel import TensorParallel
from replica.executor.worker import RunnerSpec, Worker, WorkerLost
from replica.scheduler import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("ray.serve.prefixserve.tp_workers")
HEALTH_TIMEOUT_S = 10.0


@ray.remote(concurrency_groups={"health": 1})  # a ping is answered while a step runs
class Rank:
    def address(self) -> tuple[str, int]:
        """Where the ranks meet: this node's address and a port free on it."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            return host, sock.getsockname()[1]

    def start(self, spec: RunnerSpec, tp: TensorParallel, master: tuple[str, int]) -> None:
        self._worker = Worker(spec, tp, master, ray.util.get_node_ip_address())  # Ray shows it its GPU only

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._worker.execute_model(scheduler_output)

    @ray.method(concurrency_group="health")
    def ping(self) -> None:
        pass


class RayExecutor:
    def __init__(self, spec: RunnerSpec, size: int):
        group = get_current_placement_group()
        if group is None or len(group.bundle_specs) < size:
            raise RuntimeError(f"tensor_parallel_size={size} needs a placement group of {size} bundles "
                               "(the engine deployment's placement_group_bundles)")
        self._ranks = [Rank.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote() for index, bundle in enumerate(group.bundle_specs[:size])]
        master = self._driver_result([self._ranks[0].address.remote()])
        self._driver_result([rank.start.remote(spec, TensorParallel(index, size), master)
                             for index, rank in enumerate(self._ranks)])

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        shared = ray.put(scheduler_output)
        try:
            return self._driver_result([rank.execute_model.remote(shared) for rank in self._ranks])
        except WorkerLost:
            logger.exception("ending this engine replica")
            os._exit(1)

    def check_health(self) -> None:
        try:
            ray.get([rank.ping.remote() for rank in self._ranks], timeout=HEALTH_TIMEOUT_S)
        except (RayError, GetTimeoutError) as exc:
            raise WorkerLost(f"a tensor-parallel rank is gone or unresponsive: {exc}") from None

    def shutdown(self) -> None:
        for rank in self._ranks:
            ray.kill(rank)

    @staticmethod
    def _driver_result(refs: list[ray.ObjectRef]):
        """The first call's result once every call returned; WorkerLost as soon as one fails (a rank that
        died leaves the others waiting for it in a collective)."""
        pending = refs
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready)
            except RayError as exc:
                raise WorkerLost(f"a tensor-parallel rank failed: {exc}") from None
        return ray.get(refs[0])
