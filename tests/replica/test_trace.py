import json

from replica.kv_cache import KVCacheManager
from replica.request import Request, SamplingParams
from replica.scheduler import Scheduler, SchedulerConfig
from replica.scheduler.trace import TRACE_ENV, SchedulerTrace

from .scheduler_helpers import FakeClock, make_scheduler, step


def test_trace_is_off_by_default(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert make_scheduler()._trace is None


def test_trace_writes_one_json_line_per_step(tmp_path, monkeypatch, make_request):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    clock = FakeClock()
    scheduler = make_scheduler(num_blocks=10, clock=clock)
    scheduler.add_request(make_request("a", list(range(9))))
    step(scheduler)
    clock.now = 0.25
    scheduler.add_request(make_request("b", list(range(8)) + [5]))
    step(scheduler)
    scheduler._trace.close()
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == {
        "step": 0, "time": 0.0, "num_waiting": 0, "num_running": 1, "num_free_blocks": 6, "num_cached_blocks": 2,
        "prefix_hits": {"a": {"num_tokens": 9, "num_cached_tokens": 0}},
        "scheduled": {"running": {}, "resumed": {}, "new": {"a": 9}}, "preempted": [],
        "num_pins": 0, "pins": {"pinned": [], "expired": [], "released": [], "hits": []},
    }
    assert second["prefix_hits"] == {"b": {"num_tokens": 9, "num_cached_tokens": 8}}
    assert second["scheduled"] == {"running": {"a": 1}, "resumed": {}, "new": {"b": 1}}
    assert (second["num_free_blocks"], second["time"]) == (5, 0.25)


def test_every_pin_leaves_one_record_when_it_ends(tmp_path, monkeypatch):
    path = tmp_path / "pins.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    clock = FakeClock()
    scheduler = make_scheduler(num_blocks=20, clock=clock, policy="continuum", pin_ttl_default_s=2.0)
    history = list(range(8))
    for request_id, prompt, now in (("p/1", history, 0.0), ("p/2", history + [1, 2], 1.5), ("q/1", history, 4.0)):
        clock.now = now
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                      session_id=request_id[0]))
        step(scheduler)
    scheduler._trace.close()
    records = [json.loads(line)["pin"] for line in path.read_text().splitlines() if "pin" in json.loads(line)]
    assert records == [
        {"request_id": "p/1", "session_id": "p", "pinned_at": 0.0, "expires_at": 2.0, "next_turn_arrived_at": 1.5,
         "hit": True, "end": "replaced", "ended_at": 1.5},
        {"request_id": "p/2", "session_id": "p", "pinned_at": 1.5, "expires_at": 3.5, "next_turn_arrived_at": None,
         "hit": False, "end": "expired", "ended_at": 4.0},
    ]


def test_a_pin_only_trace_writes_no_step_records(tmp_path):
    path = tmp_path / "pins.jsonl"
    scheduler = Scheduler(SchedulerConfig(policy="continuum"), KVCacheManager(20, 4), trace=SchedulerTrace(
        str(path), steps=False))
    scheduler.add_request(Request("p/1", list(range(8)), SamplingParams(max_tokens=1, ignore_eos=True),
                                  session_id="p"))
    step(scheduler)
    scheduler.reset_prefix_cache()
    assert [json.loads(line)["pin"]["end"] for line in path.read_text().splitlines()] == ["reset"]
