"""The CPU paged-attention kernel on decode batches and prefill chunks, its K/V read from memory as in a real step.

One call per layer over --layers layers' caches of their own (the default model's: 30 layers of 9 query and
3 KV heads of 64), so that no layer finds its K/V in the caches the last one left, with each request's blocks
at random places in the cache (as a served engine's pool hands them out after a while) and in order (as a
fresh pool does). Prints ms per step's attention and the K/V bytes a second it reads, next to the machine's
copy bandwidth, and the multiply-adds a second. --query-len above 1 makes each request a prefill chunk of that
many tokens at the end of its context (64 new tokens over 512 cached: `--query-len 64 --context 576`).
--baseline CHECKOUT builds another checkout's kernels beside this one's and times the two in turn in this
process: the kernel's speedup, free of the machine's drift between runs.

    python benchmarks/bench_cpu_attention.py --threads 2 --batch 16 64 --context 300 1000
    python benchmarks/bench_cpu_attention.py --batch 1 16 --query-len 64 256 --context 576 --baseline /tmp/base
"""
import argparse
import itertools
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.bench_step import copy_bandwidth  # noqa: E402
from benchmarks.timing import timed  # noqa: E402
from kernels.cpu import library  # noqa: E402
from kernels.cpu.attention import kernel_args  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def block_tables(batch: int, blocks_per_request: int, order: str, generator: torch.Generator) -> torch.Tensor:
    num_blocks = batch * blocks_per_request
    ids = torch.randperm(num_blocks, generator=generator) if order == "random" else torch.arange(num_blocks)
    return ids.to(torch.int32).view(batch, blocks_per_request)


def num_scores(batch: int, context: int, query_len: int) -> int:
    """Query-key pairs a step's attention computes in one head of one layer (the causal chunk's included)."""
    return batch * sum(context - query_len + 1 + token for token in range(query_len))


def time_step(batch: int, context: int, query_len: int, order: str, args: argparse.Namespace,
              libraries: list[SimpleNamespace]) -> list[float]:
    """Median seconds of one step's attention (query_len tokens per request, over every layer) on each library's
    kernel, the libraries taking turns."""
    generator = torch.Generator().manual_seed(args.seed)
    blocks_per_request = -(-context // BLOCK_SIZE)
    shape = (batch * blocks_per_request, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [[torch.randn(shape, generator=generator).to(args.dtype) for _ in range(2)]
              for _ in range(args.layers)]
    query = torch.randn(batch * query_len, NUM_HEADS, HEAD_DIM, generator=generator).to(args.dtype)
    tables = block_tables(batch, blocks_per_request, order, generator)
    query_start_loc = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    layers = [kernel_args(query, key_cache, value_cache, tables, query_start_loc, seq_lens, HEAD_DIM ** -0.5)
              for key_cache, value_cache in caches]

    def step(library: SimpleNamespace) -> None:
        for layer in layers:
            library.paged_attention(**layer)

    samples = [[] for _ in libraries]
    for library in libraries:
        step(library)
    for _ in range(args.repeat):
        for library, seconds in zip(libraries, samples):
            seconds.append(timed(step, library)[0])
    return [statistics.median(seconds) for seconds in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--context", type=int, nargs="+", default=[300, 1000], help="tokens each request attends to")
    parser.add_argument("--query-len", type=int, nargs="+", default=[1], help="query tokens a request (1: decodes)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", type=Path, help="another checkout, whose kernel is timed in turn with this one's")
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    libraries = [library.load()]
    if args.baseline:
        libraries.append(library.load(args.baseline / "kernels" / "cpu" / "csrc"))
    bandwidth = copy_bandwidth()
    print(f"{args.dtype}, {args.threads} threads, {args.layers} layers, copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    baseline = " baseline ms | this / baseline |" if args.baseline else ""
    print(f"| batch | query | context | blocks | ms a step | K/V GB/s | of the copy bandwidth | GMAC/s |{baseline}")
    print("|---:|---:|---:|---|---:|---:|---:|---:|" + "---:|---:|" * bool(args.baseline))
    for batch, query_len, context in itertools.product(args.batch, args.query_len, args.context):
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * args.dtype.itemsize * args.layers
        macs = 2 * num_scores(batch, context, query_len) * NUM_HEADS * HEAD_DIM * args.layers  # QK and PV
        for order in ("random", "ordered"):
            seconds, *others = time_step(batch, context, query_len, order, args, libraries)
            row = (f"| {batch} | {query_len} | {context} | {order} | {seconds * 1e3:.2f} | "
                   f"{kv_bytes / seconds / 1e9:.1f} | {kv_bytes / seconds / bandwidth:.0%} | {macs / seconds / 1e9:.0f} |")
            print(row + "".join(f" {other * 1e3:.2f} | {seconds / other:.2f} |" for other in others), flush=True)


if __name__ == "__main__":
    main()
