"""OpenAIServing: OpenAI completion and chat requests in, engine requests out, engine outputs back.

It parses each request body, tokenizes its prompt once (chat template applied), checks it against
the model's limits and hashes its full blocks exactly as the replicas do (so the router can match
them against their caches), in worker threads off the event loop that streams every response (a
small body, which takes less than the handoff, on the loop); then it hands token ids and hashes to
an engine client, which moves the request to another replica if its own is lost (migration.py).
Ray-free: the Serve ingress plugs in a client that calls the engine deployment; tests plug in a fake.
"""
import asyncio
import logging
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import pydantic
import tokenizers
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.engine_client import EngineClient, EnginesBusy, ReplicaLost
from cluster.metrics import RequestTracker, ServingMetrics
from cluster.migration import MigratingEngineClient
from cluster.protocol import (REPLICA_HEADER, SSE_DONE, APIError, ChatCompletionRequest, ChatFormat,
                              CompletionFormat, CompletionRequest, ResponseFormat, TokenLogprob, describe, sse,
                              usage)
from cluster.reasoning import Reasoning, reasoning_for
from cluster.tool_calls import (FREE_TEXT, ToolCallParser, answer_grammar, format_for,
                                 with_free_arguments_unless_strict)
from replica.async_engine import EngineOutput, EngineRequest, ModelInfo
from replica.kv_cache import hash_token_blocks
from replica.request import SamplingParams
from replica.structured_output import StructuredOutputsParams
from replica.structured_output.backend import GrammarError, GuidanceBackend
from replica.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("ray.serve.prefixserve.serving")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
# Threads that prepare requests (parse, template, tokenize, hash) off the event loop: more than one, so that
# a long prompt does not hold up the short ones behind it.
PREPARE_THREADS = 4
# A body this small is prepared on the event loop: it takes at most about a millisecond (512 bytes of text to
# tokenize), 32 token ids about 70 us, where the handoff to a thread costs about 120 us of its own.
INLINE_PREPARE_BYTES = 512
CONSTRAINT_CHECK_TIMEOUT_S = 10.0
PROMPT_TAIL_TOKENS = 8  # enough to see whether a chat template ended the prompt inside the model's thinking


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


