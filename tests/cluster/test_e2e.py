"""The real app on a real Ray cluster: 2 engine replicas of the default model, driven by the openai client.

One Ray cluster for the module. The app is first deployed with prefix routing from this process;
the last but one test kills a replica mid-request; the last replaces the app with a round_robin one through
`prefixserve serve --address ...` (joining this cluster), its ingress calling the engines by Ray actor calls instead
of gRPC, and stops that with SIGINT, as Ctrl-C would.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import ray
from ray import serve

from cluster.app import APP_NAME, build
from cluster.config import ClusterConfig
from cluster.local_ray import free_port, init_local_ray
from cluster.protocol import REPLICA_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
# fp32: bf16 need not recompute a migrated request's tokens as decoding made them (README, Migration)
BLOCK_SIZE = 16
ENGINE = {"dtype": "float32", "block_size": BLOCK_SIZE, "num_kv_blocks": 160, "max_model_len": MAX_MODEL_LEN,
          "max_num_seqs": 16}
STARTUP_TIMEOUT_S = 240
# Two long system prompts: each group's requests share one of them, then differ in the question.
PREFIXES = {
    "astronomy": "You are an astronomy tutor. " + " ".join(
        f"Fact {i}: the planet number {i} of the catalogue orbits a distant star." for i in range(12)),
    "cooking": "You are a cooking assistant. " + " ".join(
        f"Recipe {i}: take {i} cups of flour, mix with water and bake for {i + 10} minutes." for i in range(12)),
}
QUESTIONS = ["What is the first fact?", "Summarize in one word.", "What comes next?"]


@contextlib.contextmanager
def served(config: ClusterConfig) -> Iterator[str]:
    """The app on a fresh local Ray cluster; yields its base URL."""
    port = free_port()
    init_local_ray(max(2, os.cpu_count() or 1))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(config), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def base_url():
    with served(ClusterConfig(engine=ENGINE, num_replicas=2)) as url:
        yield url


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def complete(client: openai.OpenAI, prompt: str, **kwargs):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, temperature=0, **kwargs)
    return raw.headers[REPLICA_HEADER], raw.parse()


def test_completion_from_the_real_model(client):
    replica_id, completion = complete(client, "The capital of France is", max_tokens=4)
    assert replica_id
    assert "Paris" in completion.choices[0].text
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, 4)


def test_chat_with_the_models_template(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0, seed=1)
    chat = raw.parse()
    assert raw.headers[REPLICA_HEADER]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 6
    assert chat.usage.prompt_tokens > 20  # the template's default system prompt is in there


def test_logprobs_of_the_real_model(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:  # greedy: the sampled token is the likeliest
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5) and entry.logprob <= 0


def test_stream_is_sse_ending_with_done(base_url, client):
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True,
                                            temperature=0, stream_options={"include_usage": True}))
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert chunks[-1].usage.completion_tokens == 5
    _, whole = complete(client, "Once upon a time", max_tokens=5)
    assert text == whole.choices[0].text
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers[REPLICA_HEADER]
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("path, body, status, code", [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "model_not_found"),
    ("/v1/chat/completions", {"model": MODEL}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * MAX_MODEL_LEN}, 400, "context_length_exceeded"),
])
def test_bad_input_is_an_openai_error(base_url, path, body, status, code):
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = httpx.post(base_url + path, timeout=30, **kwargs)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == code


def test_models_health_and_metrics(base_url, client):
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200
    text = httpx.get(f"{base_url}/metrics").text
    for name in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_bucket", "generation_tokens_total", "router_decisions_total"):
        assert f"prefixserve:{name}" in text


def metric_values(base_url: str, name: str) -> dict[str, float]:
    """replica -> value of prefixserve:<name>."""
    text = httpx.get(f"{base_url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(rf'^prefixserve:{name}{{replica="([^"]+)"}} (\S+)$', text, re.M)}


def until_equal(read, expected, timeout_s: float = 30.0):
    """Metrics follow the engines' reports, which reach a router a moment after the requests they count."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected:
        assert time.monotonic() < deadline, (value, expected)
        time.sleep(0.5)


def test_a_client_that_disconnects_frees_its_blocks(base_url):
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PREFIXES["astronomy"], "max_tokens": 200, "stream": True,
            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        replica_id = response.headers[REPLICA_HEADER]
        assert metric_values(base_url, "kv_cache_usage_perc")[replica_id] > 0
    deadline = time.monotonic() + 30
    while metric_values(base_url, "num_requests_running")[replica_id] or \
            metric_values(base_url, "kv_cache_usage_perc")[replica_id]:
        assert time.monotonic() < deadline, "the aborted request still holds KV blocks"
        time.sleep(0.5)


def send_groups(client: openai.OpenAI) -> dict[str, list[tuple[str, int]]]:
    """group -> (replica, cached tokens) of each of its requests, sent group by group."""
    return {group: [(replica_id, completion.usage.prompt_tokens_details.cached_tokens)
                    for replica_id, completion in (complete(client, f"{prefix}\nQuestion: {q}", max_tokens=2)
                                                   for q in QUESTIONS)]
            for group, prefix in PREFIXES.items()}


