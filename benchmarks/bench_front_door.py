"""The front door: requests/s and CPU ms per request through the full HTTP path, prefixserve against a
bare Ray Serve app (benchmarks/bare_serve.py), the same load client for both, in one run.

Every request is POST /v1/completions with a fresh prompt of --prompt-tokens random token ids and
--max-tokens (1; more are all generated: ignore_eos), streamed with --stream. prefixserve serves the
tiny random model (benchmarks/random_model.py) on --replicas engine replicas, behind 1 and then 2
ingress replicas; the bare app has its ingress replicas (1, and then 2: --bare-ingress-replicas) in
front of --replicas replicas that yield a chunk a token. The bare app with one ingress replica is the
reference of every ratio; the bare app with two says what a second ingress process gives Ray Serve
itself on this machine. The apps run side by side, each at its own route prefix, and stay up through the
run; the load goes to one at a time: --warmup-s of it, then --duration-s measured, for each app in turn
in each of --rounds rounds (each round starting with the next app). The machine's speed drifts by 10-30%
over tens of seconds: a ratio is taken within a round, between windows seconds apart, and the verdict is
on the rounds' median. The load client is `wrk` (a Lua script makes each request's prompt), or without
wrk an asyncio httpx client in a process of its own. CPU ms per request: the CPU time (user + system,
psutil) that the measured app's processes and those every app shares (Ray's GCS, raylet, Serve's
controller and proxy; not this driver, not the load client, not the other apps' replicas and router
actors) spent during the measured window, over the requests answered in it.

    apt-get install -y wrk
    PYTHONPATH=. python benchmarks/bench_front_door.py --markdown benchmarks/results/front-door.md
"""
import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.random_model import SHAPES  # noqa: E402
from benchmarks.timing import percentile  # noqa: E402

MODEL_NAME = "tiny"
FIRST_TOKEN_ID = 2  # after BOS (0) and EOS (1)
ENGINE = {"served_model_name": MODEL_NAME, "num_kv_blocks": 512, "max_model_len": 1024}
VOCAB_SIZE = SHAPES["tiny"]["vocab_size"]
CLIENT_TIMEOUT_S = 10
TRANSPORTS = {"grpc": "Serve's gRPC channel", "ray": "Ray actor calls (Serve's default handle)"}


@dataclass
class Load:
    """What a load client saw: requests answered (any status) in duration_s, of which non_2xx were not
    2xx; errors and timeouts got no answer."""
    requests: int
    duration_s: float
    non_2xx: int
    errors: int
    timeouts: int
    p50_ms: float
    p99_ms: float

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s


@dataclass
class Result:
    app: str
    load: Load
    cpu_ms_by_process: dict[str, float]  # CPU ms per request by kind of process
    steal: float | None = None  # the share of the machine's time its hypervisor took from it meanwhile
    ingress_replicas: int = 1
    bare: bool = False  # the bare Ray Serve app's, not prefixserve's

    @property
    def cpu_ms_per_request(self) -> float:
        return sum(self.cpu_ms_by_process.values())


# ---- wrk

WRK_SCRIPT = """\
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end
function init(args)
  math.randomseed(tonumber(args[1]) * 1000 + id)  -- each run's and each thread's own prompts
end
function request()
  local ids = {}
  for i = 1, %(prompt_tokens)d do ids[i] = math.random(%(first_id)d, %(last_id)d) end
  local body = '%(fields)s,"prompt":[' .. table.concat(ids, ",") .. ']}'
  return wrk.format("POST", "%(path)s", {["Content-Type"] = "application/json"}, body)
end
"""


def request_fields(max_tokens: int = 1, stream: bool = False) -> dict:
    """Every request's body but its prompt."""
    fields = {"model": MODEL_NAME, "max_tokens": max_tokens}
    if max_tokens > 1:
        fields["ignore_eos"] = True  # the random model's tokens may be its EOS
    return fields | ({"stream": True} if stream else {})


