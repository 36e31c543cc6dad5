"""Triton kernels against the pure-torch references on one CUDA GPU, bf16.

Prints time per call (triton.testing.do_bench, median) of both and the speedup. The torch side
is the reference implementation run on the same GPU, so the ratio is what the Triton path buys.
Attention shapes: the default model (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64) and
a Llama-8B-like layer (32/8 heads, head dim 128), block size 16.

    python benchmarks/bench_kernels.py
"""
import sys

import torch

from kernels import get_ops, rotary_cos_sin

DTYPE = torch.bfloat16
ATTENTION_BATCHES = {
    # name: (query_lens, context_lens)
    "decode 64 x ctx 1024": ([1] * 64, [1024] * 64),
    "prefill 1 x 2048": ([2048], [2048]),
    "mixed 2 x 512-chunks + 62 decodes": ([512, 512] + [1] * 62, [1024, 512] + [1024] * 62),
}
ATTENTION_HEADS = {"smollm2 9/3 x 64": (9, 3, 64), "llama8b 32/8 x 128": (32, 8, 128)}


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def paged_attention_args(query_lens: list[int], context_lens: list[int], num_heads: int,
                         num_kv_heads: int, head_dim: int, block_size: int = 16) -> tuple:
    """Random caches; each request's blocks drawn at random from the whole cache."""
    max_blocks = -(-max(context_lens) // block_size)
    num_blocks = len(context_lens) * max_blocks
    caches = [randn(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2)]
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                   dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    return (randn(sum(query_lens), num_heads, head_dim), *caches,
            block_tables.view(len(context_lens), max_blocks), query_start_loc, seq_lens,
            head_dim ** -0.5)


def attention_cases() -> dict[str, tuple[str, tuple]]:
    return {f"paged_attention {heads_name}, {batch_name}": (
                "paged_attention", paged_attention_args(query_lens, context_lens, *heads))
            for heads_name, heads in ATTENTION_HEADS.items()
            for batch_name, (query_lens, context_lens) in ATTENTION_BATCHES.items()}


def elementwise_cases(num_tokens: int = 4096) -> dict[str, tuple[str, tuple]]:
    cache = (randn(num_tokens // 16 + 1, 16, 8, 128), randn(num_tokens // 16 + 1, 16, 8, 128))
    slots = torch.randperm(num_tokens, device="cuda")
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    cos_sin = rotary_cos_sin(128, 8192, 500000.0, torch.float32, "cuda")
    key, value = randn(num_tokens, 8, 128), randn(num_tokens, 8, 128)
    return {
        f"write_kv_cache {num_tokens} x 8 x 128": ("write_kv_cache", (key, value, *cache, slots)),
        f"rms_norm+residual {num_tokens} x 4096": (
            "rms_norm", (randn(num_tokens, 4096), randn(4096), 1e-5, randn(num_tokens, 4096))),
        f"apply_rotary {num_tokens} x 32/8 x 128": (
            "apply_rotary", (randn(num_tokens, 32, 128), key, positions, cos_sin)),
    }


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    from triton.testing import do_bench
    triton_ops, torch_ops = get_ops("triton"), get_ops("torch")
    print(f"{torch.cuda.get_device_name()}, {DTYPE}")
    print(f"{'kernel':<70} {'torch ms':>9} {'triton ms':>9} {'speedup':>8}")
    for name, (op, args) in {**attention_cases(), **elementwise_cases()}.items():
        torch_ms = do_bench(lambda: getattr(torch_ops, op)(*args))
        triton_ms = do_bench(lambda: getattr(triton_ops, op)(*args))
        print(f"{name:<70} {torch_ms:>9.3f} {triton_ms:>9.3f} {torch_ms / triton_ms:>7.2f}x")


if __name__ == "__main__":
    main()
