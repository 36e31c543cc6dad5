"""CUDA graphs for decode steps. A step whose requests each bring one token replays a graph of
the whole forward pass (embedding to final norm), captured once per batch size, instead of
launching every layer's kernels from Python: for small models and batches the launches, not the
GPU, bound a step. A batch is padded up to the next captured size; padding rows write no KV
(slot -1) and attend to one cached token, and their outputs are dropped."""
import bisect

import torch

from replica.executor.model import AttentionGroup, AttentionMetadata, KVCache, LlamaForCausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to the first size that holds max_batch."""
    sizes = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    return [size for size in sizes if size < max_batch] + [next(size for size in sizes if size >= max_batch)]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], max_batch: int, max_blocks_per_seq: int):
        device = kv_caches[0][0].device
        self.sizes = capture_sizes(max_batch)
        largest = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(largest, dtype=torch.int64)
            self.positions = torch.zeros(largest, dtype=torch.int64)
            self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64)
            self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32)
            self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32)
            self.seq_lens = torch.ones(largest, dtype=torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory pool
                self._capture(model, kv_caches, size)

    def _capture(self, model: LlamaForCausalLM, kv_caches: list[KVCache], size: int) -> None:
        metadata = AttentionMetadata(self.slot_mapping[:size], [AttentionGroup(
            0, size, self.block_tables[:size], self.query_start_loc[:size + 1], self.seq_lens[:size])])

        def forward() -> torch.Tensor:
            return model(self.input_ids[:size], self.positions[:size], kv_caches, metadata)

        forward()  # compiles the Triton kernels for this shape before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pool = self.graphs[self.sizes[-1]].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = forward()
        self.graphs[size] = graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of a batch of single-token requests from a graph;
        None for any other batch (prefill chunks, drafts, more requests than the largest graph)."""
        num_tokens = input_ids.shape[0]
        group = metadata.groups[0]
        if len(metadata.groups) > 1 or group.seq_lens.shape[0] != num_tokens or num_tokens > self.sizes[-1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)
        self.block_tables[:num_tokens, :group.block_tables.shape[1]].copy_(group.block_tables)
        self.seq_lens[:num_tokens].copy_(group.seq_lens)
        self.seq_lens[num_tokens:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:num_tokens]
