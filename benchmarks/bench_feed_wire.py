"""What one report to the router feed costs: a Ray actor call against a call on the feed's wire (router/wire.py).

An async Ray actor (as an engine replica's publisher runs) sends --calls reports, one at a time, each an
empty publish with stats, to a threaded Ray actor (as the router actor is): once through
`actor.publish.remote`, once as frames on a connection to the same actor's FeedServer. Printed: CPU
microseconds per call in the caller's process and in the actor's (all their threads: Ray's own included),
and the round trip's wall time. Runs a local Ray cluster on 127.0.0.1.

    python benchmarks/bench_feed_wire.py [--calls 3000] [--repeats 3]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

import ray  # noqa: E402

from replica.scheduler import SchedulerStats  # noqa: E402
from router.wire import FeedConnection, FeedServer  # noqa: E402

STATS = SchedulerStats(num_running=32, num_waiting=0, kv_usage=0.5, num_preemptions=0, prefix_cache_queries=0,
                       prefix_cache_hits=0)


class Sink:
    """Takes reports as the router actor does, on Ray's thread or on a feed connection's."""

    def __init__(self):
        self._server: FeedServer | None = None

    def publish(self, replica_id, seq, events, stats, finished) -> bool:
        return True

    def address(self):
        if self._server is None:
            self._server = FeedServer(self, frozenset({"publish"}), "127.0.0.1")
        return self._server.address, self._server.token

    def cpu_s(self) -> float:
        return time.process_time()


class Reporter:
    """Sends reports as an engine replica's publisher does: from an asyncio event loop, one in flight."""

    async def report(self, sink, calls: int, wire: bool) -> tuple[float, float]:
        """(CPU s, wall s) of `calls` reports."""
        connection = await FeedConnection.open(*await sink.address.remote()) if wire else None
        started_cpu, started = time.process_time(), time.perf_counter()
        for seq in range(calls):
            if wire:
                await connection.call("publish", "engine-0", seq, [], STATS, [])
            else:
                await sink.publish.remote("engine-0", seq, [], STATS, [])
        return time.process_time() - started_cpu, time.perf_counter() - started


def measure(sink, reporter, calls: int, wire: bool) -> tuple[float, float, float]:
    """(caller CPU us, actor CPU us, wall us) per call."""
    sink_before = ray.get(sink.cpu_s.remote())
    caller_cpu_s, wall_s = ray.get(reporter.report.remote(sink, calls, wire))
    sink_cpu_s = ray.get(sink.cpu_s.remote()) - sink_before
    return caller_cpu_s / calls * 1e6, sink_cpu_s / calls * 1e6, wall_s / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    sink, reporter = ray.remote(Sink).remote(), ray.remote(Reporter).remote()
    rows = []
    for repeat in range(args.repeats):
        for name, wire in (("Ray actor call", False), ("feed wire", True)):
            rows.append((name, repeat + 1, *measure(sink, reporter, args.calls, wire)))
    ray.shutdown()
    print(f"{args.calls} reports per measurement, one in flight\n")
    print("| transport | repeat | caller CPU us/call | actor CPU us/call | round trip us |")
    print("|---|---|---|---|---|")
    for name, repeat, caller, actor, wall in rows:
        print(f"| {name} | {repeat} | {caller:.0f} | {actor:.0f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
