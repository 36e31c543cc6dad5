"""Structured outputs and tool calls through the openai client against the real app (2 replicas of the real model,
fp32): JSON schemas drawn from every MaskBench category at temperature 0 and 1, pydantic parsing, a stream, calls
forced over BFCL's tools, streamed calls, and a two-turn tool loop."""
import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from benchmarks.jsonschemabench import CATEGORIES, load_schemas
from cluster.config import ClusterConfig
from cluster.protocol import REPLICA_HEADER
from replica.executor.checkpoint import load_checkpoint
from replica.structured_output import StructuredOutputsParams
from replica.structured_output.backend import GrammarError, GuidanceBackend
from tests.cluster.test_e2e import MODEL, served

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENGINE = {"dtype": "float32", "num_kv_blocks": 400, "max_model_len": 1024, "max_num_seqs": 32}
SCHEMAS_PER_CATEGORY = {"BFCL": 50, "Glaiveai2K": 80, "Handwritten": 20, "MCPspec": 20, "Synthesized": 40}
ASK = [{"role": "system", "content": "You answer with JSON only."},
       {"role": "user", "content": "Fill in an example value."}]


@pytest.fixture(scope="module")
def base_url():
    with served(ClusterConfig(engine=ENGINE, num_replicas=2)) as url:
        yield url


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def drawn_schemas() -> list:
    rng = random.Random(0)
    drawn = []
    for category in CATEGORIES:
        schemas = list(load_schemas((category,)))
        drawn += rng.sample(schemas, SCHEMAS_PER_CATEGORY[category])
    return drawn


def compiles(backend: GuidanceBackend, schema) -> bool:
    try:
        backend.compile(StructuredOutputsParams(json_schema=schema))
    except GrammarError:
        return False
    return True


def test_json_schemas_from_every_category_hold_whenever_the_output_stops(client):
    schemas = drawn_schemas()
    checkpoint = load_checkpoint(None)
    backend = GuidanceBackend(checkpoint.tokenizer.backend, checkpoint.config.vocab_size,
                              checkpoint.tokenizer.eos_token_id)

    def ask(schema, temperature: float):
        try:
            response = client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=128, temperature=temperature, seed=1,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "example", "schema": schema.schema, "strict": True}})
        except openai.BadRequestError as exc:
            return "refused", exc.message
        choice = response.choices[0]
        return choice.finish_reason, choice.message.content

    cases = [(schema, temperature) for schema in schemas for temperature in (0.0, 1.0)]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda case: ask(*case), cases))  # a 5xx raises here
    invalid = []
    for (schema, temperature), (finish_reason, text) in zip(cases, answers):
        assert (finish_reason == "refused") == (not compiles(backend, schema.schema)), (schema.name, text)
        if finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(text), schema.schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                invalid.append(f"{schema.category}/{schema.name} at {temperature}: {text!r}: {exc}")
    assert invalid == []
    finish_reasons = [finish_reason for finish_reason, _ in answers]
    assert len(schemas) >= 200 and finish_reasons.count("stop") >= 100, finish_reasons  # 152 when written


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
        max_tokens=64, temperature=0)
    assert completion.choices[0].finish_reason == "stop"
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person == Person.model_validate_json(completion.choices[0].message.content)


def test_a_streamed_constrained_answer_joins_to_the_unstreamed_one(client):
    args = dict(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,8}( [a-z]{2,8}){2}\\\\."}})
    whole = client.chat.completions.create(**args).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == \
        whole.message.content
    assert whole.finish_reason == chunks[-1].choices[0].finish_reason == "stop"


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def bfcl_tool_sets(count: int) -> list[list[dict]]:
    """BFCL's schemas ({"properties": {function name: its parameters}}, or anyOf several) as sets of OpenAI tools."""
    tool_sets = []
    for schema in random.Random(1).sample(list(load_schemas(("BFCL",))), count):
        tool_sets.append([{"type": "function", "function": {"name": name.replace(".", "_")[:64], "parameters": params}}
                          for branch in schema.schema.get("anyOf", [schema.schema])
                          for name, params in branch["properties"].items()])
    return tool_sets


def tool_request(tools: list[dict], choice, **extra) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": "Call a tool with plausible arguments."}],
                tools=tools, tool_choice=choice, max_tokens=200, **extra)


