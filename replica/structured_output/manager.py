"""Compiling constraints off the step path, and filling one step's token bitmask.

A request's grammar compiles on a small thread pool while the request waits apart from the queue (the
scheduler passes over it); compiled grammars are cached by their spec, a bounded number of them, and each
request advances a copy. A compile that fails, or is not done within the time limit, fails its request
only. The bitmask of a step is filled on a thread of its own while the model computes the step's forward
pass: llguidance computes masks without the GIL.
"""
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from replica.structured_output.backend import Grammar, GrammarError, GuidanceBackend
from replica.structured_output.params import StructuredOutputsParams
from replica.structured_output.stats import StatsRecorder


class StructuredOutputRequest:
    """One request's constraint: compiling, then its Grammar (replaying the output it already has, if it moved
    here from another replica), or the error that ends it."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future, deadline: float,
                 replay_token_ids: list[int], copy: Callable[[Grammar], Grammar], clock: Callable[[], float]):
        self.params = params
        self._compiled = compiled
        self._deadline = deadline
        self._clock = clock
        self._replay_token_ids = replay_token_ids
        self._copy = copy
        self.grammar: Grammar | None = None
        self.error: str | None = None

    @property
    def future(self) -> Future:
        return self._compiled

    def poll(self) -> bool:
        """True once settled: grammar or error is set."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self._compiled.done():
            if self._clock() < self._deadline:
                return False
            self.error = "the constraint took too long to compile"
            return True
        try:
            grammar = self._copy(self._compiled.result())
        except Exception as exc:  # a GrammarError names the problem; anything else must fail this request alone too
            self.error = str(exc) if isinstance(exc, GrammarError) else \
                f"the {self.params.kind} constraint failed to compile: {exc!r}"
            return True
        accepted = all(grammar.accept(token_id) for token_id in self._replay_token_ids)
        if accepted:
            self.grammar = grammar
        else:
            self.error = f"the output so far does not match the {self.params.kind} constraint"
        return True


@dataclass
class GrammarBitmask:
    """One step's token bitmask: rows[req_id] is the first of a request's rows, one per logits row it samples (its
    next token's, then one after each of its drafts). Pickling it (to tensor-parallel ranks) waits for the fill."""
    rows: dict[str, int]
    bitmask: Future | np.ndarray

    def result(self) -> np.ndarray:
        return self.bitmask.result() if isinstance(self.bitmask, Future) else self.bitmask

    def __getstate__(self) -> dict:
        return {"rows": self.rows, "bitmask": self.result()}


class StructuredOutputManager:
    def __init__(self, backend: GuidanceBackend, *, compile_timeout_s: float = 10.0, cache_size: int = 256,
                 num_compile_threads: int = 2, clock: Callable[[], float] = time.monotonic):
        self.backend = backend
        self.compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_size = cache_size
        self._compile_pool = ThreadPoolExecutor(num_compile_threads, thread_name_prefix="grammar-compile",
                                                initializer=_lowest_priority)
        self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._clock = clock
        self.num_words = -(-backend.vocab_size // 32)
        self.stats = StatsRecorder()

    def request(self, params: StructuredOutputsParams, replay_token_ids: list[int] = ()) -> StructuredOutputRequest:
        self.stats.request(params.kind)
        return StructuredOutputRequest(params, self._compiled(params), self._clock() + self.compile_timeout_s,
                                       list(replay_token_ids), self.backend.copy, self._clock)

    def _compiled(self, params: StructuredOutputsParams) -> Future:
        """The compile of params' spec, shared by every request with the same spec (failures included, so that
        a spec that does not compile fails its repeats at once)."""
        key = params.key()
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._compile_pool.submit(self._timed_compile, params)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def _timed_compile(self, params: StructuredOutputsParams) -> Grammar:
        started = time.perf_counter()
        try:
            return self.backend.compile(params)
        finally:
            self.stats.compiled(time.perf_counter() - started)

    def fill_bitmask(self, rows: list[tuple[str, Grammar, list[int]]]) -> GrammarBitmask | None:
        """rows: (request id, its grammar, the drafts it verifies) of each constrained request that samples this
        step. The fill runs on a thread of its own; None if there is nothing to constrain."""
        if not rows:
            return None
        first_rows, num_rows = {}, 0
        for req_id, _, drafts in rows:
            first_rows[req_id] = num_rows
            num_rows += len(drafts) + 1
        bitmask = np.full((num_rows, self.num_words), -1, dtype=np.int32)
        return GrammarBitmask(first_rows, self._fill_thread.submit(self._timed_fill, bitmask, rows, first_rows))

    def _timed_fill(self, bitmask: np.ndarray, rows: list[tuple[str, Grammar, list[int]]],
                    first_rows: dict[str, int]) -> np.ndarray:
        started = time.perf_counter()
        self.backend.fill_bitmasks(bitmask, [(grammar, first_rows[req_id]) for req_id, grammar, _ in rows])
        for req_id, grammar, drafts in rows:
            if drafts:
                _fill_draft_rows(bitmask, first_rows[req_id], grammar, drafts)
        self.stats.mask_filled(time.perf_counter() - started)
        return bitmask

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_thread.shutdown(wait=False)


def _lowest_priority() -> None:
    """A compile thread yields its core to the forward pass: on a CPU host a compile of seconds at normal priority
    tripled the steps of the streams running beside it (benchmarks/bench_structured.py --slow-compile)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _fill_draft_rows(bitmask: np.ndarray, row: int, grammar: Grammar, drafts: list[int]) -> None:
    """Under speculative decoding, the rows after a request's first (filled already): one per draft position. The
    grammar takes the drafts in turn and gives them back at the end. Rows after a draft it would reject stay
    all-allowed: the rejection sampler stops at that draft, which the mask before it rules out."""
    valid = drafts[:grammar.validate(drafts)]
    for position, token_id in enumerate(valid, 1):
        grammar.accept(token_id)
        grammar.fill_bitmask(bitmask, row + position)
    grammar.rollback(len(valid))