def wrk_script(prompt_tokens: int, route_prefix: str, fields: dict) -> str:
    opening = json.dumps(fields, separators=(",", ":")).removesuffix("}")
    return WRK_SCRIPT % {"prompt_tokens": prompt_tokens, "first_id": FIRST_TOKEN_ID, "last_id": VOCAB_SIZE - 1,
                         "fields": opening, "path": f"{route_prefix}/v1/completions"}


_WRK_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _wrk_latency_ms(text: str, quantile: str) -> float:
    value, unit = re.search(rf"^\s*{quantile}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M).groups()
    return float(value) * _WRK_UNITS_MS[unit]


def parse_wrk(text: str) -> Load:
    """wrk --latency's report."""
    requests, duration, unit = re.search(r"(\d+) requests in ([\d.]+)(ms|s|m),", text).groups()
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    connect, read, write, timeouts = map(int, socket.groups()) if socket else (0, 0, 0, 0)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    return Load(requests=int(requests), duration_s=float(duration) * _WRK_UNITS_MS[unit] / 1e3,
                non_2xx=int(non_2xx.group(1)) if non_2xx else 0, errors=connect + read + write, timeouts=timeouts,
                p50_ms=_wrk_latency_ms(text, "50"), p99_ms=_wrk_latency_ms(text, "99"))


def wrk_command(base_url: str, script: Path, args: argparse.Namespace, duration_s: float, seed: int) -> list[str]:
    return ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{duration_s:g}s", f"--timeout={CLIENT_TIMEOUT_S}s",
            "--latency", "-s", str(script), base_url, "--", str(seed)]


# ---- the httpx client, when there is no wrk

async def httpx_load(base_url: str, connections: int, duration_s: float, prompt_tokens: int, fields: dict,
                     seed: int) -> Load:
    import httpx

    rng = random.Random(seed)
    latencies_ms, statuses, failures = [], [], {"errors": 0, "timeouts": 0}
    started = time.monotonic()
    deadline = started + duration_s

    async def connection(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            body = fields | {"prompt": [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(prompt_tokens)]}
            sent = time.monotonic()
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                failures["timeouts"] += 1
                continue
            except httpx.TransportError:
                failures["errors"] += 1
                continue
            latencies_ms.append((time.monotonic() - sent) * 1e3)
            statuses.append(response.status_code)

    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=CLIENT_TIMEOUT_S) as client:
        await asyncio.gather(*(connection(client) for _ in range(connections)))
    return Load(requests=len(statuses), duration_s=time.monotonic() - started,
                non_2xx=sum(not 200 <= status < 300 for status in statuses), **failures,
                p50_ms=statistics.median(latencies_ms), p99_ms=percentile(latencies_ms, 99))


def httpx_command(base_url: str, args: argparse.Namespace, duration_s: float, seed: int) -> list[str]:
    return [sys.executable, __file__, "--httpx-client", base_url, "--connections", str(args.connections),
            "--duration-s", str(duration_s), "--prompt-tokens", str(args.prompt_tokens),
            "--max-tokens", str(args.max_tokens), *(["--stream"] if args.stream else []), "--seed", str(seed)]


# ---- CPU accounting

def cpu_seconds(processes: list) -> dict[int, float]:
    """User + system CPU seconds of each process still alive, by pid."""
    import psutil

    seconds = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


def process_kind(process) -> tuple[str, str | None]:
    """The kind of process and the Serve app whose replica it is (None: not a replica). Ray titles its
    workers by what they run and the method running now (ray::ServeReplica:<app>:<deployment>.handle_request):
    a replica's kind is its deployment's, ServeReplica:<deployment>. Its other processes go by their
    executable's name (raylet, gcs_server, python)."""
    import psutil

    try:
        title = process.cmdline()[0]
        if not title.startswith("ray::"):
            return process.name(), None
    except (psutil.NoSuchProcess, IndexError):
        return "gone", None
    actor = title.removeprefix("ray::").split(".")[0]
    if actor.startswith("ServeReplica:"):
        _, app, deployment = actor.split(":", 2)
        return f"ServeReplica:{deployment}", app
    return actor, None


