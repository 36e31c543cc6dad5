"""Migration through the HTTP entry point, with a fake engine client whose replicas are lost mid-request.

The client must not see the move: the stream, the JSON, usage and logprobs equal an undisturbed run's.
"""
import json

import pytest

from cluster.protocol import REPLICA_HEADER
from replica.kv_cache import hash_token_blocks

from .fakes import BLOCK_SIZE, HASH_SEED, FakeEngineClient, FakeTokenizer, cached_tokens
from .test_api import MODEL, make_app, request

PROMPT = "hello world"  # 11 tokens: 2 full blocks
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "logprobs": 1, "cache_salt": "s"}


def events(response) -> list[dict | str]:
    """The stream's events, each chunk without its id and creation time (they differ between requests)."""
    payloads = [event.removeprefix("data: ") for event in response.text.split("\n\n") if event]
    return [payload if payload == "[DONE]" else
            {k: v for k, v in json.loads(payload).items() if k not in ("id", "created")} for payload in payloads]


def without_id(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def post(engine: FakeEngineClient, max_migrations: int = 2, **body):
    app = make_app(engine, max_migrations=max_migrations)
    return request(app, "POST", "/v1/completions", json=BODY | body), request(app, "GET", "/metrics").text


def test_a_stream_whose_replica_is_lost_goes_on_elsewhere_as_if_undisturbed():
    body = {"stream": True, "stream_options": {"include_usage": True}}
    undisturbed, _ = post(FakeEngineClient(), **body)
    migrated, metrics = post(engine := FakeEngineClient(lost_after=[2]), **body)
    assert events(migrated) == events(undisturbed)
    assert [chunk["choices"][0]["text"] for chunk in events(migrated)[:5]] == [f"t{i} " for i in range(5)]
    # the prompt's hit is the first replica's: the second one's covers the first's output tokens too
    assert events(migrated)[5]["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16,
                                            "prompt_tokens_details": {"cached_tokens": cached_tokens(0)}}
    assert migrated.headers[REPLICA_HEADER] == "replica-a"  # sent before the move
    first, second = engine.requests
    prompt = FakeTokenizer().encode(PROMPT)
    assert (second.request_id, second.prompt_token_ids, second.params) == (first.request_id, prompt, first.params)
    assert second.output_token_ids == [100, 101]  # they count against max_tokens: 3 more to go
    assert second.block_hashes == hash_token_blocks(prompt + [100, 101], BLOCK_SIZE, cache_salt="s", seed=HASH_SEED)
    assert len(second.block_hashes) == 3
    assert (first.lost_on, second.lost_on) == (None, "replica-a")  # routed anywhere but where it was lost
    assert "prefixserve:request_migrations_total 1.0" in metrics.splitlines()


def test_a_later_choice_sent_to_the_first_choices_replica_goes_wherever_it_is_routed_once_that_is_lost():
    undisturbed, _ = post(FakeEngineClient(), n=2)
    migrated, _ = post(engine := FakeEngineClient(lost_after=[1]), n=2)
    assert without_id(migrated.json()) == without_id(undisturbed.json())
    response_id = migrated.json()["id"]
    assert [(sent.request_id, sent.route_to) for sent in engine.requests] == [
        (response_id, None), (f"{response_id}-1", "replica-a"), (response_id, None),
        (f"{response_id}-1", None)]


def test_the_ingress_times_the_request_once_and_counts_tokens_where_they_were_generated():
    _, metrics = post(FakeEngineClient(lost_after=[2]), stream=True)
    lines = metrics.splitlines()
    for line in ('prefixserve:time_to_first_token_seconds_count{replica="replica-a"} 1.0',
                 'prefixserve:prompt_tokens_total{replica="replica-a"} 11.0',
                 'prefixserve:generation_tokens_total{replica="replica-a"} 2.0',
                 'prefixserve:generation_tokens_total{replica="replica-a/1"} 3.0',
                 'prefixserve:e2e_request_latency_seconds_count{replica="replica-a/1"} 1.0'):
        assert line in lines
    assert not any(line.startswith('prefixserve:time_to_first_token_seconds_count{replica="replica-a/1"}')
                   for line in lines)


def test_a_response_whose_replicas_are_lost_twice_is_the_undisturbed_json_from_the_last():
    undisturbed, _ = post(FakeEngineClient())
    migrated, metrics = post(engine := FakeEngineClient(lost_after=[1, 3]))
    assert without_id(migrated.json()) == without_id(undisturbed.json())
    assert migrated.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": cached_tokens(0)}
    assert migrated.json()["choices"][0]["logprobs"]["tokens"] == [f"t{i} " for i in range(5)]
    assert migrated.headers[REPLICA_HEADER] == "replica-a/2"
    assert [sent.output_token_ids for sent in engine.requests] == [[], [100], [100, 101, 102, 103]]
    prompt = FakeTokenizer().encode(PROMPT)
    assert engine.requests[2].block_hashes == hash_token_blocks(prompt + [100, 101, 102, 103], BLOCK_SIZE,
                                                                cache_salt="s", seed=HASH_SEED)
    assert "prefixserve:request_migrations_total 2.0" in metrics.splitlines()


def test_a_replica_lost_before_its_first_output_means_a_plain_resubmission():
    migrated, _ = post(engine := FakeEngineClient(lost_after=[None]))
    assert migrated.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4 "
    # the prompt's hit is the second replica's, the first one's lost before any output
    assert migrated.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": cached_tokens(1)}
    first, second = engine.requests
    assert second == first


@pytest.mark.parametrize("max_migrations", [0, 1])
def test_past_the_migration_limit_the_stream_ends_with_an_error_event(max_migrations):
    lost_after = [1] * (max_migrations + 1)
    response, metrics = post(engine := FakeEngineClient(lost_after=lost_after), max_migrations, stream=True)
    assert len(engine.requests) == max_migrations + 1
    *chunks, error, done = events(response)
    assert [chunk["choices"][0]["text"] for chunk in chunks] == [f"t{i} " for i in range(max_migrations + 1)]
    assert error == {"error": {"message": "The engine replica serving this request was lost, and so were its "
                               "migrations' replicas; retry the request.", "type": "server_error", "param": None,
                               "code": "replica_lost"}}
    assert done == "[DONE]"
    assert f"prefixserve:request_migrations_total {float(max_migrations)}" in metrics.splitlines()


@pytest.mark.parametrize("lost_after", [[None, None], [None, 2]])  # before any output, and after some
def test_past_the_migration_limit_the_response_is_a_503(lost_after):
    response, _ = post(FakeEngineClient(lost_after=lost_after), max_migrations=1)
    assert response.status_code == 503
    assert (response.json()["error"]["type"], response.json()["error"]["code"]) == ("server_error", "replica_lost")


@pytest.mark.parametrize("stream", [False, True])
def test_a_migration_that_finds_no_room_is_a_429(stream):
    response, metrics = post(engine := FakeEngineClient(lost_after=[2], busy_from=1), stream=stream)
    assert len(engine.requests) == 2
    overloaded = {"error": {"message": "The server has too many requests waiting; retry later.",
                            "type": "rate_limit_error", "param": None, "code": "server_overloaded"}}
    if stream:
        assert [chunk["choices"][0]["text"] for chunk in events(response)[:2]] == ["t0 ", "t1 "]
        assert events(response)[2:] == [overloaded, "[DONE]"]
    else:
        assert (response.status_code, response.headers["retry-after"], response.json()) == (429, "1", overloaded)
    assert "prefixserve:request_migrations_total 1.0" in metrics.splitlines()


def test_an_engine_error_is_not_a_lost_replica():
    response, metrics = post(engine := FakeEngineClient(error=ValueError("the engine refused it")), stream=True)
    assert len(engine.requests) == 1
    assert (response.status_code, response.json()) == (400, {"error": {
        "message": "the engine refused it", "type": "invalid_request_error", "param": None, "code": None}})
    assert "prefixserve:request_migrations_total 0.0" in metrics.splitlines()