def test_prefix_routing_keeps_each_group_on_the_replica_caching_its_prefix(client):
    for group, served in send_groups(client).items():
        replicas = {replica_id for replica_id, _ in served}
        assert len(replicas) == 1, f"{group} spread over {replicas}"
        assert all(cached >= 160 for _, cached in served[1:]), served


def test_n_choices_share_one_prefill_on_one_replica(base_url, client):
    prompt = f"{uuid.uuid4().hex} {PREFIXES['cooking']}"  # cached nowhere
    before = metric_values(base_url, "prefix_cache_hits_total")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, n=3, max_tokens=4, seed=3)
    (replica_id,) = raw.headers[REPLICA_HEADER].split(",")
    # the first choice computes the prompt; the others find its full blocks but the last token's cached
    hit_per_choice = (raw.parse().usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    deadline = time.monotonic() + 30
    while metric_values(base_url, "prefix_cache_hits_total")[replica_id] - before.get(replica_id, 0) \
            != 2 * hit_per_choice:
        assert time.monotonic() < deadline, (before, metric_values(base_url, "prefix_cache_hits_total"))
        time.sleep(0.2)
    decisions = httpx.get(f"{base_url}/metrics").text.splitlines()
    assert 'prefixserve:router_decisions_total{outcome="directed",policy="prefix"} 2.0' in decisions


MIGRATED = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop": [" in the"], "stream_options": {"include_usage": True}}  # a stop string holds text back
KILL_AFTER_CHUNKS = 6


def kill_replica(replica_id: str) -> None:
    """Kill the Serve replica actor that the response header named."""
    [actor] = [actor for actor in ray.util.list_named_actors(all_namespaces=True)
               if actor["name"].endswith(f"#{replica_id}")]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


def stream_killing_its_replica(base_url: str, kill=kill_replica, body: dict = MIGRATED) -> tuple[str, list[dict]]:
    """The replica that took the stream, and the stream's chunks; kill(that replica's id) runs mid-stream."""
    chunks = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body | {"stream": True}, timeout=120) as response:
        replica_id = response.headers[REPLICA_HEADER]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                if len(chunks) == KILL_AFTER_CHUNKS:
                    kill(replica_id)
    return replica_id, chunks


def test_killing_the_replica_serving_a_stream_moves_the_request_unnoticed(base_url):
    """Migration: the other replica goes on from the tokens produced; the client reads the undisturbed run.
    (Serve replaces the killed replica; the next test redeploys the app anyway.)"""
    undisturbed = httpx.post(f"{base_url}/v1/completions", json=MIGRATED, timeout=120).json()
    killed, chunks = stream_killing_its_replica(base_url)
    *text_chunks, usage_chunk = chunks
    assert "".join(chunk["choices"][0]["text"] for chunk in text_chunks) == undisturbed["choices"][0]["text"]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == undisturbed["choices"][0]["finish_reason"]
    assert usage_chunk["usage"] == undisturbed["usage"]
    assert "prefixserve:request_migrations_total 1.0" in httpx.get(f"{base_url}/metrics").text.splitlines()
    # The router forgets the dead replica; the one that finished the request holds no block.
    deadline = time.monotonic() + 30
    while killed in (usage := metric_values(base_url, "kv_cache_usage_perc")) or any(usage.values()):
        assert time.monotonic() < deadline, usage
        time.sleep(0.5)


def test_round_robin_over_ray_actor_calls_spreads_each_group(base_url, tmp_path):
    # Deploy through the CLI, joining this cluster, then stop it as Ctrl-C would. It refuses to replace the app
    # this process deployed, which keeps serving; once that app is gone, it deploys its own.
    port = base_url.rsplit(":", 1)[1]
    engine_flags = ["--dtype", ENGINE["dtype"], "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
                    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(ENGINE["max_num_seqs"])]
    command = [sys.executable, "-m", "cluster.cli", "serve", "--routing-policy", "round_robin", "--engine-transport",
               "ray", "--address", ray.get_runtime_context().gcs_address, "--port", port, *engine_flags]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"prefixserve: an app named {APP_NAME!r} already runs on this cluster: "
        "stop that instance first, or start a cluster of its own (no --address)")
    assert httpx.get(f"{base_url}/health").status_code == 200
    serve.delete(APP_NAME)
    log = tmp_path / "cli.log"
    with log.open("w") as out:
        cli = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_line(cli, log, "prefixserve: serving on")
        with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            groups = send_groups(client)
        for group, served in groups.items():
            assert len({replica_id for replica_id, _ in served}) == 2, f"{group}: {served}"
        assert 'policy="round_robin"' in httpx.get(f"{base_url}/metrics").text
    finally:
        cli.send_signal(signal.SIGINT)
        cli.wait(timeout=60)
    assert cli.returncode == 0, log.read_text()
    assert "prefixserve: shutting down" in log.read_text()


def wait_for_line(process: subprocess.Popen, log, line: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while line not in log.read_text():
        assert process.poll() is None, f"exited with {process.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {line!r} after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.5)
