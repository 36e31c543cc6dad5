"""Trace-driven cluster simulator: the real router.Router and baselines over simulated replicas.

Every replica is the engine's real Scheduler and KVCacheManager with a step-time model calibrated
from real engine steps (benchmarks/sim/calibrate.py). See benchmarks/sim/ for the workloads, the
baselines' sources and defaults, and what is modelled.

    python benchmarks/sim_cluster.py                       # every workload, N = 4 8 16, load 0.9
    python benchmarks/sim_cluster.py --workloads agents --replicas 8 --policies prefix sglang
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from router import PolicyConfig  # noqa: E402

from benchmarks.sim.experiment import ClusterSpec, capacity, run  # noqa: E402
from benchmarks.sim.report import plot, table, verdict  # noqa: E402
from benchmarks.sim.routers import POLICIES  # noqa: E402
from benchmarks.sim.step_model import CALIBRATION, StepModel, cpu_name  # noqa: E402
from benchmarks.sim.workloads import WORKLOADS  # noqa: E402


def _calibration() -> str:
    fitted = json.loads(CALIBRATION.read_text())
    return (f"measured {fitted['measured']} on {fitted['cpu']}, {fitted['threads']} thread, load average "
            f"{fitted['load_average'][0]:.1f}, {len(fitted['steps'])} steps ({fitted['num_outliers_dropped']} dropped as "
            f"outliers), median error {fitted['rel_error_median']:.0%}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--load", type=float, default=0.9, help="arrival rate / measured capacity")
    parser.add_argument("--requests-per-replica", type=int, default=40)
    parser.add_argument("--num-blocks", type=int, default=ClusterSpec.num_blocks, help="KV blocks per replica")
    parser.add_argument("--publish-lag", type=float, default=ClusterSpec.publish_lag_s)
    parser.add_argument("--step-model", default="calibrated", choices=["calibrated", "gpu-assumed"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy-config", type=PolicyConfig.model_validate_json, default=PolicyConfig(),
                        help='PolicyConfig overrides as JSON, e.g. \'{"request_cost_tokens": 64}\'')
    parser.add_argument("--markdown", help="write the tables here too")
    parser.add_argument("--plot", help="save the plot here (needs matplotlib)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    spec = ClusterSpec(num_blocks=args.num_blocks, publish_lag_s=args.publish_lag)
    step_model = StepModel.load(args.step_model)
    runs, capacities, started = [], {}, time.perf_counter()
    for workload in args.workloads:
        capacities[workload] = capacity(workload, step_model, spec, args.seed)
        for num_replicas in args.replicas:
            results = run(workload, num_replicas, args.policies, args.load, args.requests_per_replica,
                          capacities[workload], step_model, spec, args.seed, args.policy_config)
            for result in results:
                print(f"{workload:>14} N={num_replicas:<3} {result.policy:>15}  hit {result.hit_rate:6.1%}  "
                      f"TTFT p50 {result.ttft_p50:7.2f} p99 {result.ttft_p99:7.2f}  "
                      f"load {result.load_max_over_mean:4.2f}  preempt {result.preemptions}", flush=True)
            runs += results
    text = "\n".join([
        "# Cluster simulator (benchmarks/sim_cluster.py)", "",
        "```", "python benchmarks/sim_cluster.py " + " ".join(sys.argv[1:]), "```", "",
        f"Step model: {args.step_model} {step_model} (seconds = a + b * prefill tokens + c * decoding sequences"
        f" + d * their context tokens); calibration: {_calibration()}.",
        f"Simulated on {cpu_name()} in {time.perf_counter() - started:.0f} s; {spec}; load {args.load}; "
        f"{args.requests_per_replica} requests per replica; seed {args.seed}.",
        "Capacity (requests/s per replica, saturated): " + ", ".join(
            f"{name} {value:.3f}" for name, value in capacities.items()) + ".", "",
        table(runs), "", *verdict(runs)])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
