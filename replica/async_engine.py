"""AsyncEngine: drives one EngineCore from asyncio and streams each request's outputs to its caller.

EngineCore is not thread-safe and its step() takes tens of milliseconds, so step() runs in a
single worker thread while the event loop stays free to accept and cancel requests. Everything
else that touches the core (adding, aborting, reading stats) runs on the event loop between two
steps, never during one.
"""
import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from replica.kv_cache import BlockHash, KVEvent
from replica.kv_cache.host_pool import HostPoolSpec
from replica.request import SamplingParams
from replica.scheduler import Scheduler, SchedulerStats

logger = logging.getLogger("ray.serve.prefixserve.engine")


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress needs to know about the engines' model and cache."""
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    hash_seed: int = 0
    host_pool: HostPoolSpec | None = None  # the node's pool the engines write through to, if any


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A tokenized request as the ingress hands it to an engine replica (and the router reads it)."""
    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[BlockHash]  # chained hashes of the full blocks of prompt + output, as the replicas hash them
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    session_id: str | None = None  # the conversation or agent program it is a turn of
    last_turn: bool = False  # the program's last: under the continuum policy, nothing to pin its blocks for
    output_token_ids: list[int] = field(default_factory=list)  # generated on a replica that was lost
    route_to: str | None = None  # the replica it goes to if still there (a later choice of n: its first's); else routed
    lost_on: str | None = None  # the replica it was lost on (a migrated request): routed anywhere else there is

    @property
    def num_tokens(self) -> int:
        """The tokens a replica computes before it generates: the prompt, and any output migrated with it."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class EngineOutput:
    """What one step produced for one request; a replica's first for a request names the replica."""
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token: (token id, logprob), likeliest first
    replica_id: str | None = None  # only on a replica's first output for the request: the replica that took it
    error: str | None = None  # the request failed on its own (finish_reason "error"): why

    def merged(self, later: "EngineOutput") -> "EngineOutput":
        """This output and a later one of the same request as one."""
        return replace(
            later, new_token_ids=self.new_token_ids + later.new_token_ids, new_text=self.new_text + later.new_text,
            logprobs=_joined(self.logprobs, later.logprobs),
            top_logprobs=_joined(self.top_logprobs, later.top_logprobs), replica_id=self.replica_id)


class Core(Protocol):
    """What AsyncEngine, ProcessEngine and ReplicaStats use of an engine core (replica.engine.EngineCore)."""
    scheduler: Scheduler

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    **options: Any) -> None: ...

    def step(self) -> list[EngineOutput]: ...

    def abort(self, request_ids: Iterable[str]) -> None: ...

    def has_unfinished(self) -> bool: ...

    def expire_pins(self) -> None: ...

    def stats(self) -> SchedulerStats: ...

    def take_kv_events(self) -> list[KVEvent]: ...

    def model_info(self) -> ModelInfo: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class ReplicaStats:
    """What an engine replica reports to the autoscaling policy; Serve aggregates each field by its name."""
    num_preemptions: int  # cumulative
    kv_cache_usage: float
    num_waiting: int
    num_waiting_uncached_tokens: int

    @classmethod
    def of(cls, core: Core) -> "ReplicaStats":
        stats = core.stats()
        return cls(num_preemptions=stats.num_preemptions, kv_cache_usage=stats.kv_usage,
                   num_waiting=stats.num_waiting,
                   num_waiting_uncached_tokens=core.scheduler.num_waiting_uncached_tokens())


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step failed, or shutdown): no request can be served any more."""


class EngineFrontend:
    """Streams each request's outputs to its caller, on an event loop, from an engine core driven elsewhere: a
    subclass hands requests and aborts to its core (_submit, _cancel) and its outputs to _dispatch."""

    def __init__(self) -> None:
        self._streams: dict[str, asyncio.Queue] = {}
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped; None while it runs."""
        return self._error

    async def generate(self, request: EngineRequest, stream_interval_s: float = 0.0) -> AsyncIterator[EngineOutput]:
        """The request's outputs until one is finished; closing the iterator early aborts it. Outputs that come
        within stream_interval_s of the last one yielded are merged into one, for a caller that pays per output;
        the first and the finished one are never held back."""
        self._check_alive()
        queue: asyncio.Queue = asyncio.Queue()
        self._submit(request, queue)
        loop = asyncio.get_running_loop()
        finished, yielded_at, error = False, -math.inf, None
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                if stream_interval_s:  # by default every output goes out as it comes, with no merging to try
                    output, error = await _merge_until(queue, output, yielded_at + stream_interval_s)
                finished = output.finished or error is not None
                yield output
                yielded_at = loop.time()
                if error is not None:
                    raise error
        finally:
            if not finished:
                self._cancel(request.request_id)

    def _submit(self, request: EngineRequest, queue: asyncio.Queue) -> None:
        raise NotImplementedError

    def _cancel(self, request_id: str) -> None:
        raise NotImplementedError

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is None:
                continue  # aborted while the step ran
            queue.put_nowait(output if output.error is None else ValueError(output.error))
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        self._error = exc
        for queue in self._streams.values():
            queue.put_nowait(exc)
        self._streams.clear()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}")


