"""The HTTP layer through its public entry point (build_api), with a fake engine: protocol, errors, SSE."""
import asyncio
import json
import threading

import httpx
import openai
import pytest

from cluster.api import build_api
from cluster.metrics import ServingMetrics
from cluster.protocol import REPLICA_HEADER
from cluster.preparing import INLINE_PREPARE_BYTES
from cluster.serving import OpenAIServing
from replica.async_engine import ModelInfo
from replica.kv_cache import hash_token_blocks
from replica.request import SamplingParams
from replica.scheduler import PinStats, SchedulerStats, SpecDecodingStats
from replica.structured_output import StructuredOutputsParams
from router.messages import ReplicaSnapshot, RouterSnapshot

from .fakes import BLOCK_SIZE, HASH_SEED, VOCAB_SIZE, FakeEngineClient, FakeTokenizer, cached_tokens

MODEL = "fake-model"
MAX_MODEL_LEN = 64
CHAT_PROMPT = "system: Be brief.\nuser: Hi\nassistant: "


def make_app(engine: FakeEngineClient | None = None, *, api_key: str | None = None,
             snapshot: RouterSnapshot | None = None, max_body_bytes: int | None = None, max_migrations: int = 0,
             tokenizer: FakeTokenizer | None = None, routed_request_id_header: str | None = None):
    serving = OpenAIServing(engine or FakeEngineClient(), tokenizer or FakeTokenizer(),
                            ModelInfo(MODEL, MAX_MODEL_LEN, VOCAB_SIZE, BLOCK_SIZE, HASH_SEED), ServingMetrics(),
                            max_migrations=max_migrations)

    async def render_metrics() -> bytes:
        return serving.metrics.render(snapshot)

    return build_api(serving, render_metrics=render_metrics, api_key=api_key, max_body_bytes=max_body_bytes,
                     routed_request_id_header=routed_request_id_header)


def http_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://test")


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def send():
        async with http_client(app) as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(send())


def with_openai(app, use, api_key: str = "sk-test"):
    async def run():
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key=api_key, http_client=http_client(app),
                                      max_retries=0) as client:
            return await use(client)
    return asyncio.run(run())


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_completion_returns_text_usage_and_the_serving_replica():
    engine = FakeEngineClient("replica-7")
    response = request(make_app(engine), "POST", "/v1/completions",
                       json={"model": MODEL, "prompt": "hello world", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200
    assert response.headers[REPLICA_HEADER] == "replica-7"
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "t0 t1 t2 ", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
                             "prompt_tokens_details": {"cached_tokens": cached_tokens(0)}}


def test_engine_gets_token_ids_block_hashes_and_sampling_params():
    engine = FakeEngineClient()
    request(make_app(engine), "POST", "/v1/completions",
            json={"model": MODEL, "prompt": "hello world", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
                  "top_k": 5, "seed": 11, "stop": "\n", "user": "u1", "cache_salt": "s", "ignore_eos": True})
    [sent] = engine.requests
    token_ids = FakeTokenizer().encode("hello world")
    assert sent.prompt_token_ids == token_ids
    assert sent.block_hashes == hash_token_blocks(token_ids, BLOCK_SIZE, cache_salt="s", seed=HASH_SEED)
    assert len(sent.block_hashes) == 2
    assert sent.cache_salt == "s"
    assert sent.params == SamplingParams(max_tokens=2, temperature=0.5, top_p=0.9, top_k=5, seed=11, stop=["\n"],
                                         ignore_eos=True)
    assert sent.request_id.startswith("cmpl-")


def test_a_session_id_and_last_turn_reach_the_engine_from_the_body_or_the_header():
    engine = FakeEngineClient()
    app = make_app(engine)
    messages = [{"role": "user", "content": "hi"}]
    request(app, "POST", "/v1/chat/completions", json={"model": MODEL, "messages": messages, "session_id": "body"},
            headers={"X-Session-Id": "header"})
    request(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "last_turn": True},
            headers={"X-Session-Id": "agent-7"})
    request(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert [(sent.session_id, sent.last_turn) for sent in engine.requests] == [
        ("body", False), ("agent-7", True), (None, False)]
    response = request(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "last_turn": "soon"})
    assert response.status_code == 400 and "last_turn" in response.json()["error"]["message"]