@dataclass
class _Progress:
    """What a request produced so far; its tracker times each output as it is added."""
    tracker: RequestTracker
    token_text: Callable[[int], str]
    logprobs: list[TokenLogprob] | None = None  # None: not asked for
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    def add(self, output: EngineOutput) -> list[TokenLogprob] | None:
        """Takes the output in; returns its tokens with their logprobs, if the request asked for them."""
        if output.replica_id is not None:  # a replica's first output: the request's, or its part after a migration
            self.tracker.replica_id = output.replica_id
        if not self.num_tokens:  # the prompt's hit; a migrated request's later hits cover its output too
            self.num_cached_tokens = output.num_cached_tokens
        self.text.append(output.new_text)
        self.num_tokens += len(output.new_token_ids)
        self.num_prompt_tokens = output.num_prompt_tokens
        self.finish_reason = output.finish_reason
        self.tracker.observe(len(output.new_token_ids), output.num_prompt_tokens, output.finished)
        if self.logprobs is None:
            return None
        tops = output.top_logprobs or [[] for _ in output.new_token_ids]
        tokens = [TokenLogprob(self.token_text(token_id), logprob, [(self.token_text(i), lp) for i, lp in top])
                  for token_id, logprob, top in zip(output.new_token_ids, output.logprobs, tops, strict=True)]
        self.logprobs.extend(tokens)
        return tokens

    def usage(self) -> dict[str, Any]:
        return usage(self.num_prompt_tokens, self.num_tokens, self.num_cached_tokens)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A request parsed, tokenized and hashed: ready for the engine."""
    body: CompletionRequest | ChatCompletionRequest
    request: EngineRequest
    response_format: ResponseFormat


Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def _parse(raw_body: bytes, model: type[Body], session_id: str | None) -> Body:
    try:
        body = model.model_validate_json(raw_body)
    except pydantic.ValidationError as exc:
        raise APIError(describe(exc)) from None
    if body.session_id is None:
        body.session_id = session_id
    return body


class OpenAIServing:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelInfo, metrics: ServingMetrics, *,
                 max_migrations: int = 0):
        """max_migrations: how many times a request may move to another replica when its own is lost."""
        self.engine = MigratingEngineClient(engine, model, max_migrations, metrics.migrations.inc)
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="ingress-prepare")
        # compiles each constraint once (on threads of its own) to refuse what the engines could not compile
        self.constraints = StructuredOutputManager(
            GuidanceBackend(tokenizer.backend, model.vocab_size, tokenizer.eos_token_id),
            compile_timeout_s=CONSTRAINT_CHECK_TIMEOUT_S)

    def list_models(self) -> dict[str, Any]:
        card = {"id": self.model.name, "object": "model", "created": 0, "owned_by": "prefixserve",
                "max_model_len": self.model.max_model_len}
        return {"object": "list", "data": [card]}

    async def create_completion(self, raw_body: bytes, arrival_time: float, session_id: str | None = None
                                ) -> Response:
        """raw_body: the request's JSON; session_id: its X-Session-Id header, if the body names none."""
        return await self._generate(await self._prepared(self._prepare_completion, raw_body, session_id),
                                    arrival_time)

    async def create_chat_completion(self, raw_body: bytes, arrival_time: float, session_id: str | None = None
                                     ) -> Response:
        """As create_completion."""
        return await self._generate(await self._prepared(self._prepare_chat_completion, raw_body, session_id),
                                    arrival_time)

    async def _prepared(self, prepare: Callable[[bytes, str | None], _Prepared], raw_body: bytes,
                        session_id: str | None) -> _Prepared:
        # Parsing, templating, tokenizing and hashing a prompt of 100k tokens takes long enough to delay
        # every other request's tokens if it ran on the event loop that streams them.
        if len(raw_body) <= INLINE_PREPARE_BYTES:
            return prepare(raw_body, session_id)
        return await asyncio.get_running_loop().run_in_executor(self._executor, prepare, raw_body, session_id)

    def _prepare_completion(self, raw_body: bytes, session_id: str | None) -> _Prepared:
        body = _parse(raw_body, CompletionRequest, session_id)
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_token_ids = self.tokenizer.encode(body.prompt)
        else:
            prompt_token_ids = self._check_token_ids(body.prompt)
        response_format = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model.name)
        return self._prepare(body, prompt_token_ids, response_format, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)

    def _prepare_chat_completion(self, raw_body: bytes, session_id: str | None) -> _Prepared:
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
        response_format = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model.name, parser, reasoning)
        return self._prepare(body, prompt_token_ids, response_format, tool_constraint=tool_constraint,
                             reasoning=reasoning)

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
                 ) -> _Prepared:
        params = self._sampling_params(body, len(prompt_token_ids), default_max_tokens, tool_constraint)
        if reasoning is not None and params.structured_outputs is not None:  # the thinking stays free
            params = params.model_copy(update={"structured_outputs": params.structured_outputs.model_copy(
                update={"reasoning": reasoning.gate(self.tokenizer.special_token_id)})})
        request = EngineRequest(
            request_id=response_format.response_id, prompt_token_ids=prompt_token_ids,
            block_hashes=hash_token_blocks(prompt_token_ids, self.model.block_size, cache_salt=body.cache_salt,
                                           seed=self.model.hash_seed),
            params=params, cache_salt=body.cache_salt, session_id=body.session_id, last_turn=body.last_turn)
        return _Prepared(body, request, response_format)

    async def _generate(self, prepared: _Prepared, arrival_time: float) -> Response:
        body = prepared.body
        await self._check_constraint(prepared.request.params)
        choices = await self._start_choices(prepared, arrival_time)
        if body.stream:
            return StreamingResponse(self._stream(choices, body.include_usage), media_type="text/event-stream",
                                     headers={REPLICA_HEADER: _replicas(choice.first.replica_id for choice in choices)})
        await self._collect(choices)
        response = choices[0].format.response([choice.response_choice() for choice in choices], _usage(choices))
        # the replicas that finished the choices, if they migrated
        return JSONResponse(response, headers={REPLICA_HEADER: _replicas(choice.progress.tracker.replica_id
                                                                         for choice in choices)})

    async def _start_choices(self, prepared: _Prepared, arrival_time: float) -> list["_Choice"]:
        """n > 1: one engine request a choice, each with its own seed. The first is routed; once its first token is
        out, the others go to its replica, where they find the prompt's full blocks cached: one prefill."""
        requests = _choice_requests(prepared.request, prepared.body.n)
        try:
            streams, firsts = await _started(self.engine, requests)
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        logprobs = prepared.request.params.logprobs
        return [_Choice(first, stream, choice_format,
                        _Progress(RequestTracker(self.metrics, first.replica_id, arrival_time), self._token_text,
                                  [] if logprobs else None))
                for first, stream, choice_format in zip(firsts, streams,
                                                        prepared.response_format.for_choices(len(requests)))]

    async def _check_constraint(self, params: SamplingParams) -> None:
        """A 400 naming the problem for a constraint that does not compile, before the request is routed."""
        if params.structured_outputs is None:
            return
        compiling = self.constraints.request(params.structured_outputs).future
        try:
            await asyncio.wait_for(asyncio.wrap_future(compiling), CONSTRAINT_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise APIError(f"the {params.structured_outputs.kind} constraint took more than "
                           f"{CONSTRAINT_CHECK_TIMEOUT_S:g} s to compile") from None
        except GrammarError as exc:
            raise APIError(str(exc)) from None
        except Exception as exc:  # never a 5xx for a constraint: the engines could not compile it either
            raise APIError(f"the {params.structured_outputs.kind} constraint failed to compile: {exc!r}") from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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

    async def _collect(self, choices: list["_Choice"]) -> None:
        try:
            for choice in choices:
                await choice.collect()
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        finally:
            for choice in choices:
                await choice.rest.aclose()

    async def _stream(self, choices: list["_Choice"], include_usage: bool) -> AsyncIterator[str]:
        """As _collect, as server-sent events."""
        try:
            for choice in choices:
                for chunk in choice.format.opening_chunks():
                    yield chunk
            async for choice, output in _outputs_in_turn(choices):
                logprobs = choice.progress.add(output)
                if (output.new_text or output.finished or logprobs) and \
                        (chunk := choice.format.chunk(output.new_text, output.finish_reason, logprobs)):
                    yield chunk
            if include_usage:
                yield choices[0].format.usage_chunk(_usage(choices))
        except ENGINE_ERRORS as exc:
            yield sse(engine_error(exc).body())
        except Exception:
            # The status line is already sent: report the failure in the stream, as OpenAI does.
            logger.exception("stream %s failed", choices[0].format.response_id)
            yield sse(internal_error().body())
        finally:
            for choice in choices:
                await choice.rest.aclose()
        yield SSE_DONE

    def _check_model(self, model: str) -> None:
        if model != self.model.name:
            raise APIError(f"The model `{model}` does not exist.", status_code=404, code="model_not_found",
                           param="model")

    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = self.model.vocab_size
        if not all(0 <= token_id < vocab_size for token_id in token_ids):
            raise APIError(f"prompt token ids must lie in [0, {vocab_size})", param="prompt")
        return token_ids


@dataclass(slots=True)
class _Choice:
    """One choice of a response: its engine stream (whose first output was taken), its format and its progress."""
    first: EngineOutput
    rest: AsyncGenerator[EngineOutput, None]
    format: ResponseFormat
    progress: _Progress

    def outputs(self) -> AsyncIterator[EngineOutput]:
        return _resumed(self.first, self.rest)

    async def collect(self) -> None:
        async for output in self.outputs():
            self.progress.add(output)

    def response_choice(self) -> dict[str, Any]:
        progress = self.progress
        return self.format.choice("".join(progress.text), progress.finish_reason, progress.logprobs)


def _choice_requests(request: EngineRequest, n: int) -> list[EngineRequest]:
    if n == 1:
        return [request]
    seed = request.params.seed
    return [replace(request, request_id=f"{request.request_id}-{index}", params=request.params.model_copy(
        update={"seed": None if seed is None else seed + index})) for index in range(n)]


async def _started(engine: EngineClient, requests: list[EngineRequest]
                   ) -> tuple[list[AsyncGenerator[EngineOutput, None]], list[EngineOutput]]:
    """Each request's stream and its first output, the first request's replica given to the others; if one fails,
    the others are closed and its error raised. Each stream is driven by this task alone, from its first output to
    its last (Serve's streams stay with the task that started them)."""
    streams, firsts = [], []
    try:
        for request in requests:
            if firsts:
                request = replace(request, route_to=firsts[0].replica_id)
            streams.append(engine.generate(request))
            firsts.append(await anext(streams[-1]))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams, firsts


async def _outputs_in_turn(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, EngineOutput]]:
    """Every choice's outputs, one choice after the other (the engines compute them together all the same)."""
    for choice in choices:
        async for output in choice.outputs():
            yield choice, output


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    """The prompt counted once, the choices' tokens together."""
    first = choices[0].progress
    return usage(first.num_prompt_tokens, sum(choice.progress.num_tokens for choice in choices),
                 first.num_cached_tokens)


def _replicas(replica_ids) -> str:
    return ",".join(dict.fromkeys(replica_ids))


async def _resumed(first: EngineOutput, rest: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
    """first, then the rest of the stream it was taken from; closing that stream stays the caller's."""
    yield first
    async for output in rest:
        yield output


def internal_error() -> APIError:
    return APIError("The server had an error while processing your request.", status_code=500,
                    type="server_error")


ENGINE_ERRORS = (ValueError, EnginesBusy, ReplicaLost)


def engine_error(exc: Exception) -> APIError:
    """The answer to one of ENGINE_ERRORS from the engine client, at any point of a request."""
    match exc:
        case EnginesBusy():  # no replica has room: for the request, or for its rest after a migration
            return APIError("The server has too many requests waiting; retry later.", status_code=429,
                            type="rate_limit_error", code="server_overloaded",
                            headers={"Retry-After": str(math.ceil(exc.retry_after_s))})
        case ReplicaLost():  # every replica it was sent to (migration's attempts) was lost before it finished
            return APIError("The engine replica serving this request was lost, and so were its migrations' "
                            "replicas; retry the request.", status_code=503, type="server_error",
                            code="replica_lost")
        case _:  # the engine refused the request
            return APIError(str(exc))
