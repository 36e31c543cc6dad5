"""Router cost: µs per routing decision and per event batch, collector pauses, bytes per cached block.

N replicas (4, 16, 64 by default) each caching --blocks blocks of 16 tokens: 8k-token prompts
(512-block chains) opening with one of 8 shared system prompts of 64 blocks. Requests are
512-block chains: a quarter a whole cached chain, a quarter a cached chain diverging at a random
block, a quarter a system prompt followed by new blocks, a quarter all new. Every decision goes
through Router.choose() (match, cost model, booking, and the session bookkeeping: each request is
a turn of one of 256 sessions, parked between turns on the replica that served it); after every 8 decisions one replica
publishes a batch of 100 KV events (50 blocks stored, 50 evicted, one event each), then a batch
that finishes the requests routed to it since (releasing their bookings). The router is warmed up the
way the actor is (gc.freeze() after the initial sync).

Baseline, same process: the membership scan any router could write without an index, counting
each replica's leading blocks with `for h in chain: if h not in held: break`. Times are wall
clock per call (this is what a request waits for); collector pauses are measured with
gc.callbacks over the whole timed phase; bytes per block with tracemalloc while building the index.

    python benchmarks/bench_router.py [--replicas 4 16 64] [--blocks 32768] [--requests 2000]
"""
import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.timing import percentile, timed  # noqa: E402
from replica.kv_cache import BlockRemoved, BlockStored, hash_token_blocks  # noqa: E402
from replica.scheduler import SchedulerStats  # noqa: E402
from router import FinishedRequest, PolicyConfig, Router  # noqa: E402

BLOCK_SIZE = 16
CHAIN_BLOCKS = 512
SYSTEM_BLOCKS = 64
TOKEN_IDS = range(49152)
SYSTEMS = [[system] * SYSTEM_BLOCKS * BLOCK_SIZE for system in range(8)]
EVENTS_PER_BATCH = 100
DECISIONS_PER_BATCH = 8
NUM_SESSIONS = 256


def random_tokens(rng: random.Random, num_blocks: int) -> list[int]:
    return rng.choices(TOKEN_IDS, k=num_blocks * BLOCK_SIZE)


def new_chain(rng: random.Random) -> list[bytes]:
    return hash_token_blocks(rng.choice(SYSTEMS) + random_tokens(rng, CHAIN_BLOCKS - SYSTEM_BLOCKS), BLOCK_SIZE)


def stats(rng: random.Random) -> SchedulerStats:
    return SchedulerStats(num_running=rng.randrange(32), num_waiting=rng.randrange(4), kv_usage=rng.random(),
                          num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0,
                          num_prefill_tokens_pending=rng.randrange(20_000), num_free_blocks=rng.randrange(4096))


