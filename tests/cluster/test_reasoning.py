"""Reasoning models: which prompts leave the output to think first, the thinking split from the answer (whole and
streamed), the grammar that holds only after the thinking (compiled by llguidance over a byte-level tokenizer),
and the API's reasoning_content with a fake engine."""
import json

import pytest

from cluster.protocol import ChatFormat
from cluster.reasoning import Reasoning, reasoning_for
from cluster.tool_calls import FORMATS, ToolCallParser
from replica.structured_output import ReasoningGate, StructuredOutputsParams
from replica.structured_output.backend import GuidanceBackend
from tests.executor.helpers import byte_tokenizer_backend

from .fakes import FakeEngineClient, FakeTokenizer
from .test_api import MODEL, make_app, request
from .test_tool_calls import NAMES, TIME, WEATHER, events

QWEN3_LIKE = "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
INSIDE, MAY_OPEN = Reasoning(starts_inside=True), Reasoning(starts_inside=False)


@pytest.mark.parametrize("template, tail, reasoning", [
    (None, "<|im_start|>assistant\n", None),
    ("{{ messages }}", "<|im_start|>assistant\n", None),  # no thinking in the template
    (QWEN3_LIKE, "<|im_start|>assistant\n", MAY_OPEN),
    (QWEN3_LIKE, "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # thinking switched off
    (QWEN3_LIKE, "<｜Assistant｜><think>\n", INSIDE),  # DeepSeek-R1 opens it in the prompt
])
def test_the_prompt_tells_whether_the_output_thinks_first(template, tail, reasoning):
    assert reasoning_for(template, tail) == reasoning


@pytest.mark.parametrize("reasoning, text, thinking, answer", [
    (MAY_OPEN, "<think>\nA plan.\n</think>\n\nThe answer.", "\nA plan.\n", "The answer."),
    (MAY_OPEN, "\n<think>A</think>B", "A", "B"),
    (MAY_OPEN, "The answer, no thinking.", None, "The answer, no thinking."),
    (MAY_OPEN, "<thi", None, "<thi"),
    (MAY_OPEN, "<think>cut off by max_tok", "cut off by max_tok", ""),
    (INSIDE, "A plan.</think>\n\n{}", "A plan.", "{}"),
    (INSIDE, "A plan that goes on </thin", "A plan that goes on </thin", ""),
])
def test_thinking_and_answer_split_alike_whole_and_streamed_however_the_text_is_cut(reasoning, text, thinking,
                                                                                  answer):
    assert reasoning.split(text) == (thinking, answer)
    for size in (1, 2, 5, len(text)):
        stream = reasoning.stream()
        pieces = [stream.feed(text[start:start + size], start + size >= len(text))
                  for start in range(0, len(text), size)]
        assert ("".join(piece[0] for piece in pieces), "".join(piece[1] for piece in pieces)) == \
            (thinking or "", answer)


def test_a_reasoning_models_calls_are_parsed_after_its_thinking_only():
    parser = ToolCallParser(FORMATS["smollm2"], NAMES)
    text = ('<think>Maybe <tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>? No, the weather.</think>\n'
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>')
    whole = ChatFormat("id", MODEL, parser, MAY_OPEN).choice(text, "stop", None)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"].startswith("Maybe <tool_call>")
    assert [call["function"]["name"] for call in whole["message"]["tool_calls"]] == ["get_weather"]
    for size in (1, 3, len(text)):
        chat = ChatFormat("id", MODEL, parser, MAY_OPEN)
        stream = "".join(chat.chunk(text[start:start + size], None) for start in range(0, len(text), size))
        deltas = [event["choices"][0]["delta"] for event in events(stream + chat.chunk("", "stop"))]
        assert "".join(delta.get("reasoning_content", "") for delta in deltas) == whole["message"]["reasoning_content"]
        assert [call["function"]["name"] for delta in deltas for call in delta.get("tool_calls", ())
                if "id" in call] == ["get_weather"]
        assert not any(delta.get("content") for delta in deltas)


@pytest.fixture(scope="module")
def backend() -> GuidanceBackend:
    return GuidanceBackend(byte_tokenizer_backend(), 258, 257)


def accepts(backend: GuidanceBackend, params: StructuredOutputsParams, text: str, prefix: tuple[int, ...] = ()) -> bool:
    token_ids = [*prefix, *byte_tokenizer_backend().encode(text).ids]
    return backend.compile(params).validate(token_ids + [257]) == len(token_ids) + 1


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("gate, thinking", [
    (ReasoningGate(closing='"</think>"', opening='"<think>"'), '<think>Say {"town": 1} <tool_call>?</think>\n\n'),
    (ReasoningGate(closing='"</think>"'), 'Say {"town": 1}?</think>'),
])
def test_a_constraint_holds_only_after_the_thinking(backend, gate, thinking):
    params = StructuredOutputsParams(json_schema=CITY, reasoning=gate)
    assert accepts(backend, params, thinking + '{"city": "Oslo"}')
    assert not accepts(backend, params, thinking + '{"town": "Oslo"}')
    assert not accepts(backend, params, thinking)  # an answer must follow
    assert accepts(backend, params, '{"city": "Oslo"}') == (gate.opening is not None)  # or no thinking at all


def test_forced_and_auto_calls_after_the_thinking(backend):
    gate = ReasoningGate(closing='"</think>"', opening='"<think>"')
    forced = FORMATS["hermes"].grammar([WEATHER, TIME], False, lambda text: None)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(backend, StructuredOutputsParams(grammar=forced, reasoning=gate), f"<think>Hm.</think>\n{call}")
    assert not accepts(backend, StructuredOutputsParams(grammar=forced, reasoning=gate), "<think>Hm.</think>Hi")


def test_a_closing_special_token_is_named_by_id(backend):
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning=ReasoningGate(closing="<[256]>"))
    thinking = byte_tokenizer_backend().encode("Well, </think> is text here").ids
    answer = byte_tokenizer_backend().encode("no").ids
    assert backend.compile(params).validate([*thinking, 256, *answer, 257]) == len(thinking) + len(answer) + 2


class ThinkingTokenizer(FakeTokenizer):
    """A model that reasons, its prompt opening the thinking (as DeepSeek-R1's template does)."""
    chat_template = QWEN3_LIKE

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return super().apply_chat_template(messages, tools) + self.encode("<think>\n")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Characters only: the prompt's (the output's text comes from the fake engine)."""
        return "".join(map(chr, token_ids))


def test_the_api_returns_the_thinking_apart_and_gates_the_constraint():
    engine = FakeEngineClient()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "response_format": {"type": "json_object"}}
    app = make_app(engine, tokenizer=ThinkingTokenizer())
    message = request(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "", "reasoning_content": "t0 t1 t2 "}  # cut off thinking
    assert engine.requests[0].params.structured_outputs == StructuredOutputsParams(
        json_object=True, reasoning=ReasoningGate(closing='"</think>"'))
    stream = request(app, "POST", "/v1/chat/completions", json=body | {"stream": True}).text
    deltas = [event["choices"][0]["delta"] for event in events(stream.removesuffix("data: [DONE]\n\n"))]
    assert "".join(delta.get("reasoning_content", "") for delta in deltas) == "t0 t1 t2 "
    assert json.dumps(deltas).count("reasoning_content") == 3
