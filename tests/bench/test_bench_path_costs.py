"""bench_path_costs.py's arithmetic: CPU by process label between two readings, and the report's ratios."""
import argparse

from benchmarks.bench_path_costs import cpu_by_label, prompts, report


def test_cpu_is_summed_by_label_over_the_processes_in_both_readings():
    before = {1: ("gcs_server", 1.0), 2: ("ServeReplica:app:engine", 2.0), 3: ("ServeReplica:app:engine", 0.5)}
    after = {1: ("gcs_server", 1.25), 2: ("ServeReplica:app:engine", 2.5), 3: ("ServeReplica:app:engine", 1.0),
             4: ("haproxy", 9.0)}  # started between the readings: its CPU is not the window's alone
    assert cpu_by_label(before, after) == {"gcs_server": 0.25, "ServeReplica:app:engine": 1.0}


def test_prompts_are_fixed_by_the_seed_and_inside_the_vocabulary():
    first = prompts(3, 16, 100, seed=7)
    assert first == prompts(3, 16, 100, seed=7) != prompts(3, 16, 100, seed=8)
    assert [len(prompt) for prompt in first] == [16, 16, 16]
    assert all(0 <= token < 100 for prompt in first for token in prompt)


def test_the_report_gives_each_path_against_the_engine_in_process():
    args = argparse.Namespace(threads=2, dtype=None, prompt_tokens=16, gap_s=0.02)
    served = {"via HAProxy": [0.02, 0.03, 0.025], "straight to the engine replica": [0.015] * 3,
              "the router's route call": None,
              "idle_ms_per_s": {"gcs_server": 12.0, "haproxy": 0.0},
              "request_ms": {"gcs_server": 0.04, "haproxy": 0.9}}
    lines = report(args, [0.010, 0.0125, 0.0125], served)
    assert "| engine in-process (EngineCore) | 12.50 | 12.50 | 1.00x |" in lines
    assert "| via HAProxy | 25.00 | 30.00 | 2.00x |" in lines
    assert "| straight to the engine replica | 15.00 | 15.00 | 1.20x |" in lines
    assert not any("route call" in line for line in lines)
    assert lines[-3:] == ["| all | 12.0 | 0.94 |", "| gcs_server | 12.0 | 0.04 |", "| haproxy | 0.0 | 0.90 |"]
