"""Routing policies end to end: prefix routing against round_robin and least_loaded.

Workload: --systems distinct system prompts of --system-words words (about 700 tokens each),
each opening --sessions chat sessions of --turns turns. A turn's prompt is the system prompt, the
session's earlier turns (user question and a fixed assistant answer, the same for every policy)
and its new question, so a session's context grows. All turns are sent in one seeded shuffled
order by --concurrency streaming clients, a session's turns one after another; every request
generates --max-tokens tokens (ignore_eos). The KV pool per replica (--num-kv-blocks) holds a
little less than all the system prompts: sent to every replica they evict one another, kept
each on one replica they all stay cached.

Starts a local Ray cluster (loopback only) with --replicas engine replicas sharing the machine's
cores, and deploys the app once per policy (fresh replicas, cold caches), then runs the same
workload against each. Per policy it prints the prefix-cache hit rate (cached / prompt tokens,
from the responses' usage), TTFT p50/p99, request and output-token throughput, those as ratios to
round_robin, the baseline, measured in the same process, and the router's decisions by outcome
(from /metrics).

With --host-pool-gib, every policy runs twice, without and with the node's KV pool of that size ("+pool": a
fresh pool file for each deployment, shared by its replicas). Ratios are to round_robin, else to the first policy
without the pool.

    python benchmarks/bench_routing.py [--policies prefix round_robin least_loaded] [--replicas 4] ...
    python benchmarks/bench_routing.py --policies prefix --host-pool-gib 1 --num-kv-blocks 96 --replicas 2
"""
import argparse
import asyncio
import functools
import itertools
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.live_app import (Completion, local_app, metrics_text, openai_client, random_words,  # noqa: E402
                                 stream_completion, warm_up)
from benchmarks.timing import percentile  # noqa: E402
from cluster.metrics import PREFIX as METRICS_PREFIX  # noqa: E402

BASELINE = "round_robin"


@dataclass
class RouterMetrics:
    """The app's /metrics summed over replicas: the router's decisions by outcome and the engines'
    prefix-cache counters."""
    decisions: Counter
    prefix_cache_queries: float = 0
    prefix_cache_hits: float = 0

    @classmethod
    def parse(cls, text: str) -> "RouterMetrics":
        metrics = cls(Counter())
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{METRICS_PREFIX}router_decisions_total":
                    metrics.decisions[sample.labels["outcome"]] += sample.value
                elif sample.name == f"{METRICS_PREFIX}prefix_cache_queries_total":
                    metrics.prefix_cache_queries += sample.value
                elif sample.name == f"{METRICS_PREFIX}prefix_cache_hits_total":
                    metrics.prefix_cache_hits += sample.value
        return metrics

    def describe_decisions(self) -> str:
        return ", ".join(f"{outcome} {count:.0f}" for outcome, count in sorted(self.decisions.items()))


@dataclass
class Result:
    policy: str
    samples: list[Completion]
    wall_s: float
    router: RouterMetrics

    @property
    def hit_rate(self) -> float:
        return sum(s.cached_tokens for s in self.samples) / sum(s.prompt_tokens for s in self.samples)

    def ttft(self, quantile: float) -> float:
        return percentile([s.first_token_s - s.sent_s for s in self.samples], quantile)

    @property
    def requests_per_s(self) -> float:
        return len(self.samples) / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return sum(s.output_tokens for s in self.samples) / self.wall_s


@dataclass(frozen=True)
class Turn:
    session: int
    prompt: str


def make_turns(args: argparse.Namespace) -> list[Turn]:
    """Every session's turns, growing its context, in one seeded shuffled order that keeps each
    session's turns in sequence."""
    rng = random.Random(args.seed)
    words = functools.partial(random_words, rng)
    systems = [f"System prompt {i}. {words(args.system_words)}" for i in range(args.systems)]
    prompts = []
    for session, system in enumerate(systems * args.sessions):
        context = f"{system}\nSession {session}.\n"
        prompts.append([])
        for _ in range(args.turns):
            context += f"User: tell me about {words(1)} and {words(1)}.\nAssistant:"
            prompts[session].append(context)
            context += f" {words(args.answer_words)}.\n"
    order = [session for session in range(len(prompts)) for _ in range(args.turns)]
    rng.shuffle(order)
    return [Turn(session, prompts[session].pop(0)) for session in order]


async def run_workload(base_url: str, policy: str, turns: list[Turn], args: argparse.Namespace) -> Result:
    async with openai_client(base_url, timeout=600) as (client, model):
        await warm_up(client, model, args.replicas)
        queue = list(reversed(turns))
        sessions = defaultdict(asyncio.Lock)  # FIFO: a session's next turn waits for its previous one
        samples: list[Completion] = []

        async def worker() -> None:
            while queue:
                turn = queue.pop()
                async with sessions[turn.session]:
                    samples.append(await stream_completion(client, model, turn.prompt, args.max_tokens))

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall_s = time.monotonic() - start
    return Result(policy, samples, wall_s, RouterMetrics.parse(await metrics_text(base_url)))


def deploy_and_run(args: argparse.Namespace, turns: list[Turn]) -> list[Result]:
    results = []
    pools = [0.0, args.host_pool_gib] if args.host_pool_gib else [0.0]
    with local_app() as deploy, tempfile.TemporaryDirectory(dir="/dev/shm") as pool_dir:
        for policy, pool_gib in itertools.product(args.policies, pools):
            engine = {"num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len}
            name = policy
            if pool_gib:
                name += "+pool"
                engine |= {"host_pool_gib": pool_gib, "host_pool_path": f"{pool_dir}/{policy}"}
            base_url = deploy(engine, args.replicas, routing=policy)
            results.append(asyncio.run(run_workload(base_url, name, turns, args)))
            print(f"{name}: {results[-1].wall_s:.1f} s", flush=True)
    return results


def report(results: list[Result]) -> None:
    baseline = next((r for r in results if r.policy == BASELINE), results[0])
    print(f"| policy | prefix-cache hit rate | TTFT p50 (s) | TTFT p99 (s) | req/s | output tok/s "
          f"| TTFT p50, p99, throughput vs {baseline.policy} | requests per replica | router decisions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        versus = (f"{baseline.ttft(50) / r.ttft(50):.2f}x, {baseline.ttft(99) / r.ttft(99):.2f}x, "
                  f"{r.requests_per_s / baseline.requests_per_s:.2f}x")
        spread = sorted(Counter(s.replica_id for s in r.samples).values(), reverse=True)
        print(f"| {r.policy} | {r.hit_rate:.1%} | {r.ttft(50):.2f} | {r.ttft(99):.2f} | {r.requests_per_s:.2f} "
              f"| {r.output_tokens_per_s:.1f} | {versus} | {spread} | {r.router.describe_decisions()} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["prefix", "round_robin", "least_loaded"])
    parser.add_argument("--replicas", type=int, default=4, help="engine replicas, sharing the machine's cores")
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=700)
    parser.add_argument("--sessions", type=int, default=4, help="chat sessions per system prompt")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--answer-words", type=int, default=24, help="words of each turn's fixed assistant answer")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host-pool-gib", type=float, default=0.0,
                        help="run every policy without and with the node's KV pool of this size too")
    args = parser.parse_args()
    turns = make_turns(args)
    print(f"{len(turns)} requests: {args.systems} system prompts x {args.sessions} sessions x {args.turns} turns, "
          f"{args.replicas} replicas, {args.concurrency} concurrent, {args.max_tokens} output tokens each", flush=True)
    results = deploy_and_run(args, turns)
    print()
    report(results)


if __name__ == "__main__":
    main()
