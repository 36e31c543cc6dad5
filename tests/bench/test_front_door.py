"""benchmarks/bench_front_door.py without Ray: wrk's report, the CPU arithmetic, the verdict, and the bare
app's handler."""
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


def result(app: str, requests: int, cpu_ms_by_process: dict[str, float] | None = None) -> bench.Result:
    return bench.Result(app, bench.Load(requests, 10.0, 0, 0, 0, 1.0, 2.0), cpu_ms_by_process or {})


def test_cpu_table_puts_the_busiest_kinds_first_with_a_column_per_app():
    results = [result("bare", 1, {"proxy": 2.0, "ingress": 1.0}), result("one", 1, {"ingress": 3.0, "router": 0.5})]
    assert bench.cpu_table(results) == "\n".join([
        "| CPU ms/request by process | bare | one |",
        "|---|---|---|",
        "| ingress | 1.00 | 3.00 |",
        "| proxy | 2.00 | 0.00 |",
        "| router | 0.00 | 0.50 |"])


def test_verdict_compares_every_served_row_with_bare_and_each_ingress_count_with_the_one_before():
    results = [result("bare", 2000), result("one", 1600), result("two", 1500)]
    assert bench.verdict(results) == [
        "one: 0.80x the bare app's requests/s, meets the 0.8x bar",
        "two: 0.75x the bare app's requests/s, misses the 0.8x bar",
        "two: 0.94x one, slower",
    ]


def test_wrk_script_sends_fresh_token_ids_in_the_tiny_vocabulary():
    script = bench.wrk_script(prompt_tokens=32)
    assert "for i = 1, 32 do ids[i] = math.random(2, 4095) end" in script
    assert '{"model":"tiny","max_tokens":1,"prompt":[' in script


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
