"""Timing one call, and the percentiles the benchmarks report."""
import statistics
import time


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """Wall-clock seconds of fn(*args, **kwargs), and what it returned."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (q in 1..99), inclusive method; a lone value is every percentile of itself."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]
