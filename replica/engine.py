"""EngineCore (add_request / step / abort over scheduler + model runner) and the offline LLM API."""
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
import torch

from kernels import Backend
from kernels.cpu import library as cpu_kernels
from replica.executor.checkpoint import load_checkpoint
from replica.executor.cpu_allocator import keep_freed_memory
from replica.executor.detokenizer import IncrementalDetokenizer
from replica.executor.model_runner import ModelRunner
from replica.executor.multiproc import MultiprocExecutor
from replica.executor.ngram_proposer import NgramProposer
from replica.executor.paged_cache import block_bytes, num_blocks_for_budget
from replica.executor.parallel import check_divisible
from replica.executor.worker import Executor, RunnerSpec, build_runner
from replica.async_engine import EngineOutput, ModelInfo
from replica.kv_cache import BlockHash, KVCacheManager, KVEvent
from replica.kv_cache.host_pool import HostPool, HostPoolSpec, HostPoolWatcher, default_pool_path
from replica.request import Request, RequestStatus, SamplingParams
from replica.config import CacheConfig, EngineConfig  # noqa: F401 (re-exported: replica.engine names them)
from replica.scheduler import ModelRunnerOutput, RequestOutput, Scheduler, SchedulerOutput, SchedulerStats
from replica.structured_output.backend import GuidanceBackend
from replica.structured_output.manager import StructuredOutputManager

# How long an idle step waits for a compiling grammar before it returns to its caller
_GRAMMAR_WAIT_S = 0.01

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is not None:
        return _DTYPES[dtype]
    # bf16 matmuls on AMX / AVX512-BF16 run several times faster than fp32 (benchmarks/results/offline.md)
    return torch.bfloat16 if device.type == "cuda" or torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def resolve_backend(backend: str, device: torch.device, head_dim: int) -> Backend:
    if backend != "auto":
        return backend
    if device.type == "cuda":
        return "triton"
    try:
        cpu_kernels.load()
    except cpu_kernels.BuildError as error:
        logger.warning("using the torch reference kernels: %s", error)
        return "torch"
    if head_dim not in cpu_kernels.HEAD_DIMS:
        logger.warning("using the torch reference kernels: the CPU kernels take head_dim in %s, not %d",
                       cpu_kernels.HEAD_DIMS, head_dim)
        return "torch"
    return "cpu"


