"""A private Ray cluster on this machine, on loopback only."""
import errno
import os
import socket

LOOPBACK = "127.0.0.1"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Make every Ray process started from here take 127.0.0.1 as its node address.

    Ray turns 127.0.0.1 into the machine's outward address unless its cluster is marked
    single-machine. Its processes read that mark from the environment when they import ray; this
    process may have imported ray already, so its copy of the mark is set too.
    """
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray._private import ray_constants
    ray_constants.ENABLE_RAY_CLUSTER = False


# Ray starts a worker per CPU when the driver connects, before anything asks for one; on 2 cores those starts
# slow Ray's own start-up and Serve's behind it: `prefixserve serve` answered its first chat in 9.9 s without
# them against 10.4 s with them (medians of 16 alternating starts, benchmarks/results/startup.md). Actors (every
# Serve replica is one) start a worker of their own either way.
NO_PRESTARTED_WORKERS = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


# Serve's controller wakes every 0.1 s by default and asks GCS for every node's state and resources each time:
# idle, that loop is 4-5% of a core, and GCS's answers 1-2% more, taken from the engine's cores under load.
SERVE_CONTROL_LOOP_INTERVAL_S = "0.5"


def slow_serve_control_loop() -> None:
    """Serve's controller loop of the cluster this process starts wakes every SERVE_CONTROL_LOOP_INTERVAL_S, unless
    RAY_SERVE_CONTROL_LOOP_INTERVAL_S says otherwise; before the cluster starts (its processes inherit it)."""
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", SERVE_CONTROL_LOOP_INTERVAL_S)


def init_local_ray(num_cpus: int, **init_args) -> None:
    """Start a new Ray cluster of this process alone, every node on 127.0.0.1, so no traffic leaves
    loopback. `address="local"`: never join the cluster that RAY_ADDRESS or `ray start` points to."""
    keep_ray_on_loopback()
    import ray
    context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK,
                       _system_config=NO_PRESTARTED_WORKERS, **init_args)
    if context.address_info["node_ip_address"] != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray started on {context.address_info['node_ip_address']}, not {LOOPBACK}")


def free_port() -> int:
    """A TCP port that nothing on 127.0.0.1 listens on now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def is_listened_on(host: str, port: int) -> bool:
    """Whether something listens on host:port. Ray Serve's proxy binds with SO_REUSEPORT, so a second
    one on a busy port would start silently and share its connections; a plain bind fails there."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is no listener
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False
