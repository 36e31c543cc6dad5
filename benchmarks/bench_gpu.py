"""Throughput on a GPU against the hardware's limits and transformers, all in one run.

    python benchmarks/bench_gpu.py        # nano-vllm's workload, random Qwen3-0.6B-shaped weights, bf16

1. The device: memory bandwidth (a device-to-device copy, bytes read + written) and the bf16
   matmul rate (8192^3), measured here, not taken from a datasheet.
2. prefixserve on nano-vllm's workload (256 sequences, input and output lengths uniform in
   100..1024, greedy, ignore_eos), each setting in a fresh engine: every kernel launched eagerly
   and synchronous scheduling, then decode CUDA graphs with synchronous and with async scheduling.
3. The roofline of that workload: every decode step reads all weights once plus the KV cache of
   every running sequence (all sequences admitted at once, as a batch this size fits), over the
   measured bandwidth; every prompt token costs 2 FLOPs per weight plus causal attention, over
   the measured matmul rate. "x roofline" is that time over the measured time.
4. transformers' generate on the same prompts, left-padded into one batch: it decodes
   max(output_lens) steps for every row, and only the workload's tokens count.
5. torch's profiler over a short run: the kernels and host ops a step spends its time in.
"""
import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_offline import (  # noqa: E402
    StepClock, Workload, bench_prefixserve, make_workload, start_prefixserve)
from benchmarks.random_model import SHAPES, write_random_model  # noqa: E402
from benchmarks.timing import timed  # noqa: E402
from replica.engine import resolve_device, resolve_dtype  # noqa: E402
from replica.request import SamplingParams  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, device: torch.device, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth(device: torch.device, gib: float) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / best_of(lambda: target.copy_(source), device)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int) -> float:
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return 2 * size**3 / best_of(lambda: a @ b, device)


def roofline_s(shape: dict, workload: Workload, dtype: torch.dtype, bandwidth: float, flops: float) -> dict:
    hidden, ffn, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q_size, kv_size = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    matmul_params = layers * (hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * ffn)
    matmul_params += shape["vocab_size"] * hidden  # the LM head (read once per step, tied or not)
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes_per_token = 2 * layers * kv_size * itemsize
    prompt_lens = list(map(len, workload.prompts))
    decode_s = 0.0
    for step in range(1, max(workload.output_lens)):
        context = sum(length + step for length, out in zip(prompt_lens, workload.output_lens) if out > step)
        decode_s += (matmul_params * itemsize + context * kv_bytes_per_token) / bandwidth
    attention_flops = 2 * layers * q_size * sum(length * length for length in prompt_lens)  # QK^T and PV, causal
    prefill_s = (2 * matmul_params * sum(prompt_lens) + attention_flops) / flops
    return {"decode_s": decode_s, "prefill_s": prefill_s, "weights_gb": matmul_params * itemsize / 1e9,
            "decode_tokens": workload.num_output_tokens - len(prompt_lens)}


SETTINGS = [{"enforce_eager": True, "async_scheduling": False}, {"enforce_eager": False, "async_scheduling": False},
            {"enforce_eager": False, "async_scheduling": True}]


def run_engine(args: argparse.Namespace, model: str, workload: Workload, setting: dict) -> dict:
    llm, startup = start_prefixserve(args, model, workload, **setting)
    clock = StepClock(llm)
    elapsed = bench_prefixserve(llm, workload)
    result = {**setting, "elapsed_s": elapsed, "startup_s": startup,
              "steps": clock.num_steps, "host_ms_per_step": 1e3 * clock.host_s / clock.num_steps,
              "model_ms_per_step": 1e3 * clock.model_s / clock.num_steps,
              "critical_host_ms_per_step": 1e3 * (elapsed - clock.model_s) / clock.num_steps}
    if args.profile and setting == SETTINGS[1]:
        profile(llm, workload)
    del llm, clock
    free_device_memory()
    return result


