"""Metrics of one simulated run, and the markdown table and plot of many."""
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass

from benchmarks.timing import percentile

from .cluster import RequestRecord
from .pooled_lru import PooledReference


@dataclass
class RunMetrics:
    workload: str
    num_replicas: int
    policy: str
    num_requests: int
    hit_rate: float           # cached prompt tokens / prompt tokens, over all replicas
    ttft_p50: float           # seconds from arrival to the end of the step that sampled the first token
    ttft_p90: float
    ttft_p99: float
    queue_p50: float          # seconds from arrival to the first step that scheduled the request
    queue_p99: float
    load_max_over_mean: float  # requests routed to the busiest replica / the mean
    preemptions: int
    pooled_lru_hit_rate: float  # the reference: one LRU cache of all replicas' blocks
    ttft_floor_p50: float       # each request alone on an idle replica holding that cache
    ttft_floor_p99: float
    num_routers: int = 1
    shared_bookings: bool = True
    seed: int = 0

    @property
    def bookings(self) -> str:
        """How the run's routers learnt of each other's bookings."""
        if self.num_routers == 1:
            return "-"
        return "shared" if self.shared_bookings else "unshared"


def measure(workload: str, num_replicas: int, policy: str, records: list[RequestRecord],
            preemptions: int, reference: PooledReference, num_routers: int = 1,
            shared_bookings: bool = True, seed: int = 0) -> RunMetrics:
    ttft = [r.first_token_s - r.arrival_s for r in records]
    queued = [r.scheduled_s - r.arrival_s for r in records]
    per_replica = Counter(r.replica_id for r in records)
    mean_load = len(records) / num_replicas
    return RunMetrics(workload, num_replicas, policy, len(records),
                      sum(r.num_cached_tokens for r in records) / sum(r.num_prompt_tokens for r in records),
                      percentile(ttft, 50), percentile(ttft, 90), percentile(ttft, 99),
                      percentile(queued, 50), percentile(queued, 99), max(per_replica.values()) / mean_load,
                      preemptions, reference.hit_rate, percentile(reference.ttft_floor, 50),
                      percentile(reference.ttft_floor, 99), num_routers, shared_bookings, seed)


