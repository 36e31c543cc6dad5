"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One flattened batch of T tokens from many requests (prefill chunks and decodes mixed) runs
through every layer at once. Q/K/V and gate/up are fused into one matmul each. Parameter names
follow Hugging Face, so checkpoints load by name (see load_weights).
"""
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import KernelOps
from replica.executor import rope
from replica.executor.config import ModelConfig
from replica.executor.fused_decoder import FusedDecoder
from replica.executor.packed_linear import PackedLinear, worth_packing
from replica.executor.parallel import TensorParallel, shard_heads, vocab_slice

KVCache = tuple[torch.Tensor, torch.Tensor]  # key, value: [num_blocks, block_size, num_kv_heads, head_dim]

# checkpoint projection -> (fused parameter, shard index)
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# projections split by input columns under tensor parallelism (row parallel); the others split by output rows
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass
class AttentionGroup:
    """Requests that attend in one kernel call, owning query rows token_start:token_end."""
    token_start: int
    token_end: int
    block_tables: torch.Tensor     # [R, max_blocks] int32
    query_start_loc: torch.Tensor  # [R + 1] int32, from 0 at token_start
    seq_lens: torch.Tensor         # [R] int32: context length including this step's tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: cache slot of each new token
    # One group, or two: the requests with a single query token, then the rest. Apart, the
    # single-token ones batch into one padded attention on CPU instead of a loop over requests.
    groups: list[AttentionGroup]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: KernelOps):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel):
        super().__init__()
        self.heads = shard_heads(config, tp)
        self.num_heads, self.num_kv_heads = self.heads.num_heads, self.heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim ** -0.5
        self.ops = ops
        self.tp = tp

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def shard_starts(self) -> list[int]:
        """Where this rank's rows of q, k and v start in the checkpoint's."""
        return [self.heads.q_start * self.head_dim, self.heads.kv_start * self.head_dim,
                self.heads.kv_start * self.head_dim]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                metadata: AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(self.shard_sizes(), dim=-1)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            query = self.q_norm(query.reshape(-1, self.head_dim)).view(query.shape)
            key = self.k_norm(key.reshape(-1, self.head_dim)).view(key.shape)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = self.ops.apply_rotary(query, key, positions, cos_sin_cache)
        out = self._paged_attention(query, key, value, kv_cache, metadata)
        return self.tp.all_reduce(self.o_proj(out.view(num_tokens, self.q_size)))

    def _paged_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                         metadata: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        # The whole batch's K/V goes in before anyone reads: a request may attend to blocks that
        # another request of this same batch is filling (a prefix-cache hit on a block in flight).
        self.ops.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        outs = [self.ops.paged_attention(query[group.token_start:group.token_end], key_cache, value_cache,
                                         group.block_tables, group.query_start_loc, group.seq_lens, self.scale)
                for group in metadata.groups]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel):
        super().__init__()
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)
        self.ops = ops
        self.tp = tp

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def shard_starts(self) -> list[int]:
        return [self.tp.rank * self.intermediate_size] * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(config, ops, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = LlamaMLP(config, ops, tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, metadata: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class VocabParallelEmbedding(nn.Module):
    """The embedding table's rows of this rank's vocabulary slice; the ranks' lookups sum to the full one."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.vocab_start, self.num_rows = vocab_slice(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.num_rows)
        embedded = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(embedded.masked_fill_(elsewhere.unsqueeze(-1), 0))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, device: torch.device | str,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config = config
        self.tp = tp
        self.ops = ops
        self.model = LlamaModel(config, ops, tp)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.num_rows, bias=False)
        self.packed_lm_head: PackedLinear | None = None
        self.fused_decoder: FusedDecoder | None = None  # CPU, small batches: see pack_linear_weights
        self.cos_sin_cache = rope.cos_sin_cache(config, device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        if self.fused_decoder is not None and self.fused_decoder.takes(hidden.shape[0]):
            return self.fused_decoder(hidden, positions, kv_caches, metadata)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, self.cos_sin_cache)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden_size] -> fp32 logits [N, vocab_size], on the driver rank; None on the others."""
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        if self.tp.size == 1:
            return logits.float()
        logits = self.tp.gather_last_dim(logits)
        return None if logits is None else logits[:, :self.config.vocab_size].float()

    def pack_linear_weights(self, small_batch: bool = False) -> None:
        """CPU, once the weights are loaded: the projections and the LM head large enough to gain from
        oneDNN-packed weights. With small_batch, they get a copy for the CPU kernels' small-batch linear too,
        and batches that small run the layers in one C++ call where the model allows (FusedDecoder). A tied
        head gets a packed copy; the embedding table stays for the lookup."""
        pack_head = worth_packing(self.lm_head_weight)  # an untied head is one of the linears packed below
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and worth_packing(child.weight):
                    setattr(module, name, PackedLinear.from_linear(child, small_batch))
        if pack_head:
            self.packed_lm_head = getattr(self, "lm_head", None) or PackedLinear(self.lm_head_weight,
                                                                                  small_batch=small_batch)
        self.fused_decoder = FusedDecoder.of(self) if small_batch else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) in; q/k/v and gate/up land in their fused parameters, and under
        tensor parallelism each parameter takes its rank's part of the tensor."""
        params = dict(self.named_parameters())
        fused = self._fused_layouts()
        layouts = {name: fused.get(name, ([param.shape[0]], [None])) for name, param in params.items()}
        expected = {(name, shard) for name, (sizes, _) in layouts.items() for shard in range(len(sizes))}
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard = _fused_name(name)
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            sizes, starts = layouts[name]
            offset = sum(sizes[:shard])
            target = params[name].data[offset:offset + sizes[shard]]
            if self.tp.size > 1:
                tensor = self._rank_part(name, tensor, starts[shard], target.shape)
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r} shard {shard}: checkpoint has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add((name, shard))
        if missing := sorted(expected - loaded):
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def _rank_part(self, name: str, tensor: torch.Tensor, start: int | None, shape: torch.Size) -> torch.Tensor:
        """The rows (columns, for a row-parallel projection) of a checkpoint tensor that this rank holds;
        start: where a fused parameter's shard starts in the tensor."""
        if name.split(".")[-2] in _ROW_PARALLEL:
            return tensor.narrow(1, self.tp.rank * shape[1], shape[1])
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = self.model.embed_tokens.vocab_start
            rows = tensor[start:start + shape[0]]
            return F.pad(rows, (0, 0, 0, shape[0] - rows.shape[0]))  # the last slice's padding rows
        if start is not None:
            return tensor.narrow(0, start, shape[0])
        return tensor  # norms: every rank holds them whole

    def _fused_layouts(self) -> dict[str, tuple[list[int], list[int]]]:
        """Fused parameter -> (its shards' sizes, where each shard's rows start in the checkpoint tensor)."""
        layouts = {}
        for name, module in self.named_modules():
            if isinstance(module, LlamaAttention):
                layout = module.shard_sizes(), module.shard_starts()
                layouts[f"{name}.qkv_proj.weight"] = layouts[f"{name}.qkv_proj.bias"] = layout
            elif isinstance(module, LlamaMLP):
                layouts[f"{name}.gate_up_proj.weight"] = module.shard_sizes(), module.shard_starts()
        return layouts


def _fused_name(name: str) -> tuple[str, int]:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 1); others unchanged, shard 0."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        fused, shard = _STACKED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return name, 0
