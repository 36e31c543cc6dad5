"""Routing policies end to end: prefix routing against round_robin and least_loaded.

Workload: --systems distinct system prompts of --system-words words (about 700 tokens each),
each followed by --turns different user turns, sent in one seeded shuffled order by
--concurrency streaming clients; every request generates --max-tokens tokens (ignore_eos). The
KV pool per replica (--num-kv-blocks) holds a little less than all the system prompts: sent to
every replica they evict one another, kept each on one replica (half of them per replica) they
all stay cached.

Starts a local Ray cluster and deploys the app once per policy (fresh replicas, cold caches),
then runs the same workload against each. Per policy it prints the prefix-cache hit rate (cached
/ prompt tokens, from the responses' usage), TTFT p50/p99, request and output-token throughput,
and those as ratios to round_robin, the baseline, measured in the same process.

    python benchmarks/bench_routing.py [--policies prefix round_robin least_loaded] [--systems 6] ...
"""
import argparse
import asyncio
import os
import random
import socket
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import openai

from cluster.protocol import REPLICA_HEADER

BASELINE = "round_robin"
WORDS = ("river stone light garden window paper silver engine market winter harbor candle forest "
         "signal mirror ladder orbit canvas thunder meadow lantern velvet copper shadow").split()


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    replica_id: str


@dataclass
class Result:
    policy: str
    samples: list[Sample]
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return sum(s.cached_tokens for s in self.samples) / sum(s.prompt_tokens for s in self.samples)

    def ttft(self, quantile: float) -> float:
        return statistics.quantiles([s.ttft_s for s in self.samples], n=100, method="inclusive")[quantile - 1]

    @property
    def requests_per_s(self) -> float:
        return len(self.samples) / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return sum(s.output_tokens for s in self.samples) / self.wall_s


def make_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    systems = [f"System prompt {i}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
               for i in range(args.systems)]
    prompts = [f"{system}\nUser turn {turn}: tell me about {rng.choice(WORDS)} and {rng.choice(WORDS)}.\n"
               for system in systems for turn in range(args.turns)]
    rng.shuffle(prompts)
    return prompts


async def send(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> Sample:
    start = time.monotonic()
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    ttft_s = None
    async for chunk in raw.parse():
        if ttft_s is None and chunk.choices and chunk.choices[0].text:
            ttft_s = time.monotonic() - start
        if chunk.usage is not None:
            usage = chunk.usage
    return Sample(ttft_s, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens,
                  raw.headers[REPLICA_HEADER])


async def run_workload(base_url: str, policy: str, prompts: list[str], args: argparse.Namespace) -> Result:
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=600) as client:
        model = (await client.models.list()).data[0].id
        # Warm every replica up (first forward passes are slow) with prompts sharing nothing.
        await asyncio.gather(*(send(client, model, f"warm up {i}", 2) for i in range(2 * args.replicas)))
        queue = list(reversed(prompts))
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                samples.append(await send(client, model, queue.pop(), args.max_tokens))

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        return Result(policy, samples, time.monotonic() - start)


def deploy_and_run(args: argparse.Namespace, prompts: list[str]) -> list[Result]:
    import ray
    from ray import serve

    from cluster.app import APP_NAME, build
    from cluster.config import ClusterConfig
    from cluster.local_ray import init_local_ray

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_local_ray(max(os.cpu_count() or 1, args.replicas), log_to_driver=False)
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for policy in args.policies:
            engine = {"num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len}
            config = ClusterConfig(engine=engine, num_replicas=args.replicas, routing_policy=policy)
            serve.run(build(config), name=APP_NAME, route_prefix="/")
            results.append(asyncio.run(run_workload(f"http://127.0.0.1:{port}", policy, prompts, args)))
            print(f"{policy}: {results[-1].wall_s:.1f} s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return results


def report(results: list[Result]) -> None:
    baseline = next((r for r in results if r.policy == BASELINE), None)
    print(f"| policy | prefix-cache hit rate | TTFT p50 (s) | TTFT p99 (s) | req/s | output tok/s "
          f"| TTFT p50 speedup vs {BASELINE} | throughput vs {BASELINE} | requests per replica |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        versus = (f"{baseline.ttft(50) / r.ttft(50):.2f}x | {r.requests_per_s / baseline.requests_per_s:.2f}x"
                  if baseline else "- | -")
        spread = sorted(Counter(s.replica_id for s in r.samples).values(), reverse=True)
        print(f"| {r.policy} | {r.hit_rate:.1%} | {r.ttft(50):.2f} | {r.ttft(99):.2f} | {r.requests_per_s:.2f} "
              f"| {r.output_tokens_per_s:.1f} | {versus} | {spread} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--systems", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=700)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = make_prompts(args)
    print(f"{len(prompts)} requests: {args.systems} system prompts x {args.turns} turns, "
          f"{args.concurrency} concurrent, {args.max_tokens} output tokens each", flush=True)
    results = deploy_and_run(args, prompts)
    print()
    report(results)


if __name__ == "__main__":
    main()