ExecutorFactory = Callable[[RunnerSpec, int], Executor]  # (spec, tensor_parallel_size) -> the ranks' executor


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, *, make_executor: ExecutorFactory = MultiprocExecutor):
        """make_executor starts the ranks when tensor_parallel_size > 1 (processes of this machine by default)."""
        self.config = config = config or EngineConfig()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if device.type == "cpu":
            keep_freed_memory()
        checkpoint = load_checkpoint(config.model)
        self.tokenizer = checkpoint.tokenizer
        self.model_config = checkpoint.config
        self.model_name = config.served_model_name or checkpoint.name
        tp_size = config.tensor_parallel_size
        check_divisible(checkpoint.config, tp_size)

        cache = config.cache
        num_blocks = cache.num_kv_blocks or num_blocks_for_budget(
            checkpoint.config, cache.block_size, dtype, int(cache.kv_cache_memory_gib * 2**30), tp_size)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_gib={cache.kv_cache_memory_gib} holds no KV block")
        self.max_model_len = self._max_model_len(num_blocks)
        self.host_pool_spec = host_pool = self._host_pool_spec(dtype)
        pool = HostPool(host_pool) if host_pool is not None else None
        self._host_pool_watcher = HostPoolWatcher(pool, cache.block_size) if pool is not None else None
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache.block_size, enable_caching=cache.enable_prefix_caching,
            watermark=cache.watermark, max_model_len=self.max_model_len, hash_seed=cache.hash_seed,
            host_pool=pool)
        async_scheduling = config.scheduler.async_scheduling
        if async_scheduling is None:  # n-gram drafts need the previous step's tokens: synchronous, as in vLLM
            async_scheduling = device.type == "cuda" and not config.num_speculative_tokens
        self.scheduler = Scheduler(config.scheduler.model_copy(update={
            "max_model_len": self.max_model_len, "async_scheduling": async_scheduling}), self.kv_cache_manager,
            num_speculative_tokens=config.num_speculative_tokens)
        self.structured_outputs = StructuredOutputManager(
            GuidanceBackend(self.tokenizer.backend, checkpoint.config.vocab_size, self.tokenizer.eos_token_id),
            compile_timeout_s=config.grammar_compile_timeout_s)
        self._proposer = NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max) \
            if config.num_speculative_tokens else None
        backend = resolve_backend(config.backend, device, checkpoint.config.head_dim)
        spec = RunnerSpec(config.model, dtype, device, backend, cache.block_size, num_blocks,
                          cuda_graphs=not config.enforce_eager,
                          max_num_seqs=config.scheduler.max_num_seqs,
                          max_blocks_per_seq=-(-self.max_model_len // cache.block_size), host_pool=host_pool)
        self.runner: ModelRunner | Executor = build_runner(spec) if tp_size == 1 else make_executor(spec, tp_size)
        if host_pool is not None and device.type == "cpu" and not async_scheduling:  # no step runs meanwhile
            self.scheduler.load_now = self.runner.load_from_host
        logger.info("%s on %s x %d: %s, %s kernels", self.model_name, device, tp_size,
                    str(dtype).removeprefix("torch."), backend)
        self._runner_thread = ThreadPoolExecutor(1, thread_name_prefix="model-runner") \
            if async_scheduling else None
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self._requests: dict[str, tuple[Request, IncrementalDetokenizer]] = {}
        logger.info("KV cache per rank: %.3f GiB = %d blocks of %d tokens (budget %s); max_model_len %d",
                    num_blocks * block_bytes(checkpoint.config, cache.block_size, dtype, tp_size) / 2**30,
                    num_blocks, cache.block_size, "num_kv_blocks" if cache.num_kv_blocks else
                    f"{cache.kv_cache_memory_gib} GiB", self.max_model_len)

    def _host_pool_spec(self, dtype: torch.dtype) -> HostPoolSpec | None:
        cache, model = self.config.cache, self.model_config
        if not cache.host_pool_gib or not cache.enable_prefix_caching:
            return None
        if self.config.tensor_parallel_size > 1:
            raise ValueError("a host KV pool (host_pool_gib) needs tensor_parallel_size=1")
        slot_bytes = block_bytes(model, cache.block_size, dtype)
        layout = (f"{self.model_name}|{str(dtype).removeprefix('torch.')}|{cache.block_size}x{model.num_kv_heads}"
                  f"x{model.head_dim}x{model.num_layers}|seed {cache.hash_seed}")
        return HostPoolSpec(cache.host_pool_path or default_pool_path(layout),
                            int(cache.host_pool_gib * 2**30) // slot_bytes, slot_bytes, layout)

    def _max_model_len(self, num_blocks: int) -> int:
        context_len = self.model_config.max_position
        wanted = self.config.max_model_len or context_len
        if wanted > context_len:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context length {context_len}")
        kv_capacity = (num_blocks - 1) * self.config.cache.block_size  # block 0 is the null block
        if kv_capacity < wanted:
            logger.warning("max_model_len capped from %d to %d tokens: the KV cache holds no more",
                           wanted, kv_capacity)
        return min(wanted, kv_capacity)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    session_id: str | None = None, last_turn: bool = False,
                    block_hashes: Sequence[BlockHash] = (), output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request; ValueError (and nothing queued) on bad input.

        block_hashes: the chain of the full blocks of prompt + output, or a prefix of it, hashed as this
        engine's KVCacheManager does (the ingress hashes once for the router and the replica).
        output_token_ids: what it generated on a replica that was lost (see Request); this engine's
        outputs continue after them, in tokens and in text."""
        structured_output = None if params.structured_outputs is None else \
            self.structured_outputs.request(params.structured_outputs, output_token_ids)
        request = Request(request_id, prompt_token_ids, params, priority=priority, arrival_time=arrival_time,
                          cache_salt=cache_salt, eos_token_id=self.tokenizer.eos_token_id, session_id=session_id,
                          last_turn=last_turn, block_hashes=block_hashes, output_token_ids=output_token_ids,
                          structured_output=structured_output)
        if max(request.all_token_ids) >= self.model_config.vocab_size:
            raise ValueError(f"token ids must be integers in [0, {self.model_config.vocab_size})")
        if len(block_hashes) > request.num_tokens // self.config.cache.block_size:
            raise ValueError(f"{len(block_hashes)} block hashes for {request.num_tokens} tokens")
        self.scheduler.add_request(request)
        self._requests[request_id] = (request, IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, request.output_token_ids))

    def step(self) -> list[EngineOutput]:
        """One schedule + execute + update; requests that produced tokens report them.

        With async scheduling the model runs in a thread of its own, and step() schedules the next
        step before it waits for the one executing, so that scheduling, stop checks and detokenizing
        happen while the model computes. The first step's outputs come with the second."""
        if self._runner_thread is None:
            scheduler_output = self._schedule()
            return self._update(scheduler_output, self.runner.execute_model(scheduler_output))
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self._schedule()
            self._in_flight.append((scheduler_output,
                                    self._runner_thread.submit(self.runner.execute_model, scheduler_output)))
            if len(self._in_flight) == 1 and scheduler_output.total_num_scheduled_tokens:
                return []
        if not self._in_flight:
            return []
        scheduler_output, model_output = self._in_flight.popleft()
        return self._update(scheduler_output, model_output.result())

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step, with the token bitmask of its constrained requests being filled (while the
        model computes the forward pass). A step with nothing to run while grammars compile waits a little for
        them, so that the engine loop does not spin."""
        scheduler_output = self.scheduler.schedule()
        drafts = scheduler_output.structured_output_drafts
        if drafts:
            requests = self.scheduler.requests
            scheduler_output.grammar_bitmask = self.structured_outputs.fill_bitmask(
                [(req_id, requests[req_id].structured_output.grammar, draft_ids)
                 for req_id, draft_ids in drafts.items()])
        elif not scheduler_output.total_num_scheduled_tokens and self.scheduler.waiting_for_grammar:
            wait([request.structured_output.future for request in self.scheduler.waiting_for_grammar],
                 timeout=_GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        return scheduler_output

    def _update(self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput) -> list[EngineOutput]:
        request_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        logprobs = dict(zip(model_output.req_ids, model_output.logprobs or ()))
        top_logprobs = dict(zip(model_output.req_ids, model_output.top_logprobs or ()))
        outputs = [self._make_output(output, logprobs.get(output.request_id), top_logprobs.get(output.request_id))
                   for output in request_outputs]
        self._propose_drafts(request_outputs)
        return outputs

    def _propose_drafts(self, request_outputs: list[RequestOutput]) -> None:
        """Speculative decoding: drafts for the next step of each request that emitted tokens and goes on,
        no more than it may still emit after the token the step verifying them adds."""
        if self._proposer is None:
            return
        for output in request_outputs:
            request = self.scheduler.requests.get(output.request_id)
            if request is None or request.status != RequestStatus.RUNNING:  # finished (by a stop string too)
                continue
            room = min(self.max_model_len - 1 - request.num_tokens, request.max_tokens - request.num_output_tokens - 1)
            drafts = self._proposer.propose(request.all_token_ids, room)
            if drafts and request.structured_output is not None:  # up to the first the grammar rejects
                drafts = drafts[:request.structured_output.grammar.validate(drafts)]
            request.spec_token_ids = drafts

    def _make_output(self, output: RequestOutput, logprobs: list[float] | None,
                     top_logprobs: list[list[tuple[int, float]]] | None) -> EngineOutput:
        request, detokenizer = self._requests[output.request_id]
        new_text, hit_stop_string = detokenizer.update(output.new_token_ids, output.finished)
        finished, finish_reason = output.finished, output.finish_reason
        if hit_stop_string:
            if not finished:
                self.scheduler.finish_requests(output.request_id, RequestStatus.FINISHED_STOPPED)
            finished, finish_reason = True, "stop"
        if finished:
            del self._requests[output.request_id]
        if output.error is not None:
            self.structured_outputs.stats.error()
        params, num_new = request.sampling_params, len(output.new_token_ids)
        return EngineOutput(
            request_id=output.request_id, new_token_ids=output.new_token_ids, new_text=new_text,
            finished=finished, finish_reason=finish_reason, error=output.error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            logprobs=logprobs[:num_new] if params.logprobs and logprobs else None,
            top_logprobs=[top[:params.top_logprobs] for top in top_logprobs[:num_new]]
            if params.top_logprobs and top_logprobs else None)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish requests now and free their KV blocks; unknown ids are ignored."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """Requests to run, or steps still executing whose outputs step() has not returned."""
        return self.scheduler.get_num_unfinished_requests() > 0 or bool(self._in_flight)

    def expire_pins(self) -> None:
        self.scheduler.expire_pins()

    def take_kv_events(self) -> list[KVEvent]:
        """The device cache's events since the last call, then the node pool's changes (medium "host")."""
        events = self.kv_cache_manager.take_events()
        if self._host_pool_watcher is not None:
            events += self._host_pool_watcher.take_events()
        return events

    def cached_block_hashes(self) -> list[BlockHash]:
        """The device's cached blocks; the next take_kv_events reports every block of the node's pool, if any."""
        if self._host_pool_watcher is not None:
            self._host_pool_watcher.report_all()
        return self.kv_cache_manager.cached_block_hashes()

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.structured_outputs = self.structured_outputs.stats.snapshot()
        return stats

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model_name, max_model_len=self.max_model_len,
                         vocab_size=self.model_config.vocab_size, block_size=self.config.cache.block_size,
                         hash_seed=self.config.cache.hash_seed, host_pool=self.host_pool_spec)

    def check_health(self) -> None:
        """WorkerLost if a tensor-parallel rank is gone."""
        if self.config.tensor_parallel_size > 1:
            self.runner.check_health()

    def shutdown(self) -> None:
        """Ends the tensor-parallel ranks' processes, if any; the engine cannot step afterwards."""
        if self._runner_thread is not None:
            self._runner_thread.shutdown(wait=True)
        self.structured_outputs.shutdown()
        if self.config.tensor_parallel_size > 1:
            self.runner.shutdown()


@dataclass
class CompletionOutput:
    """One finished request of LLM.generate / LLM.chat."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    error: str | None = None  # why it failed, when finish_reason is "error" (its constraint did not compile)


Prompt = str | Sequence[int]


class LLM:
    """Offline batch inference, used like vLLM's LLM."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = EngineCore(EngineConfig(model=model, **engine_args))
        self._request_ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionOutput]:
        """Prompts as text or token ids; one SamplingParams for all or one per prompt. Outputs in order."""
        if isinstance(prompts, str) or (prompts and all(isinstance(token, int) for token in prompts)):
            prompts = [prompts]
        token_prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_prompts, sampling_params)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[CompletionOutput]:
        """One conversation (a list of messages) or several; each gets the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self.tokenizer.apply_chat_template(list(c)) for c in conversations], sampling_params)

    def _run(self, prompts: list[list[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[CompletionOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        results: dict[str, CompletionOutput] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = str(next(self._request_ids))
                self.engine.add_request(request_id, prompt, params, arrival_time=time.monotonic())
                results[request_id] = CompletionOutput(request_id, prompt,
                                                       logprobs=[] if params.logprobs else None)
        except ValueError:
            self.engine.abort(results)
            raise
        while self.engine.has_unfinished():
            for output in self.engine.step():
                _accumulate(results[output.request_id], output)
        return list(results.values())


def _accumulate(result: CompletionOutput, output: EngineOutput) -> None:
    result.token_ids.extend(output.new_token_ids)
    result.text += output.new_text
    if output.logprobs is not None:
        result.logprobs.extend(output.logprobs)
    if output.finished:
        result.finish_reason = output.finish_reason
        result.num_cached_tokens = output.num_cached_tokens
        result.error = output.error
