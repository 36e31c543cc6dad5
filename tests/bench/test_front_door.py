"""benchmarks/bench_front_door.py without Ray: wrk's report, the CPU arithmetic, the verdict, and the bare
app's handler."""
import json

from fastapi.testclient import TestClient

from benchmarks import bench_front_door as bench
from benchmarks.bare_serve import bare_api

WRK_REPORT = """\
Running 20s test @ http://127.0.0.1:8000
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   320.10ms   80.20ms   1.20s    70.00%
    Req/Sec   100.12     20.50   150.00     65.00%
  Latency Distribution
     50%  310.50ms
     75%  350.00ms
     90%  420.00ms
     99%    1.05s
  3940 requests in 20.02s, 1.01MB read
  Socket errors: connect 1, read 2, write 3, timeout 12
  Non-2xx or 3xx responses: 5
Requests/sec:    196.80
Transfer/sec:     51.73KB
"""


def test_parse_wrk_reads_counts_errors_and_latency_quantiles_in_ms():
    load = bench.parse_wrk(WRK_REPORT)
    assert load == bench.Load(requests=3940, duration_s=20.02, non_2xx=5, errors=6, timeouts=12,
                              p50_ms=310.5, p99_ms=1050.0)
    assert round(load.requests_per_s, 2) == 196.80


def test_parse_wrk_without_errors_and_in_microseconds():
    text = "  Latency Distribution\n     50%  900.00us\n     99%    2.50ms\n  100 requests in 1.00m, 1KB read\n"
    assert bench.parse_wrk(text) == bench.Load(requests=100, duration_s=60.0, non_2xx=0, errors=0, timeouts=0,
                                               p50_ms=0.9, p99_ms=2.5)


def test_cpu_ms_per_request_by_kind_leaves_out_processes_that_came_or_went():
    before = {1: 10.0, 2: 4.5, 3: 7.0, 5: 1.0}
    after = {1: 12.0, 2: 5.0, 4: 99.0, 5: 1.5}  # 3 died, 4 started: neither counts
    kinds = {1: "engine", 2: "ProxyActor", 3: "engine", 4: "raylet", 5: "engine"}
    by_kind = bench.cpu_ms_by_kind(before, after, kinds, requests=50)
    assert by_kind == {"engine": 50.0, "ProxyActor": 10.0}  # 2.5 s and 0.5 s over 50 requests
    assert bench.Result("app", None, by_kind).cpu_ms_per_request == 60.0


def result(app: str, requests: int, cpu_ms_by_process: dict[str, float] | None = None,
           steal: float | None = None, ingress_replicas: int = 1) -> bench.Result:
    return bench.Result(app, bench.Load(requests, 10.0, 0, 0, 0, 1.0, 2.0), cpu_ms_by_process or {}, steal,
                        ingress_replicas, bare=app.startswith("bare"))


def test_cpu_table_puts_the_busiest_kinds_first_with_a_column_per_app():
    results = [result("bare", 1, {"proxy": 2.0, "ingress": 1.0}), result("one", 1, {"ingress": 3.0, "router": 0.5})]
    assert bench.cpu_table(results) == "\n".join([
        "| CPU ms/request by process | bare | one |",
        "|---|---|---|",
        "| ingress | 1.00 | 3.00 |",
        "| proxy | 2.00 | 0.00 |",
        "| router | 0.00 | 0.50 |"])


def rounds_of(requests: list[list[int]], apps: tuple[str, ...] = ("bare", "one", "two")) -> list[list[bench.Result]]:
    """Rounds of the apps (by default bare, one and two), each app's CPU ms per request in the "proxy" process;
    an app named two runs two ingress replicas."""
    return [[result(app, count, {"proxy": cpu}, ingress_replicas=2 if app.endswith("two") else 1)
             for app, count, cpu in zip(apps, counts, (10, 12, 13, 14))] for counts in requests]


def test_verdict_takes_each_ratio_within_its_round_and_judges_the_median():
    rounds = rounds_of([[1000, 800, 850], [900, 630, 600], [1200, 1080, 1000]])
    assert bench.verdict(rounds) == [
        "one: 0.80x bare (median of 0.80, 0.70, 0.90), meets the 0.8x bar",
        "two: 0.83x bare (median of 0.85, 0.67, 0.83), meets the 0.8x bar",
        "two: 0.95x one (median of 1.06, 0.95, 0.93), slower",
    ]
    assert bench.verdict(rounds_of([[2000, 1500, 1600]]))[1:] == [
        "two: 0.80x bare (median of 0.80), meets the 0.8x bar",
        "two: 1.07x one (median of 1.07), as fast or faster"]


