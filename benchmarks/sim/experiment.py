"""One simulated run end to end, and the capacity that loads are relative to."""
import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path

from replica.kv_cache.host_pool import HostPool, HostPoolSpec
from replica.scheduler.trace import SchedulerTrace
from router import PolicyConfig

from .cluster import RequestRecord, SimClock, Simulation
from .pooled_lru import pooled_lru
from .replica import SimReplica
from .report import RunMetrics, measure
from .routers import make_router
from .step_model import StepModel
from .workloads import Program, Turn, assign_starts, make_workload


@dataclass(frozen=True)
class ClusterSpec:
    num_blocks: int = 2048      # KV blocks per replica: 32k tokens at 16 per block
    block_size: int = 16
    max_model_len: int = 8192
    publish_lag_s: float = 0.01  # a publication reaches the router this long after its step
    queue_policy: str = "fcfs"   # the replicas' SchedulerConfig.policy
    num_routers: int = 1         # ingress replicas routing with views of their own
    sync_delay_s: float = 0.02   # with several routers: the extra delay before a router learns anything
    shared_bookings: bool = True  # each router's bookings reach the others
    booking_delay_s: float | None = None  # how much later they do; None: sync_delay_s
    pin_trace_dir: str | None = None  # each replica writes its pin records (replica.scheduler.trace) here
    host_pool_blocks: int = 0    # the node's pool, in blocks per replica of the node; 0: no pool
    replicas_per_node: int = 8   # the replicas sharing a pool
    load_s_per_block: float = 0.0  # copying a block in from the pool (beside the step's forward pass)
    pool_write: str = "through"  # blocks go to the pool once computed ("through") or once evicted ("evict")


def simulate(programs: list[Program], num_replicas: int, policy: str, step_model: StepModel,
             spec: ClusterSpec, seed: int, config: PolicyConfig | None = None
             ) -> tuple[list[RequestRecord], list[SimReplica]]:
    clock = SimClock()
    with tempfile.TemporaryDirectory() as pool_dir:
        pools = _node_pools(spec, num_replicas, pool_dir)
        replicas = [SimReplica(f"r{i}", spec.num_blocks, spec.block_size, step_model, clock, spec.queue_policy,
                               spec.max_model_len, _pin_trace(spec, f"r{i}"),
                               pools[i // spec.replicas_per_node] if pools else None, spec.load_s_per_block,
                               spec.pool_write)
                    for i in range(num_replicas)]
        return _simulate(programs, replicas, policy, spec, seed, clock, config)


def _node_pools(spec: ClusterSpec, num_replicas: int, directory: str) -> list[HostPool]:
    if not spec.host_pool_blocks:
        return []
    order = itertools.count()  # the pools' clock: the order of their uses, the same on every run
    num_nodes = -(-num_replicas // spec.replicas_per_node)
    return [HostPool(HostPoolSpec(f"{directory}/node{node}", spec.host_pool_blocks * spec.replicas_per_node, 1,
                                  "sim"), clock=lambda: float(next(order)))
            for node in range(num_nodes)]


def _simulate(programs: list[Program], replicas: list[SimReplica], policy: str, spec: ClusterSpec, seed: int,
              clock: SimClock, config: PolicyConfig | None) -> tuple[list[RequestRecord], list[SimReplica]]:
    replica_ids = [replica.replica_id for replica in replicas]
    routers = [make_router(policy, replica_ids, spec.block_size, clock, seed + k, config)
               for k in range(spec.num_routers)]
    simulation = Simulation(programs, replicas, routers, spec.block_size, clock, spec.publish_lag_s,
                            spec.sync_delay_s, spec.shared_bookings, spec.booking_delay_s)
    return simulation.run(), replicas


def _pin_trace(spec: ClusterSpec, replica_id: str) -> SchedulerTrace | None:
    if spec.pin_trace_dir is None:
        return None
    return SchedulerTrace(str(Path(spec.pin_trace_dir) / f"{replica_id}.jsonl"), steps=False)


def capacity(workload: str, step_model: StepModel, spec: ClusterSpec, seed: int, num_requests: int = 150) -> float:
    """Requests per second one replica completes when saturated: every turn of a one-replica
    workload's first num_requests submitted at time 0, gaps dropped."""
    programs = make_workload(workload, seed, 1, num_requests)
    turns = [turn for program in programs for turn in program.turns][:num_requests]
    flat = [Program(f"c{i}", [Turn(turn.prompt, turn.output)]) for i, turn in enumerate(turns)]
    records, _ = simulate(flat, 1, "round_robin", step_model, spec, seed)
    return len(records) / max(record.finished_s for record in records)


def run(workload: str, num_replicas: int, policies: list[str], load: float, requests_per_replica: int,
        per_replica_capacity: float, step_model: StepModel, spec: ClusterSpec, seed: int,
        config: PolicyConfig | None = None) -> list[RunMetrics]:
    """Every policy on the same programs and arrival times."""
    programs = make_workload(workload, seed, num_replicas, requests_per_replica * num_replicas)
    assign_starts(programs, load * per_replica_capacity * num_replicas, seed)
    results, reference = [], None
    for policy in policies:
        records, replicas = simulate(programs, num_replicas, policy, step_model, spec, seed, config)
        if reference is None:
            reference = pooled_lru(programs, records, num_replicas * spec.num_blocks, spec.block_size, step_model)
        preemptions = sum(replica.scheduler.num_preemptions for replica in replicas)
        results.append(measure(workload, num_replicas, policy, records, preemptions, reference,
                               spec.num_routers, spec.shared_bookings, seed))
    return results
