"""Offline throughput: prefixserve's LLM against baselines run in the same run on the same prompts.

    python benchmarks/bench_offline.py      # 64 prompts x 256 tokens, 64 output tokens each, vs transformers
    python benchmarks/bench_offline.py --vllm-python VENV/bin/python --vllm-model HF_DIR   # vLLM as well
    python benchmarks/bench_offline.py --workload nano-vllm --random-model qwen3-0.6b --device cuda --skip-hf
    python benchmarks/bench_offline.py --async-scheduling   # synchronous vs async scheduling, alternating

Workloads: "fixed" (--num-prompts prompts of --input-len tokens, --output-len output tokens each)
and "nano-vllm" (nano-vllm's bench.py: 256 sequences, input and output lengths uniform in
100..1024; --num-prompts and --max-len shrink it for a smoke run). Prompts are random token ids
(no shared prefixes); generation is greedy and ignores EOS. Throughput is output tokens / wall
time of one generate call over all prompts (prefill included), as vLLM's benchmark_throughput
reports it. transformers runs in this process (fixed workload only: its generate takes one
output length); vLLM runs in its own interpreter (benchmarks/vllm_offline.py), given an HF
directory of the same model.
"""
import argparse
import json
import logging
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.timing import timed  # noqa: E402
from replica.engine import LLM, resolve_device, resolve_dtype  # noqa: E402
from replica.executor.checkpoint import default_model_path, load_checkpoint  # noqa: E402
from replica.executor.packed_linear import PackedLinear  # noqa: E402
from replica.request import SamplingParams  # noqa: E402

FIRST_NORMAL_TOKEN = 17  # SmolLM2's ids below this are special tokens


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_tokens(self) -> int:
        return self.num_output_tokens + sum(map(len, self.prompts))


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    if args.workload == "nano-vllm":
        num_prompts = args.num_prompts or 256
        input_lens = [rng.randint(100, args.max_len) for _ in range(num_prompts)]
        output_lens = [rng.randint(100, args.max_len) for _ in range(num_prompts)]
    else:
        num_prompts = args.num_prompts or 64
        input_lens, output_lens = [args.input_len] * num_prompts, [args.output_len] * num_prompts
    prompts = [[rng.randrange(FIRST_NORMAL_TOKEN, vocab_size) for _ in range(length)] for length in input_lens]
    return Workload(prompts, output_lens)


def bench_prefixserve(llm: LLM, workload: Workload) -> float:
    params = [SamplingParams(max_tokens=length, temperature=0, ignore_eos=True) for length in workload.output_lens]
    elapsed, outputs = timed(llm.generate, workload.prompts, params)
    assert [len(output.token_ids) for output in outputs] == workload.output_lens
    return elapsed


class StepClock:
    """Seconds an engine spends in the host's work of a step (scheduling, then stop checks and
    detokenizing) and in the model runner, over its steps: what async scheduling overlaps."""

    def __init__(self, llm: LLM):
        engine = llm.engine
        self.reset()
        engine.scheduler.schedule = self._timed(engine.scheduler.schedule, "host_s", counts_step=True)
        engine._update = self._timed(engine._update, "host_s")
        engine.runner.execute_model = self._timed(engine.runner.execute_model, "model_s")

    def reset(self) -> None:
        self.host_s = self.model_s = 0.0
        self.num_steps = 0

    def _timed(self, fn, total: str, counts_step: bool = False):
        def timed_fn(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)
                self.num_steps += counts_step
        return timed_fn


