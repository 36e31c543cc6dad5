"""Per-step scheduler trace as JSONL, on only when PREFIXSERVE_SCHED_TRACE=path is set."""
import json
import os
from typing import TextIO

TRACE_ENV = "PREFIXSERVE_SCHED_TRACE"


class SchedulerTrace:
    def __init__(self, path: str):
        self._file: TextIO = open(path, "a", buffering=1)
        self._step = 0
        self._pin_events = _no_pin_events()

    @classmethod
    def from_env(cls) -> "SchedulerTrace | None":
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def pin_event(self, kind: str, request_id: str) -> None:
        """A pin since the last record: pinned, expired, released (under pressure), or hits (a next turn
        admitted while its program's pin held its history; the id is the next turn's)."""
        self._pin_events[kind].append(request_id)

    def record(self, *, num_waiting: int, num_running: int, num_free_blocks: int,
               num_cached_blocks: int, prefix_hits: dict[str, tuple[int, int]],
               scheduled: dict[str, dict[str, int]], preempted: list[str], num_pins: int) -> None:
        """prefix_hits: req_id -> (prompt tokens looked up, tokens hit) for this step's admissions."""
        self._file.write(json.dumps({
            "step": self._step,
            "num_waiting": num_waiting,
            "num_running": num_running,
            "num_free_blocks": num_free_blocks,
            "num_cached_blocks": num_cached_blocks,
            "prefix_hits": {req_id: {"num_tokens": total, "num_cached_tokens": hit}
                            for req_id, (total, hit) in prefix_hits.items()},
            "scheduled": scheduled,
            "preempted": preempted,
            "num_pins": num_pins,
            "pins": self._pin_events,
        }) + "\n")
        self._step += 1
        self._pin_events = _no_pin_events()

    def close(self) -> None:
        self._file.close()


def _no_pin_events() -> dict[str, list[str]]:
    return {"pinned": [], "expired": [], "released": [], "hits": []}
