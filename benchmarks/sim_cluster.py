"""Trace-driven cluster simulator: the real router.Router and baselines over simulated replicas.

Every replica is the engine's real Scheduler and KVCacheManager with a step-time model calibrated
from real engine steps (benchmarks/sim/calibrate.py). See benchmarks/sim/ for the workloads, the
baselines' sources and defaults, and what is modelled.

    python benchmarks/sim_cluster.py                       # every workload, N = 4 8 16, load 0.9
    python benchmarks/sim_cluster.py --workloads agents --replicas 8 --policies prefix sglang
    python benchmarks/sim_cluster.py --policies prefix --routers 1 4 --bookings shared unshared  # K routers
    python benchmarks/sim_cluster.py --policies prefix --routers 1 4 --cluster-choice-temperature --seeds 0 1 2
"""
import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from cluster.config import ClusterConfig  # noqa: E402
from router import PolicyConfig  # noqa: E402

from benchmarks.sim.experiment import ClusterSpec, capacity, run  # noqa: E402
from benchmarks.sim.report import RunMetrics, plot, routers_table, routers_verdict, table, verdict  # noqa: E402
from benchmarks.sim.routers import CORE_POLICIES, POLICIES  # noqa: E402
from benchmarks.sim.step_model import CALIBRATION, StepModel, cpu_name  # noqa: E402
from benchmarks.sim.workloads import MAX_CONTEXT, WORKLOADS, max_context  # noqa: E402

# coding-agents' contexts need replicas of a longer max_model_len and more blocks: benchmarks/bench_agents.py
ROUTING_WORKLOADS = [name for name in WORKLOADS if max_context(name) <= MAX_CONTEXT]


