"""Kernels in three backends with identical signatures: pure-torch references (here), Triton
(kernels.triton, for GPUs) and C++ (kernels.cpu, built for this CPU on first use).

Importing this package imports neither triton nor a compiler. Models pick one backend with
get_ops("triton" | "cpu" | "torch").
"""
from kernels.activation import silu_and_mul_ref
from kernels.attention import paged_attention_ref
from kernels.bitmask import apply_token_bitmask_ref
from kernels.cache_write import write_kv_cache_ref
from kernels.ops import Backend, KernelOps, get_ops
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rotary_cos_sin

__all__ = ["Backend", "KernelOps", "apply_rotary_ref", "apply_token_bitmask_ref", "get_ops", "paged_attention_ref",
           "rms_norm_ref", "rotary_cos_sin", "silu_and_mul_ref", "write_kv_cache_ref"]