class AsyncEngine(EngineFrontend):
    """The core in this process: step() runs in a worker thread."""

    def __init__(self, core: Core, *, after_step: Callable[[], None] | None = None,
                 idle_interval_s: float = 1.0):
        """after_step runs on the event loop after every step, and every idle_interval_s when idle (and when
        the loop wakes for anything but a request); the next step waits for it, so it hands anything slow
        (publishing) to a task of its own."""
        super().__init__()
        self.core = core
        self._after_step = after_step
        self._idle_interval_s = idle_interval_s
        self._to_add: deque[tuple[EngineRequest, asyncio.Queue]] = deque()
        self._to_abort: list[str] = []
        self._calls: list[tuple[Callable[[Core], Any], asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def call(self, fn: Callable[[Core], Any]) -> Any:
        """fn(core), run on the loop between two steps."""
        self._check_alive()
        future = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future))
        self._wakeup.set()
        return await future

    def model_info(self) -> ModelInfo:
        return self.core.model_info()

    async def check_health(self) -> None:
        await asyncio.to_thread(self.core.check_health)

    async def shutdown(self) -> None:
        """Stops the loop, then the core (its tensor-parallel ranks, if any)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        await asyncio.to_thread(self.core.shutdown)

    def _submit(self, request: EngineRequest, queue: asyncio.Queue) -> None:
        self._to_add.append((request, queue))
        self._wakeup.set()

    def _cancel(self, request_id: str) -> None:
        self._to_abort.append(request_id)
        self._wakeup.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if self.core.has_unfinished():
                    self._dispatch(await loop.run_in_executor(self._executor, self.core.step))
                else:
                    await self._wait_for_work()
                    self.core.expire_pins()
                    if self._to_add:
                        continue  # a step follows at once, and the hook after it reports both
                if self._after_step is not None:
                    run_hook(self._after_step)
        except asyncio.CancelledError:
            self._fail_all(EngineDeadError("the engine is shutting down"))
            raise
        except Exception as exc:
            logger.exception("engine loop failed")
            self._fail_all(exc)

    def _apply_pending(self) -> None:
        # Additions first: a caller may have gone away before its request was even added.
        while self._to_add:
            self._add(*self._to_add[0])  # if it raises, the request is still listed for _fail_all to answer
            self._to_add.popleft()
        aborts, self._to_abort = self._to_abort, []
        if aborts:
            self.core.abort(aborts)
            for request_id in aborts:
                self._streams.pop(request_id, None)
        calls, self._calls = self._calls, []
        for fn, future in calls:
            _settle(future, fn, self.core)

    def _add(self, request: EngineRequest, queue: asyncio.Queue) -> None:
        try:
            add_request(self.core, request)
        except ValueError as exc:
            queue.put_nowait(exc)
            return
        self._streams[request.request_id] = queue

    async def _wait_for_work(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._idle_interval_s):
                await self._wakeup.wait()
        self._wakeup.clear()

    def _fail_all(self, exc: BaseException) -> None:
        super()._fail_all(exc)
        for _, queue in self._to_add:
            queue.put_nowait(exc)
        for _, future in self._calls:
            future.set_exception(exc)
        self._to_add.clear()
        self._calls.clear()


def add_request(core: Core, request: EngineRequest) -> None:
    """request into core; ValueError (nothing added) on bad input."""
    core.add_request(request.request_id, request.prompt_token_ids, request.params, priority=request.priority,
                     cache_salt=request.cache_salt, session_id=request.session_id, last_turn=request.last_turn,
                     block_hashes=request.block_hashes, output_token_ids=request.output_token_ids)


def run_hook(hook: Callable[[], None]) -> None:
    try:
        hook()
    except Exception:  # publishing is best effort; it must never stop the engine
        logger.exception("after_step hook failed")


async def _merge_until(queue: asyncio.Queue, output: EngineOutput,
                       deadline: float) -> tuple[EngineOutput, BaseException | None]:
    """output merged with those the queue brings before the deadline (loop time), up to a finished one or an
    error, which is returned beside it."""
    loop = asyncio.get_running_loop()
    while not output.finished and (remaining := deadline - loop.time()) > 0:
        try:
            later = await asyncio.wait_for(queue.get(), remaining)  # a cancelled get leaves the item queued
        except TimeoutError:
            break
        if isinstance(later, BaseException):
            return output, later
        output = output.merged(later)
    return output, None


def _joined(earlier: list | None, later: list | None) -> list | None:
    return None if earlier is None and later is None else (earlier or []) + (later or [])


def _settle(future: asyncio.Future, fn: Callable[[Core], Any], core: Core) -> None:
    if future.cancelled():
        return
    try:
        future.set_result(fn(core))
    except Exception as exc:
        future.set_exception(exc)
