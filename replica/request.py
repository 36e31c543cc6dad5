"""A request as the scheduler sees it: inputs, sampling parameters, progress counters, status."""
import enum
import time
from collections.abc import Sequence

import pydantic

from replica.structured_output.params import StructuredOutputsParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # could never run: larger than the KV cache, or than a step unchunked
    # A request's own failure: its constraint did not compile. (A step that fails has already put its blocks in
    # the prefix cache unwritten, so the engine stops instead: AsyncEngine's EngineDeadError.)
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class SamplingParams(pydantic.BaseModel):
    """How to sample one request. temperature 0 means greedy; invalid values raise ValueError."""

    model_config = pydantic.ConfigDict(extra="forbid")

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False  # the sampled token's log-probability under the raw logits
    top_logprobs: int = 0  # and this many most likely tokens' (at most 20; needs logprobs)
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match (constrained decoding)

    @pydantic.model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.top_logprobs <= 20 or (self.top_logprobs and not self.logprobs):
            raise ValueError(f"top_logprobs must be in [0, 20] and needs logprobs, got {self.top_logprobs}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self


def _check_inputs(request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                  output_token_ids: Sequence[int]) -> None:
    """The one check of a request's inputs; the layers above trust a constructed Request."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string")
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
    if not prompt_token_ids:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    if not all(isinstance(token, int) and token >= 0 for token in prompt_token_ids):
        raise ValueError(f"request {request_id!r}: prompt token ids must be non-negative integers")
    if not all(isinstance(token, int) and token >= 0 for token in output_token_ids):
        raise ValueError(f"request {request_id!r}: output token ids must be non-negative integers")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        eos_token_id: int | None = None,
        session_id: str | None = None,
        last_turn: bool = False,
        block_hashes: Sequence[bytes] = (),
        output_token_ids: Sequence[int] = (),
        structured_output=None,
    ):
        """output_token_ids: tokens it already generated elsewhere (a request migrated from a lost replica).
        They count against max_tokens, the stop checks see them, and the scheduler computes them with the
        prompt, as it recomputes a preempted request.
        structured_output: the grammar of sampling_params.structured_outputs
        (replica.structured_output.manager.StructuredOutputRequest), compiling or compiled."""
        _check_inputs(request_id, prompt_token_ids, sampling_params, output_token_ids)
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.eos_token_id = eos_token_id
        self.session_id = session_id  # the conversation or agent program it is a turn of
        self.last_turn = last_turn  # the program ends with it: nothing to keep its blocks for
        self.status = RequestStatus.WAITING

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids

        self.spec_token_ids: list[int] = []  # unverified speculative drafts, consumed when scheduled
        self.num_computed_tokens = 0
        # async scheduling: tokens that steps already scheduled (and still executing) will sample
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # set on first schedule
        self.num_preemptions = 0
        self.loaded_from_host = False  # it waited for a load from the node's pool since it last ran: not again
        self.block_hashes: list[bytes] = list(block_hashes)  # chained hashes of its full blocks (kept current)
        self.stop_reason: int | str | None = None
        self.structured_output = structured_output

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __lt__(self, other: "Request") -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
