"""RequestPreparer: an OpenAI completion or chat body in, an engine request out (parsed, checked against the
model's limits, its prompt tokenized with the chat template applied and its full blocks hashed exactly as the
replicas hash them, so that the router can match them against their caches)."""
import asyncio
import json
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import pydantic
import tokenizers

from cluster.protocol import (APIError, ChatCompletionRequest, ChatFormat, CompletionFormat, CompletionRequest,
                              ResponseFormat, describe)
from cluster.reasoning import Reasoning, reasoning_for
from cluster.tool_calls import (FREE_TEXT, ToolCallParser, answer_grammar, format_for,
                                 with_free_arguments_unless_strict)
from replica.async_engine import EngineRequest, ModelInfo
from replica.kv_cache import hash_token_blocks
from replica.request import SamplingParams
from replica.structured_output import StructuredOutputsParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
PROMPT_TAIL_TOKENS = 8  # enough to see whether a chat template ended the prompt inside the model's thinking
# Threads that prepare requests off the event loop: more than one, so that a long prompt does not hold up the
# short ones behind it.
PREPARE_THREADS = 4
# A body this small is prepared on the event loop: it takes at most about a millisecond (512 bytes of text to
# tokenize), 32 token ids about 70 us, where the handoff to a thread costs about 120 us of its own.
INLINE_PREPARE_BYTES = 512


