"""Tool calls: each family's parser, the grammar that forces a call (compiled by llguidance over a byte-level
tokenizer), streamed calls that add up to the unstreamed ones, the ChatML tools template, and the API's tool
fields with a fake engine."""
import json

import pytest

from cluster.protocol import ChatFormat
from cluster.tool_calls import FORMATS, FREE_TEXT, ToolCallParser, format_for
from replica.executor.chat_templates import CHATML_TOOLS
from replica.executor.tokenizer import Tokenizer
from replica.structured_output import StructuredOutputsParams
from replica.structured_output.backend import GuidanceBackend, lark_json
from tests.executor.helpers import byte_tokenizer_backend

from .fakes import FakeEngineClient
from .test_api import MODEL, make_app, request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = frozenset({"get_weather", "get_time"})


@pytest.mark.parametrize("name, text, content, calls", [
    ("smollm2", 'Sure.<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
                '{"name": "get_time", "arguments": {}}\n]</tool_call>', "Sure.",
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check.\n",
     [("get_weather", '{"city": "Zürich", "days": 2}'), ("get_time", "{}")]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "", [("get_time", "{}")]),
])
def test_each_format_parses_its_calls(name, text, content, calls):
    parsed_content, parsed = FORMATS[name].parse(text, NAMES)
    assert (parsed_content, [(call.name, call.arguments) for call in parsed]) == (content, calls)
    assert len({call.id for call in parsed}) == len(parsed)
    assert all(len(call.id) == (9 if name == "mistral" else 29) for call in parsed)