def machine_times() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's cpu line: user, nice, system, idle, iowait, irq,
    softirq, steal, ...); None where there is no /proc/stat."""
    try:
        return [int(field) for field in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return None


STEAL = 7  # the position of steal in machine_times()


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of the time between two machine_times() that the hypervisor ran other guests on this
    machine's CPUs (Linux's steal): on a shared host it swings from 0 to over 10% from one minute to the next."""
    if before is None or after is None or len(before) <= STEAL:
        return None
    deltas = [now - then for then, now in zip(before, after)]
    return deltas[STEAL] / sum(deltas) if sum(deltas) else None


def cpu_ms_by_kind(before: dict[int, float], after: dict[int, float], kinds: dict[int, str],
                   requests: int) -> dict[str, float]:
    """CPU ms per request of each kind of process. A process that died in the window is left out: its
    last seconds cannot be read."""
    by_kind = collections.defaultdict(float)
    for pid in after.keys() & before.keys():
        by_kind[kinds[pid]] += (after[pid] - before[pid]) * 1e3 / requests
    return dict(by_kind)


# ---- the run

@dataclass(frozen=True)
class App:
    label: str  # its rows' name in the report
    name: str  # its Serve app's, and its route prefix without the slash
    application: Any  # what serve.run takes
    ingress_replicas: int
    config: Any = None  # prefixserve's ClusterConfig; None for the bare app


def measure(app: App, load_command, args: argparse.Namespace, owners: dict[int, str]) -> Result:
    """One window of load on app; load_command(app, duration_s) -> the load client's command. owners: the
    app of each process that serves one app alone and whose title does not say which (the router actors)."""
    import psutil

    subprocess.run(load_command(app, args.warmup_s), check=True, capture_output=True)
    processes, kinds = [], {}
    for process in psutil.Process().children(recursive=True):  # taken before the client starts: not counted
        kind, owner = process_kind(process)
        if owners.get(process.pid, owner) in (None, app.name):
            processes.append(process)
            kinds[process.pid] = kind
    before, machine_before = cpu_seconds(processes), machine_times()
    output = subprocess.run(load_command(app, args.duration_s), check=True, capture_output=True, text=True).stdout
    load = parse_wrk(output) if args.client == "wrk" else Load(**json.loads(output))
    result = Result(app.label, load, cpu_ms_by_kind(before, cpu_seconds(processes), kinds, load.requests),
                    steal_share(machine_before, machine_times()), app.ingress_replicas, app.config is None)
    print(f"{app.label}: {load.requests_per_s:.0f} requests/s, {result.cpu_ms_per_request:.1f} CPU ms per request "
          f"over {len(processes)} processes", flush=True)
    return result


def check_answers(base_url: str, fields: dict) -> None:
    import httpx

    body = fields | {"prompt": list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + 32))}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    if response.status_code != 200:
        raise RuntimeError(f"{base_url} answered {response.status_code}: {response.text}")


def apps_to_measure(args: argparse.Namespace, scratch: Path) -> list[App]:
    """The bare app at each --bare-ingress-replicas first, then prefixserve at each --ingress-replicas."""
    from benchmarks.bare_serve import build_bare
    from benchmarks.live_app import replica_num_cpus
    from benchmarks.random_model import write_random_model
    from cluster.app import build
    from cluster.config import ClusterConfig

    engine = ENGINE | {"model": str(write_random_model(scratch / "tiny", "tiny"))}
    served = {"router_sync_interval_s": args.router_sync_interval_s} if args.router_sync_interval_s else {}
    num_cpus = replica_num_cpus(args.replicas)
    handle = ", gRPC handle" if args.bare_transport == "grpc" else ""
    apps = [App(f"bare Ray Serve, {n} ingress{handle}", f"bare-{n}",
                build_bare(args.replicas, num_cpus, args.bare_transport, n), n) for n in args.bare_ingress_replicas]
    for n in args.ingress_replicas:
        config = ClusterConfig(engine=engine, num_replicas=args.replicas, replica_num_cpus=num_cpus,
                               ingress_replicas=n, engine_transport=args.engine_transport, **served)
        apps.append(App(f"prefixserve, {n} ingress", f"ingress-{n}", build(config), n, config))
    return apps


