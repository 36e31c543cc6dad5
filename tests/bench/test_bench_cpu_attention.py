"""benchmarks/bench_cpu_attention.py: the multiply-adds it counts, and libraries timed in turn."""
import argparse
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_cpu_attention import num_scores, time_step
from kernels.cpu import library

pytestmark = pytest.mark.skipif(not library.available(), reason="no C++ compiler to build the CPU kernels")


def test_a_chunk_scores_each_token_against_the_context_up_to_it():
    # 3 tokens at positions 7, 8 and 9 of a 10-token context see 8, 9 and 10 positions; decodes see it all
    assert num_scores(2, 10, 3) == 2 * (8 + 9 + 10)
    assert num_scores(4, 300, 1) == 4 * 300


def test_each_library_runs_every_layer_of_every_repeat():
    calls = []
    fake_library = SimpleNamespace(paged_attention=lambda **args: calls.append(args["seq_lens"].tolist()))
    args = argparse.Namespace(seed=0, layers=3, dtype=torch.float32, repeat=2)
    seconds = time_step(2, 20, 4, "random", args, [library.load(), fake_library])
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert calls == [[20, 20]] * 3 * (1 + 2)  # a warm-up step, then the repeats
