"""Tool calls in each model family's own format: the parser that turns a model's text into calls, the grammar
that makes tool_choice "required" or a named tool hold (constrained decoding in that same format), and how much
streamed text to hold back because it may begin a call.

| format | families | a call as the model writes it |
|---|---|---|
| smollm2 | ChatML under prefixserve's template (SmolLM2) | `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>` |
| hermes | Qwen2.5, Qwen3 | `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, once per call |
| llama3_json | Llama 3.1-3.3 | `{"name": ..., "parameters": {...}}` as the whole answer (`; ` between calls) |
| mistral | Mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` |

Under tool_choice "auto" a call is recognised when the answer contains the format's opening (for llama3_json:
when the whole answer is JSON) and what follows parses as calls of the declared tools; anything else (a tag
with malformed JSON, an unknown tool) stays in the message's content.
"""
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replica.structured_output import StructuredOutputsParams
from replica.structured_output.backend import is_special_terminal, lark_json, lark_terminal

WHITESPACE = r'WS: /[ \t\n]{1,8}/'
FREE_TEXT = "TEXT"  # an answer of any text


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    opening: str          # the text that begins the calls ("" for llama3_json: a JSON answer)
    arguments_key: str    # the key of a call's arguments
    id_length: int = 24   # Mistral's template wants 9 characters

    def parse(self, text: str, tool_names: frozenset[str]) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished answer; (text, []) when it holds no well-formed calls of these tools."""
        content, raw_calls = _PARSERS[self.name](self, text)
        if raw_calls is None or not raw_calls or not all(_is_call(call, self.arguments_key, tool_names)
                                                          for call in raw_calls):
            return text, []
        return content, [ToolCall(call["name"], json.dumps(call[self.arguments_key], ensure_ascii=False),
                                  self.new_id()) for call in raw_calls]

    def new_id(self) -> str:
        if self.id_length == 9:
            return uuid.uuid4().hex[:9]
        return "call_" + uuid.uuid4().hex[:self.id_length]

    def grammar(self, tools: list[dict], parallel: bool, special_token_id: Callable[[str], int | None], *,
                answer: str | None = None) -> str:
        """A Lark grammar (llguidance's) of one call, or one or more with parallel, in this format. answer: the
        grammar of an answer without calls (FREE_TEXT or a %json), which text and then the calls may replace
        (tool_choice auto); None: a call is forced."""
        call = f"call: {lark_json(_call_schema(tools, self.arguments_key))}"
        opening, calls = self._calls(parallel, special_token_id)
        if answer is None:
            return "\n".join([f"start: {opening}{calls}", call, WHITESPACE])
        if answer != FREE_TEXT:  # text before calls would be a lexeme as long as the answer's JSON
            start = f"start: answer | {opening}{calls}"
        elif not opening:  # llama3_json: a call is the whole answer, free text never starts as JSON
            start, answer = f"start: answer | {calls}", r"/(\s*[^{\s](.|\n)*)?/"
        elif is_special_terminal(opening):  # text never holds a special token
            start = f"start: answer | TEXT {opening}{calls}"
        else:  # text up to the first opening, which the calls must follow
            start = f"start: answer | opened {calls}\nopened[lazy]: TEXT {opening}"
        return "\n".join(["%llguidance {}", start, f"answer: {answer}", call, WHITESPACE, r"TEXT: /(.|\n)*/"])

    def _calls(self, parallel: bool, special_token_id: Callable[[str], int | None]) -> tuple[str, str]:
        """The opening as a grammar names it (a string, a special token or nothing), and the calls after it."""
        if self.name == "hermes":
            more = r' ("\n<tool_call>\n" call "\n</tool_call>")*' if parallel else ""
            return json.dumps(self.opening), rf' "\n" call "\n</tool_call>"{more}'
        if self.name == "llama3_json":
            return "", 'call ("; " call)*' if parallel else "call"
        opening = lark_terminal(self.opening, special_token_id)
        closing = ' "</tool_call>"' if self.name == "smollm2" else ""
        more = ' (WS? "," WS? call)*' if parallel else ""
        return opening, f' "[" WS? call{more} WS? "]"{closing}'

    def held_back(self, text: str) -> int:
        """Where text stops being plain content while it streams: at the opening, or at a suffix that may grow
        into one (for llama3_json: the whole answer once it starts as JSON). len(text) if nothing is held."""
        if not self.opening:
            return 0 if text.lstrip().startswith(("{", "<|python_tag|>")) or not text.strip() else len(text)
        if (start := text.find(self.opening)) >= 0:
            return start
        return len(text) - partial_suffix(text, self.opening)


FORMATS = {name: ToolCallFormat(name, opening, key, id_length) for name, opening, key, id_length in [
    ("smollm2", "<tool_call>", "arguments", 24), ("hermes", "<tool_call>", "arguments", 24),
    ("llama3_json", "", "parameters", 24), ("mistral", "[TOOL_CALLS]", "arguments", 9)]}


@dataclass(frozen=True)
class ToolCallParser:
    """The calls of one request's tools in its answer."""
    format: ToolCallFormat
    tool_names: frozenset[str]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return self.format.parse(text, self.tool_names)


def format_for(chat_template: str | None) -> ToolCallFormat | None:
    """The format a chat template renders calls in; None if it renders no tools."""
    if chat_template is None:
        return None
    if "<tool_call>[" in chat_template:
        return FORMATS["smollm2"]
    if "[TOOL_CALLS]" in chat_template:
        return FORMATS["mistral"]
    if "<tool_call>" in chat_template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in chat_template or "<|eom_id|>" in chat_template:
        return FORMATS["llama3_json"]
    return None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (and is shorter than it)."""
    return next((length for length in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-length:])),
                0)


def answer_grammar(constraint: StructuredOutputsParams | None) -> str | None:
    """The Lark of an answer under this constraint, for a grammar that lets calls replace it (FREE_TEXT for none);
    None for a constraint that cannot be written so (regex, choice, grammar)."""
    if constraint is None:
        return FREE_TEXT
    match constraint.kind:
        case "json":
            return lark_json(constraint.json_schema, constraint.whitespace_flexible)
        case "json_object":
            return lark_json({"type": "object"}, constraint.whitespace_flexible)
    return None


def with_free_arguments_unless_strict(tools: list[dict]) -> list[dict]:
    """The tools, those not strict taking any JSON object as arguments."""
    return [tool if tool["function"].get("strict") else
            {**tool, "function": {**tool["function"], "parameters": {"type": "object"}}} for tool in tools]


def _is_call(call: Any, arguments_key: str, tool_names: set[str]) -> bool:
    return isinstance(call, dict) and call.get("name") in tool_names and isinstance(call.get(arguments_key), dict)


def _after_opening(text: str, opening: str) -> tuple[str, str] | None:
    start = text.find(opening)
    return None if start < 0 else (text[:start].rstrip(), text[start + len(opening):])


def _json_prefix(text: str) -> tuple[Any, str] | None:
    """The JSON value text starts with (after whitespace), and what follows it."""
    stripped = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError:
        return None
    return value, stripped[end:]


def _parse_array(calls_format: ToolCallFormat, text: str, closing: str = "") -> tuple[str, list | None]:
    split = _after_opening(text, calls_format.opening)
    if split is None or (parsed := _json_prefix(split[1])) is None:
        return text, None
    value, rest = parsed
    if rest.strip() != closing:
        return text, None
    return split[0], value if isinstance(value, list) else [value]


def _parse_hermes(calls_format: ToolCallFormat, text: str) -> tuple[str, list | None]:
    blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, flags=re.DOTALL)
    if not blocks:
        return text, None
    calls = []
    for block in blocks:
        parsed = _json_prefix(block)
        if parsed is None or parsed[1].strip():
            return text, None
        calls.append(parsed[0])
    return text[:text.find("<tool_call>")], calls


def _parse_llama3(calls_format: ToolCallFormat, text: str) -> tuple[str, list | None]:
    rest, calls = text.strip().removeprefix("<|python_tag|>"), []
    while rest:
        parsed = _json_prefix(rest)
        if parsed is None:
            return text, None
        calls.append(parsed[0])
        rest = parsed[1].strip().removeprefix(";").strip()
    return "", calls or None


_PARSERS = {"smollm2": lambda f, text: _parse_array(f, text, "</tool_call>"), "hermes": _parse_hermes,
            "llama3_json": _parse_llama3, "mistral": _parse_array}


def _call_schema(tools: list[dict], arguments_key: str) -> dict[str, Any]:
    """One call of any of the tools: {"name": its name, arguments_key: its parameters}, each tool's $defs (and
    definitions) lifted to the root, where their references point; two tools defining one name differently
    is a ValueError."""
    roots: dict[str, dict] = {"$defs": {}, "definitions": {}}
    branches = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
        for key, defined in roots.items():
            for name, schema in parameters.pop(key, {}).items():
                if defined.setdefault(name, schema) != schema:
                    raise ValueError(f"tools define {key}/{name} differently; a call's grammar needs one definition")
        branches.append({"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                         "properties": {"name": {"const": function["name"]}, arguments_key: parameters}})
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    return {**schema, **{key: defined for key, defined in roots.items() if defined}}
