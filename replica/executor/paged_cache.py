"""The paged KV cache tensors: per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_dim].

Under tensor parallelism each rank holds the KV heads of its own query heads: num_kv_heads is the rank's.
"""
import contextlib
import ctypes
import logging
import math
import mmap
import os
import threading

import torch

from replica.executor.config import ModelConfig
from replica.executor.model import KVCache
from replica.executor.parallel import num_kv_heads_per_rank

logger = logging.getLogger(__name__)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_LOWEST_PRIORITY = 19


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block takes across all layers, K and V, on each rank."""
    element_size = torch.empty((), dtype=dtype).element_size()
    num_kv_heads = num_kv_heads_per_rank(config, tp_size)
    return 2 * config.num_layers * block_size * num_kv_heads * config.head_dim * element_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                          tp_size: int = 1) -> int:
    """budget_bytes: each rank's."""
    return budget_bytes // block_bytes(config, block_size, dtype, tp_size)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, tp_size: int = 1) -> list[KVCache]:
    # zeros, not empty: padded attention reads masked slots, and 0 * NaN garbage would be NaN
    shape = (num_blocks, block_size, num_kv_heads_per_rank(config, tp_size), config.head_dim)
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(config.num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """On the CPU, zeros from an anonymous memory map, whose pages the kernel hands out zeroed when they are
    first touched: torch.zeros writes every page at start-up, about 5 s for an engine replica's 1 GiB while
    another replica starts beside it on 2 vCPUs (a VM's first touch is slow)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * dtype.itemsize), dtype=dtype).view(shape)


def fault_in_background(kv_caches: list[KVCache]) -> threading.Thread | None:
    """Fault every page of CPU caches in, on a thread of the lowest priority, so that the first writes to each
    block do not pay for it later (a block loaded from the node's pool took 3x as long into pages never
    touched) while the start-up, which the lazy zeroing above keeps short, is not made to wait for it."""
    tensors = [tensor for pair in kv_caches for tensor in pair if tensor.device.type == "cpu"]
    if not tensors:
        return None
    thread = threading.Thread(target=_fault_in, args=(tensors,), name="kv-cache-fault-in", daemon=True)
    thread.start()
    return thread


def _fault_in(tensors: list[torch.Tensor]) -> None:
    with contextlib.suppress(OSError):  # this thread's priority, on Linux
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for tensor in tensors:  # ctypes lets go of the GIL for each call
        if madvise(tensor.data_ptr(), tensor.numel() * tensor.element_size(), _MADV_POPULATE_WRITE) != 0:
            logger.info("KV cache pages left to fault in at first use: madvise says %s",
                        os.strerror(ctypes.get_errno()))
            return
