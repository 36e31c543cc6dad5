"""Reading a llama.cpp GGUF file: metadata, and tensors dequantized to numpy under Hugging Face names.

One parse per file (gguf_file.py) is kept for the life of the process; everything else is derived from it on demand.
"""
import functools
import re
from collections.abc import Iterator
from typing import Any

import gguf
import gguf.quants
import numpy as np

from replica.executor.config import ModelConfig
from replica.executor.gguf_file import GGUFFile, GGUFTensor, read_gguf

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp permutes these rows for its interleaved-pair RoPE (only for the "llama" architecture)
_PERMUTED = {"attn_q": "num_heads", "attn_k": "num_kv_heads"}
_TORCH_TYPES = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)  # replica/executor/ggml_blocks.py


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    return read_gguf(path)


def read_metadata(path: str) -> dict[str, Any]:
    """Every metadata field as a plain Python value (strings, numbers, lists)."""
    return dict(open_gguf(path).metadata)


def read_config(path: str, metadata: dict[str, Any]) -> ModelConfig:
    tensors = {tensor.name: tensor for tensor in open_gguf(path).tensors}
    rope_freqs = tensors.get(_ROPE_FREQS)
    return ModelConfig.from_gguf_metadata(
        metadata, set(tensors), tuple(rope_freqs.data.tolist()) if rope_freqs is not None else ())


def iter_arrays(path: str, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) for every tensor, with llama.cpp's Q/K row permutation undone."""
    for tensor in open_gguf(path).tensors:
        if tensor.name == _ROPE_FREQS:  # read into the config's RoPE scaling
            continue
        try:
            array = dequantize(tensor)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                             "which the engine cannot dequantize") from None
        hf_name, permuted_heads = _hf_name(tensor.name, config)
        if permuted_heads:
            array = _unpermute_rows(array, permuted_heads)
        yield hf_name, array


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """gguf's dequantization, over the whole tensor at once (gguf.quants.dequantize goes 16 rows at a time); the
    default model's Q4_1 and Q8_0 in torch."""
    if tensor.tensor_type in _TORCH_TYPES:
        from replica.executor import ggml_blocks  # here: the ingress reads a GGUF's metadata without torch
        return ggml_blocks.dequantize_rows(tensor.data, tensor.tensor_type)
    quant = getattr(gguf.quants, tensor.tensor_type.name, None)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return quant.dequantize_rows(tensor.data)


def _hf_name(gguf_name: str, config: ModelConfig) -> tuple[str, int]:
    """The HF name of a GGUF tensor, and how many heads its rows are permuted over (0: none)."""
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None:
        base, suffix = gguf_name.rsplit(".", 1)
        if base not in _GLOBAL_TENSORS:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"{_GLOBAL_TENSORS[base]}.{suffix}", 0
    layer, kind, suffix = match.groups()
    if kind not in _LAYER_TENSORS:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    permuted_heads = getattr(config, _PERMUTED[kind]) if (
        kind in _PERMUTED and config.architecture == "llama") else 0
    return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}", permuted_heads


def _unpermute_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf permute: per head, pairs (i, i + d/2) back to halves."""
    head_dim = array.shape[0] // num_heads
    return (array.reshape(num_heads, head_dim // 2, 2, *array.shape[1:])
            .swapaxes(1, 2).reshape(array.shape))
