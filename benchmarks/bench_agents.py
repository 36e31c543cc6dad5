"""Agent programs under the continuum queue policy against fcfs, in the same run: job completion
time, next-turn TTFT and recomputed tokens.

An agent program sends a turn, gets a tool call back, waits for the tool (the gap) and sends its
next turn: the whole history plus the tool's result. Programs name themselves (X-Session-Id) and
mark their final turn ("last_turn"). Under continuum a replica keeps a finished turn's KV blocks
pinned for the program's next turn and serves pinned programs' turns first; under fcfs the
history is freed and, under memory pressure, evicted before the next turn comes back.

- Simulated (default): benchmarks/sim's agents workload (programs of 10-30 turns, lognormal tool
  gaps of 1-10 s, contexts up to 7000 tokens) on --replicas simulated replicas (the engine's real
  Scheduler and KVCacheManager, --num-blocks blocks each) behind the real router.Router (prefix),
  --programs-per-replica programs per replica started over --ramp seconds.
- Live (--live): the app on a local Ray cluster (loopback only), real model, --live-replicas
  replicas with --live-kv-blocks KV blocks each, --live-programs programs of --live-turns turns.

    python benchmarks/bench_agents.py                     # simulated, 16 replicas
    python benchmarks/bench_agents.py --live --no-sim     # live app, 2 replicas
"""
import argparse
import asyncio
import functools
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.live_app import (local_app, metrics_text, openai_client, random_words,  # noqa: E402
                                 stream_completion)
from benchmarks.timing import percentile  # noqa: E402

QUEUE_POLICIES = ("fcfs", "continuum")


@dataclass
class TurnResult:
    program: str
    arrival_s: float
    first_token_s: float
    finished_s: float
    prompt_tokens: int
    cached_tokens: int
    history_tokens: int  # prompt tokens an earlier turn of the program computed; 0 for a first turn


@dataclass
class Summary:
    queue_policy: str
    turns: list[TurnResult]
    pins: tuple[float, float, float, float] = (0, 0, 0, 0)  # pinned, hit, expired, released (PinStats)

    def job_completion_s(self) -> list[float]:
        programs: dict[str, list[TurnResult]] = {}
        for turn in self.turns:
            programs.setdefault(turn.program, []).append(turn)
        return [max(t.finished_s for t in turns) - min(t.arrival_s for t in turns) for turns in programs.values()]

    def next_turn_ttft_s(self) -> list[float]:
        return [t.first_token_s - t.arrival_s for t in self.turns if t.history_tokens]

    def recomputed_tokens(self) -> int:
        return sum(max(t.history_tokens - t.cached_tokens, 0) for t in self.turns)


def report(title: str, summaries: list[Summary]) -> str:
    baseline = summaries[0]
    lines = [f"### {title}", "",
             "| queue policy | JCT mean (s) | p50 | p90 | next-turn TTFT p50 (s) | p99 | recomputed tokens "
             "| mean JCT vs fcfs | pins |", "|---|---|---|---|---|---|---|---|---|"]
    for summary in summaries:
        jct, ttft = summary.job_completion_s(), summary.next_turn_ttft_s()
        lines.append(f"| {summary.queue_policy} | {statistics.mean(jct):.1f} | {percentile(jct, 50):.1f} "
                     f"| {percentile(jct, 90):.1f} | {percentile(ttft, 50):.2f} | {percentile(ttft, 99):.2f} "
                     f"| {summary.recomputed_tokens()} "
                     f"| {statistics.mean(baseline.job_completion_s()) / statistics.mean(jct):.2f}x "
                     f"| {_describe_pins(*summary.pins)} |")
    return "\n".join(lines)


def _describe_pins(pinned: float, hits: float, expired: float, released: float) -> str:
    return f"{pinned:.0f} pinned, {hits:.0f} hit, {expired:.0f} expired, {released:.0f} released"


