"""Stand-ins for the engine, its client, the tokenizer and the router client: the Serve glue tested without a model."""
import asyncio
import math
from collections.abc import Sequence

from cluster.engine_client import EnginesBusy, ReplicaLost
from replica.async_engine import EngineOutput, EngineRequest, ModelInfo
from replica.kv_cache import BlockStored, hash_token_blocks
from replica.scheduler import SchedulerStats
from replica.executor.chat_templates import CHATML_TOOLS
from tests.executor.helpers import byte_tokenizer_backend

BLOCK_SIZE = 4
HASH_SEED = 7
VOCAB_SIZE = 256


class FakeTokenizer:
    """One token per character; the chat template writes "role: content" lines then "assistant: ". Constraints
    compile against a real byte-level tokenizer (the ingress checks them)."""

    backend = byte_tokenizer_backend()
    eos_token_id = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(char) % VOCAB_SIZE for char in text]

    chat_template = None  # no model that reasons
    tools_template = CHATML_TOOLS  # tool calls in the smollm2 format

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """With tools, a first line names them."""
        if messages[-1]["role"] == "assistant":
            raise ValueError("chat template: the last message must not be the assistant's")
        text = f"tools: {','.join(tool['function']['name'] for tool in tools)}\n" if tools else ""
        text += "".join(f"{message['role']}: {message['content']}\n" for message in messages)
        return self.encode(text + "assistant: ")

    def special_token_id(self, text: str) -> int | None:
        return None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """FakeEngineCore's tokens 100 + i read "t<i> "; the others are characters."""
        return "".join(output_text(token_id - 100) if token_id >= 100 else chr(token_id) for token_id in token_ids)


def output_text(index: int) -> str:
    return f"t{index} "


class FakeEngineCore:
    """Generates token 100 + i as text "t<i> " until max_tokens; reports num_cached_tokens as the prompt's hit.
    Asked for logprobs, token i has -(i + 1) / 4, and the runner-up token 33 ("!") 1 less. Given output tokens
    (a migrated request), it goes on after them."""

    def __init__(self, *, fail_step: bool = False, num_cached_tokens: int = BLOCK_SIZE):
        self.requests: dict[str, EngineRequest] = {}  # unfinished
        self.added: list[EngineRequest] = []
        self.generated: dict[str, int] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.num_idle_pin_sweeps = 0
        self.fail_step = fail_step
        self.num_cached_tokens = num_cached_tokens
        self.cached: list[bytes] = []
        self._events: list = []

    def add_request(self, request_id, prompt_token_ids, params, *, priority=0, cache_salt=None,
                    arrival_time=None, session_id=None, last_turn=False, block_hashes=(), output_token_ids=()) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.requests[request_id] = EngineRequest(request_id, prompt_token_ids, list(block_hashes), params, cache_salt,
                                                  priority, session_id, last_turn, list(output_token_ids))
        self.added.append(self.requests[request_id])
        self.generated[request_id] = len(output_token_ids)
        hashes = hash_token_blocks(prompt_token_ids, BLOCK_SIZE, seed=HASH_SEED)
        new = [block_hash for block_hash in hashes if block_hash not in self.cached]
        self.cached.extend(new)
        if new:
            self._events.append(BlockStored(new, None, [], BLOCK_SIZE))

    def step(self) -> list[EngineOutput]:
        self.num_steps += 1
        if self.fail_step:
            raise RuntimeError("the model crashed")
        outputs = []
        for request_id, request in list(self.requests.items()):
            index = self.generated[request_id]
            self.generated[request_id] += 1
            finished = index + 1 == request.params.max_tokens
            logprob, params = -(index + 1) / 4, request.params
            top = [(100 + index, logprob), (33, logprob - 1)][:params.top_logprobs]
            outputs.append(EngineOutput(request_id, [100 + index], output_text(index), finished,
                                        "length" if finished else None, len(request.prompt_token_ids),
                                        self.num_cached_tokens, [logprob] if params.logprobs else None,
                                        [top] if params.top_logprobs else None))
            if finished:
                del self.requests[request_id]
        return outputs

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def expire_pins(self) -> None:
        self.num_idle_pin_sweeps += 1

    def take_kv_events(self) -> list:
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[bytes]:
        return list(self.cached)

    def shutdown(self) -> None:
        pass  # holds no process or thread

    def model_info(self) -> ModelInfo:
        return ModelInfo("fake", max_model_len=1024, vocab_size=200, block_size=BLOCK_SIZE, hash_seed=HASH_SEED)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.requests), num_waiting=0, kv_usage=0.5 if self.requests else 0.0,
                              num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)


class FakeEngineClient:
    """The ingress's view of the engine deployment: a FakeEngineCore's outputs, the first naming the replica.

    lost_after[n]: the replica of a request's (n + 1)th attempt is lost (ReplicaLost) after that many outputs,
    None: before it takes the request. The nth attempt (from 0) is served by replica_id, then replica_id/1, ...;
    each reports a hit of n + 1 blocks (cached_tokens(n)), so that a test can tell whose count was kept.
    """

    def __init__(self, replica_id: str = "replica-a", *, error: Exception | None = None, error_after: int = 0,
                 busy_from: int | None = None, lost_after: Sequence[int | None] = ()):
        self.replica_id = replica_id
        self.error = error  # raised after error_after outputs
        self.error_after = error_after
        self.busy_from = busy_from  # from this attempt on no room: EnginesBusy instead of the first output
        self.lost_after = lost_after
        self.requests: list[EngineRequest] = []
        self.abandoned: list[str] = []  # requests whose stream was closed before they finished

    async def generate(self, request: EngineRequest):
        attempt = sum(sent.request_id == request.request_id for sent in self.requests)
        self.requests.append(request)
        lost_after = self.lost_after[attempt] if attempt < len(self.lost_after) else math.inf
        core = FakeEngineCore(num_cached_tokens=cached_tokens(attempt))
        if self.busy_from is not None and attempt >= self.busy_from:
            raise EnginesBusy(retry_after_s=0.5)
        if lost_after is None:
            raise ReplicaLost("replica died before its first output")
        core.add_request(request.request_id, request.prompt_token_ids, request.params,
                         block_hashes=request.block_hashes, output_token_ids=request.output_token_ids)
        replica_id = f"{self.replica_id}/{attempt}" if attempt else self.replica_id
        num_outputs = 0
        try:
            while core.has_unfinished():
                if self.error is not None and num_outputs == self.error_after:
                    raise self.error
                if num_outputs == lost_after:
                    raise ReplicaLost(f"replica of attempt {attempt} died")
                for output in core.step():
                    output.replica_id = None if num_outputs else replica_id
                    yield output
                num_outputs += 1
        finally:
            if core.has_unfinished():
                self.abandoned.append(request.request_id)


def cached_tokens(attempt: int) -> int:
    """The prompt's hit reported by the replica of a request's nth attempt (from 0)."""
    return (attempt + 1) * BLOCK_SIZE


class FakeRouterClient:
    """A RouterClient handing out a fake feed connection; the first `unreachable` lookups fail. Given a
    gate, lookups wait until it is set (a slow GCS)."""

    def __init__(self, connection, *, unreachable: int = 0, gate: asyncio.Event | None = None):
        self.connection = connection
        self.unreachable = unreachable
        self.gate = gate
        self.lookups = 0
        self.resets = 0

    async def get(self, channel: str = "feed"):
        self.lookups += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.lookups <= self.unreachable:
            raise ConnectionError("GCS unavailable")
        return self.connection

    def reset(self) -> None:
        self.resets += 1