def test_verdict_sets_each_app_beside_the_bare_app_with_as_many_ingress_replicas_and_steps_each_kind():
    rounds = rounds_of([[1000, 800, 850, 720], [900, 810, 600, 630]], apps=("bare", "bare two", "one", "two"))
    assert bench.verdict(rounds) == [
        "one: 0.76x bare (median of 0.85, 0.67), misses the 0.8x bar",
        "two: 0.71x bare (median of 0.72, 0.70), misses the 0.8x bar",
        "two: 0.84x bare two (median of 0.90, 0.78), slower",
        "bare two: 0.85x bare (median of 0.80, 0.90), slower",
        "two: 0.95x one (median of 0.85, 1.05), slower",
    ]


def test_rounds_table_has_a_row_per_round_with_its_own_ratios_and_each_windows_steal():
    rounds = rounds_of([[1000, 800, 850], [900, 630, 600]])
    rounds[1][2] = result("two", 600, {"proxy": 13}, steal=0.125)
    assert bench.rounds_table(rounds) == "\n".join([
        "| round | bare req/s | one req/s (x bare) | two req/s (x bare) | CPU ms/request: bare, one, two "
        "| steal % in each app's window |",
        "|---|---|---|---|---|---|",
        "| 1 | 100 | 80 (0.80) | 85 (0.85) | 10.0, 12.0, 13.0 | -, -, - |",
        "| 2 | 90 | 63 (0.70) | 60 (0.67) | 10.0, 12.0, 13.0 | -, -, 12.5 |"])


def test_steal_share_is_the_steal_counters_part_of_all_counters_between_two_readings():
    before = [100, 50, 30, 500, 0, 0, 5, 20]
    after = [160, 110, 50, 535, 0, 0, 5, 45]  # 200 more ticks, 25 of them stolen
    assert bench.steal_share(before, after) == 0.125
    assert bench.steal_share(None, after) is None
    assert bench.steal_share(before[:4], after[:4]) is None  # a kernel without the steal counter


class FakeProcess:
    def __init__(self, title: str, name: str = "python"):
        self._title, self._name = title, name

    def cmdline(self) -> list[str]:
        return [self._title]

    def name(self) -> str:
        return self._name


def test_process_kind_names_a_replicas_deployment_and_its_app_and_leaves_others_to_every_app():
    assert bench.process_kind(FakeProcess("ray::ServeReplica:ingress-2:engine.handle_request")) == (
        "ServeReplica:engine", "ingress-2")
    assert bench.process_kind(FakeProcess("ray::ProxyActor")) == ("ProxyActor", None)
    assert bench.process_kind(FakeProcess("/usr/bin/raylet --flags", "raylet")) == ("raylet", None)


def test_pooled_sums_each_apps_rounds_and_weighs_cpu_by_requests():
    rounds = [[result("bare", 100, {"proxy": 10.0}), result("one", 50, {"proxy": 20.0})],
              [result("bare", 300, {"proxy": 14.0, "raylet": 1.0}), result("one", 150, {"proxy": 16.0})]]
    bare, one = bench.pooled(rounds)
    assert bare.load == bench.Load(400, 20.0, 0, 0, 0, 1.0, 2.0)
    assert bare.cpu_ms_by_process == {"proxy": 13.0, "raylet": 0.75}
    assert (one.app, one.load.requests, one.cpu_ms_by_process) == ("one", 200, {"proxy": 17.0})


def test_each_round_starts_with_the_next_app():
    assert [bench.rotated(["bare", "one", "two"], index) for index in range(4)] == [
        ["bare", "one", "two"], ["one", "two", "bare"], ["two", "bare", "one"], ["bare", "one", "two"]]


def test_wrk_script_sends_fresh_token_ids_in_the_tiny_vocabulary():
    script = bench.wrk_script(32, "", bench.request_fields())
    assert "for i = 1, 32 do ids[i] = math.random(2, 4095) end" in script
    assert 'local body = \'{"model":"tiny","max_tokens":1,"prompt":[\' .. table.concat(ids, ",") .. \']}\'' in script
    streamed = bench.wrk_script(8, "/x", bench.request_fields(64, stream=True))
    assert '\'{"model":"tiny","max_tokens":64,"ignore_eos":true,"stream":true,"prompt":[\'' in streamed
    assert '"/x/v1/completions"' in streamed


def test_bare_app_streams_its_chunks_into_an_openai_like_completion():
    seen = []

    async def stream(body: dict):
        seen.append(body)
        yield "<7>"

    response = TestClient(bare_api(stream)).post("/v1/completions",
                                                 json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})
    assert response.status_code == 200
    assert response.json() == {
        "id": "cmpl-bare", "object": "text_completion", "model": "tiny",
        "choices": [{"index": 0, "text": "<7>", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    assert seen == [{"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}]


def test_bare_app_streams_a_chunk_a_token_as_server_sent_events():
    async def stream(body: dict):
        for token in range(body["max_tokens"]):
            yield f"<{token}>"

    client = TestClient(bare_api(stream))
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
    assert client.post("/v1/completions", json=body).json()["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    response = client.post("/v1/completions", json=body | {"stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert [json.loads(event.removeprefix("data: "))["choices"][0]["text"] for event in events[:-2]] == [
        "<0>", "<1>", "<2>"]
