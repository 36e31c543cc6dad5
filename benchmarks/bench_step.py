"""Where one engine step's time goes: decode steps of the default model at a few batch sizes, split
into the model's parts (projections, LM head, attention, norms, ...) and the host's (scheduling, input
preparation, sampling, outputs), next to what the machine's matmul rate and copy bandwidth allow.

    python benchmarks/bench_step.py                          # batches 10 and 64, 256-token prompts
    python benchmarks/bench_step.py --threads 2 --dtype bfloat16 --markdown OUT.md

Each batch runs --batch requests of --prompt-len random tokens (sampled at temperature 1, as a served
request without options), prefills them all, then times --steps decode steps twice: bare (ms/step,
tok/s) and with a timer around each part. A part's time excludes the parts nested in it, except that
the outermost timed part takes what it calls (the LM head's projection counts as the LM head); "other"
is the step's time that no part covers (Python glue between the parts, the embedding, views).
"""
import argparse
import collections
import contextlib
import dataclasses
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.timing import timed  # noqa: E402
from kernels.ops import KernelOps  # noqa: E402
from replica.engine import EngineConfig, EngineCore  # noqa: E402
from replica.executor import model_runner  # noqa: E402
from replica.executor.packed_linear import PackedLinear  # noqa: E402
from replica.request import SamplingParams  # noqa: E402

KERNELS = {"paged_attention": "attention", "write_kv_cache": "KV cache write", "rms_norm": "norms",
           "apply_rotary": "rotary", "silu_and_mul": "activation"}


class PartTimer:
    """Wall time by part; a timed call inside another timed call counts as the outer one's."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._clock = clock
        self._depth = 0

    def wrap(self, fn: Callable, part: str) -> Callable:
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self._clock() - start
                self._depth -= 1
        return timed



@contextlib.contextmanager
def instrumented(core: EngineCore, timer: PartTimer) -> Iterator[None]:
    """The core's step parts timed by timer, within the block."""
    runner, model = core.runner, core.runner.model
    for owner, name, part in [(core.scheduler, "schedule", "scheduling"),
                              (core.scheduler, "update_from_output", "scheduling"),
                              (core, "_make_output", "outputs (detokenizing)"), (runner, "_sample", "sampling"),
                              (model, "compute_logits", "LM head")]:
        setattr(owner, name, timer.wrap(getattr(owner, name), part))
    for module in model.modules():
        if isinstance(module, (PackedLinear, torch.nn.Linear)):
            module.forward = timer.wrap(module.forward, "projections")
        if isinstance(getattr(module, "ops", None), KernelOps):
            module.ops = dataclasses.replace(module.ops, **{name: timer.wrap(getattr(module.ops, name), part)
                                                            for name, part in KERNELS.items()})
    # the layers one module and kernel at a time, so that each part is seen (not in one C++ call)
    with mock.patch.object(model_runner, "prepare_inputs", timer.wrap(model_runner.prepare_inputs,
                                                                       "input preparation")), \
            mock.patch.object(model, "fused_decoder", None):
        yield


def decoding_core(config: EngineConfig, batch: int, prompt_len: int, seed: int) -> EngineCore:
    """A core whose batch requests have all been prefilled and are decoding."""
    core = EngineCore(config)
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    for i in range(batch):
        core.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                         SamplingParams(max_tokens=10_000, ignore_eos=True))
    while any(request.num_computed_tokens < request.num_prompt_tokens for request in core.scheduler.running) or \
            core.scheduler.waiting:
        core.step()
    return core


def time_steps(core: EngineCore, steps: int) -> float:
    return timed(lambda: [core.step() for _ in range(steps)])[0] / steps


def plain_projection_seconds(model, rows: int, dtype: torch.dtype) -> float:
    """What torch's F.linear on plain (unpacked) weights takes for one step's projections at this many rows."""
    q_size, kv_size = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes = [(q_size + 2 * kv_size, model.hidden_size), (model.hidden_size, q_size),
              (2 * model.intermediate_size, model.hidden_size), (model.hidden_size, model.intermediate_size)]
    seconds = 0.0
    for out_features, in_features in shapes:
        x = torch.randn(rows, in_features, dtype=dtype)
        weight = torch.randn(out_features, in_features, dtype=dtype)
        seconds += min(_time(lambda: torch.nn.functional.linear(x, weight), 20) for _ in range(3))
    return seconds * model.num_layers


