"""What an engine reports of its constrained requests: counts by kind, failures, compile and mask-fill times."""
import bisect
import copy
import threading
from dataclasses import dataclass, field

COMPILE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MASK_FILL_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2)


@dataclass(slots=True)
class HistogramCounts:
    """Observations counted per bucket: counts[i] of them at most bounds[i] (and above bounds[i - 1]), the last
    above every bound."""
    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> "HistogramCounts":
        return cls(bounds, [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


@dataclass(slots=True)
class StructuredOutputStats:
    requests: dict[str, int] = field(default_factory=dict)  # constrained requests added, by kind (cumulative)
    errors: int = 0  # of those, failed: did not compile (in time), or the output left its grammar (cumulative)
    compile_seconds: HistogramCounts = field(default_factory=lambda: HistogramCounts.empty(COMPILE_BUCKETS_S))
    # one step's mask fill: every constrained request's rows
    mask_fill_seconds: HistogramCounts = field(default_factory=lambda: HistogramCounts.empty(MASK_FILL_BUCKETS_S))


class StatsRecorder:
    """Updated from the engine's thread and the compile and fill threads; read as a copy."""

    def __init__(self) -> None:
        self._stats = StructuredOutputStats()
        self._lock = threading.Lock()

    def request(self, kind: str) -> None:
        with self._lock:
            self._stats.requests[kind] = self._stats.requests.get(kind, 0) + 1

    def error(self) -> None:
        with self._lock:
            self._stats.errors += 1

    def compiled(self, seconds: float) -> None:
        with self._lock:
            self._stats.compile_seconds.observe(seconds)

    def mask_filled(self, seconds: float) -> None:
        with self._lock:
            self._stats.mask_fill_seconds.observe(seconds)

    def snapshot(self) -> StructuredOutputStats:
        with self._lock:
            return copy.deepcopy(self._stats)