def bench_async_scheduling(args: argparse.Namespace, model: str | None, workload: Workload) -> None:
    """Synchronous against async scheduling, alternating, on the same prompts: throughput, and per
    step the host's work, the model's, and what of the host's work stays on the critical path
    (wall minus model: all of it when synchronous, the part the model does not hide when async)."""
    engines = {mode: start_prefixserve(args, model, workload, async_scheduling=mode == "async")[0]
               for mode in ("sync", "async")}
    clocks = {mode: StepClock(llm) for mode, llm in engines.items()}
    results = {mode: [] for mode in engines}
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            clock = clocks[mode]
            clock.reset()
            elapsed = bench_prefixserve(llm, workload)
            results[mode].append((elapsed, clock.host_s, clock.model_s, clock.num_steps))
            llm.engine.scheduler.reset_prefix_cache()
    print(f"\n{'scheduling':<12}{'round':>6}{'time s':>9}{'output tok/s':>14}{'vs sync':>9}{'steps':>7}"
          f"{'host ms/step':>14}{'model ms/step':>15}{'critical host ms/step':>23}")
    for round_index in range(args.rounds):
        sync_elapsed = results["sync"][round_index][0]
        for mode in engines:
            elapsed, host_s, model_s, num_steps = results[mode][round_index]
            per_step = 1e3 / num_steps
            print(f"{mode:<12}{round_index + 1:>6}{elapsed:>9.2f}{workload.num_output_tokens / elapsed:>14.1f}"
                  f"{sync_elapsed / elapsed:>9.2f}{num_steps:>7}{host_s * per_step:>14.2f}"
                  f"{model_s * per_step:>15.2f}{(elapsed - model_s) * per_step:>23.2f}")


def bench_projection_floor(llm: LLM, workload: Workload, max_num_batched_tokens: int) -> float:
    """The model's projections and LM head alone, on random rows shaped like the workload's steps
    (prompts in chunks of the token budget, then one decode row per prompt and step): the time no
    attention kernel, sampler or scheduler work could go below."""
    model = llm.engine.runner.model
    layers = [module for module in model.model.modules() if isinstance(module, (PackedLinear, nn.Linear))]
    num_prompt_tokens, batch = sum(map(len, workload.prompts)), len(workload.prompts)
    prefill_rows = [max_num_batched_tokens] * (num_prompt_tokens // max_num_batched_tokens)
    prefill_rows += [num_prompt_tokens % max_num_batched_tokens] if num_prompt_tokens % max_num_batched_tokens else []
    steps = max(workload.output_lens)
    dtype, device = model.lm_head_weight.dtype, model.lm_head_weight.device
    inputs = {(rows, width): torch.randn(rows, width, dtype=dtype, device=device)
              for rows in {*prefill_rows, batch} for width in {layer.in_features for layer in layers}}
    with torch.inference_mode():
        start = time.perf_counter()
        for rows in prefill_rows + [batch] * (steps - 1):
            for layer in layers:
                layer(inputs[rows, layer.in_features])
        for _ in range(steps):
            model.compute_logits(inputs[batch, model.config.hidden_size])
        return time.perf_counter() - start


def bench_transformers(model: str | None, workload: Workload, dtype: torch.dtype, device: torch.device) -> float:
    from transformers import AutoModelForCausalLM
    path = Path(model) if model else default_model_path()
    gguf = {"gguf_file": path.name} if path.is_file() else {}
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent if gguf else path), dtype=dtype, **gguf)
    hf_model = hf_model.to(device).eval()
    input_ids = torch.tensor(workload.prompts, device=device)  # equal lengths: no padding needed
    output_len = workload.output_lens[0]
    with torch.inference_mode():
        hf_model.generate(input_ids[:2], attention_mask=torch.ones_like(input_ids[:2]), max_new_tokens=4,
                          do_sample=False)  # warm-up
        elapsed, output = timed(hf_model.generate, input_ids, attention_mask=torch.ones_like(input_ids),
                                do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len)
    assert output.shape[1] - input_ids.shape[1] == output_len
    return elapsed