def copy_bandwidth() -> float:
    """Bytes/s read and written by a 256 MiB copy."""
    src = torch.empty(64 * 2**20, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    seconds = min(_time(lambda: dst.copy_(src), 3) for _ in range(3))
    return 2 * src.numel() * 4 / seconds


def _time(fn: Callable, repeat: int) -> float:
    fn()
    return timed(lambda: [fn() for _ in range(repeat)])[0] / repeat


def measure(config: EngineConfig, batch: int, args: argparse.Namespace) -> dict:
    core = decoding_core(config, batch, args.prompt_len, args.seed)
    time_steps(core, 3)
    bare = time_steps(core, args.steps)
    timer = PartTimer()
    with instrumented(core, timer):
        timed = time_steps(core, args.steps)
    parts = {part: seconds / args.steps for part, seconds in timer.seconds.most_common()}
    parts["other"] = timed - sum(parts.values())
    model = core.model_config
    linear_params = model.num_layers * model.hidden_size * (
        (2 * model.num_heads + 2 * model.num_kv_heads) * model.head_dim + 3 * model.intermediate_size)
    context = args.prompt_len + 3 + args.steps + args.steps // 2  # the mean context over the timed steps
    dtype = core.runner.kv_caches[0][0].dtype
    kv_bytes = batch * context * model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype.itemsize
    core.shutdown()
    return {"batch": batch, "bare_s": bare, "timed_s": timed, "parts": parts, "model": model, "dtype": dtype,
            "model_name": core.model_name,
            "projection_flops": 2 * batch * linear_params, "weight_bytes": linear_params * dtype.itemsize,
            "kv_bytes": kv_bytes}


def report(results: list[dict], machine: str) -> str:
    lines = [machine, ""]
    order = sorted(results[-1]["parts"], key=results[-1]["parts"].get, reverse=True)
    lines.append("| part | " + " | ".join(f"batch {r['batch']}: ms/step (share)" for r in results) + " |")
    lines.append("|---|" + "---|" * len(results))
    for part in order:
        cells = [f"{r['parts'].get(part, 0) * 1e3:.1f} ({r['parts'].get(part, 0) / r['timed_s']:.0%})" for r in results]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines.append("| **step, timed** | " + " | ".join(f"{r['timed_s'] * 1e3:.1f}" for r in results) + " |")
    lines.append("| **step, bare (output tok/s)** | " + " | ".join(
        f"{r['bare_s'] * 1e3:.1f} ({r['batch'] / r['bare_s']:.0f})" for r in results) + " |")
    bandwidth = copy_bandwidth()
    lines += ["", f"The machine: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write of 256 MiB).", ""]
    for r in results:
        projections, attention = r["parts"].get("projections", 0), r["parts"].get("attention", 0)
        memory_bound = r["weight_bytes"] / bandwidth
        compute_bound = plain_projection_seconds(r["model"], r["batch"], r["dtype"])
        lines.append(f"- batch {r['batch']}: projections {projections * 1e3:.1f} ms, "
                     f"{r['projection_flops'] / projections / 1e9:.1f} GFLOP/s, at "
                     f"{max(memory_bound, compute_bound) / projections:.0%} of the larger bound: their weights "
                     f"({r['weight_bytes'] / 2**20:.0f} MiB) at the copy bandwidth {memory_bound * 1e3:.1f} ms, "
                     f"F.linear on the same shapes with weights in cache {compute_bound * 1e3:.1f} ms. Attention "
                     f"{attention * 1e3:.1f} ms for about {r['kv_bytes'] / 2**20:.0f} MiB of K/V, at "
                     f"{r['kv_bytes'] / bandwidth / attention:.0%} of the copy bandwidth.")
    return "\n".join(lines)


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    return f"{name} ({'avx512f' if 'avx512f' in info else 'avx2, no avx512f'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[10, 64])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", help="default: the engine's for this machine")
    parser.add_argument("--model", help="default: the default model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, num_kv_blocks=max(args.batch) * 32)
    results = [measure(config, batch, args) for batch in args.batch]
    text = report(results, f"{cpu()}, torch threads {args.threads}, {results[0]['dtype']}, {results[0]['model_name']}, "
                           f"prompts of {args.prompt_len} tokens, {args.steps} decode steps")
    print(text)
    if args.markdown:
        args.markdown.write_text(f"```\n{' '.join(sys.argv)}\n```\n\n{text}\n")


if __name__ == "__main__":
    main()
