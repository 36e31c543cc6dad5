"""Where the serving path's time and CPU go, on the server bench_serve_vs_vllm.py measures (one engine replica,
--threads torch threads, the direct front door): what each process of the cluster burns idle, what a request
costs each of them beyond that, and how long one request takes through each part of the path, against the engine
in-process on the same prompts, in one run.

    python benchmarks/bench_path_costs.py [--requests 200] [--gap-s 0.02] [--markdown OUT.md]

Every request is a completion of a fresh prompt of --prompt-tokens random token ids and one output token, sent
one at a time, --gap-s apart. Latency (median): the engine in-process (EngineCore, a subprocess, while no
server runs: the reference of every ratio), then through HAProxy (the client's path), straight to the engine
replica's own port (no HAProxy, no router), and the router replica's route call alone (HAProxy's question
before it forwards). CPU (user + system, from /proc, every process of the server's session): idle over
--idle-s, then over the requests sent through HAProxy, less each process's idle rate over the same time, per
request. The gap leaves the engine idle between requests, as at low load: each request's step starts cold.
"""
import argparse
import asyncio
import collections
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_serve_vs_vllm import (cpu_model, free_port, has_avx512, prefixserve_command,  # noqa: E402
                                            running_server, session_cpu_s)
from replica.executor.checkpoint import load_checkpoint  # noqa: E402

PORT_LINE = re.compile(r"prefixserve_(engine|router) \w+ -- Allocated port (\d+)")


def prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"path-costs:{seed}")
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def in_process_worker(request_path: str, report_path: str) -> None:
    """The reference: each prompt through EngineCore.add_request and step, timed, gap_s apart."""
    import torch

    from replica.config import EngineConfig
    from replica.engine import EngineCore
    from replica.request import SamplingParams

    request = json.loads(Path(request_path).read_text())
    torch.set_num_threads(request["threads"])
    core = EngineCore(EngineConfig(model=request["model"], dtype=request["dtype"]))
    latencies = []
    for index, prompt in enumerate(request["prompts"]):
        start = time.perf_counter()
        core.add_request(f"r{index}", prompt, SamplingParams(max_tokens=1))
        while core.has_unfinished():
            core.step()
        latencies.append(time.perf_counter() - start)
        time.sleep(request["gap_s"])
    Path(report_path).write_text(json.dumps(latencies))


def in_process_latencies(args: argparse.Namespace, warmup: list[list[int]], measured: list[list[int]]) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        request, report = Path(tmp, "request.json"), Path(tmp, "report.json")
        request.write_text(json.dumps({"threads": args.threads, "model": args.model, "dtype": args.dtype,
                                       "gap_s": args.gap_s, "prompts": warmup + measured}))
        subprocess.run([sys.executable, __file__, "--in-process-worker", str(request), str(report)], check=True,
                       env=os.environ | {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)})
        return json.loads(report.read_text())[len(warmup):]