def test_completion_accepts_token_ids_and_defaults_to_16_tokens():
    engine = FakeEngineClient()
    response = request(make_app(engine), "POST", "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
    assert response.json()["usage"]["completion_tokens"] == 16
    assert engine.requests[0].prompt_token_ids == [1, 2, 3]


def test_chat_applies_the_template_and_defaults_to_the_rest_of_the_context():
    engine = FakeEngineClient()

    async def chat(client: openai.AsyncOpenAI):
        return await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])

    raw = with_openai(make_app(engine), chat)
    completion = raw.parse()
    assert raw.headers[REPLICA_HEADER] == "replica-a"
    assert engine.requests[0].prompt_token_ids == FakeTokenizer().encode(CHAT_PROMPT)
    num_prompt_tokens = len(CHAT_PROMPT)
    assert engine.requests[0].params.max_tokens == MAX_MODEL_LEN - num_prompt_tokens
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "".join(f"t{i} " for i in range(MAX_MODEL_LEN - num_prompt_tokens))
    assert completion.usage.prompt_tokens_details.cached_tokens == cached_tokens(0)


def test_completion_stream_through_the_openai_client():
    async def stream(client: openai.AsyncOpenAI):
        chunks = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True})
        return [chunk async for chunk in chunks]

    chunks = with_openai(make_app(), stream)
    assert [chunk.choices[0].text for chunk in chunks[:-1]] == ["t0 ", "t1 ", "t2 "]
    assert [chunk.choices[0].finish_reason for chunk in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached_tokens(0)


def test_chat_stream_is_server_sent_events_ending_with_done():
    response = request(make_app(), "POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                             "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers[REPLICA_HEADER] == "replica-a"
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert [chunk["object"] for chunk in chunks] == ["chat.completion.chunk"] * 3
    assert [chunk["choices"][0]["delta"] for chunk in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "t0 "}, {"content": "t1 "}]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, "length"]


def test_engine_failure_mid_stream_is_an_error_event_then_done():
    engine = FakeEngineClient(error=ValueError("the engine failed"), error_after=1)
    response = request(make_app(engine), "POST", "/v1/completions",
                       json={"model": MODEL, "prompt": "hello", "stream": True})
    assert response.status_code == 200
    first, *rest = response.text.split("\n\n", 1)
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] == "t0 "
    assert rest == ['data: {"error": {"message": "the engine failed", "type": "invalid_request_error", '
                    '"param": null, "code": null}}\n\ndata: [DONE]\n\n']


def test_engine_refusing_a_stream_before_its_first_output_is_a_400():
    engine = FakeEngineClient(error=ValueError("the engine refused it"))
    response = request(make_app(engine), "POST", "/v1/completions",
                       json={"model": MODEL, "prompt": "hello", "stream": True})
    assert (response.status_code, response.json()) == (400, {"error": {
        "message": "the engine refused it", "type": "invalid_request_error", "param": None, "code": None}})


@pytest.mark.parametrize("stream", [False, True])
def test_no_room_in_any_engine_is_429_with_retry_after(stream):
    response = request(make_app(FakeEngineClient(busy_from=0)), "POST", "/v1/completions",
                       json={"model": MODEL, "prompt": "hello", "stream": stream})
    assert (response.status_code, response.headers["retry-after"]) == (429, "1")
    assert response.json() == {"error": {
        "message": "The server has too many requests waiting; retry later.", "type": "rate_limit_error",
        "param": None, "code": "server_overloaded"}}


