"""ComputeRate: how long this replica has recently taken per token it computes, from the steps it ran (and LoadRate,
per token it loads from the node's pool).
Continuum prices a pin with it: what recomputing the pinned history would cost (pin_keeper.py)."""
import math
from collections import deque
from collections.abc import Callable

_DECAY = 0.99  # per step: the rate follows about the last hundred steps


class ComputeRate:
    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._in_flight: deque[tuple[float, int]] = deque()  # (scheduled at, tokens) of steps not yet done
        self._last_done = -math.inf
        self._seconds = 0.0
        self._tokens = 0.0

    def step_scheduled(self, num_tokens: int) -> None:
        if num_tokens:
            self._in_flight.append((self._clock(), num_tokens))

    def step_done(self, num_tokens: int) -> None:
        """A step with tokens ended. Its time counts from when it was scheduled or the step before it ended,
        whichever came later: with async scheduling two steps are in flight, and idle time is no step's."""
        if not num_tokens:
            return
        scheduled_at, scheduled_tokens = self._in_flight.popleft()
        now = self._clock()
        self._seconds = self._seconds * _DECAY + now - max(scheduled_at, self._last_done)
        self._tokens = self._tokens * _DECAY + scheduled_tokens
        self._last_done = now

    def seconds(self, num_tokens: int) -> float:
        """Busy seconds for num_tokens at the recent rate, decode steps included: for a history it is what its
        recompute costs the replica (and more than its prefill alone). 0 before any step."""
        return num_tokens * self._seconds / self._tokens if self._tokens else 0.0


class LoadRate:
    """How long loading a token (from the node's pool, or pulling it from another node's) has recently taken, from
    the loads' own timings. A rate no load has renewed for max_age_s is forgotten: whatever slowed those loads
    (pages touched for the first time, a busy network) may be gone, and a replica priced out of loading by an old
    rate would never load again to measure a new one."""

    def __init__(self, clock: Callable[[], float], max_age_s: float = 60.0):
        self._clock = clock
        self._max_age_s = max_age_s
        self._seconds = 0.0
        self._tokens = 0.0
        self._last_loaded = -math.inf

    def loaded(self, num_tokens: int, seconds: float) -> None:
        if self._stale():
            self._seconds = self._tokens = 0.0
        self._seconds = self._seconds * _DECAY + seconds
        self._tokens = self._tokens * _DECAY + num_tokens
        self._last_loaded = self._clock()

    def seconds_per_token(self) -> float | None:
        return self._seconds / self._tokens if self._tokens and not self._stale() else None

    def _stale(self) -> bool:
        return self._clock() - self._last_loaded > self._max_age_s
