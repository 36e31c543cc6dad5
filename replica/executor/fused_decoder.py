"""Small CPU batches through the decoder layers in one call (kernels/cpu/decoder.py).

At a decode step's few rows, Python's calls between the kernels of LlamaForCausalLM's layers (some 300
a step: modules, views, wrappers, allocations) cost more than the kernels. This runs the same kernels
in the same order from C++, so the hidden states are bit for bit those of the layers' forward.
"""
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.decoder import LAYER_POINTERS, DecoderShape, decoder_layers
from kernels.cpu.library import HEAD_DIMS
from replica.executor.packed_linear import PackedLinear

if TYPE_CHECKING:  # model.py builds this class
    from replica.executor.model import AttentionGroup, AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


class FusedDecoder:
    """The decoder layers of a model whose projections all carry small-batch weights. It holds the weights'
    addresses: built once they are loaded and packed, for as long as they stay where they are."""

    def __init__(self, model: nn.Module):
        config, layers = model.config, model.model.layers
        attention = layers[0].self_attn
        self.shape = DecoderShape(config.hidden_size, attention.num_heads, attention.num_kv_heads, config.head_dim,
                                  layers[0].mlp.intermediate_size, config.rms_norm_eps, attention.scale)
        self.max_rows = min(linear.small_batch_rows for layer in layers for linear in _projections(layer))
        self.final_norm = model.model.norm.weight
        self.cos_sin_cache = model.cos_sin_cache.to(torch.float32).contiguous()
        self._weights = torch.tensor([_weight_pointers(layer) for layer in layers], dtype=torch.int64)
        self._layers: torch.Tensor | None = None
        self._kv_caches: list[KVCache] | None = None

    @classmethod
    def of(cls, model: nn.Module) -> "FusedDecoder | None":
        """model's fused decoder, or None where its layers are not all of what the C++ chain runs."""
        if model.ops.backend != "cpu" or model.tp.size > 1 or model.config.head_dim not in HEAD_DIMS:
            return None
        for layer in model.model.layers:
            if not all(isinstance(linear, PackedLinear) and linear.small_batch_weight is not None
                       for linear in _projections(layer)):
                return None
        return cls(model)

    def takes(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_rows

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                 metadata: "AttentionMetadata") -> torch.Tensor:
        return decoder_layers(hidden, self._layer_table(kv_caches), self.final_norm, positions, self.cos_sin_cache,
                              metadata.slot_mapping, *_one_group(metadata.groups), kv_caches[0][0], self.shape)

    def _layer_table(self, kv_caches: list[KVCache]) -> torch.Tensor:
        """The weights' addresses beside the caches'; the runner passes one list of caches on every step."""
        if kv_caches is not self._kv_caches:
            caches = torch.tensor([[key.data_ptr(), value.data_ptr()] for key, value in kv_caches],
                                  dtype=torch.int64)
            self._layers, self._kv_caches = torch.cat([self._weights, caches], dim=1), kv_caches
        return self._layers


def _one_group(groups: list["AttentionGroup"]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_tables, query_start_loc and seq_lens of all groups' requests as one: the C++ attention takes
    decodes and chunks in one call, each request's rows computed alike whichever call they are in."""
    if len(groups) == 1:
        return groups[0].block_tables, groups[0].query_start_loc, groups[0].seq_lens
    width = max(group.block_tables.shape[1] for group in groups)
    block_tables = torch.cat([F.pad(group.block_tables, (0, width - group.block_tables.shape[1]))
                              for group in groups])
    query_start_loc = torch.cat([groups[0].query_start_loc[:1]] +
                                [group.query_start_loc[1:] + group.token_start for group in groups])
    return block_tables, query_start_loc, torch.cat([group.seq_lens for group in groups])


def _projections(layer: nn.Module) -> list[nn.Module]:
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]


def _weight_pointers(layer: nn.Module) -> list[int]:
    qkv, output, gate_up, down = _projections(layer)
    attention = layer.self_attn

    def address(tensor: torch.Tensor | None) -> int:
        return 0 if tensor is None else tensor.data_ptr()

    pointers = {"input_norm": address(layer.input_layernorm.weight), "qkv": address(qkv.small_batch_weight.data),
                "qkv_bias": address(qkv.bias), "output": address(output.small_batch_weight.data),
                "post_norm": address(layer.post_attention_layernorm.weight),
                "gate_up": address(gate_up.small_batch_weight.data), "down": address(down.small_batch_weight.data),
                "q_norm": address(attention.q_norm.weight) if attention.qk_norm else 0,
                "k_norm": address(attention.k_norm.weight) if attention.qk_norm else 0}
    return [pointers[name] for name in LAYER_POINTERS[:-2]]  # the caches' two come per list of caches