def test_a_body_over_the_limit_is_413_before_it_is_read_whole():
    app = make_app(max_body_bytes=64)
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert request(app, "POST", "/v1/completions", content=body).status_code == 200
    too_long = json.dumps({"model": MODEL, "prompt": "hello " * 20, "max_tokens": 1})

    async def chunked():  # no content-length: the limit is counted as the body streams in
        yield too_long.encode()

    for content in (too_long, chunked()):
        response = request(app, "POST", "/v1/completions", content=content)
        assert response.status_code == 413
        assert error_of(response) == {"message": "The request body is larger than 64 bytes.",
                                      "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def test_closing_a_stream_early_abandons_the_engine_stream_and_migrates_nothing():
    engine = FakeEngineClient()
    serving = OpenAIServing(engine, FakeTokenizer(), ModelInfo(MODEL, MAX_MODEL_LEN, VOCAB_SIZE, BLOCK_SIZE),
                            ServingMetrics(), max_migrations=2)
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 50, "stream": True}).encode()

    async def read_one_chunk_then_disconnect():
        response = await serving.create_completion(body, arrival_time=0.0)
        first = await anext(response.body_iterator)
        await response.body_iterator.aclose()
        return first

    assert '"text": "t0 "' in asyncio.run(read_one_chunk_then_disconnect())
    assert engine.abandoned == [engine.requests[0].request_id]
    assert len(engine.requests) == 1


def test_leaving_a_chat_stream_after_its_opening_chunk_abandons_the_engine_stream_at_once():
    engine = FakeEngineClient()
    serving = OpenAIServing(engine, FakeTokenizer(), ModelInfo(MODEL, MAX_MODEL_LEN, VOCAB_SIZE, BLOCK_SIZE),
                            ServingMetrics())
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                       "stream": True}).encode()

    async def read_the_opening_chunk_then_disconnect():
        response = await serving.create_chat_completion(body, arrival_time=0.0)
        opening = await anext(response.body_iterator)
        await response.body_iterator.aclose()
        return opening, list(engine.abandoned)  # before the loop's shutdown would close what is left

    opening, abandoned = asyncio.run(read_the_opening_chunk_then_disconnect())
    assert '"role": "assistant"' in opening
    assert abandoned == [engine.requests[0].request_id]


class BlockingTokenizer(FakeTokenizer):
    """Tokenizing a text with HUGE in it lasts until release is set, as a 100k-token prompt's would."""
    HUGE = "huge"

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.HUGE in text:
            self.entered.set()
            self.release.wait(timeout=5)  # against a hang only: the old inline code fails the test after it
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", lambda prompt: {"prompt": prompt}),
    ("/v1/chat/completions", lambda prompt: {"messages": [{"role": "user", "content": prompt}]}),
])
def test_tokenizing_a_huge_prompt_holds_up_no_other_request(path, body):
    tokenizer = BlockingTokenizer()
    finished = []

    async def send(client: httpx.AsyncClient, prompt: str) -> None:
        padding = "x" * INLINE_PREPARE_BYTES if prompt == BlockingTokenizer.HUGE else ""  # as large as a huge one
        response = await client.post(path, json={"model": MODEL, "max_tokens": 2, "user": padding, **body(prompt)})
        finished.append((prompt, response.status_code))

    async def test():
        async with http_client(make_app(tokenizer=tokenizer)) as client:
            huge = asyncio.create_task(send(client, BlockingTokenizer.HUGE))
            await asyncio.to_thread(tokenizer.entered.wait, 5)
            await send(client, "hi")
            tokenizer.release.set()
            await huge

    asyncio.run(test())
    assert finished == [("hi", 200), ("huge", 200)]


