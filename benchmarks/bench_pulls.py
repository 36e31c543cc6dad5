"""Pulling a prefix from another node's pool against computing it, served: the real app on a Ray cluster of three
nodes on 127.0.0.1 (a head with Serve's controller and proxy, two worker nodes with one engine replica each, each
node with a KV pool of its own, as tests/cluster/test_e2e_pulls.py starts it), routed round robin.

    python benchmarks/bench_pulls.py --prefix-lens 32 256 1000 2000 --rounds 3

Each round sends a fresh prompt (random words, --prefix-lens tokens or about) to the replica round robin picks,
which computes it, waits until the router's index shows that replica's node pool holding it, then sends the same
prompt again: round robin takes it to the other node's replica, which pulls the prompt's blocks from the first
node's pool and loads them. TTFT is the time to the first streamed token at the client; both answers (greedy,
8 tokens) must be equal. Prints medians and pulled / computed measured in the same run.
"""
import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from cluster.config import ClusterConfig  # noqa: E402
from cluster.protocol import REPLICA_HEADER  # noqa: E402
from tests.cluster.test_e2e_multinode import three_nodes  # noqa: E402

BLOCK_SIZE = 16
WORDS = ["river", "stone", "lantern", "copper", "meadow", "signal", "harbor", "violet", "engine", "quartz"]


def streamed(base_url: str, prompt: str) -> tuple[str, float, str, dict]:
    """(the replica, seconds to the first token, the text, usage) of a greedy streamed completion."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started, first_token_s, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first_token_s = first_token_s or time.perf_counter() - started
                text += chunk["choices"][0]["text"]
            usage = chunk.get("usage") or usage
        return response.headers[REPLICA_HEADER], first_token_s, text, usage


def index_host_blocks(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^prefixserve:router_index_host_blocks{replica="([^"]+)"} (\S+)$', text, re.M)}


def wait_for_pool(base_url: str, replica: str, num_blocks: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while index_host_blocks(base_url).get(replica, 0) < num_blocks:
        if time.monotonic() > deadline:
            sys.exit(f"the router's index never showed {num_blocks} blocks in {replica}'s node pool")
        time.sleep(0.2)


def round_trip(base_url: str, prompt: str) -> tuple[int, float, float]:
    """The prompt computed on one replica, then pulled by the other: (its tokens, seconds to its first token
    computed, pulled)."""
    first, compute_s, text, usage = streamed(base_url, prompt)
    num_tokens = usage["prompt_tokens"]
    wait_for_pool(base_url, first, num_tokens // BLOCK_SIZE)
    second, pull_s, pulled_text, pulled_usage = streamed(base_url, prompt)
    cached = pulled_usage["prompt_tokens_details"]["cached_tokens"]
    if second == first or pulled_text != text or cached != (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE:
        sys.exit(f"not a pull: replicas {first} then {second}, {cached} of {num_tokens} tokens cached, "
                 f"texts {text!r} and {pulled_text!r}")
    return num_tokens, compute_s, pull_s


def run(base_url: str, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)

    def prompt(num_words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(num_words))
    round_trip(base_url, prompt(64))  # each replica's first pull looks up the router actor
    for prefix_len in args.prefix_lens:
        computed, pulled = [], []
        for _ in range(args.rounds):
            num_tokens, compute_s, pull_s = round_trip(base_url, prompt(prefix_len))
            computed.append(compute_s)
            pulled.append(pull_s)
        pull_s, compute_s = statistics.median(pulled), statistics.median(computed)
        print(f"prompt of {num_tokens} tokens: TTFT pulled from the other node {pull_s * 1e3:.0f} ms, computed "
              f"{compute_s * 1e3:.0f} ms (medians of {args.rounds}), pulled / computed {pull_s / compute_s:.3f}; "
              "greedy tokens equal", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[32, 256, 1000, 2000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-gib", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    max_len = max(args.prefix_lens) * 2 + 64
    with tempfile.TemporaryDirectory(dir="/dev/shm") as pools:
        engine = {"dtype": "float32", "max_model_len": max_len, "num_kv_blocks": 2 * max_len // BLOCK_SIZE,
                  "max_num_seqs": 4, "host_pool_gib": args.pool_gib, "host_pool_path": f"{pools}/kv-{{node}}"}
        with three_nodes(ClusterConfig(engine=engine, num_replicas=2, routing="round_robin")) as (_, _, base_url):
            run(base_url, args)


if __name__ == "__main__":
    main()
