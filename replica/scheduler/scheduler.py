"""The vLLM-V1-style scheduler: one token budget per step shared by prefills and decodes.

Each step: running requests first (preempting by recompute when the KV cache is short), then
waiting requests, only if nothing was preempted. There are no prefill or decode phases: every
request just advances num_computed_tokens towards num_tokens_with_spec (its tokens and the drafts
the speculative proposer attached to it; those the model rejects are taken back). Under the
continuum policy a finished turn of an agent program may keep its blocks pinned for the program's
next turn (pins.py).
"""
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from replica.kv_cache import KVCacheBlocks, KVCacheManager
from replica.kv_cache.host_pool import KVLoad
from replica.request import Request, RequestStatus
from replica.scheduler.compute_rate import ComputeRate, LoadRate
from replica.scheduler.config import SchedulerConfig
from replica.scheduler.output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                      RequestOutput, SchedulerOutput, SchedulerStats,
                                      SpecDecodingStats)
from replica.scheduler.pin_keeper import PinKeeper
from replica.scheduler.pins import Pins
from replica.scheduler.request_queue import ContinuumRequestQueue, FCFSRequestQueue, PriorityRequestQueue
from replica.scheduler.trace import SchedulerTrace


@dataclass
class _StepPlan:
    """One step's decisions while schedule() builds them."""
    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # (request, block ids, tokens): new block ids for running requests, all of them for the others
    running: list[tuple[Request, list[int], int]] = field(default_factory=list)
    resumed: list[tuple[Request, list[int], int]] = field(default_factory=list)
    new: list[tuple[Request, list[int], int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # the drafts scheduled, by request
    loads: list[KVLoad] = field(default_factory=list)
    prefix_hits: dict[str, tuple[int, int]] = field(default_factory=dict)   # for the trace

    def add(self, group: list, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        group.append((request, block_ids, num_tokens))
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens

    def undo_running(self, request: Request) -> None:
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.spec_tokens.pop(request.request_id, None)
        self.running = [entry for entry in self.running if entry[0] is not request]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic, *, num_speculative_tokens: int = 0,
                 trace: SchedulerTrace | None = None):
        """num_speculative_tokens: the most drafts a request brings to a step; running requests get
        slots for that many tokens beyond this step's, so the next step's drafts already have them.
        trace: None means the one PREFIXSERVE_SCHED_TRACE names, if any."""
        self.config = config
        self.num_lookahead_tokens = num_speculative_tokens
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self._clock = clock
        self._trace = trace or SchedulerTrace.from_env()
        self._pin_keeper = PinKeeper(config, kv_cache_manager, clock, self._trace)
        self._compute_rate = self._pin_keeper.compute_rate or (
            ComputeRate(clock) if kv_cache_manager.host_pool is not None else None)
        self._load_rate = LoadRate(clock)
        match config.policy:
            case "priority":
                self.waiting = PriorityRequestQueue()
            case "continuum":
                self.waiting = ContinuumRequestQueue(self._pin_keeper.rank)
            case _:
                self.waiting = FCFSRequestQueue()
        self.running: list[Request] = []
        # constrained requests whose grammar is still compiling: not in the queue, so the requests behind them run
        self.waiting_for_grammar: list[Request] = []
        # requests whose prefix is being copied in from the node's pool: out of the queue until their step ends
        self.loading: dict[str, Request] = {}
        # Copies loads in at once (per request, its leading blocks that arrived whole; the seconds it took), so that
        # a request is admitted in the step that loads it. The engine sets it where the device's KV cache is in host
        # memory (a load is a memory copy, shorter than the step it would otherwise wait for); None: loads run beside
        # the next step's forward pass, and their requests wait for it to end.
        self.load_now: Callable[[list[KVLoad]], tuple[dict[str, int], float]] | None = None
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        # requests finished without running (too large to ever run, or their grammar failed), reported by the
        # next update
        self._unscheduled_outputs: list[RequestOutput] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_pool_hits = 0  # tokens loaded from the node's pool, cumulative
        self.spec_decoding = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens leaves no room "
                f"to generate within max_model_len={self.config.max_model_len}")
        self._pin_keeper.arrived(request)
        self.kv_cache_manager.update_block_hashes(request)
        self.requests[request.request_id] = request
        if request.structured_output is None:
            self.waiting.add(request)
        else:
            self.waiting_for_grammar.append(request)  # schedule() queues it once compiled

    def _promote_compiled(self) -> None:
        """Queue the requests whose grammar has compiled; finish those whose grammar failed."""
        if not self.waiting_for_grammar:
            return
        still_compiling = []
        for request in self.waiting_for_grammar:
            structured = request.structured_output
            if not structured.poll():
                still_compiling.append(request)
            elif structured.error is None:
                self.waiting.add(request)
            else:
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request)
                self._unscheduled_outputs.append(RequestOutput(request.request_id, [], True,
                                                               request.get_finished_reason(), error=structured.error))
        self.waiting_for_grammar = still_compiling

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self.kv_cache_manager.new_step_starts()
        self.expire_pins()
        self._promote_compiled()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        output = self._make_output(plan)
        if self._compute_rate is not None:
            self._compute_rate.step_scheduled(output.total_num_scheduled_tokens)
        async_scheduling = self.config.async_scheduling
        for group in (plan.running, plan.resumed, plan.new):
            for request, _, num_tokens in group:
                request.num_computed_tokens += num_tokens
                if async_scheduling and \
                        request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                    request.num_output_placeholders += 1  # this step samples a token the next one builds on
        self.finished_req_ids = set()
        if self._trace is not None and self._trace.steps:
            self._record_trace(plan)
        return output

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(self._num_new_tokens(request, request.num_computed_tokens),
                                 plan.token_budget)
            if num_new_tokens == 0 or self._has_all_tokens_in_flight(request):
                index += 1  # pass it over (continue, not break): the requests after it may still run
                continue
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)) is None:
                if self._pin_keeper.release_one_for(request):
                    continue
                victim_index = self._victim_index()
                victim = self.running[victim_index]
                self._preempt(victim_index, plan)
                if victim is request:  # it is the least important itself: no progress this step
                    return
                if victim_index < index:
                    index -= 1
            plan.add(plan.running, request, num_new_tokens, new_blocks.get_block_ids())
            if request.spec_token_ids:
                self._schedule_drafts(request, num_new_tokens, plan)
            index += 1

    @staticmethod
    def _schedule_drafts(request: Request, num_new_tokens: int, plan: _StepPlan) -> None:
        """The drafts that fit in this step's tokens go to the runner (the budget may have trimmed
        them); all are consumed: the proposer attaches fresh ones after the step."""
        num_spec_tokens = request.num_computed_tokens + num_new_tokens - request.num_tokens
        if num_spec_tokens > 0:
            plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec_tokens]
        request.spec_token_ids = []

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            if self._load_from_host(request, computed_blocks, plan):
                continue
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens)
            if self._can_never_run(request, num_new_tokens):
                self._ignore(request)
                continue
            if num_new_tokens > plan.token_budget:
                if not self.config.enable_chunked_prefill:
                    break  # the whole prompt must go in one step, and it does not fit this one
                num_new_tokens = plan.token_budget
            new_blocks = kv.allocate_slots(request, num_new_tokens, num_computed_tokens, computed_blocks,
                                           full_sequence_must_fit=self.config.reserve_full_sequence)
            if new_blocks is None:
                if self._pin_keeper.release_to_admit(request, bool(self.running)):
                    continue
                break  # strict head-of-line: no skipping ahead, no preempting to admit
            self.waiting.pop()
            group = plan.resumed if request.status == RequestStatus.PREEMPTED else plan.new
            self._admit(request, num_computed_tokens, plan)
            plan.add(group, request, num_new_tokens, kv.get_block_ids(request.request_id))

    def _load_from_host(self, request: Request, device_hits: KVCacheBlocks, plan: _StepPlan) -> bool:
        """Copy in the blocks of the request's prefix that the node's pool holds past its device hit, now (with
        load_now) or beside the step's forward pass: then it leaves the queue until the step ends, and comes back
        to its head. False if there are none, the cache is short of blocks for them, too many loads are under
        way, or it loaded already since it last ran (what did not arrive then, or was evicted since, is
        computed)."""
        if request.loaded_from_host or len(self.loading) >= self.config.max_loading_requests:
            return False
        slots = self.kv_cache_manager.host_hits(request, len(device_hits))
        if not slots or (load := self.kv_cache_manager.start_load(request, device_hits, slots)) is None:
            return False
        self.waiting.pop()
        request.loaded_from_host = True
        self.loading[request.request_id] = request
        if self.load_now is None:
            plan.loads.append(load)
        else:
            self._finish_loads([load], *self.load_now([load]))
        return True

    def _finish_loads(self, loads: list[KVLoad], num_loaded: dict[str, int], load_s: float) -> None:
        """The loaded blocks join the prefix cache (a block the pool lost meanwhile is computed instead), and
        their requests go back to the head of the queue, to be admitted with them as prefix hits."""
        for load in loads:
            request = self.loading.pop(load.request_id, None)
            if request is None:  # aborted while it loaded
                continue
            loaded = num_loaded.get(load.request_id, 0)
            self.kv_cache_manager.finish_load(request, loaded)
            self.host_pool_hits += loaded * self.kv_cache_manager.block_size
            self.waiting.prepend(request)
        self._load_rate.loaded(sum(len(load.slots) for load in loads) * self.kv_cache_manager.block_size, load_s)

    def _can_never_run(self, request: Request, num_new_tokens: int) -> bool:
        """Too big for the whole KV cache, or for a whole step when prefills may not be chunked."""
        return not self.kv_cache_manager.fits_when_alone(request) or (
            not self.config.enable_chunked_prefill and num_new_tokens > self.config.max_num_batched_tokens)

    def _ignore(self, request: Request) -> None:
        """Finish a request that would stall the queue forever, as vLLM does (FINISHED_IGNORED)."""
        self.waiting.pop()
        request.status = RequestStatus.FINISHED_IGNORED
        self._free_request(request)
        self._unscheduled_outputs.append(RequestOutput(request.request_id, [], True, request.get_finished_reason()))

    @staticmethod
    def _has_all_tokens_in_flight(request: Request) -> bool:
        """Async scheduling's skip-ahead: the steps still executing reach max_tokens already. A constrained
        request waits for its token instead: its next mask depends on it."""
        return request.num_output_placeholders > 0 and (
            request.structured_output is not None
            or request.num_output_tokens + request.num_output_placeholders >= request.max_tokens)

    def _num_new_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """The request's uncomputed gap, before the step's remaining budget is applied."""
        num_new_tokens = request.num_tokens_with_spec + request.num_output_placeholders - num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return min(num_new_tokens, self.config.max_model_len - 1 - num_computed_tokens)

    def _admit(self, request: Request, num_computed_tokens: int, plan: _StepPlan) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed_tokens
        self.running.append(request)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        plan.prefix_hits[request.request_id] = (request.num_tokens, num_computed_tokens)
        self._pin_keeper.admitted(request, num_computed_tokens)

    def _victim_index(self) -> int:
        if self.config.policy == "priority":
            return max(range(len(self.running)),
                       key=lambda i: (self.running[i].priority, self.running[i].arrival_time))
        if self.config.policy == "continuum":  # the latest admitted of the programs holding no pin
            unpinned = (i for i in reversed(range(len(self.running))) if self.running[i].session_id not in self.pins)
            return next(unpinned, len(self.running) - 1)
        return len(self.running) - 1

    def _preempt(self, index: int, plan: _StepPlan) -> None:
        """Preemption by recompute: drop every block and start over from token 0 later."""
        victim = self.running.pop(index)
        if victim.request_id in plan.num_scheduled_tokens:
            plan.undo_running(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []  # drafted from a context it will recompute
        victim.num_preemptions += 1
        victim.loaded_from_host = False
        self.num_preemptions += 1
        self.waiting.prepend(victim)
        plan.preempted.append(victim.request_id)

    def _make_output(self, plan: _StepPlan) -> SchedulerOutput:
        new_reqs = [NewRequestData(request.request_id, request.prompt_token_ids, request.sampling_params,
                                   block_ids, request.num_computed_tokens, list(request.output_token_ids))
                    for request, block_ids, _ in plan.new]
        cached = CachedRequestData()
        for request, block_ids, _ in plan.running + plan.resumed:
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
        for request, _, _ in plan.resumed:
            cached.resumed_req_ids.add(request.request_id)
            cached.all_token_ids[request.request_id] = list(request.all_token_ids)
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - plan.token_budget,
            preempted_req_ids=set(plan.preempted),
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            kv_loads=plan.loads,
            kv_save=self.kv_cache_manager.take_saves(plan.num_scheduled_tokens),
            structured_output_drafts={
                request.request_id: plan.spec_tokens.get(request.request_id, [])
                for group in (plan.running, plan.resumed, plan.new) for request, _, num_tokens in group
                if request.structured_output is not None
                and request.num_computed_tokens + num_tokens >= request.num_tokens_with_spec},
        )

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[RequestOutput]:
        if self._compute_rate is not None:
            self._compute_rate.step_done(scheduler_output.total_num_scheduled_tokens)
        outputs, self._unscheduled_outputs = self._unscheduled_outputs, []
        if scheduler_output.kv_loads:
            self._finish_loads(scheduler_output.kv_loads, model_output.kv_loaded, model_output.kv_load_s)
        stopped: set[Request] = set()
        requests = self.requests
        update_block_hashes = self.kv_cache_manager.update_block_hashes
        for req_id, token_ids in zip(model_output.req_ids, model_output.sampled_token_ids):
            request = requests.get(req_id)
            if not token_ids or request is None:
                continue  # a partial prefill, or finished since it was scheduled
            # A request preempted while this step executed keeps its token: it recomputes it on resumption.
            was_running = request.status == RequestStatus.RUNNING
            request.num_output_placeholders = max(request.num_output_placeholders - 1, 0)
            if was_running and (draft_token_ids := scheduler_output.scheduled_spec_decode_tokens.get(req_id)):
                self._take_back_rejected(request, len(draft_token_ids), len(token_ids) - 1)
            new_token_ids = self._append_until_stop(request, token_ids)
            finished = request.is_finished()
            if finished:
                if was_running:
                    stopped.add(request)
                else:
                    self.waiting.remove(request)
                self._free_request(request)
            else:
                update_block_hashes(request)
            outputs.append(RequestOutput(req_id, new_token_ids, finished, request.get_finished_reason(),
                                         request.stop_reason, _error(request)))
        if stopped:
            self.running = [request for request in self.running if request not in stopped]
        return outputs

    def _take_back_rejected(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """schedule() counted every draft as computed; from the first rejected one on, the positions are
        computed again (their KV slots overwritten), starting with the token emitted in its place."""
        request.num_computed_tokens -= num_draft_tokens - num_accepted
        stats = self.spec_decoding
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft_tokens
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.num_accepted_tokens_per_pos[position] += 1

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append sampled tokens one by one; the rest are dropped once the request stops."""
        for num_appended, token_id in enumerate(token_ids, 1):
            request.append_output_token_ids(token_id)
            if self._check_stop(request, token_id):
                return token_ids[:num_appended]
        return token_ids

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if request.structured_output is not None and self._grammar_ends(request, token_id):
            return True
        if token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif (request.num_output_tokens >= params.max_tokens
              or request.num_tokens >= self.config.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        else:
            return False
        return True

    @staticmethod
    def _grammar_ends(request: Request, token_id: int) -> bool:
        """The grammar takes the token: it stops the request once complete, fails it if it rejects the token
        (which the mask rules out)."""
        grammar = request.structured_output.grammar
        if not grammar.accept(token_id):
            request.status = RequestStatus.FINISHED_ERROR
            request.structured_output.error = f"the constraint rejected token {token_id}: {grammar.error}"
        elif grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            return False
        return True

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish (e.g. abort) running or waiting requests and free their blocks; unknown ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        stopped: set[Request] = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                stopped.add(request)
            elif request in self.waiting_for_grammar:
                self.waiting_for_grammar.remove(request)
            elif req_id in self.loading:
                del self.loading[req_id]
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)
        if stopped:
            self.running = [request for request in self.running if request not in stopped]

    def _free_request(self, request: Request) -> None:
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self._pin_keeper.finished(request)

    def expire_pins(self) -> None:
        """Free the pins whose time is up: every step, and while the engine idles, so that an idle
        replica's KV usage (which autoscaling reads) does not keep counting them."""
        self._pin_keeper.expire()

    @property
    def pins(self) -> Pins:
        """Continuum: the finished turns whose blocks are held for their programs' next turns."""
        return self._pin_keeper.pins

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; pins end first. False when running requests still hold blocks."""
        self._pin_keeper.release_all()
        return self.kv_cache_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.waiting_for_grammar) + len(self.loading) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.waiting_for_grammar) + len(self.loading),
            kv_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            host_pool_hits=self.host_pool_hits,
            host_load_token_cost=self._host_load_token_cost(),
            compute_seconds_per_token=self._compute_seconds_per_token(),
            num_prefill_tokens_pending=sum(map(_prefill_tokens_pending, itertools.chain(self.running, self.waiting))),
            num_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_blocks=self.kv_cache_manager.block_pool.num_blocks - 1,
            num_cached_blocks=len(self.kv_cache_manager.block_pool.cached_block_hash_to_block),
            pins=self._pin_keeper.snapshot(),
            spec_decoding=dataclasses.replace(
                self.spec_decoding,
                num_accepted_tokens_per_pos=list(self.spec_decoding.num_accepted_tokens_per_pos)),
        )

    def _compute_seconds_per_token(self) -> float | None:
        return (self._compute_rate.seconds(1) if self._compute_rate is not None else 0.0) or None

    def _host_load_token_cost(self) -> float | None:
        compute_s = self._compute_seconds_per_token()
        load_s = self._load_rate.seconds_per_token()
        return load_s / compute_s if compute_s and load_s is not None else None

    def num_waiting_uncached_tokens(self) -> int:
        """Tokens the waiting requests will compute: all beyond the prefix the cache holds now."""
        kv = self.kv_cache_manager
        return sum(request.num_tokens - kv.num_cached_prefix_tokens(request) for request in self.waiting)

    def _record_trace(self, plan: _StepPlan) -> None:
        pool = self.kv_cache_manager.block_pool
        self._trace.record(
            time=self._clock(), num_waiting=len(self.waiting), num_running=len(self.running),
            num_free_blocks=pool.get_num_free_blocks(),
            num_cached_blocks=len(pool.cached_block_hash_to_block),
            prefix_hits=plan.prefix_hits,
            scheduled={name: {request.request_id: plan.num_scheduled_tokens[request.request_id]
                              for request, _, _ in group}
                       for name, group in (("running", plan.running), ("resumed", plan.resumed),
                                           ("new", plan.new))},
            preempted=plan.preempted, num_pins=len(self.pins))


def _error(request: Request) -> str | None:
    return request.structured_output.error if request.status == RequestStatus.FINISHED_ERROR else None


def _prefill_tokens_pending(request: Request) -> int:
    """Tokens still to compute before the request decodes: the prompt, or all of it again after a preemption."""
    num_tokens_to_decode_from = request.num_tokens - min(request.num_output_tokens, 1)
    return max(num_tokens_to_decode_from - request.num_computed_tokens, 0)