def test_a_finished_stream_is_not_abandoned():
    engine = FakeEngineClient()
    request(make_app(engine), "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert engine.abandoned == []


@pytest.mark.parametrize("body, status, message, code", [
    ('{"model": ', 400, "Invalid JSON: EOF while parsing a value at line 1 column 10", None),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "The model `gpt-4` does not exist.", "model_not_found"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0", None),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n: Input should be greater than or equal to 1", None),
    ({"model": MODEL, "prompt": "hi", "n": 129}, 400, "n: Input should be less than or equal to 128", None),
    ({"model": MODEL, "prompt": "hi", "logprobs": 6}, 400, "logprobs: Input should be less than or equal to 5", None),
    ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo: not supported by this server", None),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature must be non-negative, got -1.0", None),
    ({"model": MODEL}, 400, "prompt: Field required", None),
    ({"model": MODEL, "prompt": ""}, 400, "the prompt is empty", None),
    ({"model": MODEL, "prompt": []}, 400, "the prompt is empty", None),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400,
     "prompt: batched prompts are not supported; send one prompt per request", None),
    ({"model": MODEL, "prompt": [1, 256]}, 400, "prompt token ids must lie in [0, 256)", None),
    ({"model": MODEL, "prompt": "x" * MAX_MODEL_LEN}, 400,
     f"This model's maximum context length is {MAX_MODEL_LEN} tokens, but the prompt has {MAX_MODEL_LEN} tokens.",
     "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x" * 60, "max_tokens": 5}, 400,
     f"This model's maximum context length is {MAX_MODEL_LEN} tokens; the prompt has 60 tokens, which leaves room "
     "for 4 generated tokens, but max_tokens is 5.", "context_length_exceeded"),
])
def test_bad_completion_requests_get_openai_errors(body, status, message, code):
    engine = FakeEngineClient()
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = request(make_app(engine), "POST", "/v1/completions", **kwargs)
    assert response.status_code == status
    error = error_of(response)
    assert (error["message"], error["type"], error["code"]) == (message, "invalid_request_error", code)
    assert engine.requests == []


@pytest.mark.parametrize("body, message", [
    ({"model": MODEL}, "messages: Field required"),
    ({"model": MODEL, "messages": []}, "messages: List should have at least 1 item after validation, not 0"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
     "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "hi"}]},
     "chat template: the last message must not be the assistant's"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3},
     "max_tokens must be at least 1, got -3"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools.0.function: Field required"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice other than none and auto needs tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}},
     "tool_choice names 'b', which is not among the tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "a"}]},
     "functions: not supported by this server"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format: json_schema is required when type is json_schema"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5},
     "top_logprobs must be in [0, 20] and needs logprobs, got 5"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1}},
     "logit_bias: not supported by this server"),
])
def test_bad_chat_requests_get_openai_errors(body, message):
    response = request(make_app(), "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert error_of(response)["message"] == message


def test_the_openai_client_raises_on_errors():
    async def unknown_model(client: openai.AsyncOpenAI):
        await client.completions.create(model="nope", prompt="hi")

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        with_openai(make_app(), unknown_model)


    async def with_penalty(client: openai.AsyncOpenAI):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             frequency_penalty=0.5)

    with pytest.raises(openai.BadRequestError, match="frequency_penalty: not supported by this server"):
        with_openai(make_app(), with_penalty)


def test_completion_logprobs_in_openais_legacy_shape():
    async def complete(client: openai.AsyncOpenAI):
        return await client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1)

    logprobs = with_openai(make_app(), complete).choices[0].logprobs
    assert (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset) == (
        ["t0 ", "t1 "], [-0.25, -0.5], [{"t0 ": -0.25}, {"t1 ": -0.5}], [0, 3])


def test_chat_logprobs_streamed_and_whole_read_by_the_openai_client():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 2}

    async def whole_and_streamed(client: openai.AsyncOpenAI):
        whole = await client.chat.completions.create(**body)
        return whole, [chunk async for chunk in await client.chat.completions.create(**body, stream=True)]

    whole, chunks = with_openai(make_app(), whole_and_streamed)
    content = whole.choices[0].logprobs.content
    assert [(entry.token, entry.logprob, entry.bytes) for entry in content] == [
        ("t0 ", -0.25, [116, 48, 32]), ("t1 ", -0.5, [116, 49, 32])]
    assert [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in content] == [
        [("t0 ", -0.25), ("!", -1.25)], [("t1 ", -0.5), ("!", -1.5)]]
    streamed = [chunk.choices[0].logprobs for chunk in chunks]
    assert streamed[0] is None  # the opening chunk: the role, no token
    assert [logprobs.content for logprobs in streamed[1:]] == [[entry] for entry in content]


