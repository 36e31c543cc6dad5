"""Offline throughput: prefixserve's LLM vs Hugging Face transformers generate, same prompts, same process.

    python benchmarks/bench_offline.py                      # 64 prompts x 256 tokens, 64 output tokens each
    python benchmarks/bench_offline.py --dtype float32 --skip-hf

Prompts are random token ids (no shared prefixes), generation ignores EOS, greedy. Throughput is
output tokens / wall time of the whole generate call (prefill included), as vLLM's
benchmark_throughput reports it.
"""
import argparse
import logging
import os
import random
import time

import torch

from replica.engine import LLM, resolve_dtype
from replica.executor.checkpoint import default_model_path
from replica.request import SamplingParams


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    first_normal_token = 17  # SmolLM2's ids below this are special tokens
    return [[rng.randrange(first_normal_token, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


def bench_prefixserve(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, torch.dtype]:
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(output.token_ids) == args.output_len for output in outputs)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    return elapsed, dtype


def bench_transformers(args: argparse.Namespace, prompts: list[list[int]], dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    input_ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        model.generate(input_ids[:2], max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=args.output_len, min_new_tokens=args.output_len)
        elapsed = time.perf_counter() - start
    assert output.shape[1] - input_ids.shape[1] == args.output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: the engine's default for this CPU")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "torch"], help="kernel backend")
    parser.add_argument("--skip-hf", action="store_true", help="only run prefixserve")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    load_before = os.getloadavg()[0]
    prompts = make_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    num_output_tokens = args.num_prompts * args.output_len
    ours, dtype = bench_prefixserve(args, prompts)
    rows = [(f"prefixserve ({args.backend})", ours)]
    if not args.skip_hf:
        rows.append(("transformers generate", bench_transformers(args, prompts, dtype)))

    print(f"\n{args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} output tokens each, "
          f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
          f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'engine':<24}{'time s':>9}{'output tok/s':>14}{'total tok/s':>13}{'ours x':>9}")
    for name, elapsed in rows:
        total_tokens = num_output_tokens + args.num_prompts * args.input_len
        print(f"{name:<24}{elapsed:>9.2f}{num_output_tokens / elapsed:>14.1f}{total_tokens / elapsed:>13.1f}"
              f"{elapsed / ours:>9.2f}")


if __name__ == "__main__":
    main()
