"""benchmarks/bench_serve_vs_vllm.py's pure parts: the workloads it sends and the figures it computes."""
import argparse
import math
import random

import pytest

from benchmarks import bench_serve_vs_vllm as bench
from benchmarks.bench_serve_vs_vllm import RequestTiming


def test_the_burst_has_prompts_of_the_exact_length_of_normal_ids_and_a_seed_reproduces_it():
    workload = bench.random_burst(num_prompts=3, input_len=5, output_len=7, vocab_size=100, seed=0)
    assert [len(prompt) for prompt in workload.prompts] == [5, 5, 5]
    assert all(17 <= token < 100 for prompt in workload.prompts for token in prompt)
    assert (workload.output_len, workload.request_rate) == (7, math.inf)
    assert workload == bench.random_burst(3, 5, 7, 100, seed=0)
    assert workload.prompts != bench.random_burst(3, 5, 7, 100, seed=1).prompts
    assert workload.vllm_dataset == ["--dataset-name", "random", "--random-input-len", "5", "--random-output-len", "7"]


def test_prefix_repetition_prompts_share_one_of_the_prefixes_exactly_and_end_in_suffixes_of_their_own():
    workload = bench.prefix_repetition("prefix", num_prompts=8, num_prefixes=2, prefix_len=6, suffix_len=3,
                                       output_len=4, vocab_size=1000, seed=0)
    assert [len(prompt) for prompt in workload.prompts] == [9] * 8
    prefixes = [tuple(prompt[:6]) for prompt in workload.prompts]
    assert sorted(prefixes.count(prefix) for prefix in set(prefixes)) == [4, 4]
    assert len({tuple(prompt[6:]) for prompt in workload.prompts}) == 8
    assert prefixes != [prefixes[0], prefixes[1]] * 4  # shuffled, as vLLM's: not in the order they were made
    assert workload == bench.prefix_repetition("prefix", 8, 2, 6, 3, 4, 1000, seed=0)
    other = bench.prefix_repetition("prefix", 8, 2, 6, 3, 4, 1000, seed=1)
    assert not {tuple(prompt[:6]) for prompt in other.prompts} & set(prefixes)
    assert workload.vllm_dataset[-8:] == ["--prefix-repetition-prefix-len", "6", "--prefix-repetition-suffix-len",
                                          "3", "--prefix-repetition-num-prefixes", "2",
                                          "--prefix-repetition-output-len", "4"]


def test_the_workloads_are_the_burst_the_prefix_burst_other_prefixes_at_the_request_rate_and_the_stream():
    args = argparse.Namespace(num_prompts=4, input_len=8, output_len=2, num_prefixes=2, prefix_len=16,
                              suffix_len=4, prefix_output_len=3, request_rate=3.0, seed=5, stream_prompts=3,
                              stream_input_len=6, stream_output_len=9)
    burst, prefix, paced, stream = bench.make_workloads(args, vocab_size=500)
    assert [w.name for w in (burst, prefix, paced, stream)] == ["burst", "prefix", "prefix@3/s", "stream"]
    assert [w.request_rate for w in (burst, prefix, paced, stream)] == [math.inf, math.inf, 3.0, math.inf]
    assert [w.seed for w in (burst, prefix, paced, stream)] == [5, 5, 6, 7]
    assert ([len(p) for p in stream.prompts], stream.output_len) == ([6, 6, 6], 9)
    assert {len(p) for p in prefix.prompts} == {len(p) for p in paced.prompts} == {20}
    assert not {tuple(p[:16]) for p in prefix.prompts} & {tuple(p[:16]) for p in paced.prompts}
    firsts = [{tuple(p[:4]) for p in workload.prompts} for workload in (burst, prefix, stream)]
    assert not firsts[0] & firsts[1] and not firsts[0] & firsts[2] and not firsts[1] & firsts[2]


