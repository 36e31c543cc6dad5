"""The simulator's step model and its calibration fit: exact values, no timings."""
import json

import pytest

from benchmarks.sim.calibrate import fit
from benchmarks.sim.cluster import SimClock
from benchmarks.sim.replica import SimReplica
from benchmarks.sim.step_model import StepLoad, StepModel, prefill_attention
from replica.kv_cache import hash_token_blocks

BLOCK_SIZE = 16
COEFFICIENTS = {"a": 0.05, "b": 1e-3, "c": 2e-3, "d": 5e-6, "e": 1e-6}


def test_prefill_attention_counts_the_tokens_before_a_chunk_and_half_the_chunk():
    assert prefill_attention(4, 0) == 8
    assert prefill_attention(4, 10) == 48
    # chunking a prompt leaves its attention work as it was
    assert prefill_attention(3, 0) + prefill_attention(5, 3) == prefill_attention(8, 0) == 32


def test_seconds_add_up_every_term():
    model = StepModel(a=0.5, b=0.25, c=2.0, d=0.125, e=0.0625)
    assert model.seconds(StepLoad(prefill_tokens=4, num_decodes=2, decode_context=8, prefill_attention=16)) == 7.5
    assert model.seconds(StepLoad.prefill(4, 10)) == 0.5 + 0.25 * 4 + 0.0625 * 48


def test_gpu_assumed_divides_prefill_attention_as_prefill(tmp_path):
    path = tmp_path / "step_model.json"
    fitted = {"a": 1.0, "b": 4.0, "c": 2.0, "d": 0.5, "e": 8.0}
    path.write_text(json.dumps(fitted))
    assert StepModel.load("calibrated", path) == StepModel(**fitted)
    assert StepModel.load("gpu-assumed", path) == StepModel(a=0.1, b=0.1, c=0.2, d=0.05, e=0.2, name="gpu-assumed")


def _run_step(replica: SimReplica) -> float:
    output, seconds = replica.schedule()
    replica.complete(output)
    return seconds


def test_the_simulator_charges_each_chunk_for_the_tokens_computed_before_it():
    # seconds = prefill attention in a step without decodes, decode context in a step without prefill
    replica = SimReplica("r0", 2048, BLOCK_SIZE, StepModel(a=0.0, b=0.0, c=0.0, d=1.0, e=1.0), SimClock(),
                         max_model_len=16384)
    history = list(range(1000, 11000))  # 10000 tokens: chunks of 8192 and 1808 (max_num_batched_tokens)
    replica.add("a", history, hash_token_blocks(history, BLOCK_SIZE), [1, 2], 0.0, "s", False)
    assert [_run_step(replica) for _ in range(3)] == [8192 * (0 + 4096), 1808 * (8192 + 904), 10001]
    assert not replica.has_work()
    turn = history[:4096] + list(range(20000, 20100))  # its first 4096 tokens cached
    replica.add("b", turn, hash_token_blocks(turn, BLOCK_SIZE), [3], 1.0, "s", True)
    assert _run_step(replica) == 100 * (4096 + 50)


def _rows(loads: list[tuple[int, int, int, float]], scale: list[float]) -> list[tuple]:
    model = StepModel(**COEFFICIENTS)
    return [(*load, model.seconds(StepLoad(*load)) * factor) for load, factor in zip(loads, scale)]


LOADS = [(0, 1, 64, 0.0), (512, 0, 0, prefill_attention(512, 0)), (7000, 0, 0, prefill_attention(7000, 0)),
         (128, 8, 8192, prefill_attention(128, 1024)), (512, 4, 16384, prefill_attention(512, 4096)),
         (0, 4, 16384, 0.0), (8192, 0, 0, 4 * prefill_attention(2048, 0))]


def test_fit_recovers_the_coefficients_of_exact_steps():
    result = fit(_rows(LOADS, [1.0] * len(LOADS)))
    assert {k: result[k] for k in "abcde"} == pytest.approx(COEFFICIENTS, rel=1e-9)
    assert result["rel_error_median"] == pytest.approx(0, abs=1e-9)
    assert result["num_outliers_dropped"] == 0


def test_fit_drops_a_step_that_met_a_busy_machine():
    rows = _rows(LOADS, [1.0] * len(LOADS)) + _rows([(0, 2, 128, 0.0)], [4.0])  # 4x its time
    result = fit(rows)
    assert result["num_outliers_dropped"] == 1
    assert {k: result[k] for k in "abcde"} == pytest.approx(COEFFICIENTS, rel=1e-9)