def router_actor_pid(app: App) -> int | None:
    """The pid of the app's router actor (the app has answered a request: it exists); None for the bare app."""
    import ray

    from router.actor import get_or_create_router

    if app.config is None:
        return None
    actor = get_or_create_router(app.name, app.config.routing_config, app.config.engine.cache.block_size,
                                 create=False)
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def run_all(args: argparse.Namespace, scratch: Path) -> list[list[Result]]:
    """--rounds rounds of every app, each round's results in the apps' order (the bare apps first)."""
    from benchmarks.live_app import local_serve

    seeds = itertools.count()  # no run repeats another's prompts
    num_apps = len(args.bare_ingress_replicas) + len(args.ingress_replicas)
    with local_serve(num_cpus=num_apps * (os.cpu_count() or 1)) as run:
        apps = apps_to_measure(args, scratch)
        urls = {app.name: run(app.application, app.name, f"/{app.name}") for app in apps}
        scripts = {app.name: scratch / f"{app.name}.lua" for app in apps} if args.client == "wrk" else {}
        fields = request_fields(args.max_tokens, args.stream)
        for name, script in scripts.items():
            script.write_text(wrk_script(args.prompt_tokens, f"/{name}", fields))

        def load_command(app: App, duration_s: float) -> list[str]:
            if scripts:
                return wrk_command(urls[app.name], scripts[app.name], args, duration_s, next(seeds))
            return httpx_command(urls[app.name], args, duration_s, next(seeds))

        for url in urls.values():
            check_answers(url, fields)
        owners = {pid: app.name for app in apps if (pid := router_actor_pid(app)) is not None}
        rounds = []
        for index in range(args.rounds):
            print(f"round {index + 1} of {args.rounds}", flush=True)
            measured = {app.name: measure(app, load_command, args, owners)
                        for app in rotated(apps, index)}
            rounds.append([measured[app.name] for app in apps])
        return rounds


def rotated(items: list, start: int) -> list:
    """Round i runs the apps from the i-th on: none always goes first, into a machine that is still quiet."""
    start %= len(items)
    return items[start:] + items[:start]


# ---- the report