def bench_vllm(args: argparse.Namespace, workload: Workload) -> tuple[float, dict]:
    """Runs benchmarks/vllm_offline.py in vLLM's interpreter."""
    with tempfile.TemporaryDirectory() as scratch:
        request, report = Path(scratch, "request.json"), Path(scratch, "report.json")
        request.write_text(json.dumps({
            "model": args.vllm_model, "prompts": workload.prompts, "output_lens": workload.output_lens,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}))
        driver = Path(__file__).with_name("vllm_offline.py")
        subprocess.run([*shlex.split(args.vllm_python), str(driver), str(request), str(report)], check=True)
        result = json.loads(report.read_text())
    return result["generate_s"], result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["fixed", "nano-vllm"], default="fixed")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: 64 (fixed), 256 (nano-vllm)")
    parser.add_argument("--input-len", type=int, default=256, help="fixed workload")
    parser.add_argument("--output-len", type=int, default=64, help="fixed workload")
    parser.add_argument("--max-len", type=int, default=1024, help="nano-vllm workload: lengths in 100..max-len")
    model_group = parser.add_mutually_exclusive_group()
    model_group.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    model_group.add_argument("--random-model", choices=["qwen3-0.6b", "tiny"], help="random weights of this shape")
    parser.add_argument("--dtype", default=None, help="default: the engine's default for the device")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "cpu", "torch"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size, for every engine")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--vllm-python", help="python of an environment with vLLM, as a command line "
                        "(`env VAR=... VENV/bin/python` sets its environment): adds a vLLM row")
    parser.add_argument("--vllm-model", help="HF directory of the same model, for vLLM")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="instead: synchronous against async scheduling, --rounds times each, alternating")
    parser.add_argument("--rounds", type=int, default=3, help="with --async-scheduling")
    args = parser.parse_args()
    if args.vllm_python and not args.vllm_model:
        parser.error("--vllm-python needs --vllm-model")
    if args.max_len < 100:
        parser.error("--max-len must be at least 100")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if args.random_model:
            from benchmarks.random_model import write_random_model
            model = str(write_random_model(Path(scratch, args.random_model), args.random_model))
        run(args, model)


def run(args: argparse.Namespace, model: str | None) -> None:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    workload = make_workload(args, load_checkpoint(model).config.vocab_size)
    load_before = os.getloadavg()[0]
    if args.async_scheduling:
        bench_async_scheduling(args, model, workload)
        print_setting(args, workload, dtype, device, load_before)
        return
    llm, startup = start_prefixserve(args, model, workload)
    ours = bench_prefixserve(llm, workload)
    rows = [(f"prefixserve ({args.backend})", ours, f"start-up {startup:.0f} s")]
    if args.workload == "fixed":
        floor = bench_projection_floor(llm, workload, args.max_num_batched_tokens)
        rows.append(("projections alone", floor, "a floor: the same matmuls, nothing else"))
    if not args.skip_hf and args.workload == "fixed":
        rows.append(("transformers generate", bench_transformers(model, workload, dtype, device), ""))
    if args.vllm_python:
        elapsed, report = bench_vllm(args, workload)
        rows.append((f"vLLM {report['vllm_version']}", elapsed, f"start-up {report['startup_s']:.0f} s"))
    print_setting(args, workload, dtype, device, load_before)
    print_table(rows, workload)


def print_setting(args: argparse.Namespace, workload: Workload, dtype: torch.dtype, device: torch.device,
                  load_before: float) -> None:
    print(f"\n{len(workload.prompts)} prompts ({args.workload}), {sum(map(len, workload.prompts))} prompt tokens, "
          f"{workload.num_output_tokens} output tokens; {str(dtype).removeprefix('torch.')} on {device}, "
          f"{torch.get_num_threads()} threads, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")


def start_prefixserve(args: argparse.Namespace, model: str | None, workload: Workload,
                      **engine_args) -> tuple[LLM, float]:
    """The engine, warmed up on two reversed prompts (no prefix-cache hits later), and the seconds that took."""
    start = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
              backend=args.backend, kv_cache_memory_gib=args.kv_cache_gib, **engine_args)
    llm.generate([prompt[::-1] for prompt in workload.prompts[:2]], SamplingParams(max_tokens=4, temperature=0))
    return llm, time.perf_counter() - start


def print_table(rows: list[tuple[str, float, str]], workload: Workload) -> None:
    ours = rows[0][1]
    print(f"{'engine':<24}{'time s':>9}{'output tok/s':>14}{'total tok/s':>13}{'ours x':>9}  note")
    for name, elapsed, note in rows:
        print(f"{name:<24}{elapsed:>9.2f}{workload.num_output_tokens / elapsed:>14.1f}"
              f"{workload.num_tokens / elapsed:>13.1f}{elapsed / ours:>9.2f}  {note}")


if __name__ == "__main__":
    main()
