"""Measure real engine steps and fit the simulator's step-time model to them.

Runs the real EngineCore (default model, SmolLM2-135M-Instruct, on this machine's CPU) over a grid
of batches: D decoding requests of context C, plus one fresh prompt of P tokens prefilled in the
same step. Each step's wall time is fitted by least squares to

    t = a + b * prefill_tokens + c * num_decode_seqs + d * sum_decode_context_tokens

and the coefficients are written to step_model.json next to this file, with the date and the CPU.
The grid is small so that it runs in minutes on 2 cores shared with other work: the fit
extrapolates to longer prompts linearly (prefill attention's quadratic term is not modelled).

    python -m benchmarks.sim.calibrate      # a few minutes on 2 busy cores
"""
import datetime
import itertools
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from replica.engine import EngineConfig, EngineCore
from replica.request import SamplingParams

from .step_model import cpu_name

OUTPUT = Path(__file__).with_name("step_model.json")
DECODE_SEQS = (1, 24)
CONTEXTS = (64, 256)
PREFILLS = (0, 128, 512)
REPEATS = 2  # the fastest of these is kept: other processes on the machine only ever add time


class Probe:
    """One engine, filled with decoding requests, timed one step at a time."""

    def __init__(self, vocab_seed: int = 0):
        self.core = EngineCore(EngineConfig(num_kv_blocks=1024, max_num_batched_tokens=8192))
        self._rng = random.Random(vocab_seed)
        self._ids = itertools.count()

    def add(self, num_tokens: int, max_tokens: int) -> None:
        prompt = [self._rng.randrange(100, 40000) for _ in range(num_tokens)]  # unique: no prefix hits
        self.core.add_request(f"r{next(self._ids)}", prompt,
                              SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.core.step()
        return time.perf_counter() - start

    def measure(self, num_decode: int, context: int) -> list[tuple[int, int, int, float]]:
        """(prefill tokens, decode seqs, decode context, seconds) rows for one batch of decodes."""
        for _ in range(num_decode):
            self.add(context, max_tokens=10_000)
        self.core.step()  # prefills them all
        rows = []
        for prefill in PREFILLS:
            timings = []
            for _ in range(REPEATS):
                if prefill:
                    self.add(prefill, max_tokens=1)
                timings.append(self.timed_step())
            sum_context = sum(r.num_computed_tokens for r in self.core.scheduler.running
                              if r.num_output_tokens > 1)
            rows.append((prefill, num_decode, sum_context, min(timings)))
            print(rows[-1], flush=True)
        self.core.abort([r.request_id for r in list(self.core.scheduler.running)])
        return rows


def fit(rows: list[tuple[int, int, int, float]]) -> dict[str, float]:
    """Least squares on relative errors, once more without the steps off by more than half:
    those met a busy machine (another process took the core), not a bigger batch."""
    coefficients, errors = _fit(rows)
    kept = [row for row, error in zip(rows, errors) if abs(error) <= 0.5]
    coefficients, errors = _fit(kept)
    return {**dict(zip("abcd", map(float, coefficients))), "rel_error_median": float(np.median(np.abs(errors))),
            "num_outliers_dropped": len(rows) - len(kept)}


def _fit(rows: list[tuple[int, int, int, float]]) -> tuple[np.ndarray, np.ndarray]:
    matrix = np.array([[1.0, p, d, c] for p, d, c, _ in rows])
    seconds = np.array([row[3] for row in rows])
    coefficients, *_ = np.linalg.lstsq(matrix / seconds[:, None], np.ones(len(rows)), rcond=None)
    return coefficients, (matrix @ coefficients - seconds) / seconds


def save(rows: list[tuple[int, int, int, float]], model: str, load_average: tuple[float, ...]) -> dict:
    result = fit(rows)
    result.update(measured=datetime.date.today().isoformat(), cpu=cpu_name(), load_average=load_average,
                  model=model, threads=torch.get_num_threads(), steps=rows,
                  grid={"prefill_tokens": PREFILLS, "decode_seqs": DECODE_SEQS, "contexts": CONTEXTS})
    OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    probe = Probe()
    probe.add(64, 2)
    for _ in range(3):
        probe.core.step()  # warm-up
    rows = [row for num_decode, context in itertools.product(DECODE_SEQS, CONTEXTS)
            for row in probe.measure(num_decode, context)]
    print(json.dumps(save(rows, probe.core.model_name, os.getloadavg()), indent=2))


if __name__ == "__main__":
    main()
