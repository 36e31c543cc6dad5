"""Compiles every Triton kernel for an H100 (sm_90) without a GPU, then prints its name.

The interpreter accepts programs a GPU compiler rejects (tl.dot under 16 rows, for one); this
runs the real compiler down to a cubin with the ptxas shipped in the triton wheel. Run in a
process without TRITON_INTERPRET:  python -m tests.kernels.compile_for_h100
"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton import activation, attention, cache_write, rms_norm, rotary

H100 = GPUTarget("cuda", 90, 32)
INDEX_POINTERS = {"block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32",
                  "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i64", "positions_ptr": "*i64"}


def compile_kernel(kernel: triton.JITFunction, dtype: str, constexprs: dict, **options) -> None:
    """Arguments by naming convention: *_ptr tensors of dtype, UPPER constexprs, scalars i32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = INDEX_POINTERS.get(name, f"*{dtype}")
        else:
            signature[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
    triton.compile(ASTSource(kernel, signature, constexprs), target=H100, options=options)
    print(kernel.__name__, dtype, *constexprs.values())


def main() -> None:
    dot_dtypes = {"bf16": tl.bfloat16, "fp32": tl.float32}
    # (dtype, group, head_dim, block_m): decode tiles, GQA 5 (padded to 8), prefill tiles
    for dtype, group, head_dim, block_m in [("bf16", 1, 128, 16), ("bf16", 5, 128, 16),
                                            ("bf16", 3, 64, 64), ("fp32", 4, 128, 64)]:
        compile_kernel(attention._paged_attention_kernel, dtype, dict(
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=16,
            BLOCK_M=block_m, TILE_N=attention.TILE_N, HEAD_DIM_PAD=head_dim,
            DOT_DTYPE=dot_dtypes[dtype], DOT_PRECISION="ieee" if dtype == "fp32" else "tf32"))
    compile_kernel(cache_write._write_kv_cache_kernel, "bf16", dict(HEADS_PAD=8, HEAD_DIM_PAD=128))
    for has_residual in (False, True):
        compile_kernel(rms_norm._rms_norm_kernel, "bf16",
                       dict(HAS_RESIDUAL=has_residual, BLOCK_H=4096), num_warps=8)
    compile_kernel(rotary._rotary_kernel, "bf16", dict(HEADS_PAD=32, KV_HEADS_PAD=8, HALF_PAD=64))
    compile_kernel(activation._silu_and_mul_kernel, "bf16", dict(BLOCK=activation.BLOCK))


if __name__ == "__main__":
    main()