def profile(llm, workload: Workload) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    prompts = [prompt[:256] for prompt in workload.prompts[:64]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        llm.generate(prompts, params)
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(f"\nprofile: 64 prompts x 256 tokens, 32 output tokens each, by {sort_by}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=18, max_name_column_width=60))


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_transformers(model: str, workload: Workload, dtype: torch.dtype, device: torch.device) -> float:
    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    width = max(map(len, workload.prompts))
    input_ids = torch.zeros(len(workload.prompts), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(workload.prompts):  # left padding
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    steps = max(workload.output_lens)
    with torch.inference_mode():
        hf_model.generate(input_ids[:2], attention_mask=attention_mask[:2], max_new_tokens=4, do_sample=False)
        synchronize(device)
        elapsed, output = timed(hf_model.generate, input_ids, attention_mask=attention_mask, do_sample=False,
                                max_new_tokens=steps, min_new_tokens=steps)
    assert output.shape[1] == width + steps
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-model", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024, help="lengths uniform in 100..max-len")
    parser.add_argument("--kv-cache-gib", type=float, default=48.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth probe")
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--profile", action="store_true", help="torch profiler over a short run")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.workload, args.backend = "nano-vllm", "auto"
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype, torch.device("cpu"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "dtype": args.dtype, "torch": torch.__version__,
              "bandwidth_gbs": memory_bandwidth(device, args.copy_gib) / 1e9,
              "matmul_tflops": matmul_rate(device, dtype, args.matmul_size) / 1e12}
    print(f"{name}: copy {report['bandwidth_gbs']:.0f} GB/s, {args.dtype} matmul {report['matmul_tflops']:.3g} TFLOP/s")
    with tempfile.TemporaryDirectory() as scratch:
        model = str(write_random_model(Path(scratch, args.random_model), args.random_model, seed=args.seed))
        workload = make_workload(args, SHAPES[args.random_model]["vocab_size"])
        report["roofline"] = roofline_s(SHAPES[args.random_model], workload, dtype,
                                        report["bandwidth_gbs"] * 1e9, report["matmul_tflops"] * 1e12)
        report["runs"] = [run_engine(args, model, workload, setting) for setting in SETTINGS]
        if not args.skip_hf:
            report["transformers_s"] = run_transformers(model, workload, dtype, device)
    print_report(report, workload)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def print_report(report: dict, workload: Workload) -> None:
    roof = report["roofline"]
    roof_s = roof["decode_s"] + roof["prefill_s"]
    tokens = workload.num_output_tokens
    print(f"\n{len(workload.prompts)} prompts, {sum(map(len, workload.prompts))} prompt tokens, {tokens} output "
          f"tokens; {report['dtype']} on {report['device']}, torch {report['torch']}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"roofline: decode {roof['decode_s']:.2f} s ({roof['weights_gb']:.2f} GB of weights a step + KV), "
          f"prefill {roof['prefill_s']:.2f} s -> {tokens / roof_s:.0f} output tok/s at most")
    print(f"\n{'prefixserve':<30}{'time s':>9}{'output tok/s':>14}{'x roofline':>12}{'steps':>7}"
          f"{'host ms/step':>14}{'model ms/step':>15}{'critical host ms/step':>23}")
    for run in report["runs"]:
        print(f"{label(run):<30}{run['elapsed_s']:>9.2f}{tokens / run['elapsed_s']:>14.1f}"
              f"{roof_s / run['elapsed_s']:>12.2f}{run['steps']:>7}{run['host_ms_per_step']:>14.2f}"
              f"{run['model_ms_per_step']:>15.2f}{run['critical_host_ms_per_step']:>23.2f}")
    if "transformers_s" in report:
        elapsed = report["transformers_s"]
        print(f"{'transformers generate':<30}{elapsed:>9.2f}{tokens / elapsed:>14.1f}{roof_s / elapsed:>12.2f}")
        for run in report["runs"]:
            print(f"prefixserve, {label(run)}: {elapsed / run['elapsed_s']:.2f}x transformers")


def label(run: dict) -> str:
    launches = "eager" if run["enforce_eager"] else "CUDA graphs"
    return f"{launches}, {'async' if run['async_scheduling'] else 'sync'} scheduling"


if __name__ == "__main__":
    main()
