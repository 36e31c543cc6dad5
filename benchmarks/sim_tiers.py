"""The node's KV pool in the cluster simulator: no pool, a pool with a fixed host-hit credit, a priced pool.

    python benchmarks/sim_tiers.py                                  # every workload, N = 8 16 64, load 0.9
    python benchmarks/sim_tiers.py --workloads multi-turn --replicas 8 --pool-ratio 4 --credit 0.8

Every arm routes with prefixserve's router (policy prefix) over replicas that are the engine's real Scheduler
and KVCacheManager (benchmarks/sim/). With a pool, each node of --replicas-per-node replicas shares the real
HostPool (slots of no bytes) of --pool-ratio times their device blocks; its blocks are written through, a
waiting request loads the part of its prefix the pool holds past its device hit (a block takes bytes / load
bandwidth, beside the forward pass) and the pool's changes reach the router as host-tier events. "fixed"
prices a loaded token at 1 - --credit of a computed one, as llm-d (0.8) and Dynamo (0.75) do; "priced" at what
the replica measured (its loads' time per token against its recent steps') plus the share of its KV cache that
requests hold; "on evict" prices so too, but a block reaches the pool only when a device cache evicts it, not
once computed (the write policy the engine does not take: a what-if). Hit rates are shares of all prompt
tokens: on the device, and loaded from the pool.
"""
import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from router import PolicyConfig  # noqa: E402

from benchmarks.sim.experiment import ClusterSpec, capacity, simulate  # noqa: E402
from benchmarks.sim.report import measure  # noqa: E402
from benchmarks.sim.step_model import StepModel, cpu_name  # noqa: E402
from benchmarks.sim.pooled_lru import pooled_lru  # noqa: E402
from benchmarks.sim.workloads import assign_starts, make_workload  # noqa: E402
from benchmarks.sim_cluster import ROUTING_WORKLOADS, _calibration  # noqa: E402

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M's K and V, float32 as the step model was calibrated


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=ROUTING_WORKLOADS, choices=ROUTING_WORKLOADS)
    parser.add_argument("--replicas", nargs="+", type=int, default=[8, 16, 64])
    parser.add_argument("--load", type=float, default=0.9, help="arrival rate / measured capacity")
    parser.add_argument("--requests-per-replica", type=int, default=40)
    parser.add_argument("--num-blocks", type=int, default=ClusterSpec.num_blocks, help="device KV blocks per replica")
    parser.add_argument("--pool-ratio", type=float, default=4.0, help="the pool's blocks / its node's device blocks")
    parser.add_argument("--replicas-per-node", type=int, default=8)
    parser.add_argument("--load-gbps", type=float, default=6.0,
                        help="pool-to-device copy bandwidth, GB/s (6: measured on this machine, index_select + "
                             "index_copy_ of float32 blocks)")
    parser.add_argument("--credit", type=float, default=0.8, help="the fixed arm's host-hit credit")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--markdown", help="write the table here too")
    return parser.parse_args()


def arms(args: argparse.Namespace, spec: ClusterSpec) -> dict[str, tuple[ClusterSpec, PolicyConfig]]:
    pooled = replace(spec, host_pool_blocks=int(args.pool_ratio * spec.num_blocks),
                     replicas_per_node=args.replicas_per_node,
                     load_s_per_block=spec.block_size * BYTES_PER_TOKEN / (args.load_gbps * 1e9))
    return {"no pool": (spec, PolicyConfig()),
            f"fixed {args.credit:g}": (pooled, PolicyConfig(host_hit_credit=args.credit)),
            "priced": (pooled, PolicyConfig()),
            "on evict": (replace(pooled, pool_write="evict"), PolicyConfig())}