class Cluster:
    """What the router mirrors: every replica's cached chains, as lists of hashes and as sets."""

    def __init__(self, rng: random.Random, num_replicas: int, blocks_per_replica: int):
        self.rng = rng
        self.chains: dict[str, list[list[bytes]]] = {}
        self.held: dict[str, set[bytes]] = {}
        for replica_index in range(num_replicas):
            replica_id = f"replica-{replica_index}"
            self.chains[replica_id], self.held[replica_id] = [], set()
            while len(self.held[replica_id]) < blocks_per_replica:
                chain = new_chain(rng)
                self.chains[replica_id].append(chain)
                self.held[replica_id].update(chain)
        self.seq = dict.fromkeys(self.chains, 1)

    def sync(self, router: Router) -> None:
        for replica_id, chains in self.chains.items():
            router.publish(replica_id, 1, [BlockStored(chain, None, [], BLOCK_SIZE) for chain in chains],
                           stats(self.rng), [])

    def requests(self, count: int) -> list[list[bytes]]:
        cached = [chain for chains in self.chains.values() for chain in chains]
        requests = []
        for index in range(count):
            kind = index % 4
            if kind == 0:
                chain = self.rng.choice(cached)
            elif kind == 1:
                keep = self.rng.randrange(1, CHAIN_BLOCKS)
                chain = self.rng.choice(cached)[:keep] + new_chain(self.rng)[keep:]
            else:
                chain = new_chain(self.rng) if kind == 2 else hash_token_blocks(
                    random_tokens(self.rng, CHAIN_BLOCKS), BLOCK_SIZE)
            requests.append(chain)
        return requests

    def event_batch(self, replica_id: str) -> list:
        """50 blocks stored (a new chain's head) and 50 of the replica's oldest blocks evicted, one event each."""
        oldest = self.chains[replica_id][0]
        evicted, self.chains[replica_id][0] = oldest[-50:], oldest[:-50] or new_chain(self.rng)
        stored = new_chain(self.rng)[:EVENTS_PER_BATCH // 2]
        return ([BlockStored([block_hash], None, [], BLOCK_SIZE) for block_hash in stored]
                + [BlockRemoved([block_hash]) for block_hash in evicted])


def scan_match(held: dict[str, set[bytes]], chain: list[bytes]) -> dict[str, int]:
    matched = {}
    for replica_id, blocks in held.items():
        depth = 0
        for block_hash in chain:
            if block_hash not in blocks:
                break
            depth += 1
        if depth:
            matched[replica_id] = depth
    return matched


class PauseClock:
    """Wall time of every garbage collection while installed."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)


def bytes_per_block(num_replicas: int, blocks: int) -> float:
    """Memory the router holds per cached block, the hashes' bytes objects included (as in the actor,
    where every replica's events arrive as objects of their own)."""
    cluster = Cluster(random.Random(1), num_replicas, blocks)
    num_blocks = sum(len(held) for held in cluster.held.values())
    tracemalloc.start()
    router = Router(PolicyConfig(), BLOCK_SIZE)
    for replica_id, chains in cluster.chains.items():
        events = [BlockStored([bytes(bytearray(block_hash)) for block_hash in chain], None, [], BLOCK_SIZE)
                  for chain in chains]
        router.publish(replica_id, 1, events, stats(cluster.rng), [])
        del events
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size / num_blocks


def run(num_replicas: int, blocks: int, num_requests: int) -> dict[str, list[float]]:
    rng = random.Random(num_replicas)
    cluster = Cluster(rng, num_replicas, blocks)
    router = Router(PolicyConfig(), BLOCK_SIZE, seed=0)
    cluster.sync(router)
    requests = cluster.requests(num_requests)
    assert all(router.index.match(chain) == scan_match(cluster.held, chain) for chain in requests[:50])
    replica_ids = list(cluster.chains)
    gc.collect()
    gc.freeze()  # warm-up done, as in the router actor
    pauses = PauseClock()
    gc.callbacks.append(pauses)
    samples: dict[str, list[float]] = {"scan": [], "match": [], "choose": [], "event batch": [], "finish batch": []}
    routed: dict[str, list[FinishedRequest]] = {replica_id: [] for replica_id in replica_ids}
    try:
        for number, chain in enumerate(requests):
            samples["scan"].append(timed(scan_match, cluster.held, chain)[0])
            samples["match"].append(timed(router.index.match, chain)[0])
            seconds, decision = timed(router.choose, f"req-{number}", chain, replica_ids,
                                      session_id=f"session-{rng.randrange(NUM_SESSIONS)}")
            samples["choose"].append(seconds)
            routed[decision.replica_id].append(FinishedRequest(f"req-{number}", 0))
            if number % DECISIONS_PER_BATCH == DECISIONS_PER_BATCH - 1:
                replica_id = rng.choice(replica_ids)
                samples["event batch"].append(publish(router, cluster, replica_id, cluster.event_batch(replica_id), []))
                samples["finish batch"].append(publish(router, cluster, replica_id, [], routed[replica_id]))
                routed[replica_id] = []
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()
    samples["gc pause"] = pauses.pauses or [0.0]
    return samples


def publish(router: Router, cluster: Cluster, replica_id: str, events: list, finished: list) -> float:
    cluster.seq[replica_id] += 1
    return timed(router.publish, replica_id, cluster.seq[replica_id], events, stats(cluster.rng), finished)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--blocks", type=int, default=32768, help="cached blocks per replica")
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    print(f"{args.blocks} cached blocks of {BLOCK_SIZE} tokens per replica, {CHAIN_BLOCKS}-block (8k-token) "
          f"prompts, {args.requests} decisions, a {EVENTS_PER_BATCH}-event batch every {DECISIONS_PER_BATCH}")
    print(f"index memory: {bytes_per_block(4, min(args.blocks, 8192)):.0f} bytes per cached block (4 replicas)")
    print("| N | what | p50 µs | p99 µs | max µs | p50 x scan |")
    print("|---|---|---|---|---|---|")
    for num_replicas in args.replicas:
        samples = run(num_replicas, args.blocks, args.requests)
        scan_p50 = statistics.median(samples["scan"])
        for name, values in samples.items():
            ratio = f"{statistics.median(values) / scan_p50:.3f}" if name != "gc pause" else "-"
            print(f"| {num_replicas} | {name} | {percentile(values, 50) * 1e6:.0f} "
                  f"| {percentile(values, 99) * 1e6:.0f} | {max(values) * 1e6:.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
