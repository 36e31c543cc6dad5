"""A model runner built from the engine's resolved choices: in the engine's process, or as one tensor-parallel
rank (a Worker) holding its shard of the model and the KV cache of its heads."""
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import Backend, get_ops
from replica.executor.checkpoint import load_checkpoint
from replica.executor.cpu_allocator import keep_freed_memory
from replica.executor.cuda_graphs import DecodeGraphs
from replica.executor.host_copies import HostCopies
from replica.executor.model import KVCache, LlamaForCausalLM
from replica.executor.model_runner import ModelRunner
from replica.executor.paged_cache import allocate_kv_caches, fault_in_background
from replica.executor.parallel import TensorParallel, init_process_group
from replica.executor.weights import build_model
from replica.kv_cache.host_pool import HostPool, HostPoolSpec
from replica.scheduler import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class RunnerSpec:
    """What every rank builds the same runner from (sent to the workers, so plain values only)."""
    model: str | None
    dtype: torch.dtype
    device: torch.device
    backend: Backend
    block_size: int
    num_blocks: int
    cuda_graphs: bool = False  # capture decode steps where the kernels and ranks allow (see decode_graphs)
    max_num_seqs: int = 0
    max_blocks_per_seq: int = 0
    host_pool: HostPoolSpec | None = None  # the node's second KV tier


def build_runner(spec: RunnerSpec, tp: TensorParallel = TensorParallel(),
                 device: torch.device | None = None) -> ModelRunner:
    """device: the rank's, if not spec.device."""
    device = device or spec.device
    checkpoint = load_checkpoint(spec.model)
    model = build_model(checkpoint, dtype=spec.dtype, device=device, ops=get_ops(spec.backend), tp=tp)
    kv_caches = allocate_kv_caches(checkpoint.config, spec.num_blocks, spec.block_size, spec.dtype, device, tp.size)
    fault_in_background(kv_caches)
    host_copies = HostCopies(HostPool(spec.host_pool), kv_caches) if spec.host_pool is not None else None
    return ModelRunner(model, kv_caches, spec.block_size, decode_graphs(spec, model, kv_caches), host_copies)


def decode_graphs(spec: RunnerSpec, model: LlamaForCausalLM, kv_caches: list[KVCache]) -> DecodeGraphs | None:
    # the torch reference kernels sync with the host (boolean masks): only Triton's can be captured;
    # with several ranks the collectives are launched eagerly, so every step is
    if (not spec.cuda_graphs or spec.backend != "triton" or kv_caches[0][0].device.type != "cuda"
            or model.tp.size > 1):
        return None
    return DecodeGraphs(model, kv_caches, spec.max_num_seqs, spec.max_blocks_per_seq)


class WorkerLost(RuntimeError):
    """A tensor-parallel rank of the engine died: the engine cannot step again."""


class Executor(Protocol):
    """Drives the tensor-parallel ranks of one engine: MultiprocExecutor, or the Ray app's RayExecutor."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The driver rank's output; WorkerLost if a rank is gone."""

    def check_health(self) -> None:
        """WorkerLost if a rank is gone."""

    def shutdown(self) -> None: ...


class Worker:
    """One tensor-parallel rank. Every rank executes every step; only the driver's output means anything."""

    def __init__(self, spec: RunnerSpec, tp: TensorParallel, master: tuple[str, int], host: str,
                 local_gpu: int = 0):
        """master: the driver's (host, port) the ranks meet at; host: this rank's address for gloo;
        local_gpu: which of the GPUs this process sees it computes on."""
        device = torch.device("cuda", local_gpu) if spec.device.type == "cuda" else spec.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            keep_freed_memory()
        init_process_group(tp, master, host, device)
        self.tp = tp
        self.runner = build_runner(spec, tp, device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.runner.execute_model(scheduler_output)
        return output if self.tp.is_driver else None