def table(results: list[Result]) -> str:
    bare = results[0]
    rows = ["| app | requests/s | x bare | answered | non-2xx | errors | timeouts | p50 ms | p99 ms | CPU ms/request "
            "| CPU x bare |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        load = result.load
        rate = load.requests_per_s
        rows.append(f"| {result.app} | {rate:.0f} | {rate / bare.load.requests_per_s:.2f} "
                    f"| {load.requests} | {load.non_2xx} | {load.errors} | {load.timeouts} | {load.p50_ms:.1f} "
                    f"| {load.p99_ms:.1f} | {result.cpu_ms_per_request:.2f} "
                    f"| {result.cpu_ms_per_request / bare.cpu_ms_per_request:.2f} |")
    return "\n".join(rows)


def cpu_table(results: list[Result]) -> str:
    """CPU ms per request by kind of process, the busiest kinds first."""
    kinds = sorted({kind for result in results for kind in result.cpu_ms_by_process},
                   key=lambda kind: -max(result.cpu_ms_by_process.get(kind, 0.0) for result in results))
    rows = ["| CPU ms/request by process | " + " | ".join(result.app for result in results) + " |",
            "|---" * (len(results) + 1) + "|"]
    rows += [f"| {kind} | " + " | ".join(f"{result.cpu_ms_by_process.get(kind, 0.0):.2f}" for result in results) + " |"
             for kind in kinds]
    return "\n".join(rows)


def pooled(rounds: list[list[Result]]) -> list[Result]:
    """Each app's rounds as one result: requests and time summed, CPU per request over all its requests,
    the latency quantiles the rounds' medians."""
    return [_pooled(list(results)) for results in zip(*rounds)]


def _pooled(results: list[Result]) -> Result:
    loads = [result.load for result in results]
    requests = sum(load.requests for load in loads)
    kinds = {kind for result in results for kind in result.cpu_ms_by_process}
    cpu_ms = {kind: sum(result.cpu_ms_by_process.get(kind, 0.0) * result.load.requests for result in results)
              / max(requests, 1) for kind in kinds}
    load = Load(requests, sum(load.duration_s for load in loads), sum(load.non_2xx for load in loads),
                sum(load.errors for load in loads), sum(load.timeouts for load in loads),
                statistics.median(load.p50_ms for load in loads), statistics.median(load.p99_ms for load in loads))
    first = results[0]
    return Result(first.app, load, cpu_ms, ingress_replicas=first.ingress_replicas, bare=first.bare)


def ratios(results: list[Result]) -> list[float]:
    """One round's requests/s of every app but the first over the first's (the bare app, 1 ingress)."""
    bare = results[0].load.requests_per_s
    return [result.load.requests_per_s / bare for result in results[1:]]


def rounds_table(rounds: list[list[Result]]) -> str:
    served = [result.app for result in rounds[0][1:]]
    rows = [f"| round | {rounds[0][0].app} req/s | " + " | ".join(f"{app} req/s (x bare)" for app in served)
            + " | CPU ms/request: " + ", ".join(result.app for result in rounds[0])
            + " | steal % in each app's window |",
            "|---" * (len(served) + 4) + "|"]
    for index, results in enumerate(rounds, 1):
        cells = [f"{result.load.requests_per_s:.0f} ({ratio:.2f})"
                 for result, ratio in zip(results[1:], ratios(results))]
        cpu = ", ".join(f"{result.cpu_ms_per_request:.1f}" for result in results)
        steal = ", ".join("-" if result.steal is None else f"{result.steal * 100:.1f}" for result in results)
        rows.append(f"| {index} | {results[0].load.requests_per_s:.0f} | " + " | ".join(cells)
                    + f" | {cpu} | {steal} |")
    return "\n".join(rows)


def verdict(rounds: list[list[Result]], min_ratio: float = 0.8) -> list[str]:
    """Whether the done-when of issue 29 holds, on the median over the rounds (each ratio taken within its
    round): every prefixserve app at least min_ratio x the first app's requests/s (the bare app with one
    ingress replica), and each one with more ingress replicas at least as fast as the one before. Beside it,
    each prefixserve app against the bare app with as many ingress replicas, and the bare app's own steps."""
    apps = rounds[0]
    by_app = [[1.0] * len(rounds)] + [list(app_ratios) for app_ratios in zip(*(ratios(results) for results in rounds))]
    lines = []
    for index, app in enumerate(apps[1:], 1):
        if not app.bare:
            median = statistics.median(by_app[index])
            lines.append(f"{app.app}: {median:.2f}x {apps[0].app} (median of {_listed(by_app[index])}), "
                         f"{'meets' if median >= min_ratio else 'misses'} the {min_ratio}x bar")
    bare_by_ingress = {app.ingress_replicas: index for index, app in enumerate(apps) if app.bare and index}
    for index, app in enumerate(apps):
        peer = bare_by_ingress.get(app.ingress_replicas)
        if not app.bare and peer is not None:
            lines.append(_step_line(app.app, apps[peer].app, by_app[peer], by_app[index]))
    for before in range(len(apps) - 1):
        after = before + 1
        if apps[before].bare == apps[after].bare:
            lines.append(_step_line(apps[after].app, apps[before].app, by_app[before], by_app[after]))
    return lines


def _step_line(app: str, reference: str, reference_ratios: list[float], app_ratios: list[float]) -> str:
    steps = [mine / theirs for theirs, mine in zip(reference_ratios, app_ratios)]
    median = statistics.median(steps)
    return (f"{app}: {median:.2f}x {reference} (median of {_listed(steps)}), "
            f"{'as fast or faster' if median >= 1 else 'slower'}")


def _counted(counts: list[int]) -> str:
    return " and ".join(map(str, counts))


def _listed(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def machine() -> str:
    import torch

    from replica.engine import resolve_dtype

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M).group(1)
    flags = set(re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M).group(1).split())
    vector = ", ".join(flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags)
    dtype = str(resolve_dtype(None, torch.device("cpu"))).removeprefix("torch.")
    return f"{os.cpu_count()} cores of {model} ({vector}); the engines' dtype {dtype}"


