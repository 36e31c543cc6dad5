"""A fake model for driving the scheduler: every request that reached the end of its tokens samples one."""
import time

from replica.kv_cache import KVCacheManager
from replica.kv_cache.host_pool import HostPool
from replica.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(num_blocks: int = 100, block_size: int = 4, watermark: float = 0.0, clock=time.monotonic,
                   num_speculative_tokens: int = 0, host_pool: HostPool | None = None, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    manager = KVCacheManager(num_blocks, block_size, watermark=watermark, max_model_len=config["max_model_len"],
                             host_pool=host_pool)
    return Scheduler(SchedulerConfig(**config), manager, clock, num_speculative_tokens=num_speculative_tokens)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_model_output(scheduler: Scheduler, output: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    req_ids = list(output.num_scheduled_tokens)
    requests = [scheduler.requests[req_id] for req_id in req_ids]
    return ModelRunnerOutput(req_ids, [[token_id] if r.num_computed_tokens >= r.num_tokens else [] for r in requests])


def step(scheduler: Scheduler, token_id: int = 7):
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, fake_model_output(scheduler, output, token_id))
