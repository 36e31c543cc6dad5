"""A simulated engine replica: the real Scheduler and KVCacheManager, with no model.

Each step is scheduled by the real scheduler; its duration comes from the step model; at its
end every request that finished its prompt samples the next token of its scripted answer. After
every step the replica publishes to the router as cluster/publisher.py does: its KV events, its
stats and the requests that finished, numbered 1, 2, 3...

With a node's pool (the real HostPool, slots of no bytes), the scheduler loads at once, as the CPU engine's
does: a block takes load_s_per_block, added to the step; the step's written-through blocks are stored at its
end, and the pool's changes go out as host-tier events, as the engine's do. pool_write "evict" stores a block
only when the device cache evicts it instead (what the engine does not do: a what-if for the write policy).
"""
from collections.abc import Callable
from dataclasses import dataclass

from replica.kv_cache import BlockHash, BlockPool, BlockRemoved, KVCacheBlock, KVCacheManager, KVEvent
from replica.kv_cache.host_pool import HostPool, HostPoolWatcher, KVLoad
from replica.request import Request, SamplingParams
from replica.scheduler import ModelRunnerOutput, RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput
from replica.scheduler import SchedulerStats
from replica.scheduler.trace import SchedulerTrace
from router.messages import FinishedRequest

from .step_model import StepModel

WATERMARK = 0.01  # the engine's default (replica.engine.EngineConfig)


@dataclass
class Publication:
    seq: int
    events: list[KVEvent]
    stats: SchedulerStats
    finished: list[FinishedRequest]


class SimReplica:
    def __init__(self, replica_id: str, num_blocks: int, block_size: int, step_model: StepModel,
                 clock: Callable[[], float], queue_policy: str = "fcfs", max_model_len: int = 8192,
                 trace: SchedulerTrace | None = None, host_pool: HostPool | None = None,
                 load_s_per_block: float = 0.0, pool_write: str = "through"):
        self.replica_id = replica_id
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, watermark=WATERMARK,
                                               max_model_len=max_model_len, host_pool=host_pool)
        self.host_pool = host_pool
        self._write_through = pool_write == "through"
        if host_pool is not None and not self._write_through:
            self.kv_cache_manager.block_pool = _WriteOnEvict(num_blocks, block_size, host_pool)
        self._watcher = HostPoolWatcher(host_pool, block_size) if host_pool is not None else None
        self.load_s_per_block = load_s_per_block
        self._load_s = 0.0  # loads of the step being scheduled
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=max_model_len, policy=queue_policy),
                                   self.kv_cache_manager, clock, trace=trace)
        if host_pool is not None:
            self.scheduler.load_now = self._load_now
        self.step_model = step_model
        self.busy = False
        self._scripts: dict[str, list[int]] = {}
        self._live: dict[str, Request] = {}
        self._finished: list[FinishedRequest] = []
        self._seq = 0

    def add(self, request_id: str, prompt: list[int], block_hashes: list[BlockHash], output: list[int],
            now: float, session_id: str, last_turn: bool) -> None:
        request = Request(request_id, prompt, SamplingParams(max_tokens=len(output), ignore_eos=True),
                          arrival_time=now, session_id=session_id, last_turn=last_turn)
        request.block_hashes = list(block_hashes)  # hashed once at the ingress, as the cluster does
        self.scheduler.add_request(request)
        self._scripts[request_id] = output
        self._live[request_id] = request

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> tuple[SchedulerOutput, float]:
        output = self.scheduler.schedule()
        load_s, self._load_s = self._load_s, 0.0
        return output, self.step_model.step_seconds(output, self.scheduler.requests) + load_s

    def _load_now(self, loads: list[KVLoad]) -> tuple[dict[str, int], float]:
        seconds = self.load_s_per_block * sum(len(load.slots) for load in loads)
        self._load_s += seconds
        return {load.request_id: self.host_pool.load(load.slots, load.block_hashes, _no_copy) for load in loads}, seconds

    def complete(self, output: SchedulerOutput) -> list[RequestOutput]:
        """End the step: sample a token for every request whose prompt is computed; store its written-through
        blocks in the pool (no bytes)."""
        requests = self.scheduler.requests
        req_ids = list(output.num_scheduled_tokens)
        sampled = [self._sample(requests[req_id]) for req_id in req_ids]
        if output.kv_save is not None and self._write_through:
            self.host_pool.store(output.kv_save.block_hashes, _no_copy)
        outputs = self.scheduler.update_from_output(output, ModelRunnerOutput(req_ids, sampled))
        for result in outputs:
            if result.finished:
                request = self._live.pop(result.request_id)
                del self._scripts[result.request_id]
                self._finished.append(FinishedRequest(result.request_id, request.num_cached_tokens))
        return outputs

    def publish(self) -> Publication:
        self._seq += 1
        finished, self._finished = self._finished, []
        events = self.kv_cache_manager.take_events()
        if self._watcher is not None:
            events += self._watcher.take_events()
        return Publication(self._seq, events, self.scheduler.make_stats(), finished)

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.kv_cache_manager.cached_block_hashes()

    def _sample(self, request: Request) -> list[int]:
        if request.num_computed_tokens < request.num_tokens:
            return []  # a prefill chunk
        return [self._scripts[request.request_id][request.num_output_tokens]]


def _no_copy(*slots) -> None:
    """The simulated pool's slots hold no bytes."""


class _WriteOnEvict(BlockPool):
    """A device block pool whose cached blocks go to the node's pool as they are evicted, not when computed."""

    def __init__(self, num_blocks: int, block_size: int, host_pool: HostPool):
        super().__init__(num_blocks, block_size)
        self._host_pool = host_pool

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        num_events = len(self.events)
        blocks = super().get_new_blocks(num_blocks)
        for event in self.events[num_events:]:
            if isinstance(event, BlockRemoved):
                self._host_pool.store(event.block_hashes, _no_copy)
        return blocks