def test_fields_that_ask_for_nothing_unsupported_are_accepted():
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [],
            "response_format": {"type": "text"}, "logprobs": False, "frequency_penalty": 0, "stream_options": None}
    assert request(make_app(), "POST", "/v1/chat/completions", json=body).status_code == 200


def test_unknown_routes_and_methods_are_openai_errors():
    app = make_app()
    assert error_of(request(app, "GET", "/v1/nothing"))["message"] == "Not Found"
    response = request(app, "GET", "/v1/completions")
    assert response.status_code == 405
    assert error_of(response)["message"] == "Method Not Allowed"


def test_api_key_guards_v1_routes_but_not_health_or_metrics():
    app = make_app(api_key="secret")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
        response = request(app, "POST", "/v1/completions", json=body, headers=headers)
        assert response.status_code == 401
        assert error_of(response)["code"] == "invalid_api_key"
    assert request(app, "GET", "/v1/models").status_code == 401
    assert request(app, "POST", "/v1/completions", json=body,
                   headers={"Authorization": "Bearer secret"}).status_code == 200
    assert request(app, "GET", "/health").status_code == 200
    assert request(app, "GET", "/metrics").status_code == 200

    async def authorized(client: openai.AsyncOpenAI):
        return await client.models.list()

    assert [model.id for model in with_openai(app, authorized, api_key="secret").data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        with_openai(app, authorized, api_key="wrong")


def test_models_lists_the_served_model():
    assert request(make_app(), "GET", "/v1/models").json() == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "prefixserve", "max_model_len": MAX_MODEL_LEN}]}


def test_metrics_have_one_series_per_replica():
    stats = SchedulerStats(num_running=2, num_waiting=1, kv_usage=0.25, num_preemptions=3, prefix_cache_queries=40,
                           prefix_cache_hits=16, host_pool_hits=8, num_cached_blocks=5, pulled_tokens=48,
                           pull_failures=1, pins=PinStats(12, 9, 6, 2, 1, 300, 240),
                           spec_decoding=SpecDecodingStats(7, 18, 11, [6, 4, 1]))
    stats.structured_outputs.requests.update(json=4, regex=1)
    stats.structured_outputs.errors = 2
    stats.structured_outputs.compile_seconds.observe(0.002)
    stats.structured_outputs.compile_seconds.observe(20.0)
    snapshot = RouterSnapshot("prefix", {"replica-a": ReplicaSnapshot(stats, 5, 2, 32, 16, 3, 7)},
                              {"prefix_hit": 4, "no_hit": 1})
    app = make_app(FakeEngineClient("replica-a"), snapshot=snapshot)
    request(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 3})
    lines = set(request(app, "GET", "/metrics").text.splitlines())
    per_replica = {
        "generation_tokens_total": 3.0, "prompt_tokens_total": 11.0, "time_to_first_token_seconds_count": 1.0,
        "inter_token_latency_seconds_count": 2.0, "e2e_request_latency_seconds_count": 1.0,
        "num_requests_running": 2.0, "num_requests_waiting": 1.0, "kv_cache_usage_perc": 0.25,
        "num_preemptions_total": 3.0, "prefix_cache_queries_total": 40.0, "prefix_cache_hits_total": 16.0,
        "host_pool_hits_total": 8.0, "router_index_host_blocks": 7.0, "pulled_tokens_total": 48.0,
        "pull_failures_total": 1.0,
        "pinned_blocks": 12.0, "pins_total": 9.0, "pin_hits_total": 6.0, "pins_expired_total": 2.0,
        "pins_released_total": 1.0, "next_turn_prefix_cache_queries_total": 300.0,
        "next_turn_prefix_cache_hits_total": 240.0, "kv_cached_blocks": 5.0, "router_index_blocks": 5.0,
        "router_requests_in_flight": 2.0,
        "router_parked_sessions": 3.0, "router_predicted_cached_tokens_total": 32.0,
        "router_actual_cached_tokens_total": 16.0, "spec_decode_num_drafts_total": 7.0,
        "spec_decode_num_draft_tokens_total": 18.0, "spec_decode_num_accepted_tokens_total": 11.0,
        "structured_output_errors_total": 2.0, "grammar_compile_seconds_count": 2.0,
        "grammar_compile_seconds_sum": 20.002, "grammar_mask_fill_seconds_count": 0.0,
    }
    for name, value in per_replica.items():
        assert f'prefixserve:{name}{{replica="replica-a"}} {value}' in lines
    for position, value in enumerate([6.0, 4.0, 1.0]):
        assert (f'prefixserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{position}",'
                f'replica="replica-a"}} {value}') in lines
    assert 'prefixserve:router_decisions_total{outcome="prefix_hit",policy="prefix"} 4.0' in lines
    assert 'prefixserve:router_decisions_total{outcome="no_hit",policy="prefix"} 1.0' in lines
    assert 'prefixserve:structured_output_requests_total{kind="json",replica="replica-a"} 4.0' in lines
    assert 'prefixserve:structured_output_requests_total{kind="regex",replica="replica-a"} 1.0' in lines
    for bound, count in (("0.001", 0.0), ("0.0025", 1.0), ("10.0", 1.0), ("+Inf", 2.0)):
        assert f'prefixserve:grammar_compile_seconds_bucket{{le="{bound}",replica="replica-a"}} {count}' in lines


