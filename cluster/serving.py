"""OpenAIServing: OpenAI completion and chat requests in, engine requests out, engine outputs back.

It prepares each request (preparing.py: parsed, its prompt tokenized once and its full blocks hashed) in
worker threads off the event loop that streams every response (a small body, which takes less than the
handoff, on the loop); then it hands token ids and hashes to an engine client, which moves the request to
another replica if its own is lost (migration.py). Ray-free: the Serve ingress plugs in a client that calls
the engine deployment, an engine replica serving HTTP itself its own engine; tests plug in a fake.
"""
import asyncio
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from cluster.engine_client import EngineClient, EnginesBusy, ReplicaLost
from cluster.metrics import RequestTracker, ServingMetrics
from cluster.migration import MigratingEngineClient
from cluster.preparing import Prepared, RequestPreparer, Tokenizer
from cluster.protocol import REPLICA_HEADER, SSE_DONE, APIError, ResponseFormat, TokenLogprob, sse, usage
from replica.async_engine import EngineOutput, EngineRequest, ModelInfo
from replica.request import SamplingParams
from replica.structured_output.backend import GrammarError, GuidanceBackend
from replica.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("ray.serve.prefixserve.serving")

CONSTRAINT_CHECK_TIMEOUT_S = 10.0


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


class OpenAIServing:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelInfo, metrics: ServingMetrics, *,
                 max_migrations: int = 0):
        """max_migrations: how many times a request may move to another replica when its own is lost."""
        self.engine = MigratingEngineClient(engine, model, max_migrations, metrics.migrations.inc)
        self.preparer = RequestPreparer(tokenizer, model)
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = metrics
        # compiles each constraint once (on threads of its own) to refuse what the engines could not compile
        self.constraints = StructuredOutputManager(
            GuidanceBackend(tokenizer.backend, model.vocab_size, tokenizer.eos_token_id),
            compile_timeout_s=CONSTRAINT_CHECK_TIMEOUT_S)

    def list_models(self) -> dict[str, Any]:
        card = {"id": self.model.name, "object": "model", "created": 0, "owned_by": "prefixserve",
                "max_model_len": self.model.max_model_len}
        return {"object": "list", "data": [card]}

    async def create_completion(self, raw_body: bytes, arrival_time: float, session_id: str | None = None,
                                request_id: str | None = None) -> Response:
        """raw_body: the request's JSON; session_id: its X-Session-Id header, if the body names none; request_id:
        the id its router booked it under, if it was routed before it came (else a new one)."""
        prepared = await self.preparer.off_loop(self.preparer.completion, raw_body, session_id, request_id)
        return await self._generate(prepared, arrival_time)

    async def create_chat_completion(self, raw_body: bytes, arrival_time: float, session_id: str | None = None,
                                     request_id: str | None = None) -> Response:
        """As create_completion."""
        prepared = await self.preparer.off_loop(self.preparer.chat_completion, raw_body, session_id, request_id)
        return await self._generate(prepared, arrival_time)

    async def _generate(self, prepared: Prepared, arrival_time: float) -> Response:
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

    async def _start_choices(self, prepared: Prepared, arrival_time: float) -> list["_Choice"]:
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
            for choice in choices:  # one after the other (the engines compute them together all the same)
                if chunk := choice.chunk(choice.first):
                    yield chunk
                async for output in choice.rest:
                    if chunk := choice.chunk(output):
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

@dataclass(slots=True)
class _Choice:
    """One choice of a response: its engine stream (whose first output was taken), its format and its progress."""
    first: EngineOutput
    rest: AsyncGenerator[EngineOutput, None]
    format: ResponseFormat
    progress: _Progress

    async def collect(self) -> None:
        self.progress.add(self.first)
        async for output in self.rest:
            self.progress.add(output)

    def chunk(self, output: EngineOutput) -> str:
        """The output taken in, as a stream's event ("" if it has nothing to send)."""
        logprobs = self.progress.add(output)
        if output.new_text or output.finished or logprobs:
            return self.format.chunk(output.new_text, output.finish_reason, logprobs)
        return ""

    def response_choice(self) -> dict[str, Any]:
        progress = self.progress
        return self.format.choice("".join(progress.text), progress.finish_reason, progress.logprobs)


def _choice_requests(request: EngineRequest, n: int) -> list[EngineRequest]:
    """The first choice is the request itself (its id is the one a router booked); choice i's id ends in -i."""
    seed = request.params.seed
    return [request] + [replace(request, request_id=f"{request.request_id}-{index}", params=request.params.model_copy(
        update={"seed": None if seed is None else seed + index})) for index in range(1, n)]


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


def _usage(choices: list[_Choice]) -> dict[str, Any]:
    """The prompt counted once, the choices' tokens together."""
    first = choices[0].progress
    return usage(first.num_prompt_tokens, sum(choice.progress.num_tokens for choice in choices),
                 first.num_cached_tokens)


def _replicas(replica_ids) -> str:
    return ",".join(dict.fromkeys(replica_ids))


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