@pytest.mark.parametrize("name, text", [
    ("smollm2", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"'),   # cut off
    ("smollm2", '<tool_call>[{"name": "launch_rockets", "arguments": {}}]</tool_call>'),  # not a declared tool
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("llama3_json", 'The answer is {"name": "get_time", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS]{"name": "get_time", "arguments": "{}"}'),  # arguments must be an object
])
def test_malformed_calls_stay_content(name, text):
    assert FORMATS[name].parse(text, NAMES) == (text, [])


def test_the_format_follows_the_chat_template():
    assert [format_for(template).name for template in (
        CHATML_TOOLS, "{{ '<tool_call>\\n' }}{{ tools }}", "[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]",
        "<|python_tag|>{{ tools }}")] == ["smollm2", "hermes", "mistral", "llama3_json"]
    assert format_for("{{ messages }}") is None and format_for(None) is None


@pytest.mark.parametrize("text, held_from", [
    ("Hello", 5), ("Hello <tool", 6), ("Hello <tool_call>[", 6), ("a<", 1), ("<tool_call", 0)])
def test_streamed_text_that_may_open_a_call_is_held_back(text, held_from):
    assert FORMATS["smollm2"].held_back(text) == held_from


def test_llama3_json_holds_back_an_answer_that_starts_as_json():
    assert [FORMATS["llama3_json"].held_back(text) for text in ("  ", ' {"na', "Hi {", "<|python_tag|>")] == \
        [0, 0, 4, 0]


@pytest.fixture(scope="module")
def backend() -> GuidanceBackend:
    return GuidanceBackend(byte_tokenizer_backend(), 258, 257)


def accepts(backend: GuidanceBackend, grammar: str, text: str) -> bool:
    compiled = backend.compile(StructuredOutputsParams(grammar=grammar))
    token_ids = byte_tokenizer_backend().encode(text).ids
    return compiled.validate(token_ids + [257]) == len(token_ids) + 1


@pytest.mark.parametrize("name, parallel, good, bad", [
    ("smollm2", True, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                      '{"name":"get_time","arguments":{}}]</tool_call>',
     '<tool_call>[{"name": "get_weather", "arguments": {"town": "Rome"}}]</tool_call>'),
    ("smollm2", False, '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>',
     '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]</tool_call>'),
    ("hermes", True, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                     '{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>'),
    ("llama3_json", False, '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     '{"name": "get_weather", "arguments": {"city": "Rome"}}'),
    ("mistral", True, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', '[{"name": "get_time", "arguments": {}}]'),
])
def test_the_forcing_grammar_takes_calls_in_the_native_format_only(backend, name, parallel, good, bad):
    grammar = FORMATS[name].grammar([WEATHER, TIME], parallel, lambda text: None)
    assert accepts(backend, grammar, good) and not accepts(backend, grammar, bad)
    assert FORMATS[name].parse(good, NAMES)[1]


GOOD_WEATHER = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
BAD_WEATHER = '{"name": "get_weather", "arguments": {"town": "Rome"}}'


@pytest.mark.parametrize("name, good, bad", [
    ("smollm2", f"I will look.<tool_call>[{GOOD_WEATHER}]</tool_call>", f"I will look.<tool_call>[{BAD_WEATHER}]"),
    ("hermes", f"I will look.\n<tool_call>\n{GOOD_WEATHER}\n</tool_call>",
     f"I will look.\n<tool_call>\n{BAD_WEATHER}\n</tool_call>"),
    ("llama3_json", GOOD_WEATHER.replace("arguments", "parameters"), "{\"It is sunny\"}"),
    ("mistral", f"[TOOL_CALLS][{GOOD_WEATHER}]", f"Let me see. [TOOL_CALLS][{BAD_WEATHER}]"),
])
def test_the_grammar_of_text_or_calls_takes_any_text_and_well_formed_calls_only(backend, name, good, bad):
    grammar = FORMATS[name].grammar([WEATHER, TIME], False, lambda text: None, answer=FREE_TEXT)
    assert accepts(backend, grammar, good) and not accepts(backend, grammar, bad)
    assert all(accepts(backend, grammar, text) for text in ("", "It is sunny in Rome.", "A <tool_ca or [TOOL_C"))
    assert FORMATS[name].parse(good, NAMES)[1]


def test_call_arguments_take_bounded_whitespace(backend):
    grammar = FORMATS["hermes"].grammar([TIME], False, lambda text: None)
    call = '<tool_call>\n{"name":%s"get_time", "arguments": {}}\n</tool_call>'
    assert accepts(backend, grammar, call % (" " * 20)) and not accepts(backend, grammar, call % (" " * 21))


@pytest.mark.parametrize("name, call", [
    ("smollm2", f"<tool_call>[{GOOD_WEATHER}]</tool_call>"), ("hermes", f"<tool_call>\n{GOOD_WEATHER}\n</tool_call>"),
    ("llama3_json", GOOD_WEATHER.replace("arguments", "parameters")), ("mistral", f"[TOOL_CALLS][{GOOD_WEATHER}]"),
])
def test_a_json_answer_or_calls_instead(backend, name, call):
    answer = lark_json({"type": "object", "properties": {"town": {"type": "string"}}, "required": ["town"]})
    grammar = FORMATS[name].grammar([WEATHER], False, lambda text: None, answer=answer)
    assert accepts(backend, grammar, '{"town": "Rome"}') and accepts(backend, grammar, call)
    assert not any(accepts(backend, grammar, text) for text in ("Rome", '{"city": "Rome"}', f"Well. {call}"))


def test_text_or_calls_behind_a_special_token(backend):
    grammar = FORMATS["mistral"].grammar([TIME], False, {"[TOOL_CALLS]": 256}.get, answer=FREE_TEXT)
    compiled = backend.compile(StructuredOutputsParams(grammar=grammar))
    text, call, bad = (byte_tokenizer_backend().encode(part).ids for part in (
        "Let me see.", '[{"name": "get_time", "arguments": {}}]', '[{"name": "get_date", "arguments": {}}]'))
    assert compiled.validate([*text, 257]) == len(text) + 1
    assert compiled.validate([*text, 256, *call, 257]) == len(text) + len(call) + 2
    assert compiled.validate([*text, 256, *bad]) < len(text) + 1 + len(bad)


def test_a_special_token_opening_is_named_by_id(backend):
    grammar = FORMATS["mistral"].grammar([TIME], False, {"[TOOL_CALLS]": 256}.get)
    assert grammar.startswith('start: <[256]> "["')
    compiled = backend.compile(StructuredOutputsParams(grammar=grammar))
    call = byte_tokenizer_backend().encode('[{"name": "get_time", "arguments": {}}]').ids
    assert compiled.validate([256, *call, 257]) == len(call) + 2


def test_tools_with_clashing_definitions_are_refused():
    clashing = [{"type": "function", "function": {"name": name, "parameters": {"$defs": {"Unit": {"enum": [unit]}}}}}
                for name, unit in (("a", "C"), ("b", "F"))]
    with pytest.raises(ValueError, match=r"tools define \$defs/Unit differently"):
        FORMATS["hermes"].grammar(clashing, True, lambda text: None)


def events(stream: str) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in stream.split("\n\n") if line]


@pytest.mark.parametrize("text", [
    'I will call it.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "get_time", "arguments": {}}]</tool_call>',
    "No call here, only <tool talk.",
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Par'])
def test_streamed_calls_add_up_to_the_unstreamed_ones_however_the_text_is_split(text):
    parser = ToolCallParser(FORMATS["smollm2"], NAMES)
    whole = ChatFormat("id", MODEL, parser).choice(text, "stop", None)
    for size in (1, 2, 7, len(text)):
        chat = ChatFormat("id", MODEL, parser)
        pieces = [text[start:start + size] for start in range(0, len(text), size)]
        stream = "".join(chat.chunk(piece, None) for piece in pieces) + chat.chunk("", "stop")
        deltas = [event["choices"][0] for event in events(stream)]
        content = "".join(delta["delta"].get("content", "") for delta in deltas)
        calls = [call for delta in deltas for call in delta["delta"].get("tool_calls", ())]
        openings = [call for call in calls if "id" in call]
        assert content == (whole["message"]["content"] or "")
        assert [(call["index"], call["type"], call["function"]["name"]) for call in openings] == [
            (index, "function", call["function"]["name"])
            for index, call in enumerate(whole["message"].get("tool_calls", ()))]
        assert all(call["id"].startswith("call_") for call in openings)
        arguments = ["".join(call["function"]["arguments"] for call in calls if call["index"] == index)
                     for index in range(len(openings))]
        assert arguments == [call["function"]["arguments"] for call in whole["message"].get("tool_calls", ())]
        assert deltas[-1]["finish_reason"] == whole["finish_reason"]
    assert whole["finish_reason"] == ("tool_calls" if "tool_calls" in whole["message"] else "stop")


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_tool_loop_renders_in_the_chatml_tools_template():
    tokenizer = Tokenizer(byte_tokenizer_backend(), bos_token_id=None, eos_token_id=257, chat_template=CHATML)
    assert tokenizer.tools_template == CHATML_TOOLS
    loop = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    rendered = tokenizer.render_chat(loop, [TIME])
    assert rendered.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '<tools>[{"name": "get_time", "parameters": {"type": "object", "properties": {}}}]</tools>' in rendered
    assert rendered.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.render_chat(loop[:1]) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    plain = Tokenizer(byte_tokenizer_backend(), bos_token_id=None, eos_token_id=257, chat_template="{{ messages }}")
    with pytest.raises(ValueError, match="this model's chat template does not render tools"):
        plain.render_chat(loop[:1], [TIME])


def chat(engine: FakeEngineClient, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 2, **fields}
    return request(make_app(engine), "POST", "/v1/chat/completions", json=body)


def test_forced_calls_reach_the_engine_as_a_grammar_and_tools_share_a_prefix():
    engine = FakeEngineClient()
    assert chat(engine, tools=[WEATHER, TIME], tool_choice="required").status_code == 200
    assert chat(engine, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                parallel_tool_calls=False).status_code == 200
    assert chat(engine, tools=[WEATHER, TIME]).status_code == 200
    required, named, auto = (sent.params.structured_outputs for sent in engine.requests)
    assert required.grammar == FORMATS["smollm2"].grammar([WEATHER, TIME], True, lambda text: None)
    assert named.grammar == FORMATS["smollm2"].grammar([TIME], False, lambda text: None)
    assert auto is None
    hashes = [sent.block_hashes for sent in engine.requests]
    assert hashes[0] == hashes[1] == hashes[2] and len(hashes[0]) > 2  # the same tools: the same prompt blocks


def test_under_auto_strict_tools_and_a_json_answer_reach_the_engine_as_one_grammar():
    engine = FakeEngineClient()
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    for fields in ({"tools": [strict_weather, TIME]},
                   {"tools": [WEATHER, TIME], "response_format": {"type": "json_schema", "json_schema": {
                       "name": "city", "schema": city}}},
                   {"tools": [strict_weather], "structured_outputs": {"regex": "[a-z]+"}}):
        assert chat(engine, **fields).status_code == 200
    strict, json_answer, regex = (sent.params.structured_outputs for sent in engine.requests)
    free_weather, free_time = ({**tool, "function": {**tool["function"], "parameters": {"type": "object"}}}
                               for tool in (WEATHER, TIME))
    assert strict.grammar == FORMATS["smollm2"].grammar([strict_weather, free_time], True, lambda text: None,
                                                        answer=FREE_TEXT)
    assert json_answer.grammar == FORMATS["smollm2"].grammar([free_weather, free_time], True, lambda text: None,
                                                             answer=lark_json(city))
    assert regex == StructuredOutputsParams(regex="[a-z]+")  # no calls under a constraint a grammar cannot hold


def test_tool_messages_reach_the_template_and_bad_arguments_are_a_400():
    engine = FakeEngineClient()
    loop = [{"role": "user", "content": "Time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    assert chat(engine, messages=loop, tools=[TIME]).status_code == 200
    loop[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    response = chat(engine, messages=loop, tools=[TIME])
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "tool call 'get_time': arguments are not valid JSON"


def test_a_forced_call_with_another_constraint_is_a_400():
    response = chat(FakeEngineClient(), tools=[TIME], tool_choice="required", response_format={"type": "json_object"})
    assert response.status_code == 400
    assert "only one kind of constraint per request" in response.json()["error"]["message"]