def seeds_report(title: str, runs: list[tuple[int, list[Summary]]]) -> str:
    """Continuum against fcfs on each seed, then the mean and the spread over the seeds."""
    rows = [(str(seed), *_versus_fcfs(*summaries)) for seed, summaries in runs]
    rows += [(name, *map(aggregate, zip(*(row[1:] for row in rows))))
             for name, aggregate in (("mean", statistics.mean), ("min", min), ("max", max))]
    lines = [f"### {title}", "", "| seed | mean JCT vs fcfs | next-turn TTFT p99 vs fcfs | pins expired before the "
             "next turn |", "|---|---|---|---|"]
    lines += [f"| {name} | {jct:.2f}x | {ttft:.2f}x | {expired:.1%} |" for name, jct, ttft, expired in rows]
    return "\n".join(lines)


def _versus_fcfs(fcfs: Summary, continuum: Summary) -> tuple[float, float, float]:
    """fcfs's mean JCT over continuum's (above 1: continuum sooner), continuum's next-turn TTFT p99 over
    fcfs's (above 1: continuum slower), and the share of continuum's pins that expired unused."""
    pinned, _, expired, _ = continuum.pins
    return (statistics.mean(fcfs.job_completion_s()) / statistics.mean(continuum.job_completion_s()),
            percentile(continuum.next_turn_ttft_s(), 99) / percentile(fcfs.next_turn_ttft_s(), 99),
            expired / pinned if pinned else 0.0)


# --- simulated ---------------------------------------------------------------------------------

def plot(panels: list[tuple[str, list[Summary]]], path: str) -> None:
    """Per panel, the distribution of the programs' completion times under each queue policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (title, summaries) in zip(axes[0], panels):
        for summary in summaries:
            jct = sorted(summary.job_completion_s())
            axis.step(jct, [(i + 1) / len(jct) for i in range(len(jct))], where="post",
                      label=f"{summary.queue_policy} (mean {statistics.mean(jct):.0f} s)")
        axis.set(title=title, xlabel="job completion time (s)", ylabel="programs completed (fraction)")
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def simulated(args: argparse.Namespace) -> tuple[str, list[Summary]]:
    from benchmarks.sim.experiment import ClusterSpec, simulate
    from benchmarks.sim.step_model import StepModel
    from benchmarks.sim.workloads import make_workload, max_context

    context = max_context(args.workload)
    if args.num_blocks * ClusterSpec.block_size <= context:
        raise SystemExit(f"--num-blocks {args.num_blocks} cannot hold a program's context of up to {context} tokens")
    step_model = StepModel.load(args.step_model)
    num_programs = args.programs_per_replica * args.replicas
    programs = make_workload(args.workload, args.seed, args.replicas, 50 * num_programs)[:num_programs]
    rng = random.Random(args.seed)
    for program in programs:
        program.start_s = rng.uniform(0, args.ramp)
    summaries, outcomes = [], []
    for queue_policy in QUEUE_POLICIES:
        trace_dir = _fresh_dir(Path(args.pin_trace) / queue_policy) if args.pin_trace and queue_policy != "fcfs" \
            else None
        spec = ClusterSpec(num_blocks=args.num_blocks, max_model_len=context + ClusterSpec.block_size,
                           queue_policy=queue_policy, pin_trace_dir=trace_dir and str(trace_dir))
        records, replicas = simulate(programs, args.replicas, "prefix", step_model, spec, args.seed)
        by_id = {record.request_id: record for record in records}
        if trace_dir:
            outcomes.append(f"Pin outcomes under {queue_policy} (per-pin trace in {trace_dir}): "
                            + ", ".join(f"{count} {outcome}" for outcome, count in
                                        pin_outcomes(trace_dir, by_id).most_common()))
        turns = []
        for program in programs:
            for index, turn in enumerate(program.turns):
                record = by_id[f"{program.session_id}/{index}"]
                previous = program.turns[index - 1] if index else None
                history = len(previous.prompt) + len(previous.output) - 1 if previous else 0
                turns.append(TurnResult(program.session_id, record.arrival_s, record.first_token_s, record.finished_s,
                                        record.num_prompt_tokens, record.num_cached_tokens, history))
        pins = [replica.scheduler.make_stats().pins for replica in replicas]
        summaries.append(Summary(queue_policy, turns, tuple(sum(getattr(p, name) for p in pins)
                                                            for name in ("pinned", "hits", "expired", "released"))))
        print(f"simulated {queue_policy}: {len(records)} turns", flush=True)
    title = (f"Simulated: {args.replicas} replicas x {args.num_blocks} KV blocks of 16 tokens, {num_programs} "
             f"{args.workload} programs ({sum(len(p.turns) for p in programs)} turns) started over {args.ramp:.0f} s, "
             f"prefix router, {args.step_model} step model, seed {args.seed}")
    return "\n\n".join([report(title, summaries), *outcomes]), summaries


def _fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.jsonl"):
        old.unlink()
    return path


def pin_outcomes(trace_dir: Path, records: dict) -> Counter:
    """What became of every pin, from the replicas' pin records (one file per replica) and where each
    program's next turn went."""
    outcomes = Counter()
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            outcomes[pin_outcome(json.loads(line)["pin"], path.stem, records)] += 1
    return outcomes


