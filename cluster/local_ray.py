"""A private Ray cluster on this machine, on loopback only."""
import os
import socket

LOOPBACK = "127.0.0.1"


def init_local_ray(num_cpus: int, **init_args) -> None:
    """Start Ray with every node on 127.0.0.1, so no traffic leaves loopback.

    Ray turns 127.0.0.1 into the machine's outward address unless its cluster is marked
    single-machine, which it reads when ray is first imported: the caller that imports ray
    earlier must set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 first.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    context = ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK, **init_args)
    if context.address_info["node_ip_address"] != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray started on {context.address_info['node_ip_address']}, not {LOOPBACK}: "
                           "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before ray is imported")


def free_port() -> int:
    """A TCP port that nothing on 127.0.0.1 listens on now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]
