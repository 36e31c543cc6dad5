"""Router CPU time per routing decision: RouterState.choose() against a plain membership scan.

8 replicas, each caching about 10k blocks: chains of 64 blocks (block size 16) that open with
one of 4 system prompts of 16 blocks held by every replica. Requests
are 64-block chains: a quarter a whole cached chain, a quarter a cached chain diverging at a
random block, a quarter a system prompt followed by new blocks, a quarter all new.

Baseline, same process: the loop any router could write without an index, counting each
replica's leading blocks by set membership (`for h in chain: if h not in held: break`).
choose() adds to its match the scoring, the booking, and the insert of the routed chain's new
blocks into the index (work the replica's BlockStored event would otherwise do later). Its
passes route cumulatively: later passes find the chains earlier ones routed.
Times are process CPU time per decision, the median of --repeats passes over --requests requests.

    python benchmarks/bench_router.py [--requests 2000] [--repeats 5]
"""
import argparse
import random
import statistics
import time

from replica.kv_cache import BlockStored, hash_token_blocks
from router import ReplicaLoad, RouterState

BLOCK_SIZE = 16
NUM_REPLICAS = 8
BLOCKS_PER_REPLICA = 10_000
CHAIN_BLOCKS = 64
SYSTEM_BLOCKS = 16
VOCAB = 49152
SYSTEMS = [[system] * SYSTEM_BLOCKS * BLOCK_SIZE for system in range(4)]


def random_tokens(rng: random.Random, num_blocks: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(num_blocks * BLOCK_SIZE)]


def build_cluster(rng: random.Random) -> tuple[RouterState, dict[str, list[list[int]]], dict[str, set[bytes]]]:
    """A RouterState mirroring 8 replicas' caches, each replica's cached prompts and its set of hashes."""
    state = RouterState()
    prompts: dict[str, list[list[int]]] = {}
    held_by_replica: dict[str, set[bytes]] = {}
    for replica_index in range(NUM_REPLICAS):
        replica_id = f"replica-{replica_index}"
        prompts[replica_id], held_by_replica[replica_id], events = [], set(), []
        while len(held_by_replica[replica_id]) < BLOCKS_PER_REPLICA:
            prompt = rng.choice(SYSTEMS) + random_tokens(rng, CHAIN_BLOCKS - SYSTEM_BLOCKS)
            block_hashes = hash_token_blocks(prompt, BLOCK_SIZE)
            prompts[replica_id].append(prompt)
            held_by_replica[replica_id].update(block_hashes)
            events.append(BlockStored(block_hashes, None, [], BLOCK_SIZE))
        state.update(replica_id, 1, events, ReplicaLoad(kv_usage=rng.random(), num_running=rng.randrange(8)))
    return state, prompts, held_by_replica


def make_requests(rng: random.Random, prompts: dict[str, list[list[int]]], count: int) -> list[list[bytes]]:
    cached = [prompt for replica_prompts in prompts.values() for prompt in replica_prompts]
    requests = []
    for index in range(count):
        kind = index % 4
        if kind == 0:
            prompt = rng.choice(cached)
        elif kind == 1:
            keep = rng.randrange(1, CHAIN_BLOCKS) * BLOCK_SIZE
            prompt = rng.choice(cached)[:keep] + random_tokens(rng, CHAIN_BLOCKS - keep // BLOCK_SIZE)
        elif kind == 2:
            prompt = rng.choice(SYSTEMS) + random_tokens(rng, CHAIN_BLOCKS - SYSTEM_BLOCKS)
        else:
            prompt = random_tokens(rng, CHAIN_BLOCKS)
        requests.append(hash_token_blocks(prompt, BLOCK_SIZE))
    return requests


def scan_match(held_by_replica: dict[str, set[bytes]], block_hashes: list[bytes]) -> dict[str, int]:
    matched = {}
    for replica_id, held in held_by_replica.items():
        depth = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            depth += 1
        if depth:
            matched[replica_id] = depth
    return matched


def time_per_call(fn, requests: list[list[bytes]], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        for block_hashes in requests:
            fn(block_hashes)
        samples.append((time.process_time() - start) / len(requests))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    state, prompts, held_by_replica = build_cluster(rng)
    requests = make_requests(rng, prompts, args.requests)
    replica_ids = list(prompts)
    index = state.index
    assert all(index.match(chain) == scan_match(held_by_replica, chain) for chain in requests)
    blocks = sum(index.num_blocks(replica_id) for replica_id in replica_ids) // NUM_REPLICAS
    print(f"{NUM_REPLICAS} replicas x {blocks} cached blocks, {CHAIN_BLOCKS}-block chains, "
          f"{len(requests)} requests x {args.repeats} passes")

    def choose(block_hashes: list[bytes]) -> None:
        state.release(state.choose(block_hashes, replica_ids).replica_id)

    baseline = time_per_call(lambda chain: scan_match(held_by_replica, chain), requests, args.repeats)
    match = time_per_call(index.match, requests, args.repeats)
    decision = time_per_call(choose, requests, args.repeats)
    print(f"{'what':<28} {'us/decision':>12} {'x baseline':>11}")
    for name, seconds in (("baseline: membership scan", baseline), ("BlockIndex.match", match),
                          ("RouterState.choose", decision)):
        print(f"{name:<28} {seconds * 1e6:>12.1f} {seconds / baseline:>11.2f}")


if __name__ == "__main__":
    main()