def pin_outcome(pin: dict, replica_id: str, records: dict) -> str:
    if pin["hit"]:
        return "hit"
    session_id, index = pin["request_id"].rsplit("/", 1)
    next_turn = records.get(f"{session_id}/{int(index) + 1}")
    if next_turn is None:
        return f"{pin['end']}, no next turn"
    if next_turn.replica_id != replica_id:
        return f"{pin['end']}, next turn routed elsewhere"
    if pin["next_turn_arrived_at"] is None:
        return f"{pin['end']} before the next turn arrived"
    return f"{pin['end']} while the next turn waited"


# --- live --------------------------------------------------------------------------------------

@dataclass
class LiveProgram:
    name: str
    system: str
    tool_results: list[str]
    gaps_s: list[float]


def make_live_programs(args: argparse.Namespace) -> list[LiveProgram]:
    rng = random.Random(args.seed)
    words = functools.partial(random_words, rng)
    systems = [f"You are agent {i}. Tools: search, read, write. {words(args.live_system_words)}" for i in range(2)]
    return [LiveProgram(f"agent-{i}", f"{rng.choice(systems)}\nTask {i}: {words(30)}\n",
                        [f"Tool result: {words(rng.randint(40, 90))}\nAssistant:" for _ in range(args.live_turns)],
                        [min(max(rng.lognormvariate(math.log(1.5), 0.6), 0.5), 5.0) for _ in range(args.live_turns)])
            for i in range(args.live_programs)]


async def run_program(client, model: str, program: LiveProgram, max_tokens: int,
                      clock_start: float) -> list[TurnResult]:
    results, context, history = [], program.system, 0
    for index, tool_result in enumerate(program.tool_results):
        if index:
            await asyncio.sleep(program.gaps_s[index])
        context += tool_result
        last = index == len(program.tool_results) - 1
        turn = await stream_completion(client, model, context, max_tokens, {"X-Session-Id": program.name},
                                       last_turn=last)
        results.append(TurnResult(program.name, turn.sent_s - clock_start, turn.first_token_s - clock_start,
                                  turn.finished_s - clock_start, turn.prompt_tokens, turn.cached_tokens, history))
        history = turn.prompt_tokens + turn.output_tokens - 1
        context += turn.text + "\n"
    return results


async def run_live_workload(base_url: str, programs: list[LiveProgram], max_tokens: int) -> list[TurnResult]:
    async with openai_client(base_url, timeout=900) as (client, model):
        start = time.monotonic()
        per_program = await asyncio.gather(*(run_program(client, model, p, max_tokens, start) for p in programs))
    return [turn for turns in per_program for turn in turns]