HEADER = ("| workload | N | policy | hit rate | pooled LRU | TTFT p50 (s) | p90 | p99 | queued p50 (s) | p99 | "
          "load max/mean | preemptions |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def table(runs: list[RunMetrics]) -> str:
    """A row a run; in bold, the best hit rate, TTFT p50 and TTFT p99 of each (workload, N)."""
    lines = [HEADER]
    for run in runs:
        group = [r for r in runs if (r.workload, r.num_replicas) == (run.workload, run.num_replicas)]
        best_hit, best_p50, best_p99 = (min(group, key=key) is run for key in (
            lambda r: -r.hit_rate, lambda r: r.ttft_p50, lambda r: r.ttft_p99))
        cells = [_bold(f"{run.hit_rate:.1%}", best_hit), f"{run.pooled_lru_hit_rate:.1%}",
                 _bold(f"{run.ttft_p50:.2f}", best_p50), f"{run.ttft_p90:.2f}", _bold(f"{run.ttft_p99:.2f}", best_p99),
                 f"{run.queue_p50:.2f}", f"{run.queue_p99:.2f}", f"{run.load_max_over_mean:.2f}", str(run.preemptions)]
        lines.append(f"| {run.workload} | {run.num_replicas} | {run.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bold(text: str, bold: bool) -> str:
    return f"**{text}**" if bold else text


def verdict(runs: list[RunMetrics]) -> list[str]:
    """The issue's Done-when, per (workload, N): prefix against the best baseline."""
    lines = []
    groups: dict[tuple, list[RunMetrics]] = {}
    for run in runs:
        groups.setdefault((run.workload, run.num_replicas), []).append(run)
    for (workload, num_replicas), group in groups.items():
        prefix = next((r for r in group if r.policy == "prefix"), None)
        others = [r for r in group if r.policy != "prefix"]
        if prefix is None or not others:
            continue
        best_hit = max(r.hit_rate for r in others)
        best_p50 = min(r.ttft_p50 for r in others)
        best_p99 = min(r.ttft_p99 for r in others)
        strict = workload in ("multi-turn", "agents") and num_replicas >= 8
        factor = 0.8 if strict else 1.0
        holds = (prefix.hit_rate >= best_hit and prefix.ttft_p50 <= factor * best_p50
                 and prefix.ttft_p99 <= factor * best_p99)
        lines.append(f"| {workload} | {num_replicas} | {prefix.hit_rate:.1%} vs {best_hit:.1%} | "
                     f"{prefix.ttft_p50 / best_p50:.2f}x | {prefix.ttft_p99 / best_p99:.2f}x | "
                     f"{prefix.ttft_floor_p50 / best_p50:.2f}x | {prefix.ttft_floor_p99 / best_p99:.2f}x | "
                     f"{'≤ 0.8x' if strict else '≤ 1x'} | {'yes' if holds else '**no**'} |")
    return ["| workload | N | prefix hit vs best baseline | TTFT p50 / best | p99 / best | floor p50 / best | "
            "floor p99 / best | needed | holds |", "|---|---|---|---|---|---|---|---|---|"] + lines


def routers_table(runs: list[RunMetrics]) -> str:
    """A row a run, each against the one-router run of its (workload, N, policy, seed)."""
    lines = ["| workload | N | seed | policy | routers | bookings | hit rate | vs 1 router (points) | TTFT p50 (s) | "
             "/ 1 router | p99 (s) | / 1 router | load max/mean | preemptions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        alone = _one_router(runs, run)
        cells = [str(run.num_routers), run.bookings, f"{run.hit_rate:.1%}",
                 f"{100 * (run.hit_rate - alone.hit_rate):+.1f}", f"{run.ttft_p50:.2f}",
                 f"{run.ttft_p50 / alone.ttft_p50:.2f}x", f"{run.ttft_p99:.2f}",
                 f"{run.ttft_p99 / alone.ttft_p99:.2f}x", f"{run.load_max_over_mean:.2f}", str(run.preemptions)]
        lines.append(f"| {run.workload} | {run.num_replicas} | {run.seed} | {run.policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def routers_verdict(runs: list[RunMetrics], num_routers: int = 4) -> list[str]:
    """Issue 29's Done-when, per (workload, N, policy, bookings): num_routers routers within 1 point of one
    router's hit rate and within 1.1x of its TTFT p50 and p99, each run against the one-router run of its seed.
    Over several seeds it is judged on the mean hit-rate difference and the geometric means of the TTFT
    ratios: one seed's p99 moves by up to a third when anything about the routing changes."""
    groups: dict[tuple, list[tuple[RunMetrics, RunMetrics]]] = {}
    for run in runs:
        if run.num_routers == num_routers:
            key = (run.workload, run.num_replicas, run.policy, run.bookings)
            groups.setdefault(key, []).append((run, _one_router(runs, run)))
    lines = [f"| workload | N | policy | bookings | seeds | hit rate, {num_routers} routers vs 1 (points) | "
             "TTFT p50 / 1 router | p99 / 1 router | holds | seeds where it holds alone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (workload, num_replicas, policy, bookings), pairs in groups.items():
        hit, p50, p99 = _compared(pairs)
        alone = sum(_holds(*_compared([pair])) for pair in pairs)
        lines.append(f"| {workload} | {num_replicas} | {policy} | {bookings} | "
                     f"{', '.join(str(run.seed) for run, _ in pairs)} | {hit:+.1f} | {p50:.2f}x | {p99:.2f}x | "
                     f"{'yes' if _holds(hit, p50, p99) else '**no**'} | {alone} of {len(pairs)} |")
    return lines


def _compared(pairs: list[tuple[RunMetrics, RunMetrics]]) -> tuple[float, float, float]:
    """(run, one-router run) pairs -> the mean hit-rate difference in points and the geometric means of
    the TTFT p50 and p99 ratios."""
    def geometric_mean(ratios: list[float]) -> float:
        return math.exp(statistics.fmean(map(math.log, ratios)))

    return (statistics.fmean(100 * (run.hit_rate - alone.hit_rate) for run, alone in pairs),
            geometric_mean([run.ttft_p50 / alone.ttft_p50 for run, alone in pairs]),
            geometric_mean([run.ttft_p99 / alone.ttft_p99 for run, alone in pairs]))


def _holds(hit_points: float, p50_ratio: float, p99_ratio: float) -> bool:
    return hit_points >= -1 and p50_ratio <= 1.1 and p99_ratio <= 1.1


def _one_router(runs: list[RunMetrics], run: RunMetrics) -> RunMetrics:
    return next(r for r in runs if (r.workload, r.num_replicas, r.policy, r.seed, r.num_routers) ==
                (run.workload, run.num_replicas, run.policy, run.seed, 1))


def plot(runs: list[RunMetrics], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in runs))
    policies = list(dict.fromkeys(r.policy for r in runs))
    figure, axes = plt.subplots(3, len(workloads), figsize=(4 * len(workloads), 9), squeeze=False)
    for column, workload in enumerate(workloads):
        for row, (label, value) in enumerate((("hit rate", "hit_rate"), ("TTFT p50 (s)", "ttft_p50"),
                                              ("TTFT p99 (s)", "ttft_p99"))):
            axis = axes[row][column]
            for policy in policies:
                points = [(r.num_replicas, asdict(r)[value]) for r in runs
                          if r.workload == workload and r.policy == policy]
                axis.plot(*zip(*sorted(points)), marker="o", label=policy)
            axis.set(xlabel="replicas", ylabel=label)
            axis.set_xscale("log", base=2)
            if row == 0:
                axis.set_title(workload)
            else:
                axis.set_yscale("log")
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
