"""Tensor parallelism: which shard of the model a rank holds, and the collectives that join the shards.

Attention heads split across ranks (each rank holds the KV cache of its own KV heads), q/k/v and
gate/up split by output rows (column parallel), o and down by input columns (row parallel, summed by
an all-reduce), and the vocabulary of the embedding and the LM head in equal, padded slices. With
fewer KV heads than ranks, each KV head is replicated on the ranks whose query heads read it, as vLLM
does. With one rank every collective is skipped: the model runs exactly as without parallelism.
"""
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from replica.executor.config import ModelConfig

# How long a rank waits in a collective for a peer before it fails; a dead peer is noticed sooner by the
# executor that drives the ranks.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and reports the step's tokens."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's tensor, concatenated along the last dim, on the driver; None on the others."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_driver else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The driver's tensor, on every rank (the others pass one of the same shape and dtype)."""
        if self.size > 1:
            dist.broadcast(tensor, src=0)
        return tensor


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads [q_start, q_start + num_heads), KV heads likewise."""
    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def shard_heads(config: ModelConfig, tp: TensorParallel) -> HeadShard:
    check_divisible(config, tp.size)
    num_heads = config.num_heads // tp.size
    if config.num_kv_heads >= tp.size:
        num_kv_heads = config.num_kv_heads // tp.size
        return HeadShard(num_heads, num_kv_heads, tp.rank * num_heads, tp.rank * num_kv_heads)
    return HeadShard(num_heads, 1, tp.rank * num_heads, tp.rank * config.num_kv_heads // tp.size)


def check_divisible(config: ModelConfig, size: int) -> None:
    """ValueError, naming the counts, for a model that does not split into `size` ranks."""
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {config.num_heads} query heads "
                         f"({config.num_kv_heads} KV heads); pick a size that divides both, or replicate")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} neither divides the model's {config.num_kv_heads} KV heads "
                         "nor is a multiple of them (to replicate each on size / KV heads ranks)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size {config.intermediate_size}")


def num_kv_heads_per_rank(config: ModelConfig, size: int) -> int:
    return max(config.num_kv_heads // size, 1)


def vocab_slice(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first token id, rows) of the rank's slice of the vocabulary; the last slice is padded to the rest's size."""
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


def init_process_group(tp: TensorParallel, master: tuple[str, int], host: str, device: torch.device) -> None:
    """Joins the ranks: NCCL on GPUs, gloo on CPUs over this host's own address (never another interface)."""
    master_host, master_port = master
    store = dist.TCPStore(master_host, master_port, tp.size, is_master=tp.is_driver, timeout=COLLECTIVE_TIMEOUT)
    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=tp.rank, world_size=tp.size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=device)
        return
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = COLLECTIVE_TIMEOUT
    dist.init_process_group("gloo", store=store, rank=tp.rank, world_size=tp.size, timeout=COLLECTIVE_TIMEOUT,
                            pg_options=options)
