"""Chaos soak: the real app under load while engine replicas and the router actor are killed.

--requests requests from --clients concurrent clients: chat and completions, streamed and not,
greedy and sampled, random lengths, prompts opening with one of a few shared prefixes, and
--drop-rate of the streams abandoned by their client after the first chunk. A chaos task kills a
random engine replica every --kill-every-s seconds (Serve replaces it) and the router actor once,
at --router-kill-at-s (the next caller recreates it and the replicas resync into it). Faults can be
scheduled by progress as well: --kill-every-requests K kills a replica every K ended requests and
--router-kill-at-requests N the router after N, each fault at its time or its count, whichever comes
first. The same workload then runs against a fresh, quiet app in the same session.

Every request must end within --deadline-s: completed, or an error only when every replica it
was sent to died (migration gave up); a request past the deadline is a hang. Once the load
stops, every replica must drain (KV usage 0, nothing running or waiting) and the router's index
must hold exactly the blocks in each live replica's prefix cache, and no dead replica. Prints the
table (benchmarks/results/soak.md) and exits 1 when a check fails.

    python benchmarks/soak.py [--requests 10000] [--quiet-requests N] [--clients 64] [--replicas 4]
                              [--kill-every-s 60] [--kill-every-requests K] [--router-kill-at-requests N]
"""
import argparse
import asyncio
import functools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.live_app import local_app, random_words  # noqa: E402
from benchmarks.timing import percentile  # noqa: E402
from cluster.metrics import PREFIX as METRICS_PREFIX  # noqa: E402

ENGINE = {"num_kv_blocks": 512, "max_model_len": 1024, "max_num_seqs": 32}
NUM_PREFIXES = 8
DRAIN_TIMEOUT_S = 120.0
PROGRESS_EVERY = 500
CHAOS_POLL_S = 0.05


@dataclass
class Outcome:
    kind: str  # completed, dropped (the client left), refused (429), gave_up (every replica died), failed, hang
    ttft_s: float | None = None
    output_tokens: int = 0
    detail: str = ""


@dataclass
class RunResult:
    name: str
    wall_s: float
    outcomes: list[Outcome]
    kills: list[str] = field(default_factory=list)
    migrations: float = 0.0
    drained: dict[str, str] = field(default_factory=dict)  # replica -> what it still holds ("" when idle)
    index_mismatches: dict[str, tuple[float, float]] = field(default_factory=dict)  # replica -> (index, cache)
    stale_replicas: list[str] = field(default_factory=list)  # in the router's view, but dead

    def count(self, kind: str) -> int:
        return sum(outcome.kind == kind for outcome in self.outcomes)

    @property
    def problems(self) -> list[str]:
        return ([f"{self.count(kind)} {kind}" for kind in ("failed", "hang") if self.count(kind)]
                + [f"{replica} holds {held}" for replica, held in self.drained.items() if held]
                + [f"{replica} index {index} != cache {cache}" for replica, (index, cache) in
                   self.index_mismatches.items()]
                + [f"router still tracks dead {replica}" for replica in self.stale_replicas])


class Workload:
    """The seeded requests of one run: (endpoint, body, drop after the first chunk)."""

    def __init__(self, seed: int, model: str, drop_rate: float):
        self.rng = random.Random(seed)
        self.model = model
        self.drop_rate = drop_rate
        self.prefixes = [f"Context {i}: " + random_words(random.Random(i), 60) for i in range(NUM_PREFIXES)]

    def request(self) -> tuple[str, dict, bool]:
        rng = self.rng
        text = f"{rng.choice(self.prefixes)}\nQuestion: {random_words(rng, rng.randint(3, 24))}"
        stream = rng.random() < 0.5
        body = {"model": self.model, "max_tokens": rng.randint(1, 16), "stream": stream,
                "temperature": rng.choice([0.0, 0.0, 0.8])}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            endpoint, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
        else:
            endpoint, body["prompt"] = "/v1/completions", text
        return endpoint, body, stream and rng.random() < self.drop_rate


