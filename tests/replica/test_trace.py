import json

from replica.scheduler.trace import TRACE_ENV

from .scheduler_helpers import make_scheduler, step


def test_trace_is_off_by_default(monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert make_scheduler()._trace is None


def test_trace_writes_one_json_line_per_step(tmp_path, monkeypatch, make_request):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    scheduler = make_scheduler(num_blocks=10)
    scheduler.add_request(make_request("a", list(range(9))))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(8)) + [5]))
    step(scheduler)
    scheduler._trace.close()
    first, second = [json.loads(line) for line in path.read_text().splitlines()]
    assert first == {
        "step": 0, "num_waiting": 0, "num_running": 1, "num_free_blocks": 6, "num_cached_blocks": 2,
        "prefix_hits": {"a": {"num_tokens": 9, "num_cached_tokens": 0}},
        "scheduled": {"running": {}, "resumed": {}, "new": {"a": 9}}, "preempted": [],
        "num_pins": 0, "pins": {"pinned": [], "expired": [], "released": [], "hits": []},
    }
    assert second["prefix_hits"] == {"b": {"num_tokens": 9, "num_cached_tokens": 8}}
    assert second["scheduled"] == {"running": {"a": 1}, "resumed": {}, "new": {"b": 1}}
    assert second["num_free_blocks"] == 5