def test_arrivals_are_all_at_once_at_an_infinite_rate_else_seeded_exponential_gaps():
    assert bench.arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    rng = random.Random(7)
    gaps = [rng.expovariate(3.0) for _ in range(4)]
    assert bench.arrival_offsets(4, 3.0, seed=7) == pytest.approx([sum(gaps[:i + 1]) for i in range(4)])
    assert bench.arrival_offsets(4, 3.0, seed=7) == bench.arrival_offsets(4, 3.0, seed=7)


def test_summary_figures_are_vllm_bench_serves_on_fabricated_timings():
    timings = [RequestTiming(sent_s=0.0, first_token_s=0.1, finished_s=1.1, output_tokens=11),  # TPOT 1.0 / 10
               RequestTiming(sent_s=0.0, first_token_s=0.3, finished_s=1.3, output_tokens=6),   # TPOT 1.0 / 5
               RequestTiming(sent_s=1.0, first_token_s=1.2, finished_s=1.2, output_tokens=1)]   # no TPOT
    result = bench.summarize(timings, duration_s=2.0)
    assert result == pytest.approx({
        "completed": 3, "duration": 2.0, "request_throughput": 1.5, "output_throughput": 9.0,
        "median_ttft_ms": 200.0, "p99_ttft_ms": 298.0,  # TTFTs 0.1 0.2 0.3: 0.2 + 0.98 x 0.1 (numpy's linear)
        "median_tpot_ms": 150.0})


def test_vllm_bench_serve_gets_the_anchor_readmes_flags():
    workload = bench.random_burst(64, 256, 64, 1000, seed=0)
    command = bench.vllm_bench_command(bench.Path("/a"), "http://127.0.0.1:9", "smollm2", workload, bench.Path("/r"))
    assert command == ["/a/venv/bin/python", "/a/vllm_cli.py", "bench", "serve", "--backend", "openai",
                       "--endpoint", "/v1/completions", "--base-url", "http://127.0.0.1:9", "--model", "smollm2",
                       "--tokenizer", "/a/smollm2-135m-hf", "--dataset-name", "random", "--random-input-len", "256",
                       "--random-output-len", "64", "--num-prompts", "64", "--request-rate", "inf", "--ignore-eos",
                       "--seed", "0", "--save-result", "--result-dir", "/r", "--result-filename", "result.json"]


def test_the_verdict_checks_each_front_door_against_the_engine_offline_and_vllm_only_where_it_ran():
    burst = bench.random_burst(num_prompts=4, input_len=5, output_len=10, vocab_size=100, seed=0)  # 40 tokens
    prefix = bench.prefix_repetition("prefix", 2, 1, 3, 2, 5, 100, 0)  # 10 tokens
    offline = {"engine_s": 2.0, "engine_prefix_s": 2.0}  # 20 and 5 tok/s
    figures = {"output_throughput": 18.0, "median_ttft_ms": 50.0, "median_tpot_ms": 20.0,
               "cpu_ms_per_token": {"engine": 3.0, "proxy": 0.25}, "idle_cpu_ms_per_token": {"engine": 1.0,
                                                                                             "proxy": 0.125}}
    vllm = {"burst": {**figures, "output_throughput": 15.0}, "prefix": {**figures, "output_throughput": 4.0},
            "stream": figures, "prefix@3/s": {**figures, "median_ttft_ms": 60.0, "median_tpot_ms": 10.0}}
    servers = {"prefixserve direct": {**{name: figures for name in vllm},
                                      "prefix": {**figures, "output_throughput": 4.0}}}
    lines = bench.verdict(servers | {"vLLM": vllm}, offline, burst, prefix, None, "prefix@3/s")
    assert lines == [
        "- prefixserve direct, burst: served / offline 0.90 (met: 0.9)",
        "- prefixserve direct, prefix: served / offline 0.80 (not met: 0.9)",
        *[f"- prefixserve direct, {w}: 0.25 CPU ms per token outside the busiest process (met: 0.3), 0.12 net of "
          "idle (met: 0.15)"
          for w in ("burst", "prefix", "stream", "prefix@3/s")],
        "- prefixserve direct, burst: 1.20x vLLM's output tok/s (met: 1.2x)",
        "- prefixserve direct, prefix: 1.00x vLLM's output tok/s (not met: 1.2x)",
        "- prefixserve direct, stream: 1.00x vLLM's output tok/s (not met: 1.2x)",
        "- prefixserve direct, prefix@3/s median_ttft_ms: 50.0 against vLLM's 60.0 (met: no worse)",
        "- prefixserve direct, prefix@3/s median_tpot_ms: 20.0 against vLLM's 10.0 (not met: no worse)"]
    lines = bench.verdict(servers, offline, burst, prefix, "vLLM skipped: no AVX-512", "prefix@3/s")
    assert lines[-1].endswith("not checkable here. vLLM skipped: no AVX-512.")
    assert len(lines) == 7


