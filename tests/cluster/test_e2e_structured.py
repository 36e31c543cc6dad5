"""Structured outputs through the openai client against the real app (2 replicas of the real model, fp32): JSON
schemas drawn from every MaskBench category at temperature 0 and 1, pydantic parsing, and a stream."""
import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from benchmarks.jsonschemabench import CATEGORIES, load_schemas
from cluster.config import ClusterConfig
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