class Tokenizer(Protocol):
    backend: tokenizers.Tokenizer
    eos_token_id: int | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]: ...

    @property
    def tools_template(self) -> str | None: ...

    def special_token_id(self, text: str) -> int | None: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request parsed, tokenized and hashed: ready for the engine."""
    body: CompletionRequest | ChatCompletionRequest
    request: EngineRequest
    response_format: ResponseFormat


Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)
Result = TypeVar("Result")


class RequestPreparer:
    def __init__(self, tokenizer: Tokenizer, model: ModelInfo):
        self.tokenizer = tokenizer
        self.model = model
        self._executor = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="prepare")

    async def off_loop(self, prepare: Callable[..., Result], raw_body: bytes, *args) -> Result:
        """prepare(raw_body, *args) on a thread: parsing, templating, tokenizing and hashing a prompt of 100k
        tokens takes long enough to delay every other request's tokens if it ran on the event loop that streams
        them."""
        if len(raw_body) <= INLINE_PREPARE_BYTES:
            return prepare(raw_body, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, prepare, raw_body, *args)

    def completion(self, raw_body: bytes, session_id: str | None, request_id: str | None = None) -> Prepared:
        """raw_body: the request's JSON; session_id: its X-Session-Id header, if the body names none; request_id:
        the engine request's and the response's id, if one was given it before (else a new one)."""
        body = _parse(raw_body, CompletionRequest, session_id)
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_token_ids = self.tokenizer.encode(body.prompt)
        else:
            prompt_token_ids = self._check_token_ids(body.prompt)
        response_format = CompletionFormat(request_id or _new_request_id("cmpl"), self.model.name)
        return self._prepare(body, prompt_token_ids, response_format, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)

    def chat_completion(self, raw_body: bytes, session_id: str | None, request_id: str | None = None) -> Prepared:
        """As completion."""
        body = _parse(raw_body, ChatCompletionRequest, session_id)
        self._check_model(body.model)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        try:
            prompt_token_ids = self.tokenizer.apply_chat_template([m.as_template_input() for m in body.messages],
                                                                  tools)
        except ValueError as exc:  # the template refused the conversation
            raise APIError(str(exc), param="messages") from None
        parser, tool_constraint = self._tool_calls(body)
        reasoning = reasoning_for(self.tokenizer.chat_template, self.tokenizer.decode(
            prompt_token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
        response_format = ChatFormat(request_id or _new_request_id("chatcmpl"), self.model.name, parser, reasoning)
        return self._prepare(body, prompt_token_ids, response_format, tool_constraint=tool_constraint,
                             reasoning=reasoning)

    def routable(self, raw_body: bytes, session_id: str | None) -> EngineRequest | None:
        """The engine request of a body whose endpoint is unknown (a chat's has messages, a completion's a prompt);
        None for a body that either endpoint would refuse."""
        try:
            keys = json.loads(raw_body)
        except ValueError:
            return None
        prepare = self.chat_completion if isinstance(keys, dict) and "messages" in keys else self.completion
        try:
            return prepare(raw_body, session_id).request
        except APIError:
            return None

    def _tool_calls(self, body: ChatCompletionRequest) -> tuple[ToolCallParser | None, StructuredOutputsParams | None]:
        """How to find the calls in the answer, and the grammar of its calls: one forced (tool_choice required or
        named), or an answer that calls may replace (auto), the strict tools' arguments held to their parameters
        and the answer to its own constraint; None where neither holds anything."""
        tools = body.tools_in_play
        if not tools:
            return None, None
        call_format = format_for(self.tokenizer.tools_template)
        if call_format is None:
            raise APIError("this model's chat template writes tool calls in a format prefixserve does not parse",
                           param="tools")
        parser = ToolCallParser(call_format, frozenset(tool["function"]["name"] for tool in tools))
        answer = None
        if not body.forces_a_call:
            try:
                answer = answer_grammar(body.structured_outputs_params())
            except ValueError as exc:
                raise APIError(str(exc)) from None
            if answer is None or (answer == FREE_TEXT and not any(tool["function"].get("strict") for tool in tools)):
                return parser, None  # free calls, or (regex, choice, grammar) the answer's constraint alone
            tools = with_free_arguments_unless_strict(tools)
        try:
            grammar = call_format.grammar(tools, body.parallel_tool_calls, self.tokenizer.special_token_id,
                                          answer=answer)
        except ValueError as exc:
            raise APIError(str(exc), param="tools") from None
        return parser, StructuredOutputsParams(grammar=grammar)

    def _prepare(self, body: CompletionRequest | ChatCompletionRequest, prompt_token_ids: list[int],
                 response_format: ResponseFormat, *, default_max_tokens: int | None = None,
                 tool_constraint: StructuredOutputsParams | None = None, reasoning: Reasoning | None = None
                 ) -> Prepared:
        params = self._sampling_params(body, len(prompt_token_ids), default_max_tokens, tool_constraint)
        if reasoning is not None and params.structured_outputs is not None:  # the thinking stays free
            params = params.model_copy(update={"structured_outputs": params.structured_outputs.model_copy(
                update={"reasoning": reasoning.gate(self.tokenizer.special_token_id)})})
        request = EngineRequest(
            request_id=response_format.response_id, prompt_token_ids=prompt_token_ids,
            block_hashes=hash_token_blocks(prompt_token_ids, self.model.block_size, cache_salt=body.cache_salt,
                                           seed=self.model.hash_seed),
            params=params, cache_salt=body.cache_salt, session_id=body.session_id, last_turn=body.last_turn)
        return Prepared(body, request, response_format)

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                         default_max_tokens: int | None, tool_constraint: StructuredOutputsParams | None
                         ) -> SamplingParams:
        max_model_len = self.model.max_model_len
        if num_prompt_tokens == 0:
            raise APIError("the prompt is empty", param="prompt")
        if num_prompt_tokens >= max_model_len:
            raise APIError(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                           f"{num_prompt_tokens} tokens.", code="context_length_exceeded")
        room = max_model_len - num_prompt_tokens
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{num_prompt_tokens} tokens, which leaves room for {room} generated tokens, "
                           f"but max_tokens is {max_tokens}.", code="context_length_exceeded", param="max_tokens")
        try:
            return body.sampling_params(max_tokens, tool_constraint)
        except pydantic.ValidationError as exc:
            raise APIError(describe(exc)) from None
        except ValueError as exc:
            raise APIError(str(exc)) from None

    def _check_model(self, model: str) -> None:
        if model != self.model.name:
            raise APIError(f"The model `{model}` does not exist.", status_code=404, code="model_not_found",
                           param="model")

    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = self.model.vocab_size
        if not all(0 <= token_id < vocab_size for token_id in token_ids):
            raise APIError(f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
        return token_ids


def _new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def _parse(raw_body: bytes, model: type[Body], session_id: str | None) -> Body:
    try:
        body = model.model_validate_json(raw_body)
    except pydantic.ValidationError as exc:
        raise APIError(describe(exc)) from None
    if body.session_id is None:
        body.session_id = session_id
    return body