async def send(client: httpx.AsyncClient, endpoint: str, body: dict, drop: bool, deadline_s: float) -> Outcome:
    try:
        async with asyncio.timeout(deadline_s):
            if body["stream"]:
                return await _stream(client, endpoint, body, drop)
            return await _whole(client, endpoint, body)
    except TimeoutError:
        return Outcome("hang", detail=f"{endpoint} past {deadline_s} s")
    except httpx.HTTPError as exc:
        return Outcome("failed", detail=repr(exc))


async def _whole(client: httpx.AsyncClient, endpoint: str, body: dict) -> Outcome:
    response = await client.post(endpoint, json=body)
    if response.status_code != 200:
        return _error_outcome(response.status_code, response.text)
    payload = response.json()
    if payload["choices"][0]["finish_reason"] not in ("stop", "length"):
        return Outcome("failed", detail=f"finish_reason {payload['choices'][0]['finish_reason']}")
    return Outcome("completed", output_tokens=payload["usage"]["completion_tokens"])


async def _stream(client: httpx.AsyncClient, endpoint: str, body: dict, drop: bool) -> Outcome:
    sent = time.monotonic()
    ttft, finish_reason, output_tokens = None, None, 0
    async with client.stream("POST", endpoint, json=body) as response:
        if response.status_code != 200:
            return _error_outcome(response.status_code, (await response.aread()).decode())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return _error_outcome(500, line)
            if drop:
                return Outcome("dropped")  # leaving the block closes the connection mid-stream
            for choice in chunk.get("choices", ()):
                if ttft is None and (choice.get("text") or choice.get("delta", {}).get("content")):
                    ttft = time.monotonic() - sent
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
    if finish_reason not in ("stop", "length"):
        return Outcome("failed", detail=f"stream ended without a finish_reason ({finish_reason})")
    return Outcome("completed", ttft, output_tokens)


def _error_outcome(status: int, text: str) -> Outcome:
    if status == 429:
        return Outcome("refused", detail=text)
    # migration's last word: every replica the request was sent to was lost
    return Outcome("gave_up" if "replica_lost" in text else "failed", detail=f"{status} {text[:200]}")


async def run_load(base_url: str, model: str, args: argparse.Namespace, num_requests: int,
                   outcomes: list[Outcome]) -> float:
    """Sends the requests, appending each one's outcome as it ends; returns the wall time."""
    workload = Workload(args.seed, model, args.drop_rate)
    requests = iter([workload.request() for _ in range(num_requests)])
    limits = httpx.Limits(max_connections=args.clients)

    async def client_loop(client: httpx.AsyncClient) -> None:
        for endpoint, body, drop in requests:
            outcomes.append(await send(client, endpoint, body, drop, args.deadline_s))
            if len(outcomes) % PROGRESS_EVERY == 0:
                print(f"{len(outcomes)} of {num_requests} requests in {time.monotonic() - started:.0f} s",
                      file=sys.stderr, flush=True)

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
    return time.monotonic() - started


class Chaos:
    """Kills a random engine replica every kill_every_s or kill_every_requests ended requests, and the router
    actor once, at router_kill_at_s or router_kill_at_requests: each fault at its time or at its count of ended
    requests, whichever comes first."""

    def __init__(self, args: argparse.Namespace, num_ended: Callable[[], int]):
        self.args = args
        self.num_ended = num_ended
        self.rng = random.Random(args.seed)
        self.kills: list[str] = []
        self.started = time.monotonic()
        self.num_engine_kills = 0
        self.router_pending = True
        self.stopping = False

    async def run(self) -> None:
        """Until stop(): a kill under way when it is called still completes and is recorded."""
        while not self.stopping:
            kill = self.due_kill()
            if kill is None:
                await asyncio.sleep(CHAOS_POLL_S)
            else:
                self.kills.append(await asyncio.to_thread(kill))

    def stop(self) -> None:
        self.stopping = True

    def due_kill(self) -> Callable[[], str] | None:
        """The next kill whose time or count has come (counted as done), if any."""
        args = self.args
        if self.router_pending and self._due(args.router_kill_at_s, args.router_kill_at_requests):
            self.router_pending = False
            return kill_router
        next_kill = self.num_engine_kills + 1
        if self._due(next_kill * args.kill_every_s, next_kill * args.kill_every_requests):
            self.num_engine_kills = next_kill
            return functools.partial(kill_engine_replica, self.rng)
        return None

    def _due(self, at_s: float, at_requests: float) -> bool:
        return time.monotonic() - self.started >= at_s or self.num_ended() >= at_requests


