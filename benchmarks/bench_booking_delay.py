"""How late the other ingresses learn of a booking: the delay the K-router simulator's --booking-delay-ms models.

--followers FollowingRouters (as many ingress replicas would hold, here on one event loop in one process)
follow one RouterActor on a local Ray cluster on 127.0.0.1, while an actor reports --engines engines' steps,
--steps-per-s each, to its feed. The first follower routes --rate requests a second (Poisson arrivals,
--seed); for each booking the delay until every other follower's Router holds it is printed as p50, p99
and max, beside the sync interval, with the router actor's CPU (all its threads, in cores) meanwhile.

    python benchmarks/bench_booking_delay.py [--followers 2] [--engines 16] [--steps-per-s 50] [--rate 100]
"""
import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import ray  # noqa: E402

from cluster.local_ray import init_local_ray  # noqa: E402
from replica.scheduler import SchedulerStats  # noqa: E402
from router.actor import NAMESPACE, RouterClient, router_actor_name  # noqa: E402
from router.core import Router  # noqa: E402
from router.follower import FollowingRouter  # noqa: E402
from router.policy import PolicyConfig  # noqa: E402

APP = "booking-delay"
BLOCK_SIZE = 16
POLICY = PolicyConfig()
STATS = SchedulerStats(num_running=8, num_waiting=0, kv_usage=0.5, num_preemptions=0, prefix_cache_queries=0,
                       prefix_cache_hits=0)


class StampingRouter(Router):
    """A Router that notes when each booking routed elsewhere reaches it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.booked_at: dict[str, float] = {}

    def book(self, request_id, *args, **kwargs) -> None:
        self.booked_at.setdefault(request_id, time.perf_counter())
        super().book(request_id, *args, **kwargs)


class Engines:
    """Reports engines' steps to the feed as their publishers do: empty publishes with stats, in order."""

    async def report(self, engines: int, steps_per_s: float, seconds: float) -> int:
        feed = await self._connect()
        loop = asyncio.get_running_loop()
        start, steps = loop.time(), 0
        while loop.time() < start + seconds:
            steps += 1
            for engine in range(engines):
                await feed.call("publish", f"engine-{engine}", steps, [], STATS, [])
            await asyncio.sleep(max(0.0, start + steps / steps_per_s - loop.time()))
        return steps

    async def _connect(self):
        """The feed, once a follower has created the router actor."""
        client = RouterClient(APP, POLICY, BLOCK_SIZE, create=False)
        while True:
            try:
                return await client.get()
            except ValueError:
                await asyncio.sleep(0.1)


async def route(args, engines_done: "ray.ObjectRef") -> list[float]:
    """Delays (s) until every follower but the first held each booking the first one made."""
    followers = [FollowingRouter(StampingRouter(POLICY, BLOCK_SIZE), RouterClient(APP, POLICY, BLOCK_SIZE),
                                 f"{APP}:{i}", args.sync_interval_s) for i in range(args.followers)]
    loop = asyncio.get_running_loop()
    for follower in followers:
        follower.start(loop)
    while any(len(follower.router.snapshot().replicas) < args.engines for follower in followers):
        await asyncio.sleep(0.1)  # every engine is reporting, to every follower
    rng, candidates, routed_at = random.Random(args.seed), [f"engine-{i}" for i in range(args.engines)], {}
    cpu_before, started = await actor_cpu_time(), time.perf_counter()
    for n in range(args.requests):
        request_id = f"request-{n}"
        hashes = [rng.getrandbits(63) for _ in range(4)]
        routed_at[request_id] = time.perf_counter()
        followers[0].choose(request_id, hashes, candidates, num_prompt_tokens=64, session_id=None)
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.sleep(1.0)
    actor_cores = (await actor_cpu_time() - cpu_before) / (time.perf_counter() - started)
    await asyncio.wrap_future(engines_done.future())
    delays = [max(f.router.booked_at[request_id] for f in followers[1:]) - at for request_id, at in routed_at.items()]
    return delays, actor_cores


async def actor_cpu_time() -> float:
    actor = ray.get_actor(router_actor_name(APP, POLICY, BLOCK_SIZE), namespace=NAMESPACE)
    return await asyncio.wrap_future(actor.__ray_call__.remote(lambda _: time.process_time()).future())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, default=2)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--steps-per-s", type=float, default=50)
    parser.add_argument("--rate", type=float, default=100, help="bookings a second")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--sync-interval-s", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    init_local_ray(2, log_to_driver=False)
    seconds = args.requests / args.rate + 5.0  # the followers' start (a second or two) and a margin
    engines_done = ray.remote(Engines).options(num_cpus=0).remote().report.remote(
        args.engines, args.steps_per_s, seconds)
    delays, actor_cores = asyncio.run(route(args, engines_done))
    delays_ms = sorted(1000 * delay for delay in delays)
    ray.shutdown()
    p99 = delays_ms[int(0.99 * (len(delays_ms) - 1))]
    print(f"{args.followers} followers, {args.engines} engines x {args.steps_per_s:g} steps/s, "
          f"{args.requests} bookings at {args.rate:g}/s, sync interval {1000 * args.sync_interval_s:g} ms\n")
    print("| booking delay p50 ms | p99 ms | max ms | p99 / sync interval | router actor CPU (cores) |")
    print("|---|---|---|---|---|")
    print(f"| {statistics.median(delays_ms):.2f} | {p99:.2f} | {delays_ms[-1]:.2f} | "
          f"{p99 / (1000 * args.sync_interval_s):.2f} | {actor_cores:.2f} |")


if __name__ == "__main__":
    main()
