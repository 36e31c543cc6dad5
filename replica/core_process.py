"""ProcessEngine: an EngineCore in a process of its own, streamed to callers on this process's event loop.

The core process loops on its own: it takes what arrived (requests, aborts, calls) between two steps, steps
while it has work, and sends one message per step with every request's outputs, the step's KV events and the
core's stats. The serving process, with its Ray and Serve machinery, never shares an interpreter with the step;
a reader thread of the core process takes messages off the pipe while the step runs, so that a send from the
event loop never waits for a step to end. A core that fails a step fails every stream of it with EngineDeadError;
a core process that dies, with EngineCoreLost.
"""
import asyncio
import contextlib
import functools
import logging
import multiprocessing
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from replica.async_engine import (Core, EngineDeadError, EngineFrontend, EngineOutput, EngineRequest, ModelInfo,
                                  add_request, run_hook)
from replica.config import EngineConfig
from replica.kv_cache import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from replica.kv_cache.events import Medium
from replica.scheduler import SchedulerStats

logger = logging.getLogger("ray.serve.prefixserve.engine")
_SHUTDOWN_TIMEOUT_S = 10.0


class EngineCoreLost(EngineDeadError):
    """The core process is gone (killed, out of memory, crashed) while the serving process lives: its requests may
    go on elsewhere. A core that fails a step (an exception) is only an EngineDeadError, as in a thread."""


@dataclass
class Step:
    """What the core process sends after each step (and every idle interval when idle)."""
    outputs: list[EngineOutput]
    kv_events: list[KVEvent]
    stats: SchedulerStats


class CoreView:
    """The serving side's view of the core, from its step messages: what RouterPublisher.record reads. The cached
    block hashes are the KV events applied in order, as the router's index applies them."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._cached: dict[Medium, dict[BlockHash, None]] = {"device": {}, "host": {}}
        self._stats: SchedulerStats | None = None
        self._report_host: BlockStored | None = None  # the node pool's blocks, for the next take_kv_events
        self._block_size = 0

    def apply(self, step: Step) -> None:
        self._events += step.kv_events
        self._stats = step.stats
        for event in step.kv_events:
            cached = self._cached[event.medium]
            if isinstance(event, BlockStored):
                cached.update(dict.fromkeys(event.block_hashes))
                self._block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    cached.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()

    def take_kv_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        if self._report_host is not None:  # it covers the host events so far
            events = [event for event in events if event.medium == "device"]
            events += [AllBlocksCleared("host"), self._report_host]
            self._report_host = None
        return events

    def cached_block_hashes(self) -> list[BlockHash]:
        """The device's cached blocks; the next take_kv_events reports every block of the node's pool, if any."""
        if self._cached["host"]:
            self._report_host = BlockStored(list(self._cached["host"]), None, [], self._block_size, "host")
        return list(self._cached["device"])

    def stats(self) -> SchedulerStats | None:
        """The last step's; None before the first."""
        return self._stats


