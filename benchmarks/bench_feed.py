"""Router feed cost: the CPU one ingress replica spends following N engines that step S times a second.

Every engine step publishes one batch: --stores-per-step BlockStored events of one block each (32 running
requests decoding store a block every 16 tokens each: 2 a step), as many BlockRemoved once the engine's
cache is full, its stats, and a finished request every 4th step. The feed's owner (the router actor)
records --seconds of those batches; a follower syncing every --sync-interval-s takes each update
through pickle (what the feed's wire, router/wire.py, does to it) and replays it on its own Router. Printed: the
follower's CPU seconds per second of engine traffic (the fraction of a core it costs), against the
owner's applying the same batches to its own Router (what the one router actor did alone before) in
the same run.

    python benchmarks/bench_feed.py [--engines 16 64] [--steps-per-s 50] [--sync-interval-s 0.01]
"""
import argparse
import pickle
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from replica.kv_cache import BlockRemoved, BlockStored  # noqa: E402
from replica.scheduler import SchedulerStats  # noqa: E402
from router import FinishedRequest, PolicyConfig, Router  # noqa: E402
from router.feed import FeedingRouter, Publish, replay  # noqa: E402

BLOCK_SIZE = 16
CACHE_BLOCKS = 256  # per engine, small so that evictions (a BlockRemoved per new block) start within the run


def engine_batches(rng: random.Random, engines: int, steps: int, stores_per_step: int) -> list[Publish]:
    """steps × engines batches in the order they would arrive, each engine's numbered from 1."""
    cached = {f"engine-{e}": [] for e in range(engines)}
    batches = []
    for step in range(1, steps + 1):
        for replica_id, blocks in cached.items():
            stored = [rng.randbytes(16) for _ in range(stores_per_step)]
            events = [BlockStored([block_hash], None, [], BLOCK_SIZE) for block_hash in stored]
            blocks += stored
            if len(blocks) > CACHE_BLOCKS:
                evicted, blocks[:] = blocks[:stores_per_step], blocks[stores_per_step:]
                events += [BlockRemoved([block_hash]) for block_hash in evicted]
            finished = [FinishedRequest(f"{replica_id}-{step}", 64)] if step % 4 == 0 else []
            stats = SchedulerStats(num_running=32, num_waiting=0, kv_usage=0.5, num_preemptions=0,
                                   prefix_cache_queries=step, prefix_cache_hits=step // 2)
            batches.append(Publish(replica_id, step, events, stats, finished))
    return batches


def cpu_s(fn, *args) -> float:
    started = time.process_time()
    fn(*args)
    return time.process_time() - started


def run(engines: int, steps_per_s: int, seconds: float, sync_interval_s: float, stores_per_step: int) -> dict:
    steps = int(steps_per_s * seconds)
    batches = engine_batches(random.Random(0), engines, steps, stores_per_step)
    owner, alone = FeedingRouter(PolicyConfig(), BLOCK_SIZE), Router(PolicyConfig(), BLOCK_SIZE)
    follower = Router(PolicyConfig(), BLOCK_SIZE)
    per_sync = max(1, round(len(batches) / (seconds / sync_interval_s)))
    follower_cpu_s, epoch, cursor = 0.0, None, 0
    alone_cpu_s = cpu_s(lambda: [alone.publish(b.replica_id, b.seq, b.events, b.stats, b.finished) for b in batches])
    owner_cpu_s = 0.0
    for start in range(0, len(batches), per_sync):
        owner_cpu_s += cpu_s(lambda: [owner.publish(b.replica_id, b.seq, b.events, b.stats, b.finished)
                                      for b in batches[start:start + per_sync]])
        started = time.process_time()
        wire = pickle.dumps(owner.follow("follower", epoch, cursor, []), protocol=5)
        owner_cpu_s += time.process_time() - started
        update = None

        def receive():
            nonlocal update
            update = pickle.loads(wire)
            replay(follower, update, "follower")
        follower_cpu_s += cpu_s(receive)
        epoch, cursor = update.epoch, update.cursor
    blocks = {replica_id: (follower.index.num_blocks(replica_id), alone.index.num_blocks(replica_id))
              for replica_id in sorted({batch.replica_id for batch in batches})}
    assert all(followed == applied for followed, applied in blocks.values()), blocks
    return {"engines": engines, "blocks": blocks, "follower_core": follower_cpu_s / seconds,
            "owner_core": owner_cpu_s / seconds, "alone_core": alone_cpu_s / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps-per-s", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=4.0, help="engine traffic generated per run")
    parser.add_argument("--sync-interval-s", type=float, default=0.01)
    parser.add_argument("--stores-per-step", type=int, default=2)
    args = parser.parse_args()
    print("| engines | batches/s | follower (cores) | owner: record + apply + answer (cores) | "
          "a router applying them alone (cores) | follower / alone |")
    print("|---|---|---|---|---|---|")
    for engines in args.engines:
        row = run(engines, args.steps_per_s, args.seconds, args.sync_interval_s, args.stores_per_step)
        print(f"| {engines} | {engines * args.steps_per_s} | {row['follower_core']:.3f} | {row['owner_core']:.3f} | "
              f"{row['alone_core']:.3f} | {row['follower_core'] / row['alone_core']:.2f}x |")


if __name__ == "__main__":
    main()