def _calibration() -> str:
    fitted = json.loads(CALIBRATION.read_text())
    load = fitted["load_average"]
    return (f"measured {fitted['measured']} on {fitted['cpu']}, {fitted['dtype']}, {fitted['threads']} threads, load "
            f"average {load['before'][0]:.1f} before and {load['after'][0]:.1f} after, {len(fitted['steps'])} steps "
            f"({fitted['num_outliers_dropped']} dropped as outliers), median error {fitted['rel_error_median']:.0%}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=ROUTING_WORKLOADS, choices=ROUTING_WORKLOADS)
    parser.add_argument("--replicas", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--load", type=float, default=0.9, help="arrival rate / measured capacity")
    parser.add_argument("--requests-per-replica", type=int, default=40)
    parser.add_argument("--num-blocks", type=int, default=ClusterSpec.num_blocks, help="KV blocks per replica")
    parser.add_argument("--publish-lag", type=float, default=ClusterSpec.publish_lag_s)
    parser.add_argument("--step-model", default="calibrated", choices=["calibrated", "gpu-assumed"])
    parser.add_argument("--routers", nargs="+", type=int, default=[1],
                        help="how many routers (ingress replicas) route, each with its own view; 1: today's actor")
    parser.add_argument("--sync-delay-ms", type=float, default=1000 * ClusterSpec.sync_delay_s,
                        help="with several routers: how much later each learns of publications and bookings")
    parser.add_argument("--booking-delay-ms", type=float,
                        help="with shared bookings: how much later the others learn of a router's booking "
                             "(default: --sync-delay-ms)")
    parser.add_argument("--bookings", nargs="+", default=["shared"], choices=["shared", "unshared"],
                        help="with several routers: whether each router's bookings reach the others")
    parser.add_argument("--seeds", "--seed", nargs="+", type=int, default=[0],
                        help="several: the routers verdict is judged over them (each run against its seed's K = 1)")
    parser.add_argument("--policy-config", type=PolicyConfig.model_validate_json, default=PolicyConfig(),
                        help='PolicyConfig overrides as JSON, e.g. \'{"request_cost_tokens": 64}\'')
    parser.add_argument("--cluster-choice-temperature", action="store_true",
                        help="each router count draws at the choice temperature the cluster gives that many ingress "
                             "replicas (ClusterConfig), whatever --policy-config says")
    parser.add_argument("--markdown", help="write the tables here too")
    parser.add_argument("--plot", help="save the plot here (needs matplotlib)")
    args = parser.parse_args()
    if max(args.routers) > 1 and not set(args.policies) <= set(CORE_POLICIES):
        parser.error(f"several routers need --policies among {', '.join(CORE_POLICIES)}")
    if 1 not in args.routers:
        parser.error("--routers needs 1 too: the table compares every router count with one router")
    if len(args.seeds) > 1 and args.routers == [1]:
        parser.error("several --seeds are for comparing router counts (--routers 1 K)")
    if args.booking_delay_ms is None:
        args.booking_delay_ms = args.sync_delay_ms
    return args


def router_specs(args: argparse.Namespace, spec: ClusterSpec) -> list[ClusterSpec]:
    """A spec a router count and bookings; a lone router has no one to share bookings with."""
    return [replace(spec, num_routers=num_routers, shared_bookings=bookings == "shared")
            for num_routers in args.routers for bookings in (args.bookings if num_routers > 1 else args.bookings[:1])]


def policy_config(args: argparse.Namespace, num_routers: int) -> PolicyConfig:
    if not args.cluster_choice_temperature:
        return args.policy_config
    temperature = ClusterConfig(ingress_replicas=num_routers).routing_config.choice_temperature_tokens
    return args.policy_config.model_copy(update={"choice_temperature_tokens": temperature})


def _summary(run: RunMetrics) -> str:
    return (f"{run.workload:>14} N={run.num_replicas:<3} seed {run.seed} {run.policy:>15} K={run.num_routers} "
            f"{run.bookings:>8}  "
            f"hit {run.hit_rate:6.1%}  TTFT p50 {run.ttft_p50:7.2f} p99 {run.ttft_p99:7.2f}  "
            f"load {run.load_max_over_mean:4.2f}  preempt {run.preemptions}")


def _seeds(seeds: list[int]) -> str:
    return f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + ", ".join(map(str, seeds))


def main() -> None:
    args = parse_args()
    spec = ClusterSpec(num_blocks=args.num_blocks, publish_lag_s=args.publish_lag,
                       sync_delay_s=args.sync_delay_ms / 1000, booking_delay_s=args.booking_delay_ms / 1000)
    step_model = StepModel.load(args.step_model)
    runs, capacities, started = [], {}, time.perf_counter()
    for seed in args.seeds:
        for workload in args.workloads:
            capacities[workload, seed] = capacity(workload, step_model, spec, seed)
            for num_replicas in args.replicas:
                for routed in router_specs(args, spec):
                    results = run(workload, num_replicas, args.policies, args.load, args.requests_per_replica,
                                  capacities[workload, seed], step_model, routed, seed,
                                  policy_config(args, routed.num_routers))
                    for result in results:
                        print(_summary(result), flush=True)
                    runs += results
    tables = [table(runs), "", *verdict(runs)] if args.routers == [1] else [
        f"Routers {args.routers}: turns dealt to them in turn; with several, each learns of publications "
        f"{args.sync_delay_ms:g} ms later and (bookings {' / '.join(args.bookings)}) of the others' bookings "
        f"{args.booking_delay_ms:g} ms later; "
        "a lone router is fed directly.", "", routers_table(runs), "", *routers_verdict(runs)]
    text = "\n".join([
        "# Cluster simulator (benchmarks/sim_cluster.py)", "",
        "```", "python benchmarks/sim_cluster.py " + " ".join(sys.argv[1:]), "```", "",
        f"Step model: {args.step_model} {step_model} (seconds = a + b * prefill tokens + c * decoding sequences"
        f" + d * their context tokens + e * prefill attention, tokens x (tokens before + tokens / 2) per chunk);"
        f" calibration: {_calibration()}.",
        f"Simulated on {cpu_name()} in {time.perf_counter() - started:.0f} s; {spec}; load {args.load}; "
        f"{args.requests_per_replica} requests per replica; {_seeds(args.seeds)}.",
        "Capacity (requests/s per replica, saturated; one figure a seed): " + ", ".join(
            f"{name} {' / '.join(f'{capacities[name, seed]:.3f}' for seed in args.seeds)}"
            for name in args.workloads) + ".", "",
        *tables])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
