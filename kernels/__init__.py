"""Triton kernels and their pure-torch references (identical signatures).

Importing this package does not import triton. The Triton ops live in kernels.triton; each op
module also exports its Triton op by name (kernels.rms_norm.rms_norm), imported on first access.
Models pick one backend with get_ops("triton" | "torch").
"""
from kernels.attention import paged_attention_ref
from kernels.cache_write import write_kv_cache_ref
from kernels.ops import KernelOps, get_ops
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import apply_rotary_ref, rotary_cos_sin

__all__ = ["KernelOps", "apply_rotary_ref", "get_ops", "paged_attention_ref", "rms_norm_ref",
           "rotary_cos_sin", "write_kv_cache_ref"]