async def pin_metrics(base_url: str) -> tuple[float, float, float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.metrics import PREFIX

    text = await metrics_text(base_url)
    totals = {family.name.removeprefix(PREFIX): sum(sample.value for sample in family.samples
                                                     if sample.name.endswith("_total"))
              for family in text_string_to_metric_families(text)}
    return (totals.get("pins", 0), totals.get("pin_hits", 0), totals.get("pins_expired", 0),
            totals.get("pins_released", 0))


def live(args: argparse.Namespace) -> tuple[str, list[Summary]]:
    programs = make_live_programs(args)
    summaries = []
    with local_app() as deploy:
        for queue_policy in QUEUE_POLICIES:
            engine = {"num_kv_blocks": args.live_kv_blocks, "max_model_len": args.live_kv_blocks * 16 - 16,
                      "policy": queue_policy}
            base_url = deploy(engine, args.live_replicas)
            started = time.monotonic()
            turns = asyncio.run(run_live_workload(base_url, programs, args.max_tokens))
            summaries.append(Summary(queue_policy, turns, asyncio.run(pin_metrics(base_url))))
            print(f"live {queue_policy}: {time.monotonic() - started:.0f} s", flush=True)
    title = (f"Live: {args.live_replicas} CPU replicas of SmolLM2-135M x {args.live_kv_blocks} KV blocks of 16 tokens, "
             f"{args.live_programs} programs x {args.live_turns} turns, tool gaps 0.5-5 s, {args.max_tokens} tokens "
             f"per tool call, prefix router, seed {args.seed}")
    return report(title, summaries), summaries


def run_seeds(args: argparse.Namespace, name: str, run) -> tuple[list[str], list[tuple[int, list[Summary]]]]:
    """Every seed's table, after (with several seeds) continuum against fcfs over the seeds."""
    tables, runs = [], []
    for seed in args.seed:
        table, summaries = run(argparse.Namespace(**vars(args) | {"seed": seed}))
        tables.append(table)
        runs.append((seed, summaries))
    if len(runs) > 1:
        tables.insert(0, seeds_report(f"{name}, seeds {' '.join(map(str, args.seed))}: continuum against fcfs", runs))
    return tables, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sim", dest="sim", action="store_false", help="skip the simulated run")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--workload", default="agents", choices=["agents", "coding-agents"],
                        help="simulated: benchmarks/sim/workloads.py's")
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per simulated replica")
    parser.add_argument("--programs-per-replica", type=int, default=4)
    parser.add_argument("--ramp", type=float, default=30.0, help="seconds over which the programs start")
    parser.add_argument("--step-model", default="calibrated", choices=["calibrated", "gpu-assumed"])
    parser.add_argument("--live", action="store_true", help="also run against the live app")
    parser.add_argument("--live-replicas", type=int, default=2)
    parser.add_argument("--live-kv-blocks", type=int, default=96)
    parser.add_argument("--live-programs", type=int, default=8)
    parser.add_argument("--live-turns", type=int, default=8)
    parser.add_argument("--live-system-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens of each live tool call")
    parser.add_argument("--seed", type=int, nargs="+", default=[0], help="one run per seed")
    parser.add_argument("--markdown", help="append the tables here")
    parser.add_argument("--plot", help="save the completion-time distributions here (needs matplotlib)")
    parser.add_argument("--pin-trace", help="simulated: write each replica's pin records under this directory "
                        "and count what became of the pins")
    args = parser.parse_args()
    modes = ([("Simulated", simulated)] if args.sim else []) + ([("Live", live)] if args.live else [])
    results = [(name, *run_seeds(args, name, run)) for name, run in modes]
    command = f"```\npython benchmarks/bench_agents.py {' '.join(sys.argv[1:])}\n```"
    text = "\n\n".join([command, *(table for _, tables, _ in results for table in tables)])
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(text + "\n\n")
    if args.plot:
        plot([(f"{name}, seed {runs[0][0]}", runs[0][1]) for name, _, runs in results], args.plot)


if __name__ == "__main__":
    main()
