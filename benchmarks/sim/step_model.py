"""How long one engine step takes, from what the scheduler put in it.

The default model is fitted to real engine steps by calibrate.py (step_model.json). The
"gpu-assumed" profile is NOT measured: it divides the calibrated coefficients by fixed factors
(prefill and prefill attention 40x, decode and fixed costs 10x) to stand for an accelerator where
prefill is compute-bound and a step's fixed cost is small. Use it only as labelled: an assumption.
"""
import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from replica.scheduler import SchedulerOutput

CALIBRATION = Path(__file__).with_name("step_model.json")
_GPU_ASSUMED_SPEEDUP = {"a": 10.0, "b": 40.0, "c": 10.0, "d": 10.0, "e": 40.0}


def prefill_attention(num_tokens: int, num_computed_before: int) -> float:
    """The attention work of a prefill chunk: each of its tokens attends to the tokens before the
    chunk and, on average, to half the chunk. A prompt's chunks add up to the same work however it
    is chunked: num_tokens * (num_computed_before + num_tokens / 2) of the whole."""
    return num_tokens * (num_computed_before + num_tokens / 2)


@dataclass(frozen=True)
class StepLoad:
    """What a step's duration depends on."""
    prefill_tokens: int = 0
    num_decodes: int = 0
    decode_context: int = 0  # context tokens the decoding sequences attend to, summed
    prefill_attention: float = 0.0  # prefill_attention() summed over the step's prefill chunks

    @classmethod
    def prefill(cls, num_tokens: int, num_computed_before: int = 0) -> "StepLoad":
        return cls(prefill_tokens=num_tokens, prefill_attention=prefill_attention(num_tokens, num_computed_before))

    @classmethod
    def of(cls, output: SchedulerOutput, requests: dict) -> "StepLoad":
        """The load of a step just scheduled: the scheduler has already advanced each request's
        num_computed_tokens by its tokens in the step. Decodes are requests scheduled for one token
        past their prompt; everything else is prefill."""
        prefill = num_decodes = context = 0
        attention = 0.0
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[request_id]
            if num_tokens == 1 and request.num_output_tokens > 0:
                num_decodes += 1
                context += request.num_computed_tokens
            else:
                prefill += num_tokens
                attention += prefill_attention(num_tokens, request.num_computed_tokens - num_tokens)
        return cls(prefill, num_decodes, context, attention)


@dataclass(frozen=True)
class StepModel:
    a: float  # seconds per step
    b: float  # per prefill token
    c: float  # per decoding sequence
    d: float  # per context token a decoding sequence attends to
    e: float = 0.0  # per unit of prefill attention (see prefill_attention)
    name: str = "calibrated"

    @classmethod
    def load(cls, profile: str = "calibrated", path: Path = CALIBRATION) -> "StepModel":
        fitted = json.loads(path.read_text())
        model = cls(*(fitted[k] for k in "abcde"))
        if profile == "calibrated":
            return model
        if profile == "gpu-assumed":
            return cls(*(getattr(model, k) / _GPU_ASSUMED_SPEEDUP[k] for k in "abcde"), name=profile)
        raise ValueError(f"unknown step model {profile!r}: calibrated or gpu-assumed")

    def seconds(self, load: StepLoad) -> float:
        return max(self.a + self.b * load.prefill_tokens + self.c * load.num_decodes + self.d * load.decode_context
                   + self.e * load.prefill_attention, 1e-4)

    def step_seconds(self, output: SchedulerOutput, requests: dict) -> float:
        return self.seconds(StepLoad.of(output, requests))


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