def engine_replica_actors() -> dict[str, str]:
    """Live engine replicas: their replica id (as /metrics labels them) -> their actor name."""
    import ray
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["namespace"] == "serve" and "#engine#" in actor["name"]]
    return {name.rsplit("#", 1)[1]: name for name in names}


def kill_engine_replica(rng: random.Random) -> str:
    import ray
    replicas = engine_replica_actors()
    replica_id = rng.choice(sorted(replicas))
    ray.kill(ray.get_actor(replicas[replica_id], namespace="serve"), no_restart=True)
    return f"engine replica {replica_id}"


def kill_router() -> str:
    import ray
    from router.actor import NAMESPACE
    [name] = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
              if actor["namespace"] == NAMESPACE and actor["name"].startswith("router:")]
    ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    return "router actor"


def replica_metrics(text: str) -> tuple[dict[str, dict[str, float]], float]:
    """Per replica: its series by name (without the prefix); and the migrations counted by the ingress."""
    replicas: dict[str, dict[str, float]] = {}
    migrations = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(METRICS_PREFIX)
            if name == "request_migrations_total":
                migrations += sample.value
            elif "replica" in sample.labels:
                replicas.setdefault(sample.labels["replica"], {})[name] = sample.value
    return replicas, migrations


async def check_drained(base_url: str, result: RunResult) -> None:
    """Waits for the replicas to drain and the router to catch up; records whatever does not."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    async with httpx.AsyncClient(base_url=base_url) as client:
        while True:
            replicas, result.migrations = replica_metrics((await client.get("/metrics")).text)
            live = set(await asyncio.to_thread(engine_replica_actors))
            result.drained = {replica: _held(series) for replica, series in replicas.items() if replica in live}
            result.index_mismatches = {
                replica: (series.get("router_index_blocks", 0), series.get("kv_cached_blocks", 0))
                for replica, series in replicas.items()
                if replica in live and series.get("router_index_blocks") != series.get("kv_cached_blocks")}
            routed = {replica for replica, series in replicas.items() if "router_index_blocks" in series}
            result.stale_replicas = sorted(routed - live)  # the ingress's own series outlive replicas, the router's not
            if not result.problems or time.monotonic() > deadline:
                return
            await asyncio.sleep(2.0)


def _held(series: dict[str, float]) -> str:
    held = {name: series.get(name, 0) for name in ("num_requests_running", "num_requests_waiting",
                                                   "kv_cache_usage_perc")}
    return ", ".join(f"{name} {value}" for name, value in held.items() if value)


async def soak(base_url: str, model: str, args: argparse.Namespace, *, chaos: bool) -> RunResult:
    outcomes: list[Outcome] = []
    chaos_task = None
    killer = Chaos(args, num_ended=outcomes.__len__)
    if chaos:
        chaos_task = asyncio.create_task(killer.run())
    try:
        wall_s = await run_load(base_url, model, args, args.requests if chaos else args.quiet_requests, outcomes)
    finally:
        if chaos_task is not None:
            killer.stop()
            await chaos_task
    result = RunResult("chaos" if chaos else "quiet", wall_s, outcomes, killer.kills)
    await check_drained(base_url, result)
    return result


def table(results: list[RunResult]) -> str:
    rows = [
        ("requests", lambda r: len(r.outcomes)),
        ("completed", lambda r: r.count("completed")),
        ("migrations (ingress counter)", lambda r: int(r.migrations)),
        ("dropped by their client on purpose", lambda r: r.count("dropped")),
        ("refused with 429", lambda r: r.count("refused")),
        ("error: every replica tried died", lambda r: r.count("gave_up")),
        ("error: anything else (5xx, bad stream)", lambda r: r.count("failed")),
        ("hangs (past the deadline)", lambda r: r.count("hang")),
        ("replicas not drained at the end", lambda r: sum(bool(held) for held in r.drained.values())),
        ("router index != replica cache (replicas)", lambda r: len(r.index_mismatches)),
        ("dead replicas still in the router", lambda r: len(r.stale_replicas)),
        ("kills", lambda r: len(r.kills)),
        ("wall time (s)", lambda r: f"{r.wall_s:.0f}"),
        ("completed requests/s", lambda r: f"{r.count('completed') / r.wall_s:.2f}"),
        ("output tokens/s", lambda r: f"{sum(o.output_tokens for o in r.outcomes) / r.wall_s:.0f}"),
        ("TTFT p50 (s, streamed)", lambda r: f"{percentile(_ttfts(r), 50):.3f}"),
        ("TTFT p99 (s, streamed)", lambda r: f"{percentile(_ttfts(r), 99):.3f}"),
    ]
    lines = ["| | " + " | ".join(r.name for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(str(value(r)) for r in results) + " |" for label, value in rows]
    return "\n".join(lines)


def _ttfts(result: RunResult) -> list[float]:
    return [o.ttft_s for o in result.outcomes if o.ttft_s is not None] or [float("nan")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--quiet-requests", type=int, default=None,
                        help="requests of the quiet run, the same mix (default: --requests)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--kill-every-s", type=float, default=60.0)
    parser.add_argument("--router-kill-at-s", type=float, default=None,
                        help="when the router actor dies (default: 1.5 x --kill-every-s)")
    parser.add_argument("--kill-every-requests", type=int, default=None,
                        help="also kill an engine replica every this many ended requests, if sooner than by time")
    parser.add_argument("--router-kill-at-requests", type=int, default=None,
                        help="also kill the router actor after this many ended requests, if sooner than by time")
    parser.add_argument("--drop-rate", type=float, default=0.1, help="share of streams the client abandons")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="a request unanswered by then hangs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="+", choices=["quiet", "chaos"], default=["quiet", "chaos"])
    parser.add_argument("--async-scheduling", action="store_true", help="engine replicas schedule asynchronously")
    args = parser.parse_args(argv)
    if args.quiet_requests is None:
        args.quiet_requests = args.requests
    if args.router_kill_at_s is None:
        args.router_kill_at_s = args.kill_every_s * 1.5
    for option in ("kill_every_requests", "router_kill_at_requests"):
        if getattr(args, option) is None:
            setattr(args, option, math.inf)  # by time only
    return args


def main(argv: list[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    with local_app() as deploy:
        from ray import serve

        from cluster.app import APP_NAME
        results = []
        for run in args.runs:
            serve.delete(APP_NAME)  # fresh replicas, cold caches, for each run
            base_url = deploy(ENGINE | {"async_scheduling": args.async_scheduling}, args.replicas)
            model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
            results.append(asyncio.run(soak(base_url, model, args, chaos=run == "chaos")))
    print(table(results))
    for result in results:
        print(f"{result.name}: kills {result.kills}")
        for problem in result.problems:
            print(f"{result.name}: FAILED {problem}")
        print(Counter(o.detail for o in result.outcomes if o.kind in ("failed", "gave_up")).most_common(5))
    return results


if __name__ == "__main__":
    sys.exit(1 if any(result.problems for result in main()) else 0)
