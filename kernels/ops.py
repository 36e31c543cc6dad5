"""The four kernels the model calls, from one backend: Triton (GPU) or pure torch (CPU)."""
from dataclasses import dataclass
from typing import Callable, Literal

from kernels.attention import paged_attention_ref
from kernels.cache_write import write_kv_cache_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref


@dataclass(frozen=True)
class KernelOps:
    write_kv_cache: Callable
    paged_attention: Callable
    rms_norm: Callable
    apply_rotary: Callable


def get_ops(backend: Literal["triton", "torch"]) -> KernelOps:
    """The kernels of one backend; "triton" imports triton (and so needs it installed)."""
    if backend == "torch":
        return KernelOps(write_kv_cache_ref, paged_attention_ref, rms_norm_ref, apply_rotary_ref)
    if backend == "triton":
        from kernels.triton.attention import paged_attention
        from kernels.triton.cache_write import write_kv_cache
        from kernels.triton.rms_norm import rms_norm
        from kernels.triton.rotary import apply_rotary
        return KernelOps(write_kv_cache, paged_attention, rms_norm, apply_rotary)
    raise ValueError(f"unknown kernel backend {backend!r}; expected 'triton' or 'torch'")
