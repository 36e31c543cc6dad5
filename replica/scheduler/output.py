"""What the scheduler hands the model runner each step, and what comes back."""
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from replica.kv_cache.host_pool import KVLoad, KVSave
from replica.request import SamplingParams
from replica.structured_output.stats import StructuredOutputStats

if TYPE_CHECKING:
    from replica.structured_output.manager import GrammarBitmask


@dataclass(slots=True)
class NewRequestData:
    """A request scheduled for the first time: everything the runner needs to start it."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit
    output_token_ids: list[int] = field(default_factory=list)  # generated before, on a replica that was lost


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner has seen before: only what changed since the last step."""
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)  # preempted earlier, re-admitted now
    new_block_ids: list[list[int]] = field(default_factory=list)  # all block ids for a resumed request
    num_computed_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)  # resumed requests only


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]  # finished since the previous step: the runner drops their state
    # the drafts to verify, per request that has any scheduled: they follow its last token in
    # num_scheduled_tokens (which counts them)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # the constrained requests that sample this step, with the drafts each verifies (the engine fills their
    # token bitmask into grammar_bitmask while the runner computes the forward pass)
    structured_output_drafts: dict[str, list[int]] = field(default_factory=dict)
    grammar_bitmask: "GrammarBitmask | None" = None
    kv_loads: list[KVLoad] = field(default_factory=list)  # copied in from the node's pool while the step runs
    kv_save: KVSave | None = None  # written through to the node's pool once the step has computed them


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] for a partial prefill
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None  # per sampled token: (token id, logprob)
    kv_loaded: dict[str, int] = field(default_factory=dict)  # per KVLoad: its leading blocks that arrived whole
    kv_load_s: float = 0.0  # how long the loads took (beside the forward pass)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it finished with FINISHED_ERROR


@dataclass(slots=True)
class PinStats:
    """Continuum's pins: blocks held now, and cumulative counts of what happened to pins."""
    num_pinned_blocks: int = 0  # distinct blocks the pins hold
    pinned: int = 0             # finished turns whose blocks were pinned
    hits: int = 0               # next turns admitted while their program's pin held their history
    expired: int = 0            # pins that ran out of time before the program's next turn came
    released: int = 0           # pins released early to give a running request or an admission blocks
    next_turn_queries: int = 0  # prompt tokens of next turns (their program's last turn finished here)
    next_turn_hits: int = 0     # of those, found in the prefix cache at admission
    num_releasable_blocks: int = 0  # of the pinned blocks, those only pins hold (no request shares them)


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding, cumulative: what was verified and how much of it the target model accepted."""
    num_drafts: int = 0           # request-steps that verified at least one draft token
    num_draft_tokens: int = 0     # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    # by draft position, num_speculative_tokens long
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int       # cumulative
    prefix_cache_queries: int  # tokens looked up at admission, cumulative
    prefix_cache_hits: int     # tokens found in the prefix cache, cumulative
    host_pool_hits: int = 0    # of those, tokens loaded from the node's pool (KV it held, not the device), cumulative
    # what a token loaded from the node's pool costs here, in tokens computed in the same time (recent loads against
    # recent steps); None until both were measured
    host_load_token_cost: float | None = None
    compute_seconds_per_token: float | None = None  # its recent compute rate, with a node pool; None until measured
    # set by the serving side: prompt tokens its replica pulled from other nodes' pools into its own, and the
    # pulls that failed or timed out (their requests computed the prefix instead), cumulative; its recent pulls'
    # seconds a token (None until it pulls)
    pulled_tokens: int = 0
    pull_failures: int = 0
    pull_seconds_per_token: float | None = None
    num_prefill_tokens_pending: int = 0  # tokens of running and waiting requests still to prefill (or recompute)
    num_free_blocks: int = 0             # blocks a new request can take: free ones and evictable cached ones
    num_blocks: int = 0                  # blocks requests can take at all (its KV cache, the null block left out)
    num_cached_blocks: int = 0           # blocks in the prefix cache's hash map: what the router's index mirrors
    pins: PinStats = field(default_factory=PinStats)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    structured_outputs: StructuredOutputStats = field(default_factory=StructuredOutputStats)  # set by the engine