def test_the_offline_rows_set_each_all_at_once_workload_against_the_engine_on_its_own_prompts():
    burst = bench.random_burst(num_prompts=4, input_len=5, output_len=10, vocab_size=100, seed=0)  # 40 tokens
    prefix = bench.prefix_repetition("prefix", 2, 1, 3, 2, 5, 100, 0)  # 10 tokens
    figures = {"request_throughput": 1.0, "median_ttft_ms": 50.0, "p99_ttft_ms": 70.0, "median_tpot_ms": 20.0}
    served = {"burst": {**figures, "output_throughput": 16.0, "cpu_ms_per_token": {"engine": 2.0, "proxy": 0.5},
                        "idle_cpu_ms_per_token": {"engine": 0.5, "proxy": 0.2}},
              "prefix": {**figures, "output_throughput": 4.0, "cpu_ms_per_token": {"engine": 3.0}}}
    offline = {"engine_s": 2.0, "engine_prefix_s": 2.0, "projections_s": 1.0, "startup_s": 3.0}
    direct = {workload: {**figures, "output_throughput": 2 * figures["output_throughput"]}
              for workload, figures in served.items()}
    rows = bench.table({"prefixserve ingress": served, "prefixserve direct": direct}, offline, burst, prefix)
    cpu = rows.index("") + 1
    assert rows[cpu:cpu + 7] == [
        "| CPU ms per output token | process | burst | prefix |", "|---|---|---:|---:|",
        "| prefixserve ingress | all | 2.50 | 3.00 |", "| prefixserve ingress | all but the busiest | 0.50 | 0.00 |",
        "| prefixserve ingress | all but the busiest, net of idle | 0.30 | 0.00 |",
        "| prefixserve ingress | engine | 2.00 | 3.00 |", "| prefixserve ingress | proxy | 0.50 | 0.00 |"]
    offline_rows = rows[rows.index("", cpu) + 1:]
    assert offline_rows == [
        "| offline, all at once | prompts | time s | output tok/s | prefixserve ingress / this | "
        "prefixserve direct / this |", "|---|---|---:|---:|---:|---:|",
        "| engine (LLM.generate) | burst | 2.00 | 20.0 | 0.80 | 1.60 |",
        "| engine (LLM.generate) | prefix | 2.00 | 5.0 | 0.80 | 1.60 |",
        "| projections alone | burst | 1.00 | 40.0 | 0.40 | 0.80 |"]


def test_cpu_per_token_adds_up_each_kind_of_process_and_counts_a_new_one_from_zero():
    before = {1: ("ServeReplica:prefixserve:engine", 10.0), 2: ("ProxyActor", 5.0), 3: ("raylet", 1.0)}
    after = {1: ("ServeReplica:prefixserve:engine", 14.0), 2: ("ProxyActor", 6.0), 3: ("raylet", 1.5),
             4: ("ServeReplica:prefixserve:engine", 2.0)}
    assert bench.cpu_ms_per_token(before, after, num_tokens=1000) == {
        "ServeReplica:prefixserve:engine": 6.0, "ProxyActor": 1.0, "raylet": 0.5}
    assert list(bench.cpu_ms_per_token(before, after, 1000)) == ["ServeReplica:prefixserve:engine", "ProxyActor",
                                                                 "raylet"]


