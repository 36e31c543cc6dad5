from typing import Literal

import pydantic


class SchedulerConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    max_num_batched_tokens: int = pydantic.Field(8192, ge=1)  # the one token budget per step
    max_num_seqs: int = pydantic.Field(256, ge=1)              # cap on the running set
    max_model_len: int = pydantic.Field(8192, ge=2)
    max_loading_requests: int = pydantic.Field(4, ge=1)  # waiting requests copying their prefix in from the pool
    long_prefill_token_threshold: int = pydantic.Field(0, ge=0)  # 0 = off
    enable_chunked_prefill: bool = True
    # continuum: FCFS, and a program's turn that ends in a tool call keeps its KV blocks pinned until
    # its next turn (which waits ahead of the others) or a predicted time-to-live (replica/scheduler/pins.py)
    policy: Literal["fcfs", "priority", "continuum"] = "fcfs"
    reserve_full_sequence: bool = True  # admit only when the whole prompt's blocks fit
    # schedule step N+1 while step N executes: the tokens N will sample count as placeholders.
    # None: the engine decides (on with CUDA, where host work is a sizeable part of a step)
    async_scheduling: bool | None = None
    pin_ttl_default_s: float = pydantic.Field(2.0, ge=0)  # a pin's TTL before any tool gap was observed
    # cap on a pin's TTL, however long the observed gaps: coding agents wait up to 30 s for tests and builds
    pin_ttl_max_s: float = pydantic.Field(30.0, ge=0)
    # the longest a waiting turn defers to pinned programs and to programs that came first: past it, counted from
    # its arrival, it goes first and may release the pins it has waited longer for than their history's recompute
    # would take (it bounds the next turns' latency; benchmarks/results/agents.md)
    pin_max_wait_s: float = pydantic.Field(100.0, ge=0)
