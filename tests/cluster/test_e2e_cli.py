"""README's serve command as a user runs it: the installed console script in a subprocess, with none of
the environment the tests set for themselves, on a machine that may have interfaces besides loopback.

The tests run in order on one server: it serves, refuses a second instance on its port, then stops."""
import os
import re
import shutil
import signal
import subprocess
import threading
import time

import httpx
import openai
import psutil
import pytest

from cluster.direct_ingress import haproxy_binary
from cluster.local_ray import LOOPBACK, SERVE_CONTROL_LOOP_INTERVAL_S, free_port

from .test_e2e import MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVE_FLAGS = ["--replicas", "1", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4"]
STARTUP_TIMEOUT_S = 300
SHUTDOWN_TIMEOUT_S = 120


class Server:
    """`prefixserve serve` in a subprocess, its output collected line by line."""

    def __init__(self, port: int, flags: list[str] = SERVE_FLAGS):
        self.port = port
        self.lines: list[str] = []
        self.process = subprocess.Popen([shutil.which("prefixserve"), "serve", "--port", str(port), *flags],
                                        env=user_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_until_serving(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            serving = [line for line in self.lines if line.startswith("prefixserve: serving on")]
            if serving:
                return serving[0]
            time.sleep(0.5)
        raise AssertionError(f"no 'serving on' line (exit code {self.process.poll()}):\n{''.join(self.lines[-40:])}")


def user_environment() -> dict[str, str]:
    """The environment of a user's shell: nothing that makes Ray stay on loopback or join a cluster."""
    return {name: value for name, value in os.environ.items()
            if name not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}


@pytest.fixture(scope="module")
def server():
    server = Server(free_port())
    try:
        server.serving_line = server.wait_until_serving()
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_it_serves_a_chat_from_a_ray_node_on_loopback(server):
    assert server.serving_line == (f"prefixserve: serving on http://{LOOPBACK}:{server.port}/v1 "
                                   f"from Ray node {LOOPBACK} (Ctrl-C to stop)\n")
    with openai.OpenAI(base_url=f"http://{LOOPBACK}:{server.port}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (4, "length")
    assert ray_node_listeners_beyond_loopback(server.process.pid) == []
    serving_processes = {name_of(process) for process in psutil.Process(server.process.pid).children(recursive=True)}
    assert ("haproxy" in serving_processes) == (haproxy_binary() is not None)  # the direct front door where it can


def test_serves_controller_loops_every_half_second_on_the_cluster_it_starts(server):
    controllers = [process for process in psutil.Process(server.process.pid).children(recursive=True)
                   if title_of(process).startswith("ray::ServeController")]  # its title names its method
    assert len(controllers) == 1
    assert controllers[0].environ()["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == SERVE_CONTROL_LOOP_INTERVAL_S == "0.5"


def test_a_second_instance_on_its_port_exits_and_the_first_keeps_serving(server):
    second = subprocess.run([shutil.which("prefixserve"), "serve", "--port", str(server.port), *SERVE_FLAGS],
                            env=user_environment(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines()[-1] == (
        f"prefixserve: {LOOPBACK}:{server.port} is already in use (another server listens there): "
        "stop it or choose another --port")
    assert httpx.get(f"http://{LOOPBACK}:{server.port}/health", timeout=30).status_code == 200


def test_sigint_stops_it_and_leaves_no_process_behind(server):
    descendants = psutil.Process(server.process.pid).children(recursive=True)
    assert len(descendants) > 0
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(SHUTDOWN_TIMEOUT_S) == 0
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert [process.pid for process in alive] == []
    assert "prefixserve: shutting down\n" in server.lines


def ray_node_listeners_beyond_loopback(pid: int) -> list[str]:
    """'address:port (process)' of every TCP socket that the Ray node under `pid` (its GCS and raylet) listens
    on beyond loopback. (Serve's replicas open their inter-deployment gRPC server on [::] whatever the node
    address: Ray Serve 2.60's replica.py.)"""
    node = [process for process in psutil.Process(pid).children(recursive=True)
            if name_of(process) in ("gcs_server", "raylet")]
    assert len(node) == 2
    return [f"{conn.laddr.ip}:{conn.laddr.port} ({process.name()})" for process in node
            for conn in _listening(process) if not re.fullmatch(r"(::ffff:)?127\.\d+\.\d+\.\d+|::1", conn.laddr.ip)]


def name_of(process: psutil.Process) -> str | None:
    """None for a process gone since it was listed (an HAProxy that a reload replaced, say)."""
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return None


def title_of(process: psutil.Process) -> str:
    """A process's first word ("" if it is gone since it was listed): a Ray worker's title."""
    try:
        return (process.cmdline() or [""])[0]
    except psutil.NoSuchProcess:
        return ""


def _listening(process: psutil.Process) -> list:
    try:
        return [conn for conn in process.net_connections(kind="tcp") if conn.status == psutil.CONN_LISTEN]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_it_starts_shuts_down_what_had_started(signum):
    server = Server(free_port())
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not any("Deploying new version of Deployment" in line for line in server.lines):
            assert time.monotonic() < deadline and server.process.poll() is None, "".join(server.lines[-40:])
            time.sleep(0.1)
        descendants = psutil.Process(server.process.pid).children(recursive=True)
        server.process.send_signal(signum)
        assert server.process.wait(SHUTDOWN_TIMEOUT_S) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert [process.pid for process in alive] == []
    assert "prefixserve: shutting down\n" in server.lines
    assert not any(line.startswith("Traceback") for line in server.lines), "".join(server.lines)
