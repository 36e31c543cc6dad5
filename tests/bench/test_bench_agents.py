"""benchmarks/bench_agents.py: its metrics on hand-made turns, and a tiny simulated run."""
import argparse

from benchmarks.bench_agents import Summary, TurnResult, seeds_report, simulated


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
    # the calibrated step model's (step_model.json) outcomes: a new calibration changes them
    assert table.endswith(f"Pin outcomes under continuum (per-pin trace in {tmp_path / 'continuum'}): 66 released "
                          "before the next turn arrived, 49 hit, 9 expired before the next turn arrived, 1 released "
                          "while the next turn waited")


def test_seeds_report_compares_continuum_with_fcfs_on_each_seed_then_over_the_seeds():
    def summary(policy: str, finished_s: float, next_turn_ttft_s: float, pins=(0, 0, 0, 0)) -> Summary:
        return Summary(policy, [TurnResult("a", 0.0, 1.0, 2.0, 10, 0, 0),
                                TurnResult("a", 4.0, 4.0 + next_turn_ttft_s, finished_s, 20, 10, 10)], pins)

    runs = [(0, [summary("fcfs", 10.0, 2.0), summary("continuum", 5.0, 2.2, (10, 8, 1, 1))]),
            (1, [summary("fcfs", 8.0, 2.0), summary("continuum", 8.0, 1.0, (10, 9, 0, 1))])]
    assert seeds_report("Simulated", runs).splitlines()[2:] == [
        "| seed | mean JCT vs fcfs | next-turn TTFT p99 vs fcfs | pins expired before the next turn |",
        "|---|---|---|---|",
        "| 0 | 2.00x | 1.10x | 10.0% |",
        "| 1 | 1.00x | 0.50x | 0.0% |",
        "| mean | 1.50x | 0.80x | 5.0% |",
        "| min | 1.00x | 0.50x | 0.0% |",
        "| max | 2.00x | 1.10x | 10.0% |",
    ]
