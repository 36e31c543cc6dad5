"""The direct front door, as a user starts it (`prefixserve serve --front-door direct`, the installed console
script in a subprocess): HAProxy asks the router deployment where each request goes and forwards it to that
engine replica, which serves the OpenAI API itself. Two replicas with room for two requests each."""
import asyncio
import contextlib
import signal
import subprocess
import uuid

import httpx
import openai
import psutil
import pytest

from cluster.local_ray import LOOPBACK, free_port
from cluster.protocol import REPLICA_HEADER

from .test_e2e import MODEL, PREFIXES, metric_values, send_groups, until_equal
from .test_e2e_cli import SHUTDOWN_TIMEOUT_S, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLAGS = ["--front-door", "direct", "--replicas", "2", "--num-kv-blocks", "64", "--max-model-len", "512",
         "--max-num-seqs", "2", "--max-waiting-requests", "0"]
HELD = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module")
def base_url():
    server = Server(free_port(), FLAGS)
    try:
        assert server.wait_until_serving().startswith(f"prefixserve: serving on http://{LOOPBACK}:{server.port}/v1")
        yield f"http://{LOOPBACK}:{server.port}"
    finally:
        stop(server)


def stop(server: Server) -> None:
    """SIGINT, as a user stops it; whatever is left of it after that is killed (HAProxy outlives a killed Ray)."""
    descendants = psutil.Process(server.process.pid).children(recursive=True)
    server.process.send_signal(signal.SIGINT)
    try:
        server.process.wait(SHUTDOWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    for process in psutil.wait_procs(descendants, timeout=30)[1]:
        process.kill()


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_chat_and_stream_through_haproxy_name_the_replica_that_served_them(base_url, client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    chat = raw.parse()
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (4, "length")
    until_equal(lambda: raw.headers[REPLICA_HEADER] in metric_values(base_url, "kv_cache_usage_perc"), True)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == chat.choices[0].message.content


def test_n_choices_come_from_one_replica(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PREFIXES["cooking"], n=2, max_tokens=3,
                                                      seed=1)
    assert [choice.index for choice in raw.parse().choices] == [0, 1]
    assert "," not in raw.headers[REPLICA_HEADER]


def test_bad_input_is_an_openai_error_from_the_replica(base_url):
    response = httpx.post(f"{base_url}/v1/chat/completions", content=b"{bad", timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_prefix_routing_keeps_each_group_on_the_replica_caching_its_prefix_and_books_under_the_served_id(
        base_url, client):
    groups = send_groups(client)
    for group, served in groups.items():
        replicas = {replica_id for replica_id, _ in served}
        assert len(replicas) == 1, f"{group} spread over {replicas}"
        assert all(cached >= 160 for _, cached in served[1:]), served
    # The replicas finished what the router booked under the id each request was served as: nothing stays in
    # flight, and the hits they reported for its decisions are the ones it predicted.
    until_equal(lambda: set(metric_values(base_url, "router_requests_in_flight").values()), {0.0})
    actual = metric_values(base_url, "router_actual_cached_tokens_total")
    assert sum(actual.values()) >= sum(cached for served in groups.values() for _, cached in served)
    assert metric_values(base_url, "router_predicted_cached_tokens_total") == actual


def test_a_sessions_turns_stay_on_one_replica(client):
    session = uuid.uuid4().hex
    replicas = set()
    for turn in range(4):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"{session} turn {turn}", max_tokens=2, extra_headers={"x-session-id": session})
        replicas.add(raw.headers[REPLICA_HEADER])
    assert len(replicas) == 1


def test_a_client_cannot_choose_the_id_its_request_is_booked_under(client):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PREFIXES["astronomy"], max_tokens=2,
        extra_headers={"x-serve-router-request-id": "cmpl-chosen-by-the-client"})
    assert raw.parse().id != "cmpl-chosen-by-the-client"


async def hold_and_send(base_url: str, num_held: int, count: int) -> list[httpx.Response]:
    """Streams num_held long requests and, once every one runs, sends count more at once."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async with contextlib.AsyncExitStack() as stack:
            lines = []  # each held stream's reader: one collected would close its stream
            for _ in range(num_held):  # prompts cached nowhere: the router spreads them by load alone
                body = HELD | {"prompt": f"{uuid.uuid4().hex} {HELD['prompt']}"}
                held = await stack.enter_async_context(client.stream("POST", "/v1/completions", json=body))
                assert held.status_code == 200
                lines.append(held.aiter_lines())
                await anext(lines[-1])  # its first chunk: it runs
            return await asyncio.gather(*(client.post("/v1/completions", json=HELD | {"stream": False,
                                                                                       "max_tokens": 2})
                                          for _ in range(count)))


def test_requests_past_every_replicas_room_get_an_openai_429_and_leave_no_block_behind(base_url):
    responses = asyncio.run(hold_and_send(base_url, num_held=4, count=3))
    assert [response.status_code for response in responses] == [429] * 3
    for response in responses:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "server_overloaded"
    # the held streams' clients went away: their replicas abort them
    until_equal(lambda: set(metric_values(base_url, "kv_cache_usage_perc").values()), {0.0}, timeout_s=60)
