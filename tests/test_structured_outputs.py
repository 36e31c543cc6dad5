"""Constrained decoding end to end on the real default model (fp32, CPU): every kind of constraint, failures
that end only their request, and greedy tokens under a grammar unchanged by batching, speculative decoding,
preemption, async scheduling and migration."""
import json
import re
import time

import jsonschema
import pytest

from replica.engine import LLM
from replica.kv_cache import hash_token_blocks
from replica.request import SamplingParams
from replica.structured_output import StructuredOutputsParams
from tests.test_engine import PROMPTS, make_llm, run, token_ids

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def constrained(max_tokens: int = 48, temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def person_greedy(llm) -> list[int]:
    output = llm.chat(ASK, constrained(json_schema=PERSON))[0]
    assert output.finish_reason == "stop"
    return output.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(llm, temperature):
    outputs = llm.chat([ASK] * 4, constrained(64, temperature, json_schema=PERSON))
    assert {output.finish_reason for output in outputs} == {"stop"}
    for output in outputs:
        jsonschema.validate(json.loads(output.text), PERSON)


def test_each_kind_of_constraint_holds(llm):
    regex, choice = r"\d{3}-[a-z]{2,4}", ["pineapple", "kiwi", "fig"]
    one_key = [{"role": "user", "content": "Give a JSON object with one key, ok, set to true."}]
    outputs = llm.chat([one_key] + [ASK] * 3, [
        constrained(json_object=True, max_tokens=100), constrained(regex=regex), constrained(choice=choice),
        constrained(grammar='start: "x" ("y" | "z")~1..3 "!"')])
    assert [output.finish_reason for output in outputs] == ["stop"] * 4
    assert isinstance(json.loads(outputs[0].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outputs[1].text)  # \d is an ASCII digit
    assert outputs[2].text in choice
    assert re.fullmatch(r"x[yz]{1,3}!", outputs[3].text)


def test_compact_json_has_no_whitespace(llm):
    output = llm.chat(ASK, constrained(json_schema=PERSON, whitespace_flexible=False))[0]
    assert output.finish_reason == "stop"
    assert output.text == json.dumps(json.loads(output.text), separators=(",", ":"))


def test_a_constraint_that_does_not_compile_fails_only_its_request(llm, person_greedy):
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    before = llm.engine.stats().structured_outputs
    outputs = llm.chat([ASK] * 3, [constrained(json_schema=bad), constrained(json_schema=PERSON),
                                   constrained(grammar="start: nothing_defined")])
    assert [output.finish_reason for output in outputs] == ["error", "stop", "error"]
    assert "does not compile" in outputs[0].error and "missing" in outputs[0].error
    assert outputs[1].token_ids == person_greedy
    assert outputs[0].token_ids == outputs[2].token_ids == []
    assert llm.engine.kv_cache_manager.usage == 0.0
    after = llm.engine.stats().structured_outputs
    assert (after.errors - before.errors, after.requests["json"] - before.requests.get("json", 0),
            after.requests["grammar"] - before.requests.get("grammar", 0)) == (2, 2, 1)
    assert sum(after.mask_fill_seconds.counts) > sum(before.mask_fill_seconds.counts)


def test_a_compile_past_the_time_limit_fails_its_request(monkeypatch):
    llm = make_llm(grammar_compile_timeout_s=0.05)
    backend = llm.engine.structured_outputs.backend
    compile_now = backend.compile
    monkeypatch.setattr(backend, "compile", lambda params: time.sleep(0.5) or compile_now(params))
    outputs = llm.chat([ASK] * 2, [constrained(json_schema=PERSON), SamplingParams(max_tokens=4, temperature=0)])
    assert [output.finish_reason for output in outputs] == ["error", "length"]
    assert outputs[0].error == "the constraint took too long to compile"


def test_unconstrained_requests_batched_with_constrained_ones_keep_their_tokens(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = token_ids(llm.generate(PROMPTS, greedy))
    mixed = llm.generate(PROMPTS * 2, [greedy] * 4 + [constrained(json_schema=PERSON)] * 4)
    assert token_ids(mixed[:4]) == alone


@pytest.mark.parametrize("engine_args", [
    {"num_speculative_tokens": 3}, {"async_scheduling": True}, {"max_num_batched_tokens": 16},
    {"num_kv_blocks": 8, "watermark": 0.0}], ids=["ngram", "async", "chunked", "preempted"])
def test_greedy_tokens_under_a_grammar_are_unchanged_by_how_the_engine_runs(person_greedy, engine_args):
    llm = make_llm(**engine_args)
    long_prompt = [{"role": "user", "content": PROMPTS[2] + " Describe a person as JSON."}]
    outputs = llm.chat([ASK, long_prompt, ASK], constrained(json_schema=PERSON))
    assert outputs[0].token_ids == outputs[2].token_ids == person_greedy
    stats = llm.engine.stats()
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0
    if "num_speculative_tokens" in engine_args:
        assert stats.spec_decoding.num_draft_tokens > 0


def test_a_migrated_request_goes_on_under_its_grammar(llm, person_greedy):
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template(ASK)
    for split in (1, len(person_greedy) // 2, len(person_greedy) - 1):
        done = person_greedy[:split]
        rest = run(engine, f"moved-{split}", prompt, constrained(json_schema=PERSON), output_token_ids=done,
                   block_hashes=hash_token_blocks(prompt + done, 16))
        assert done + [token for output in rest for token in output.new_token_ids] == person_greedy
        assert rest[-1].finish_reason == "stop"


def test_output_the_grammar_rejects_cannot_be_migrated(llm):
    prompt = llm.tokenizer.apply_chat_template(ASK)
    outputs = run(llm.engine, "moved-bad", prompt, constrained(json_schema=PERSON),
                  output_token_ids=llm.tokenizer.encode("nope", add_special_tokens=False))
    assert [(output.finished, output.finish_reason) for output in outputs] == [(True, "error")]
    assert outputs[0].error == "the output so far does not match the json constraint"
