"""How long one engine step takes, from what the scheduler put in it.

The default model is fitted to real engine steps by calibrate.py (step_model.json). The
"gpu-assumed" profile is NOT measured: it divides the calibrated coefficients by fixed factors
(prefill 40x, decode and fixed costs 10x) to stand for an accelerator where prefill is
compute-bound and a step's fixed cost is small. Use it only as labelled: an assumption.
"""
import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from replica.scheduler import SchedulerOutput

CALIBRATION = Path(__file__).with_name("step_model.json")
_GPU_ASSUMED_SPEEDUP = {"a": 10.0, "b": 40.0, "c": 10.0, "d": 10.0}


@dataclass(frozen=True)
class StepModel:
    a: float  # seconds per step
    b: float  # per prefill token
    c: float  # per decoding sequence
    d: float  # per context token a decoding sequence attends to
    name: str = "calibrated"

    @classmethod
    def load(cls, profile: str = "calibrated", path: Path = CALIBRATION) -> "StepModel":
        fitted = json.loads(path.read_text())
        model = cls(fitted["a"], fitted["b"], fitted["c"], fitted["d"])
        if profile == "calibrated":
            return model
        if profile == "gpu-assumed":
            return cls(*(getattr(model, k) / _GPU_ASSUMED_SPEEDUP[k] for k in "abcd"), name=profile)
        raise ValueError(f"unknown step model {profile!r}: calibrated or gpu-assumed")

    def seconds(self, prefill_tokens: int, num_decodes: int, decode_context: int) -> float:
        return max(self.a + self.b * prefill_tokens + self.c * num_decodes + self.d * decode_context, 1e-4)

    def step_seconds(self, output: SchedulerOutput, requests: dict) -> float:
        """Decodes are requests scheduled for one token past their prompt; everything else is prefill."""
        prefill = num_decodes = context = 0
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[request_id]
            if num_tokens == 1 and request.num_output_tokens > 0:
                num_decodes += 1
                context += request.num_computed_tokens
            else:
                prefill += num_tokens
        return self.seconds(prefill, num_decodes, context)


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()
