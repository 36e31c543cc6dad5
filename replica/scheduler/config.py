from typing import Literal

import pydantic


class SchedulerConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    max_num_batched_tokens: int = pydantic.Field(8192, ge=1)  # the one token budget per step
    max_num_seqs: int = pydantic.Field(256, ge=1)              # cap on the running set
    max_model_len: int = pydantic.Field(8192, ge=2)
    long_prefill_token_threshold: int = pydantic.Field(0, ge=0)  # 0 = off
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    reserve_full_sequence: bool = True  # admit only when the whole prompt's blocks fit