@pytest.mark.parametrize("cmdline, label", [
    (["ray::ServeReplica:prefixserve:engine"], "ServeReplica:prefixserve:engine"),
    (["ray::ProxyActor", ""], "ProxyActor"),
    (["/usr/bin/python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"],
     "spawned process (engine core)"),
    (["/venv/bin/python", "-m", "cluster.cli", "serve"], "cluster.cli serve"),
    (["/ray/core/src/ray/gcs/gcs_server", "--flag"], "gcs_server"),
    (["/venv/bin/python3", "-u", "/venv/lib/site-packages/ray/_private/log_monitor.py", "--x=1"], "log_monitor.py"),
])
def test_processes_are_named_by_what_they_run(cmdline, label):
    assert bench.process_label(cmdline) == label


def test_prefixserve_is_served_with_the_stream_interval_front_door_and_engine_core_asked_for():
    args = argparse.Namespace(threads=2, stream_interval_s=0.25, model=None, dtype="bfloat16", device=None,
                              engine_core=None)
    command = bench.prefixserve_command(args, port=8100, front_door="direct")
    assert command[1:] == ["-m", "cluster.cli", "serve", "--replicas", "1", "--replica-cpus", "2", "--host",
                           "127.0.0.1", "--port", "8100", "--stream-interval-s", "0.25", "--front-door", "direct",
                           "--dtype", "bfloat16"]
    args.engine_core = "process"
    assert bench.prefixserve_command(args, port=8100, front_door="ingress")[-2:] == ["--engine-core", "process"]


FAKE_VLLM_BENCH = '''import json, sys, time
result_dir = sys.argv[sys.argv.index("--result-dir") + 1]
print("Starting initial single prompt test run...")
print("Starting main benchmark run...")
time.sleep(0.3)
print("============ Serving Benchmark Result ============")
json.dump({"output_throughput": 12.5}, open(result_dir + "/result.json", "w"))
time.sleep(0.3)
'''


def test_vllm_bench_marks_its_main_run_alone_as_it_prints_its_start_and_its_results(tmp_path):
    """A fake anchor (an empty env.sh, this interpreter, a script that prints vllm bench serve's cues) stands in
    for vLLM's client: the marks come at its cues, not at its start and exit."""
    (tmp_path / "venv/bin").mkdir(parents=True)
    (tmp_path / "venv/bin/python").symlink_to(bench.sys.executable)
    (tmp_path / "env.sh").write_text("")
    (tmp_path / "vllm_cli.py").write_text(FAKE_VLLM_BENCH)
    workload = bench.random_burst(num_prompts=2, input_len=4, output_len=3, vocab_size=100, seed=0)
    marks = {}
    started = bench.time.monotonic()
    result = bench.run_vllm_bench(tmp_path, "http://127.0.0.1:1", "m", workload,
                                  lambda name: marks.setdefault(name, bench.time.monotonic()))
    ended = bench.time.monotonic()
    assert result == {"output_throughput": 12.5}
    assert list(marks) == ["start", "end"]
    assert marks["end"] - marks["start"] >= 0.3 and ended - marks["end"] >= 0.3
    assert marks["start"] > started


def test_a_load_without_a_mark_is_an_error_naming_the_cue_it_lacks():
    assert bench.load_window({"start": (1.0, {}), "end": (2.0, {})}) == ((1.0, {}), (2.0, {}))
    with pytest.raises(RuntimeError, match="no start mark .*'Starting main benchmark run'"):
        bench.load_window({"end": (2.0, {})})
    with pytest.raises(RuntimeError, match="no start and no end mark"):
        bench.load_window({})
