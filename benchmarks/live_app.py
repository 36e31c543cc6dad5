"""The app on a local Ray cluster for the live benchmarks: every node on 127.0.0.1, one Serve port."""
import contextlib
import os
import socket
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def local_app() -> Iterator[Callable[..., str]]:
    """Yields deploy(engine, num_replicas, **cluster_config) -> the app's base URL. Each deploy replaces
    the app with fresh replicas (cold caches) that share the machine's cores."""
    from cluster.local_ray import init_local_ray

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    num_cpus = os.cpu_count() or 1
    init_local_ray(num_cpus, log_to_driver=False)  # before anything imports ray
    import ray
    from ray import serve

    from cluster.app import APP_NAME, build
    from cluster.config import ClusterConfig

    def deploy(engine: dict, num_replicas: int, **cluster_config) -> str:
        config = ClusterConfig(engine=engine, num_replicas=num_replicas,
                               replica_num_cpus=min(1.0, num_cpus / num_replicas), **cluster_config)
        serve.run(build(config), name=APP_NAME, route_prefix="/")
        return f"http://127.0.0.1:{port}"

    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield deploy
    finally:
        serve.shutdown()
        ray.shutdown()
