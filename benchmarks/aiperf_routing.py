"""Routing policies measured by NVIDIA's AIPerf: multi-turn chat with shared prefixes against the
live app's /v1/chat/completions, one freshly started `prefixserve serve` per policy.

AIPerf (`pip install aiperf`, in its own venv: pass its executable as --aiperf) generates
--conversations chat sessions of --turns turns; each session's first message starts with one of
--prefixes shared prompts of --prefix-tokens tokens, and every later turn resends the history
(the model's answers included), so a session's context grows. --concurrency sessions run at once,
streaming; the replicas are warmed up first as in bench_routing.py. AIPerf counts tokens with the
served model's own tokenizer, exported offline as a Hugging Face directory
(benchmarks/export_tokenizer.py). Per policy it prints AIPerf's TTFT p50/p99 and request throughput,
the engines' prefix-cache hit rate (hits / queries from /metrics) and the router's decisions by outcome.

    python benchmarks/aiperf_routing.py --aiperf /path/to/venv/bin/aiperf [--policies prefix round_robin least_loaded]
"""
import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_routing import RouterMetrics  # noqa: E402
from benchmarks.export_tokenizer import export as export_tokenizer  # noqa: E402
from benchmarks.live_app import metrics_text, openai_client, warm_up  # noqa: E402

# With --concurrency alone AIPerf polls for a free slot in a busy loop, which takes most of a core from
# the replicas on a small machine. A request rate far above what the app serves paces that loop (a free
# slot waits at most one interval) while --concurrency still bounds the requests in flight.
PACING_REQUEST_RATE = 20
READY_LINE = "prefixserve: serving on"
STARTUP_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 120
# A policy named with this suffix runs with AIPerf naming each conversation in the X-Session-Id header.
SESSIONS_SUFFIX = "+sessions"


@dataclass
class Result:
    policy: str
    aiperf: dict  # AIPerf's profile_export_aiperf.json
    router: RouterMetrics

    def metric(self, name: str, stat: str) -> float:
        return self.aiperf[name][stat]


@contextlib.contextmanager
def serving(policy: str, args: argparse.Namespace) -> Iterator[str]:
    """`prefixserve serve` on its own local Ray cluster, bound to loopback; its base URL until Ctrl-C'd."""
    command = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(args.port),
               "--replicas", str(args.replicas), "--replica-cpus", str(args.replica_cpus),
               "--routing-policy", policy.removesuffix(SESSIONS_SUFFIX), "--num-kv-blocks", str(args.num_kv_blocks),
               "--max-model-len", str(args.max_model_len)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = args.artifact_dir / policy / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(server, log)
        yield f"http://127.0.0.1:{args.port}"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_ready(server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while READY_LINE not in log.read_text():
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"prefixserve serve did not become ready (exit code {server.poll()}); see {log}")
        time.sleep(1)


async def warm_up_replicas(base_url: str, num_replicas: int) -> str:
    """The served model's name, after warming every replica up as bench_routing does."""
    async with openai_client(base_url) as (client, model):
        await warm_up(client, model, num_replicas)
    return model


def run_aiperf(base_url: str, policy: str, tokenizer: Path, args: argparse.Namespace) -> Result:
    artifacts = args.artifact_dir / policy
    model = asyncio.run(warm_up_replicas(base_url, args.replicas))
    sessions = ["--session-header", "X-Session-Id"] if policy.endswith(SESSIONS_SUFFIX) else []
    subprocess.run([
        args.aiperf, "profile", "--model", model, "--url", base_url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(tokenizer), "--conversation-num", str(args.conversations),
        "--conversation-turn-mean", str(args.turns), "--conversation-turn-stddev", "0",
        "--request-count", str(args.conversations * args.turns),
        "--num-prefix-prompts", str(args.prefixes), "--prefix-prompt-length", str(args.prefix_tokens),
        "--isl", str(args.isl), "--isl-stddev", "0", "--osl", str(args.osl), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--concurrency", str(args.concurrency), "--request-rate", str(PACING_REQUEST_RATE),
        "--arrival-pattern", "constant", "--random-seed", str(args.seed),
        "--artifact-dir", str(artifacts), "--ui-type", "none", *sessions,
    ], check=True)  # not HF_HUB_OFFLINE=1: AIPerf 0.13 then looks a local --tokenizer up in the hub's cache
    export = json.loads(next(artifacts.rglob("profile_export_aiperf.json")).read_text())
    return Result(policy, export, RouterMetrics.parse(asyncio.run(metrics_text(base_url))))


def report(results: list[Result]) -> None:
    print("| policy | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | req/s | output tok/s "
          "| requests | router decisions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        hit_rate = r.router.prefix_cache_hits / max(r.router.prefix_cache_queries, 1)
        print(f"| {r.policy} | {hit_rate:.1%} | {r.metric('time_to_first_token', 'p50'):.0f} "
              f"| {r.metric('time_to_first_token', 'p99'):.0f} | {r.metric('request_throughput', 'avg'):.2f} "
              f"| {r.metric('output_token_throughput', 'avg'):.1f} | {r.metric('request_count', 'avg'):.0f} "
              f"| {r.router.describe_decisions()} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf executable (default: on PATH)")
    parser.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"],
                        help=f"routing policies; with {SESSIONS_SUFFIX} (prefix{SESSIONS_SUFFIX}) AIPerf sends "
                             "each conversation's id in X-Session-Id")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--replica-cpus", type=float, help="CPUs per replica (default: the machine's, shared)")
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=8, help="shared prefix prompts")
    parser.add_argument("--prefix-tokens", type=int, default=700)
    parser.add_argument("--isl", type=int, default=32, help="tokens of each user message")
    parser.add_argument("--osl", type=int, default=8, help="tokens of each answer")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--artifact-dir", type=Path, default=Path(tempfile.gettempdir()) / "aiperf_routing",
                        help="AIPerf's exports, the servers' logs and the tokenizer (default: %(default)s)")
    args = parser.parse_args()
    args.replica_cpus = args.replica_cpus or min(1.0, (os.cpu_count() or 1) / args.replicas)
    tokenizer = args.artifact_dir / "tokenizer"
    export_tokenizer(None, tokenizer)
    results = []
    for policy in args.policies:
        with serving(policy, args) as base_url:
            results.append(run_aiperf(base_url, policy, tokenizer, args))
    report(results)


if __name__ == "__main__":
    main()