def run_cell(workload: str, num_replicas: int, seed: int, args: argparse.Namespace, spec: ClusterSpec,
             step_model: StepModel, per_replica_capacity: float) -> list[tuple[str, dict]]:
    programs = make_workload(workload, seed, num_replicas, args.requests_per_replica * num_replicas)
    assign_starts(programs, args.load * per_replica_capacity * num_replicas, seed)
    rows = []
    for name, (arm_spec, config) in arms(args, spec).items():
        records, replicas = simulate(programs, num_replicas, "prefix", step_model, arm_spec, seed, config)
        reference = pooled_lru(programs, records, num_replicas * spec.num_blocks, spec.block_size, step_model)
        metrics = measure(workload, num_replicas, name, records, 0, reference)
        prompt_tokens = sum(record.num_prompt_tokens for record in records)
        loaded = sum(replica.scheduler.host_pool_hits for replica in replicas) / prompt_tokens
        rows.append((name, {"hit": metrics.hit_rate, "device": metrics.hit_rate - loaded, "loaded": loaded,
                            "p50": metrics.ttft_p50, "p99": metrics.ttft_p99}))
        print(f"{workload:>14} N={num_replicas:<3} seed {seed} {name:>9}  hit {metrics.hit_rate:6.1%} (loaded {loaded:6.1%})  "
              f"TTFT p50 {metrics.ttft_p50:6.2f} p99 {metrics.ttft_p99:6.2f}", flush=True)
    return rows


def main() -> None:
    args = parse_args()
    spec = ClusterSpec(num_blocks=args.num_blocks)
    step_model = StepModel.load("calibrated")
    lines = ["| workload | N | seed | arm | hit rate | on the device | loaded from the pool | TTFT p50 (s) | p99 (s) | "
             "p50 / no pool | p99 / no pool |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = ["| workload | N | priced p50 / fixed | priced p99 / fixed | priced p50 / no pool | holds | "
                "on evict p50 / priced | on evict p99 / priced |", "|---|---|---|---|---|---|---|---|"]
    started = time.perf_counter()
    for workload in args.workloads:
        capacities = {seed: capacity(workload, step_model, spec, seed) for seed in args.seeds}
        for num_replicas in args.replicas:
            ratios = []
            for seed in args.seeds:
                rows = dict(run_cell(workload, num_replicas, seed, args, spec, step_model, capacities[seed]))
                base, fixed, priced, evict = (rows[name] for name in ("no pool", f"fixed {args.credit:g}", "priced",
                                                                      "on evict"))
                for name, row in rows.items():
                    lines.append(f"| {workload} | {num_replicas} | {seed} | {name} | {row['hit']:.1%} | "
                                 f"{row['device']:.1%} | {row['loaded']:.1%} | {row['p50']:.2f} | {row['p99']:.2f} | "
                                 f"{row['p50'] / base['p50']:.2f}x | {row['p99'] / base['p99']:.2f}x |")
                ratios.append((priced["p50"] / fixed["p50"], priced["p99"] / fixed["p99"], priced["p50"] / base["p50"],
                               evict["p50"] / priced["p50"], evict["p99"] / priced["p99"]))
            p50_fixed, p99_fixed, p50_base, p50_evict, p99_evict = (statistics.geometric_mean(column)
                                                                     for column in zip(*ratios))
            holds = p50_fixed <= 1 and p99_fixed <= 1
            verdicts.append(f"| {workload} | {num_replicas} | {p50_fixed:.2f}x | {p99_fixed:.2f}x | {p50_base:.2f}x | "
                            f"{'yes' if holds else '**no**'} | {p50_evict:.2f}x | {p99_evict:.2f}x |")
    text = "\n".join([
        "# The node's KV pool in the cluster simulator (benchmarks/sim_tiers.py)", "",
        "```", "python benchmarks/sim_tiers.py " + " ".join(sys.argv[1:]), "```", "",
        f"Step model: calibrated ({_calibration()}). Simulated on {cpu_name()} in "
        f"{time.perf_counter() - started:.0f} s; {spec}; load {args.load}; {args.requests_per_replica} requests per "
        f"replica; seeds {', '.join(map(str, args.seeds))}; pool {args.pool_ratio:g}x the device blocks of each node of "
        f"{args.replicas_per_node} replicas; loads at {args.load_gbps:g} GB/s ({BYTES_PER_TOKEN} bytes a token).",
        "", *lines, "", "Priced against fixed, geometric means over the seeds (holds: priced TTFT p50 and p99 no worse "
        "than fixed):", "", *verdicts])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
