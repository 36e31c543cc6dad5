"""The OpenAI wire format: request bodies, response and chunk builders, error bodies."""
import abc
import copy
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import pydantic

from cluster.reasoning import Reasoning, ReasoningStream
from cluster.tool_calls import ToolCallParser
from replica.request import SamplingParams
from replica.structured_output import StructuredOutputsParams

REPLICA_HEADER = "x-prefixserve-replica"
SESSION_HEADER = "x-session-id"  # Ray Serve's session router and AIPerf's --session-header send it


class APIError(Exception):
    """A request the server refuses, sent as OpenAI's {"error": {...}} body with a 4xx/5xx status."""

    def __init__(self, message: str, *, status_code: int = 400, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def describe(error: pydantic.ValidationError) -> str:
    """Each problem as "field: message", without pydantic's URLs and input echo."""
    problems = []
    for problem in error.errors(include_url=False, include_input=False):
        field = ".".join(str(part) for part in problem["loc"])
        message = problem["msg"].removeprefix("Value error, ")
        problems.append(f"{field}: {message}" if field else message)
    return "; ".join(problems)


MAX_CHOICES = 128  # OpenAI's limit on n


class StreamOptions(pydantic.BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(pydantic.BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = pydantic.Field({"type": "object"}, alias="schema")
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormatParam(pydantic.BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @pydantic.model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormatParam":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is json_schema")
        return self

    def constraint(self) -> dict[str, Any]:
        match self.type:
            case "json_object":
                return {"json_object": True}
            case "json_schema":
                return {"json_schema": self.json_schema.schema_}
        return {}


class StructuredOutputsBody(pydantic.BaseModel):
    """vLLM's extension `structured_outputs`: exactly one of json (a schema, or its JSON text), json_object,
    regex, choice and grammar (Lark or GBNF)."""
    model_config = pydantic.ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = pydantic.Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> dict[str, Any]:
        schema = self.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        given = {"json_schema": schema, "json_object": self.json_object or None, "regex": self.regex,
                 "choice": self.choice, "grammar": self.grammar}
        return {kind: value for kind, value in given.items() if value is not None} | \
            {"whitespace_flexible": not self.disable_any_whitespace}


class _GenerationRequest(pydantic.BaseModel):
    """The fields completions and chat share. Unknown fields are ignored; OpenAI's fields this server does
    not implement are refused unless they ask for nothing (UNSUPPORTED: field -> the values that do)."""

    UNSUPPORTED: ClassVar[dict[str, tuple]] = {
        "logit_bias": (None, {}), "frequency_penalty": (None, 0), "presence_penalty": (None, 0)}

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = pydantic.Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted as OpenAI does; not used
    cache_salt: str | None = None
    """Requests with different salts never share prefix-cache blocks (vLLM's extension)."""
    ignore_eos: bool = False
    """Generate max_tokens even past the end-of-sequence token (vLLM's extension, for benchmarks)."""
    session_id: str | None = None
    """The conversation or agent program this turn belongs to (or the X-Session-Id header): the router
    keeps the sessions that come back in mind when it places a new one, and replicas under the
    continuum policy pin a finished turn's KV blocks for the next."""
    last_turn: bool = False
    """The session's last turn: nothing to pin its blocks for (continuum)."""
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputsBody | None = None
    """What the output must match (vLLM's extension); only one of it and a JSON response_format."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _nothing_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, asks_for_nothing in cls.UNSUPPORTED.items():
                if data.get(name) not in asks_for_nothing:
                    raise ValueError(f"{name}: not supported by this server")
        return data

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> tuple[bool, int]:
        """Whether to report each sampled token's logprob, and how many likeliest tokens to list with it."""
        return False, 0

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, tool_constraint: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """tool_constraint: the grammar of the tool calls, which holds the answer's own constraint if it has one.
        ValueError (pydantic's included) for values that do not go together."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        logprobs, top_logprobs = self.requested_logprobs
        structured_outputs = tool_constraint if tool_constraint is not None else self.structured_outputs_params()
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, top_logprobs=top_logprobs, structured_outputs=structured_outputs)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The answer's own constraint: response_format or structured_outputs."""
        constraints = self._constraints()
        if len(constraints) > 1:
            raise ValueError("only one kind of constraint per request: response_format or structured_outputs")
        return StructuredOutputsParams(**constraints[0]) if constraints else None

    def _constraints(self) -> list[dict[str, Any]]:
        return [constraint for constraint in (
            self.response_format.constraint() if self.response_format else {},
            self.structured_outputs.constraint() if self.structured_outputs else {}) if constraint]


class CompletionRequest(_GenerationRequest):
    UNSUPPORTED = _GenerationRequest.UNSUPPORTED | {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}

    prompt: str | list[int] | list[str]
    logprobs: int | None = pydantic.Field(None, ge=0, le=5)

    @property
    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    @pydantic.field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if prompt and isinstance(prompt, list) and isinstance(prompt[0], str):
            if len(prompt) > 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            return prompt[0]
        return prompt


class TextPart(pydantic.BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(pydantic.BaseModel):
    name: str
    arguments: str  # JSON text

    def as_template_input(self) -> dict[str, Any]:
        """Templates take the arguments as an object (Qwen's writes them with tojson)."""
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError:
            raise ValueError(f"tool call {self.name!r}: arguments are not valid JSON") from None
        return {"name": self.name, "arguments": arguments}


class ToolCallParam(pydantic.BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(pydantic.BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """ValueError for tool-call arguments that are not JSON."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": call.function.as_template_input()}
                                     for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(pydantic.BaseModel):
    name: str = pydantic.Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(pydantic.BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(pydantic.BaseModel):
    class Function(pydantic.BaseModel):
        name: str

    type: Literal["function"]
    function: Function


class ChatCompletionRequest(_GenerationRequest):
    UNSUPPORTED = _GenerationRequest.UNSUPPORTED | {
        "functions": (None, []), "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
        "prediction": (None,)}

    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @pydantic.model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        names = {tool.function.name for tool in self.tools or ()}
        if self.tool_choice in ("required",) or isinstance(self.tool_choice, NamedToolChoice):
            if not names:
                raise ValueError("tool_choice other than none and auto needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.forces_a_call and self._constraints():
            raise ValueError("only one kind of constraint per request: a tool_choice that forces a call leaves no "
                             "answer for response_format or structured_outputs")
        return self

    @property
    def tools_in_play(self) -> list[dict[str, Any]]:
        """The tools the model may call (tool_choice none: none); a named choice leaves only that one."""
        if not self.tools or self.tool_choice == "none":
            return []
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [tool for tool in tools if tool["function"]["name"] == self.tool_choice.function.name]
        return tools

    @property
    def forces_a_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token as text, its logprob, and the likeliest tokens at its position (likeliest first)."""
    token: str
    logprob: float
    top: list[tuple[str, float]]


TEXT_MARKER = "\x00text"  # where a chunk's text goes in its template (no response id or model name holds it)


class ResponseFormat(abc.ABC):
    """How one kind of endpoint (completions, chat) shapes one choice of its responses and stream chunks."""

    object: str
    chunk_object: str

    def __init__(self, response_id: str, model: str):
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.index = 0  # the choice's
        self._text_chunk: tuple[str, str] | None = None  # a text chunk's halves, made at the first

    def for_choices(self, n: int) -> list["ResponseFormat"]:
        """One format per choice of a request with n of them (each keeps its own stream's state); itself for one."""
        if n == 1:
            return [self]
        formats = [copy.copy(self) for _ in range(n)]
        for index, choice_format in enumerate(formats):
            choice_format.index = index
            choice_format._text_chunk = None  # its halves name its own index
        return formats

    def response(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        """choices: each choice's choice()."""
        return self._envelope(self.object, choices, usage=usage_)

    def chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None) -> str:
        if text and finish_reason is None and logprobs is None:  # most of a stream: text alone, a template's
            head, tail = self._text_chunk_halves()
            return f"data: {head}{json.dumps(text)}{tail}\n\n"
        return sse(self._envelope(self.chunk_object, [self.chunk_choice(text, finish_reason, logprobs)]))

    def _text_chunk_halves(self) -> tuple[str, str]:
        """A chunk of text alone, as sse() writes it, split where the text goes (a sixth of dumping it whole)."""
        if self._text_chunk is None:
            whole = json.dumps(self._envelope(self.chunk_object, [self.chunk_choice(TEXT_MARKER, None, None)]))
            head, tail = whole.split(json.dumps(TEXT_MARKER))
            self._text_chunk = head, tail
        return self._text_chunk

    def usage_chunk(self, usage_: dict[str, Any]) -> str:
        return sse(self._envelope(self.chunk_object, [], usage=usage_))

    def opening_chunks(self) -> list[str]:
        return []

    @abc.abstractmethod
    def choice(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None) -> dict[str, Any]: ...

    @abc.abstractmethod
    def chunk_choice(self, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprob] | None) -> dict[str, Any]: ...

    def _envelope(self, object_: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}


class CompletionFormat(ResponseFormat):
    object = chunk_object = "text_completion"

    def __init__(self, response_id: str, model: str):
        super().__init__(response_id, model)
        self._text_offset = 0  # where the next token's text starts in the completion

    def choice(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": None if logprobs is None else self._logprobs(logprobs),
                "finish_reason": finish_reason}

    chunk_choice = choice

    def _logprobs(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        offsets = list(itertools.accumulate((len(token.token) for token in tokens), initial=self._text_offset))
        self._text_offset = offsets.pop()
        return {"tokens": [token.token for token in tokens], "token_logprobs": [token.logprob for token in tokens],
                "top_logprobs": [dict(token.top) for token in tokens], "text_offset": offsets}


class ChatFormat(ResponseFormat):
    """tool_calls: how to find the calls of the request's tools in the model's text, when it may call them.
    Streamed, text that may begin a call is held back until it is known not to; each call then goes out as a
    delta with its index, id, type and name, and one with its whole arguments (equal to the unstreamed ones).
    reasoning: for a reasoning model, its thinking goes to reasoning_content and only what follows is parsed."""
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, tool_calls: ToolCallParser | None = None,
                 reasoning: Reasoning | None = None):
        super().__init__(response_id, model)
        self._tool_calls = tool_calls
        self._reasoning = reasoning
        self._thinking: ReasoningStream | None = None  # made at the first chunk: each choice's copy has its own
        self._streamed_text = ""
        self._num_content_chars_sent = 0

    def choice(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        thinking, text = self._reasoning.split(text) if self._reasoning is not None else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._tool_calls is not None and (parsed := self._tool_calls.parse(text))[1]:
            content, calls = parsed
            message = {"role": "assistant", "content": content or None,
                       "tool_calls": [call.as_openai() for call in calls]}
            finish_reason = _with_calls(finish_reason)
        if self._reasoning is not None:
            message["reasoning_content"] = thinking
        return {"index": self.index, "message": message, "logprobs": _chat_logprobs(logprobs),
                "finish_reason": finish_reason}

    def chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None) -> str:
        """"" when everything new is held back."""
        if self._reasoning is None:
            return self._answer_chunk(text, finish_reason, logprobs)
        if self._thinking is None:
            self._thinking = self._reasoning.stream()
        thinking, text = self._thinking.feed(text, finish_reason is not None)
        thought = self._delta({"reasoning_content": thinking}) if thinking else ""
        if not (text or finish_reason or logprobs):
            return thought
        return thought + self._answer_chunk(text, finish_reason, logprobs)

    def _answer_chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None) -> str:
        if self._tool_calls is None:
            return super().chunk(text, finish_reason, logprobs)
        self._streamed_text += text
        if finish_reason is None:
            held_from = max(self._tool_calls.format.held_back(self._streamed_text), self._num_content_chars_sent)
            content = self._streamed_text[self._num_content_chars_sent:held_from]
            self._num_content_chars_sent = held_from
            return super().chunk(content, None, logprobs) if content or logprobs else ""
        content, calls = self._tool_calls.parse(self._streamed_text)
        if not calls:
            return super().chunk(self._streamed_text[self._num_content_chars_sent:], finish_reason, logprobs)
        events = [super().chunk(content[self._num_content_chars_sent:], None)] \
            if len(content) > self._num_content_chars_sent else []
        for index, call in enumerate(calls):
            opening = {"index": index, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": ""}}
            events += [self._delta({"tool_calls": [opening]}),
                       self._delta({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})]
        events.append(super().chunk("", _with_calls(finish_reason), logprobs))
        return "".join(events)

    def _delta(self, delta: dict[str, Any]) -> str:
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return sse(self._envelope(self.chunk_object, [choice]))

    def chunk_choice(self, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": self.index, "delta": delta, "logprobs": _chat_logprobs(logprobs),
                "finish_reason": finish_reason}

    def opening_chunks(self) -> list[str]:
        opening = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}
        return [sse(self._envelope(self.chunk_object, [opening]))]


def _with_calls(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _chat_logprobs(tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    if tokens is None:
        return None
    return {"content": [entry(token.token, token.logprob) | {"top_logprobs": [entry(*top) for top in token.top]}
                        for token in tokens]}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")