HI = [{"role": "user", "content": "hi"}]
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.mark.parametrize("fields, constraint", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}},
     {"json_schema": POINT}),
    ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
    ({"structured_outputs": {"json": '{"type": "integer"}', "disable_any_whitespace": True}},
     {"json_schema": {"type": "integer"}, "whitespace_flexible": False}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"grammar": 'root ::= "a" | "b"'}),
])
def test_constraints_reach_the_engine(fields, constraint):
    engine = FakeEngineClient()
    response = request(make_app(engine), "POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": HI, "max_tokens": 2, **fields})
    assert response.status_code == 200
    assert engine.requests[0].params.structured_outputs == StructuredOutputsParams(**constraint)


def test_completions_take_constraints_too():
    engine = FakeEngineClient()
    response = request(make_app(engine), "POST", "/v1/completions",
                       json={"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"}})
    assert response.status_code == 200
    assert engine.requests[0].params.structured_outputs == StructuredOutputsParams(json_object=True)


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "only one kind of constraint per request: response_format or structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "exactly one kind of constraint (json, json_object, regex, choice or grammar) per request, got 2: regex, choice"),
    ({"structured_outputs": {}}, "exactly one kind of constraint"),
    ({"structured_outputs": {"choice": []}}, "choice must list at least one string"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json is not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "the json constraint does not compile: "),
    ({"structured_outputs": {"json": {"type": "object", "not": {"required": ["a"]}}}},
     'the json constraint does not compile: Unimplemented keys: ["not"]'),
    ({"structured_outputs": {"regex": "(unclosed"}}, "the regex constraint does not compile: "),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "the grammar constraint does not compile: "),
])
def test_constraints_that_cannot_run_get_a_400_before_routing(fields, message):
    engine = FakeEngineClient()
    response = request(make_app(engine), "POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": HI, **fields})
    assert response.status_code == 400
    assert message in error_of(response)["message"]
    assert engine.requests == []


def test_an_engine_that_fails_a_constraint_gets_a_400():
    engine = FakeEngineClient(error=ValueError("the constraint took too long to compile"))
    response = request(make_app(engine), "POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": HI, "response_format": {"type": "json_object"}})
    assert response.status_code == 400
    assert error_of(response)["message"] == "the constraint took too long to compile"


