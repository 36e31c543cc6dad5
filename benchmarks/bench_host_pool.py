"""The node's KV pool (the second tier) against computing, with the real default model, engines in this process.

    python benchmarks/bench_host_pool.py reload      # a prefix another engine computed: loaded vs computed
    python benchmarks/bench_host_pool.py pressure    # shared prefixes past the device cache: with the pool vs without

reload: engine A computes a prefix (--prefix-lens, random tokens, a fresh one each round); engine B, which shares
A's pool, then answers a request that starts with it and goes on for --suffix-len more tokens, and so does engine
C, which has no pool. TTFT is one generate call of one output token; the greedy tokens of B and C (16 each) must
be equal. pressure: one engine whose device cache holds --device-blocks blocks serves --rounds passes over
--num-prefixes shared prefixes (each request: a prefix and a unique suffix), --batch requests at a time, with a
pool of --pool-gib and without one, alternating; throughput is output tokens over wall time, TTFT from the
request's arrival to its first token. Prints medians and ratios measured in the same run.
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from replica.engine import LLM  # noqa: E402
from replica.request import SamplingParams  # noqa: E402

FIRST_NORMAL_TOKEN = 17  # SmolLM2's ids below this are special tokens
VOCAB = 49152


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_NORMAL_TOKEN, VOCAB) for _ in range(count)]


def first_token_seconds(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - started


def reload(args: argparse.Namespace, pool_path: str) -> None:
    common = {"dtype": "float32", "num_kv_blocks": args.device_blocks}
    with_pool = {**common, "host_pool_gib": args.pool_gib, "host_pool_path": pool_path}
    first, second, alone = LLM(**with_pool), LLM(**with_pool), LLM(**common)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    rng = random.Random(args.seed)
    for prefix_len in args.prefix_lens:
        loaded, computed = [], []
        for _ in range(args.rounds):
            prefix = random_tokens(rng, prefix_len)
            first.generate(prefix, SamplingParams(max_tokens=1))
            prompt = prefix + random_tokens(rng, args.suffix_len)
            loaded.append(first_token_seconds(second, prompt))
            computed.append(first_token_seconds(alone, prompt))
            tokens = [llm.generate(prompt, greedy)[0].token_ids for llm in (second, alone)]
            if tokens[0] != tokens[1]:
                sys.exit(f"prefix of {prefix_len}: loaded and computed tokens differ: {tokens}")
            for llm in (second, alone):
                llm.engine.scheduler.reset_prefix_cache()
        ratio = statistics.median(loaded) / statistics.median(computed)
        print(f"prefix {prefix_len} + {args.suffix_len} tokens: TTFT loaded from the pool "
              f"{statistics.median(loaded) * 1e3:.0f} ms, computed {statistics.median(computed) * 1e3:.0f} ms "
              f"(medians of {args.rounds}), loaded / computed {ratio:.3f}; greedy tokens equal", flush=True)


def serve_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[float, list[float]]:
    """All prompts at once: the wall time, and each request's time to its first token."""
    engine, params = llm.engine, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    first_token: dict[str, float] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.new_token_ids and output.request_id not in first_token:
                first_token[output.request_id] = time.perf_counter() - started
    return time.perf_counter() - started, list(first_token.values())


def pressure(args: argparse.Namespace, pool_path: str) -> None:
    common = {"dtype": "float32", "num_kv_blocks": args.device_blocks}
    engines = {"no pool": LLM(**common),
               "pool": LLM(**common, host_pool_gib=args.pool_gib, host_pool_path=pool_path)}
    rng = random.Random(args.seed)
    prefixes = [random_tokens(rng, args.prefix_lens[0]) for _ in range(args.num_prefixes)]
    batches = [[prefixes[(start + offset) % len(prefixes)] + random_tokens(rng, args.suffix_len)
                for offset in range(args.batch)]
               for start in range(0, args.rounds * len(prefixes), args.batch)]
    results = {name: ([], []) for name in engines}
    for batch in batches:
        for name, llm in engines.items():
            wall_s, ttfts = serve_batch(llm, batch, args.output_len)
            results[name][0].append(wall_s)
            results[name][1].extend(ttfts)
    summary = {}
    for name, (walls, ttfts) in results.items():
        quantiles = statistics.quantiles(ttfts, n=100)
        summary[name] = (len(batches) * args.batch * args.output_len / sum(walls), quantiles[49], quantiles[98])
        print(f"{name}: {summary[name][0]:.1f} output tok/s, TTFT p50 {quantiles[49] * 1e3:.0f} ms, "
              f"p99 {quantiles[98] * 1e3:.0f} ms; prefix cache hits "
              f"{engines[name].engine.stats().prefix_cache_hits} tokens, of them loaded from the pool "
              f"{engines[name].engine.stats().host_pool_hits}", flush=True)
    (throughput, p50, p99), (base_throughput, base_p50, base_p99) = summary["pool"], summary["no pool"]
    print(f"pool / no pool: throughput {throughput / base_throughput:.2f}x, TTFT p50 {p50 / base_p50:.2f}x, "
          f"p99 {p99 / base_p99:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["reload", "pressure"])
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[2000])
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device-blocks", type=int, default=400, help="each engine's KV cache, in blocks of 16")
    parser.add_argument("--pool-gib", type=float, default=1.0)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as directory:
        (reload if args.mode == "reload" else pressure)(args, os.path.join(directory, "pool"))


if __name__ == "__main__":
    main()