class ProcessEngine(EngineFrontend):
    def __init__(self, process: multiprocessing.Process, pipe: Connection, model_info: ModelInfo, *,
                 after_step: Callable[[CoreView], None] | None = None):
        """Use start()."""
        super().__init__()
        self._model_info = model_info
        self.view = CoreView()
        self._process = process
        self._pipe = pipe
        self._after_step = after_step
        self._calls: dict[int, asyncio.Future] = {}
        self._next_call = 0
        self._loop = asyncio.get_running_loop()
        # A thread reads the pipe, not the event loop: a loop watching the pipe may make it non-blocking (uvloop,
        # Serve's) and a message that arrives in parts then fails to read.
        self._reader = threading.Thread(target=self._read_forever, name="engine-core-outbox", daemon=True)
        self._reader.start()

    @classmethod
    async def start(cls, make_core: Callable[[], Core], *, after_step: Callable[[CoreView], None] | None = None,
                    idle_interval_s: float = 1.0) -> "ProcessEngine":
        """Starts the core process, which calls make_core (it must pickle: an EngineConfig's, core_of(config)),
        and waits for it to load its model (seconds); the error that make_core raised, if any."""
        context = multiprocessing.get_context("spawn")  # a forked torch (threads, CUDA) is not safe to use
        ours, theirs = context.Pipe()
        process = context.Process(target=run_core, args=(theirs, make_core, idle_interval_s), name="engine-core",
                                  daemon=True)
        with _main_module_unseen():
            process.start()
        theirs.close()
        try:
            kind, payload = await asyncio.to_thread(_first_message, ours, process)
        except BaseException:
            process.kill()
            raise
        if kind == "failed":
            process.join()
            raise payload
        return cls(process, ours, payload, after_step=after_step)

    async def call(self, fn: Callable[[Core], Any]) -> Any:
        """fn(core) in the core process, between two steps; fn and its result must pickle."""
        self._check_alive()
        call_id, self._next_call = self._next_call, self._next_call + 1
        future = self._calls[call_id] = self._loop.create_future()
        self._send(("call", call_id, fn))
        return await future

    def model_info(self) -> ModelInfo:
        return self._model_info

    async def check_health(self) -> None:
        self._check_alive()
        if not self._process.is_alive():
            raise EngineDeadError(f"the engine core process exited (code {self._process.exitcode})")

    async def shutdown(self) -> None:
        if self._error is None:
            self._send(None)
        await asyncio.to_thread(self._process.join, _SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
        await asyncio.to_thread(self._reader.join)  # it reads to the end of the pipe, which the exit closed
        self._pipe.close()
        self._close(EngineDeadError("the engine is shutting down"))

    def _submit(self, request: EngineRequest, stream: asyncio.Queue) -> None:
        self._streams[request.request_id] = stream
        self._send(("add", request))

    def _cancel(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self._error is None:
            self._send(("abort", request_id))

    def _send(self, message: Any) -> None:
        try:
            self._pipe.send(message)
        except OSError:  # the process is gone: the reader reports it
            pass

    def _read_forever(self) -> None:
        try:
            while True:
                self._loop.call_soon_threadsafe(self._handle, *self._pipe.recv())
        except (EOFError, OSError) as exc:
            self._process.join(1.0)
            error = EngineCoreLost(f"the engine core process exited (code {self._process.exitcode}): {exc!r}")
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            return
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._close, error)

    def _handle(self, kind: str, *payload: Any) -> None:
        if kind == "step":
            step = payload[0]
            self.view.apply(step)
            self._dispatch(step.outputs)
            if self._after_step is not None:
                run_hook(lambda: self._after_step(self.view))
        elif kind == "rejected":
            request_id, message = payload
            if (stream := self._streams.pop(request_id, None)) is not None:
                stream.put_nowait(ValueError(message))
        elif kind == "result":
            call_id, ok, value = payload
            future = self._calls.pop(call_id)
            if future.cancelled():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        elif kind == "failed":
            logger.error("the engine core failed: %r", payload[0])
            self._close(payload[0])

    def _close(self, exc: BaseException) -> None:
        if self._error is None:
            self._fail_all(exc)
            for future in self._calls.values():
                future.set_exception(exc)
            self._calls.clear()


@contextlib.contextmanager
def _main_module_unseen():
    """A spawned process runs its parent's main module again (as __mp_main__) unless the parent's has neither a
    file nor a module name: in a Serve replica that is Ray's worker script, whose imports (Ray's) the core
    process never uses. What the core runs must pickle by importable names anyway."""
    main = sys.modules["__main__"]
    path, spec = main.__dict__.pop("__file__", None), main.__spec__
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = spec
        if path is not None:
            main.__file__ = path


def _first_message(pipe: Connection, process: multiprocessing.Process) -> tuple[str, Any]:
    ready = multiprocessing.connection.wait([pipe, process.sentinel])
    if pipe not in ready:
        raise EngineDeadError(f"the engine core process exited while starting (code {process.exitcode})")
    return pipe.recv()


def core_of(config: EngineConfig) -> Callable[[], Core]:
    """What ProcessEngine.start takes to run an EngineCore of config."""
    return functools.partial(_engine_core, config)


def _engine_core(config: EngineConfig) -> Core:
    from replica.engine import EngineCore  # imported in the core process, when it runs

    return EngineCore(config)


def run_core(pipe: Connection, make_core: Callable[[], Core], idle_interval_s: float) -> None:
    """The core process: build the core, then step it until told to stop (None) or the serving side is gone."""
    try:
        core = make_core()
    except Exception as exc:
        pipe.send(("failed", exc))
        return
    pipe.send(("ready", core.model_info()))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_forever, args=(pipe, inbox), name="engine-core-inbox", daemon=True).start()
    try:
        _loop(core, pipe, inbox, idle_interval_s)
    except BrokenPipeError:
        pass  # the serving process is gone, and with it whoever would read what this step made
    except Exception as exc:
        logger.exception("engine core failed")
        with contextlib.suppress(OSError):
            pipe.send(("failed", EngineDeadError(f"the engine core failed: {exc!r}")))
    finally:
        core.shutdown()


def _read_forever(pipe: Connection, inbox: queue.SimpleQueue) -> None:
    try:
        while True:
            inbox.put(pipe.recv())
    except (EOFError, OSError):  # the serving process is gone: stop as if told to
        inbox.put(None)


def _loop(core, pipe: Connection, inbox: queue.SimpleQueue, idle_interval_s: float) -> None:
    while True:
        for message in _arrived(inbox, None if core.has_unfinished() else idle_interval_s):
            if message is None:
                return
            _apply(core, pipe, message)
        if core.has_unfinished():
            outputs = core.step()
        else:
            core.expire_pins()
            outputs = []
        pipe.send(("step", Step(outputs, core.take_kv_events(), core.stats())))


def _arrived(inbox: queue.SimpleQueue, wait_s: float | None) -> list:
    """The messages that arrived; with wait_s (the core is idle), up to that long for the first."""
    messages = []
    try:
        if wait_s is not None:
            messages.append(inbox.get(timeout=wait_s))
        while True:
            messages.append(inbox.get_nowait())
    except queue.Empty:
        return messages


def _apply(core, pipe: Connection, message: tuple) -> None:
    kind, *payload = message
    if kind == "add":
        request: EngineRequest = payload[0]
        try:
            add_request(core, request)
        except ValueError as exc:
            pipe.send(("rejected", request.request_id, str(exc)))
    elif kind == "abort":
        core.abort(payload)
    elif kind == "call":
        call_id, fn = payload
        try:
            pipe.send(("result", call_id, True, fn(core)))
        except Exception as exc:
            pipe.send(("result", call_id, False, exc))