async def send_one_at_a_time(url: str, path: str, bodies: list[dict], gap_s: float) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=60) as client:
        for body in bodies:
            start = time.perf_counter()
            response = await client.post(url + path, json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(gap_s)
    return latencies


def cpu_by_label(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds by process label between two session_cpu_s readings (processes in both)."""
    spent = collections.defaultdict(float)
    for pid, (label, seconds) in after.items():
        if pid in before:
            spent[label] += seconds - before[pid][1]
    return spent


def measure_server(args: argparse.Namespace, bodies_for, log_path: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with running_server(prefixserve_command(args, port, "direct"), base, {}, 300, log_path) as (model, sid):
        warmup, measured = (bodies_for(model, prompt_set) for prompt_set in args.prompt_sets)
        asyncio.run(send_one_at_a_time(base, "/v1/completions", warmup, args.gap_s))
        ports = dict(PORT_LINE.findall(log_path.read_text()))
        time.sleep(args.settle_s)
        idle_start, start = session_cpu_s(sid), time.monotonic()
        time.sleep(args.idle_s)
        idle_end, idle_s = session_cpu_s(sid), time.monotonic() - start
        via_haproxy = asyncio.run(send_one_at_a_time(base, "/v1/completions", measured, args.gap_s))
        busy_s, busy_end = time.monotonic() - start - idle_s, session_cpu_s(sid)
        direct = asyncio.run(send_one_at_a_time(f"http://127.0.0.1:{ports['engine']}", "/v1/completions",
                                                measured, args.gap_s)) if "engine" in ports else None
        route = asyncio.run(send_one_at_a_time(f"http://127.0.0.1:{ports['router']}", "/internal/route",
                                               measured, args.gap_s)) if "router" in ports else None
    idle = {label: seconds / idle_s for label, seconds in cpu_by_label(idle_start, idle_end).items()}
    busy = cpu_by_label(idle_end, busy_end)
    per_request = {label: (seconds - idle.get(label, 0.0) * busy_s) / len(measured)
                   for label, seconds in busy.items()}
    return {"via HAProxy": via_haproxy, "straight to the engine replica": direct, "the router's route call": route,
            "idle_ms_per_s": {k: v * 1000 for k, v in idle.items()},
            "request_ms": {k: v * 1000 for k, v in per_request.items()}}


def report(args: argparse.Namespace, reference: list[float], served: dict) -> list[str]:
    base = statistics.median(reference) * 1000
    lines = [f"- commit {git_commit()}, {time.strftime('%Y-%m-%d %H:%M')}; {cpu_model()}, AVX-512 "
             f"{'yes' if has_avx512() else 'no'}; {args.threads} torch threads, dtype {args.dtype or 'default'}; "
             f"{len(reference)} requests of {args.prompt_tokens} prompt tokens and 1 output token, {args.gap_s:g} s "
             "apart", "",
             "| one request, one at a time | median ms | p90 ms | vs in-process |", "|---|---:|---:|---:|",
             f"| engine in-process (EngineCore) | {base:.2f} | {quantile(reference, 0.9):.2f} | 1.00x |"]
    for name in ("via HAProxy", "straight to the engine replica", "the router's route call"):
        if served[name]:
            median = statistics.median(served[name]) * 1000
            lines.append(f"| {name} | {median:.2f} | {quantile(served[name], 0.9):.2f} | {median / base:.2f}x |")
    idle, request = served["idle_ms_per_s"], served["request_ms"]
    lines += ["", "| process | idle CPU ms a second | CPU ms a request, net of idle |", "|---|---:|---:|",
              f"| all | {sum(idle.values()):.1f} | {sum(request.values()):.2f} |"]
    for label in sorted(idle.keys() | request.keys(), key=lambda k: -(idle.get(k, 0) + request.get(k, 0))):
        if idle.get(label, 0) >= 0.5 or abs(request.get(label, 0)) >= 0.05:
            lines.append(f"| {label} | {idle.get(label, 0):.1f} | {request.get(label, 0):.2f} |")
    return lines


def quantile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000


def git_commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--gap-s", type=float, default=0.02)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--settle-s", type=float, default=5.0, help="after the warm-up, before the idle window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    args.device = args.engine_core = None
    args.stream_interval_s = 0.0
    return args


def main() -> None:
    if sys.argv[1:2] == ["--in-process-worker"]:
        in_process_worker(*sys.argv[2:4])
        return
    args = parse_args()
    vocab_size = load_checkpoint(args.model).config.vocab_size
    args.prompt_sets = (prompts(args.warmup, args.prompt_tokens, vocab_size, args.seed),
                        prompts(args.requests, args.prompt_tokens, vocab_size, args.seed + 1))
    reference = in_process_latencies(args, *args.prompt_sets)

    def bodies(model: str, prompt_set: list[list[int]]) -> list[dict]:
        return [{"model": model, "prompt": prompt, "max_tokens": 1} for prompt in prompt_set]

    with tempfile.TemporaryDirectory() as tmp:
        served = measure_server(args, bodies, Path(tmp, "server.log"))
    lines = report(args, reference, served)
    print("\n".join(lines))
    if args.markdown:
        command = "python benchmarks/bench_path_costs.py " + " ".join(sys.argv[1:])
        args.markdown.write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