def test_n_choices_are_one_engine_request_each_sent_where_the_first_went_with_the_prompt_counted_once():
    engine = FakeEngineClient("replica-a")
    response = request(make_app(engine), "POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": HI, "max_tokens": 3, "n": 3, "seed": 5})
    assert response.status_code == 200
    body = response.json()
    assert [(choice["index"], choice["message"]["content"], choice["finish_reason"]) for choice in body["choices"]] \
        == [(index, "t0 t1 t2 ", "length") for index in range(3)]
    prompt_tokens = len(FakeTokenizer().apply_chat_template(HI))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 9, "total_tokens": prompt_tokens + 9,
                             "prompt_tokens_details": {"cached_tokens": cached_tokens(0)}}
    response_id = body["id"]
    assert [(sent.request_id, sent.params.seed, sent.route_to) for sent in engine.requests] == [
        (response_id, 5, None), (f"{response_id}-1", 6, "replica-a"), (f"{response_id}-2", 7, "replica-a")]
    assert len({tuple(sent.block_hashes) for sent in engine.requests}) == 1
    assert response.headers[REPLICA_HEADER] == "replica-a"


def test_n_streamed_choices_come_by_index():
    engine = FakeEngineClient("replica-a")
    response = request(make_app(engine), "POST", "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}})
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n")
              if line and line != "data: [DONE]"]
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "t0 t1 ", 1: "t0 t1 "}
    assert [event["choices"][0]["finish_reason"] for event in events[:-1]].count("length") == 2
    assert events[-1]["usage"]["completion_tokens"] == 4 and events[-1]["usage"]["prompt_tokens"] == 2
    assert [sent.params.seed for sent in engine.requests] == [None, None]


def test_a_failing_choice_fails_the_request_and_stops_the_others():
    engine = FakeEngineClient(error=ValueError("the constraint took too long to compile"), error_after=1)
    response = request(make_app(engine), "POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": HI, "max_tokens": 5, "n": 3})
    assert response.status_code == 400
    assert error_of(response)["message"] == "the constraint took too long to compile"
    assert sorted(engine.abandoned) == sorted(sent.request_id for sent in engine.requests)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hello"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_a_routed_request_is_served_under_the_id_its_router_booked_where_the_app_takes_it(path, body):
    body = {"model": MODEL, "max_tokens": 2} | body
    routed = {"x-routed-id": "cmpl-booked"}
    engine = FakeEngineClient()
    response = request(make_app(engine, routed_request_id_header="x-routed-id"), "POST", path, json=body,
                       headers=routed)
    assert response.json()["id"] == "cmpl-booked" == engine.requests[0].request_id
    unrouted = request(make_app(engine), "POST", path, json=body, headers=routed)
    assert unrouted.json()["id"] == engine.requests[1].request_id != "cmpl-booked"


def test_a_router_prepares_a_body_of_either_endpoint_as_the_replica_will_and_passes_on_what_it_refuses():
    serving = OpenAIServing(FakeEngineClient(), FakeTokenizer(),
                            ModelInfo(MODEL, MAX_MODEL_LEN, VOCAB_SIZE, BLOCK_SIZE, HASH_SEED), ServingMetrics())
    preparer = serving.preparer
    completion = json.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 2}).encode()
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    for raw, prepare, kind in ((completion, preparer.completion, "cmpl-"), (chat, preparer.chat_completion,
                                                                           "chatcmpl-")):
        routable = preparer.routable(raw, "session-1")
        expected = prepare(raw, "session-1").request
        assert routable.request_id.startswith(kind)
        assert (routable.prompt_token_ids, routable.block_hashes, routable.session_id) == (
            expected.prompt_token_ids, expected.block_hashes, "session-1")
    assert [preparer.routable(raw, None) for raw in (b"{bad", b"[1]", json.dumps({"model": "other", "prompt": "x"})
                                                     .encode())] == [None, None, None]
