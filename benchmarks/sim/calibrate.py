"""Measure real engine steps and fit the simulator's step-time model to them.

Runs the real EngineCore (default model, SmolLM2-135M-Instruct, on this machine's CPU) over batches
of D decoding requests of C context tokens each (BATCHES, up to 7000 tokens: the model's
max_model_len is 8192). The steps that prefill a batch are measured once each: they are the long
prefills (a 7000-token prompt alone takes about 40 s). Then the batch decodes, alone and with
a prompt of P tokens in the same step that continues the first request's history (its C tokens
cached, attended to by the P), the fastest of REPEATS kept. Each step's load is read from its
scheduler output as the simulator reads it (StepLoad.of), and the wall times are fitted by least
squares on relative errors to

    t = a + b * prefill_tokens + c * num_decode_seqs + d * sum_decode_context_tokens + e * prefill_attention

(prefill_attention: over the step's prefill chunks, tokens * (tokens before them + tokens / 2)),
written to step_model.json next to this file with the date, the CPU, the dtype, the threads and
the load average.

    python -m benchmarks.sim.calibrate      # about 3.5 minutes on 2 quiet cores
"""
import datetime
import itertools
import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from benchmarks.timing import timed
from replica.engine import EngineConfig, EngineCore, resolve_device, resolve_dtype
from replica.request import SamplingParams

from .step_model import StepLoad, cpu_name

OUTPUT = Path(__file__).with_name("step_model.json")
BATCHES = ((1, 64), (8, 64), (1, 1024), (8, 1024), (4, 4096), (1, 7000))  # (decoding requests, context tokens)
PREFILLS = (0, 128, 512)
REPEATS = 3  # the fastest of these is kept: other processes on the machine only ever add time
NUM_KV_BLOCKS = 2048  # the largest batch and a continued history: about 17k tokens
MAX_OUTLIER_ERROR = 0.5

Row = tuple[int, int, int, float, float]  # prefill tokens, decode seqs, decode context, prefill attention, seconds


class Probe:
    """One engine, filled with decoding requests, timed one step at a time."""

    def __init__(self, vocab_seed: int = 0):
        self.core = EngineCore(EngineConfig(num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=8192))
        self._rng = random.Random(vocab_seed)
        self._ids = itertools.count()
        # each step's load is read from the scheduler's output, as the simulator reads it
        self._schedule = self.core.scheduler.schedule
        self.core.scheduler.schedule = self._schedule_and_record
        self._load = StepLoad()

    def _schedule_and_record(self):
        output = self._schedule()
        self._load = StepLoad.of(output, self.core.scheduler.requests)
        return output

    def fresh(self, num_tokens: int) -> list[int]:
        return [self._rng.randrange(100, 40000) for _ in range(num_tokens)]  # unique: no prefix hits

    def add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"r{next(self._ids)}"
        self.core.add_request(request_id, prompt,
                              SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return request_id

    def timed_step(self) -> Row:
        seconds, _ = timed(self.core.step)
        load = self._load
        row = load.prefill_tokens, load.num_decodes, load.decode_context, load.prefill_attention, seconds
        print(row, flush=True)
        return row

    def measure(self, num_decode: int, context: int) -> list[Row]:
        """Rows for one batch of decodes: the steps that prefill it, then each of PREFILLS with it."""
        prompts = [self.fresh(context) for _ in range(num_decode)]
        request_ids = [self.add(prompt, max_tokens=10_000) for prompt in prompts]
        requests = [self.core.scheduler.requests[request_id] for request_id in request_ids]
        rows = []
        while any(request.num_output_tokens == 0 for request in requests):
            rows.append(self.timed_step())
        for prefill in PREFILLS:
            timings = []
            for _ in range(REPEATS):
                if prefill:
                    self.add(prompts[0] + self.fresh(prefill), max_tokens=1)
                timings.append(self.timed_step())
            rows.append(min(timings, key=lambda row: row[-1]))
        self.core.abort(request_ids)
        return rows


def fit(rows: list[Row]) -> dict[str, float]:
    """Least squares on relative errors, once more without the steps off by more than half:
    those met a busy machine (another process took the core), not a bigger batch."""
    coefficients, errors = _fit(rows)
    kept = [row for row, error in zip(rows, errors) if abs(error) <= MAX_OUTLIER_ERROR]
    coefficients, errors = _fit(kept)
    return {**dict(zip("abcde", map(float, coefficients))), "rel_error_median": float(np.median(np.abs(errors))),
            "rel_error_max": float(np.max(np.abs(errors))), "num_outliers_dropped": len(rows) - len(kept)}


def _fit(rows: list[Row]) -> tuple[np.ndarray, np.ndarray]:
    matrix = np.array([[1.0, *row[:-1]] for row in rows])
    seconds = np.array([row[-1] for row in rows])
    coefficients, *_ = np.linalg.lstsq(matrix / seconds[:, None], np.ones(len(rows)), rcond=None)
    return coefficients, (matrix @ coefficients - seconds) / seconds


def save(rows: list[Row], probe: Probe, load_average: dict[str, tuple[float, ...]]) -> dict:
    config = probe.core.config
    result = fit(rows)
    result.update(measured=datetime.datetime.now().isoformat(timespec="minutes"), cpu=cpu_name(),
                  load_average=load_average, model=probe.core.model_name,
                  dtype=str(resolve_dtype(config.dtype, resolve_device(config.device))).removeprefix("torch."),
                  threads=torch.get_num_threads(), steps=rows,
                  grid={"batches": BATCHES, "prefill_tokens": PREFILLS, "repeats": REPEATS})
    OUTPUT.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    probe = Probe()
    probe.add(probe.fresh(64), 2)
    for _ in range(3):
        probe.core.step()  # warm-up
    before = os.getloadavg()
    rows = [row for num_decode, context in BATCHES for row in probe.measure(num_decode, context)]
    load_average = {"before": before, "after": os.getloadavg()}  # after: with this run's own threads
    print(json.dumps(save(rows, probe, load_average), indent=2))


if __name__ == "__main__":
    main()
