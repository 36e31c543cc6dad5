"""The kernels the model calls, from one backend: Triton (GPU), C++ (CPU) or pure torch (anywhere)."""
from dataclasses import dataclass
from typing import Callable, Literal

from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref
from kernels.bitmask import apply_token_bitmask_ref
from kernels.cache_write import write_kv_cache_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref

Backend = Literal["triton", "cpu", "torch"]


@dataclass(frozen=True)
class KernelOps:
    backend: Backend
    write_kv_cache: Callable
    paged_attention: Callable
    rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    apply_token_bitmask: Callable


def get_ops(backend: Backend) -> KernelOps:
    """The kernels of one backend; "triton" imports triton, "cpu" builds its library on first call."""
    if backend == "torch":
        return KernelOps(backend, write_kv_cache_ref, paged_attention_ref, rms_norm_ref, apply_rotary_ref,
                         silu_and_mul_ref, apply_token_bitmask_ref)
    if backend == "triton":
        from kernels.triton import activation, attention, bitmask, cache_write, rms_norm, rotary
    elif backend == "cpu":
        from kernels.cpu import activation, attention, bitmask, cache_write, rms_norm, rotary
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; expected 'triton', 'cpu' or 'torch'")
    return KernelOps(backend, cache_write.write_kv_cache, attention.paged_attention, rms_norm.rms_norm,
                     rotary.apply_rotary, activation.silu_and_mul, bitmask.apply_token_bitmask)
