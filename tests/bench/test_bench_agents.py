"""benchmarks/bench_agents.py: its metrics on hand-made turns, and a tiny simulated run."""
import argparse

from benchmarks.bench_agents import Summary, TurnResult, simulated


def test_summary_measures_programs_next_turns_and_recomputed_history():
    turns = [TurnResult("a", 0.0, 1.0, 2.0, 100, 0, 0), TurnResult("a", 5.0, 5.5, 9.0, 150, 96, 110),
             TurnResult("b", 1.0, 3.0, 4.0, 50, 0, 0)]
    summary = Summary("fcfs", turns)
    assert summary.job_completion_s() == [9.0, 3.0]
    assert summary.next_turn_ttft_s() == [0.5]
    assert summary.recomputed_tokens() == 14


def test_a_tiny_simulated_run_finishes_every_turn_under_both_queue_policies(tmp_path):
    args = argparse.Namespace(step_model="calibrated", programs_per_replica=4, replicas=2, seed=0, ramp=5.0,
                              num_blocks=512, pin_trace=str(tmp_path), workload="agents")
    table, summaries = simulated(args)
    assert [summary.queue_policy for summary in summaries] == ["fcfs", "continuum"]
    assert len({len(summary.turns) for summary in summaries}) == 1
    assert "| continuum |" in table
    assert summaries[1].recomputed_tokens() < summaries[0].recomputed_tokens()
    assert table.endswith(f"Pin outcomes under continuum (per-pin trace in {tmp_path / 'continuum'}): 60 released "
                          "before the next turn arrived, 48 hit, 16 expired before the next turn arrived, 1 released "
                          "while the next turn waited")
