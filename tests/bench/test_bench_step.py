"""benchmarks/bench_step.py: the part timer's accounting, and every part of a real step timed."""
import argparse

import pytest

from benchmarks.bench_step import KERNELS, PartTimer, measure
from benchmarks.random_model import write_random_model
from replica.engine import EngineConfig


def test_a_timed_call_inside_another_counts_as_the_outer_part():
    timer = PartTimer(clock=iter([0.0, 3.0, 10.0, 10.5]).__next__)
    inner = timer.wrap(lambda x: x + 1, "inner")
    outer = timer.wrap(lambda x: inner(x) * 2, "outer")
    assert (outer(1), inner(1)) == (4, 2)
    assert timer.seconds == {"outer": 3.0, "inner": 0.5}


def test_every_part_of_a_decode_step_is_timed_and_other_is_the_rest(tmp_path):
    config = EngineConfig(model=str(write_random_model(tmp_path / "tiny", "tiny")), dtype="float32",
                          num_kv_blocks=64)
    args = argparse.Namespace(prompt_len=20, steps=2, seed=0)
    result = measure(config, 3, args)
    assert set(result["parts"]) == {"scheduling", "outputs (detokenizing)", "sampling", "LM head", "projections",
                                    "input preparation", "other", *KERNELS.values()}
    assert sum(result["parts"].values()) == pytest.approx(result["timed_s"], rel=1e-9)
    assert result["projection_flops"] == 2 * 3 * 2 * 128 * ((2 * 4 + 2 * 2) * 32 + 3 * 256)
    assert result["weight_bytes"] == 2 * 128 * ((2 * 4 + 2 * 2) * 32 + 3 * 256) * 4
    assert result["kv_bytes"] == 3 * (20 + 3 + 2 + 1) * 2 * 2 * 2 * 32 * 4
