"""Scheduler trace as JSONL, on only when PREFIXSERVE_SCHED_TRACE=path is set: one record per step (with the
scheduler's clock when it was scheduled: the gaps are the steps' durations), and
one per pin when it ends ({"pin": ...}: when it was pinned, until when, when the program's next turn
arrived here, whether that turn found it, and how and when it ended)."""
import json
import os
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from replica.scheduler.pins import Pin

TRACE_ENV = "PREFIXSERVE_SCHED_TRACE"


class SchedulerTrace:
    def __init__(self, path: str, *, steps: bool = True):
        """steps=False: the pin records only."""
        self.steps = steps
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
        if self.steps:
            self._pin_events[kind].append(request_id)

    def pin_ended(self, pin: "Pin", end: str, now: float) -> None:
        """end: expired, released (under pressure), replaced (by the program's next pin), ended (the
        program's last turn or an abort), reset, or reused (its request id came again)."""
        self._file.write(json.dumps({"pin": {
            "request_id": pin.request.request_id, "session_id": pin.request.session_id,
            "pinned_at": pin.pinned_at, "expires_at": pin.expires_at,
            "next_turn_arrived_at": pin.next_turn_arrived_at, "hit": pin.hit, "end": end, "ended_at": now,
        }}) + "\n")

    def record(self, *, time: float, num_waiting: int, num_running: int, num_free_blocks: int,
               num_cached_blocks: int, prefix_hits: dict[str, tuple[int, int]],
               scheduled: dict[str, dict[str, int]], preempted: list[str], num_pins: int) -> None:
        """prefix_hits: req_id -> (prompt tokens looked up, tokens hit) for this step's admissions."""
        self._file.write(json.dumps({
            "step": self._step,
            "time": time,
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