def report(args: argparse.Namespace, rounds: list[list[Result]]) -> str:
    together = pooled(rounds)
    client = "wrk" if args.client == "wrk" else "an asyncio httpx client in its own process" + (
        "" if shutil.which("wrk") else " (wrk is not installed)")
    return "\n\n".join([
        f"```\nPYTHONPATH=. python benchmarks/bench_front_door.py {' '.join(sys.argv[1:])}\n```",
        f"Machine: {machine()}. Load client: {client}, {args.connections} connections, {args.warmup_s:g} s of warm-up "
        f"then {args.duration_s:g} s measured per app and round, {args.rounds} rounds (each round starts with the "
        f"next app in turn; the ratios are taken within a round), a fresh prompt of {args.prompt_tokens} random token "
        f"ids per request, max_tokens {args.max_tokens}{', streamed' if args.stream else ''}. {args.replicas} "
        f"engine replicas of the tiny random model (bare app: {args.replicas} replicas yielding a chunk a token, "
        f"behind {_counted(args.bare_ingress_replicas)} ingress replicas), called over "
        f"{TRANSPORTS[args.engine_transport]} (bare app: {TRANSPORTS[args.bare_transport]}). The apps run side by "
        f"side through the run, the load on one at a time. "
        f"CPU ms per request: user + system time of the measured app's processes and those every app shares "
        f"(Ray's and Serve's) during the measured window, over the requests answered in it.",
        rounds_table(rounds),
        "All rounds together:\n\n" + table(together),
        cpu_table(together),
        "\n".join(f"- {line}" for line in verdict(rounds))])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (bare app: chunk replicas)")
    parser.add_argument("--ingress-replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bare-ingress-replicas", type=int, nargs="+", default=[1, 2],
                        help="the bare app's ingress replicas, one app each; the first is every ratio's reference")
    parser.add_argument("--router-sync-interval-s", type=float, help="default: ClusterConfig's")
    parser.add_argument("--engine-transport", choices=["grpc", "ray"], default="grpc",
                        help="prefixserve's ingress-to-engine calls (ClusterConfig.engine_transport)")
    parser.add_argument("--bare-transport", choices=["ray", "grpc"], default="ray",
                        help="the bare app's ingress-to-chunk calls: ray (Serve's default handle) or grpc")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="wrk's threads")
    parser.add_argument("--duration-s", type=float, default=10.0, help="measured load on an app in a round")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="load on an app before each measured window")
    parser.add_argument("--rounds", type=int, default=10, help="times every app is measured, in turn")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens each request generates, all of them")
    parser.add_argument("--stream", action="store_true", help="stream the responses (server-sent events)")
    parser.add_argument("--client", choices=["wrk", "httpx"], default="wrk" if shutil.which("wrk") else "httpx")
    parser.add_argument("--markdown", help="write the command, machine, table and verdict here")
    parser.add_argument("--httpx-client", metavar="BASE_URL",
                        help="internal: be the httpx load client against BASE_URL and print its result as JSON")
    parser.add_argument("--seed", type=int, default=0, help="internal: the httpx client's prompts")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.httpx_client:
        load = asyncio.run(httpx_load(args.httpx_client, args.connections, args.duration_s, args.prompt_tokens,
                                      request_fields(args.max_tokens, args.stream), args.seed))
        print(json.dumps(asdict(load)))
        return
    if args.client == "httpx":
        print("wrk is not installed (apt-get install -y wrk): the load client is an asyncio httpx client", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        rounds = run_all(args, Path(scratch))
    text = report(args, rounds)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(f"# The front door: prefixserve against a bare Ray Serve app\n\n{text}\n")


if __name__ == "__main__":
    main()
