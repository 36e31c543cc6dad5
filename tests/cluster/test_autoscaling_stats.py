"""What an engine replica reports to the autoscaling policy, over a real scheduler and KV cache manager."""
from dataclasses import dataclass

from replica.async_engine import ReplicaStats
from replica.kv_cache import KVCacheManager
from replica.request import Request, SamplingParams
from replica.scheduler import Scheduler, SchedulerConfig, SchedulerStats

BLOCK_SIZE = 4


@dataclass
class FakeCore:
    """The parts of EngineCore that ReplicaStats reads."""
    scheduler: Scheduler

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=1, num_waiting=len(self.scheduler.waiting), kv_usage=0.25,
                              num_preemptions=7, prefix_cache_queries=0, prefix_cache_hits=0)


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def test_waiting_tokens_count_only_what_the_prefix_cache_lacks():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    served = request("served", list(range(12)))
    manager.allocate_slots(served, 12)
    manager.free(served)  # its 3 blocks stay cached
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), manager)
    for waiting in [request("shares-two-blocks", list(range(10)) + [99] * 6),  # 16 tokens, 8 cached
                    request("all-cached", list(range(12))),  # the last token is computed anyway: 4
                    request("nothing-cached", [50] * 5)]:  # 5
        scheduler.add_request(waiting)
    hashes_before = [list(r.block_hashes) for r in scheduler.waiting]
    stats = ReplicaStats.of(FakeCore(scheduler))
    assert stats == ReplicaStats(num_preemptions=7, kv_cache_usage=0.25, num_waiting=3,
                                 num_waiting_uncached_tokens=8 + 4 + 5)
    assert [r.block_hashes for r in scheduler.waiting] == hashes_before  # reading the stats changed nothing