def test_forced_calls_over_bfcl_tools_have_arguments_that_validate(client):
    cases = [(tools, choice) for tools in bfcl_tool_sets(40)
             for choice in ("required", {"type": "function", "function": {"name": tools[0]["function"]["name"]}})]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda case: client.chat.completions.create(
            **tool_request(*case, temperature=1.0, seed=3)).choices[0], cases))
    called = 0
    for (tools, choice), answer in zip(cases, answers):
        assert answer.finish_reason in ("tool_calls", "length")
        parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        for call in answer.message.tool_calls or ():
            assert choice == "required" or call.function.name == choice["function"]["name"]
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
            called += 1
    assert called >= 60, [answer.finish_reason for answer in answers]


@pytest.mark.parametrize("response_format", [None, {"type": "json_schema", "json_schema": {
    "name": "person", "schema": PERSON, "strict": True}}])
def test_under_auto_strict_tools_and_a_json_answer_hold_in_one_grammar(client, response_format):
    """SmolLM2 seldom calls a tool unforced: what this checks on the real vocabulary is that the answer stays free
    (or holds to its schema) and that no malformed call is left as text; tests/cluster/test_tool_calls.py checks
    that the grammar takes only well-formed calls."""
    tool_sets = [[{**tool, "function": {**tool["function"], "strict": True}} for tool in tools]
                 for tools in bfcl_tool_sets(20)]
    extra = {"response_format": response_format} if response_format else {}
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda tools: client.chat.completions.create(
            **tool_request(tools, "auto", temperature=1.0, seed=5, **extra)).choices[0], tool_sets))
    for tools, answer in zip(tool_sets, answers):
        parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
        assert "<tool_call>" not in (answer.message.content or ""), answer
        for call in answer.message.tool_calls or ():
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        if response_format and answer.finish_reason == "stop":
            jsonschema.validate(json.loads(answer.message.content), PERSON)
    assert sum(answer.finish_reason == "stop" for answer in answers) >= 10, [answer.finish_reason for answer in answers]


def test_streamed_call_deltas_join_to_the_unstreamed_arguments(client):
    for tools in bfcl_tool_sets(4):
        args = tool_request(tools, "required", temperature=0)
        whole = client.chat.completions.create(**args).choices[0]
        chunks = [chunk.choices[0] for chunk in client.chat.completions.create(stream=True, **args) if chunk.choices]
        deltas = [call for chunk in chunks for call in chunk.delta.tool_calls or ()]
        names = [delta.function.name for delta in deltas if delta.id is not None]
        joined = ["".join(delta.function.arguments or "" for delta in deltas if delta.index == index)
                  for index in range(len(names))]
        assert names == [call.function.name for call in whole.message.tool_calls]
        assert joined == [call.function.arguments for call in whole.message.tool_calls]
        assert chunks[-1].finish_reason == whole.finish_reason == "tool_calls"


def test_a_tool_loop_continues_from_the_cached_conversation(client):
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city today.",
                                             "parameters": {"type": "object", "required": ["city"],
                                                            "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=[tool],
                                                           tool_choice="required", max_tokens=64, temperature=0)
    first = raw.parse()
    call = first.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments).keys()) == ("get_weather", {"city"})
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    raw_again = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=[tool],
                                                                 max_tokens=32, temperature=0)
    second = raw_again.parse()
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert raw_again.headers[REPLICA_HEADER] == raw.headers[REPLICA_HEADER]  # routed to the cached conversation
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16


def test_n_choices_each_hold_their_own_grammar(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], n=3, temperature=1.0, seed=11,
        max_tokens=64, logprobs=True, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    completion = raw.parse()
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    stopped = [choice for choice in completion.choices if choice.finish_reason == "stop"]
    assert len(stopped) >= 2 and all(jsonschema.validate(json.loads(choice.message.content), PERSON) is None
                                     for choice in stopped)
    assert len({choice.message.content for choice in completion.choices}) > 1  # three sampling streams
    assert completion.usage.completion_tokens == sum(len(choice.logprobs.content) for choice in completion.choices)
    assert completion.usage.prompt_tokens == client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=1).usage.prompt_tokens
    assert len(raw.headers[REPLICA_HEADER].split(",")) == 1  # the choices follow the first one
