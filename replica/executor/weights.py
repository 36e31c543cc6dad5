"""Building the model from a checkpoint: weights streamed from GGUF or safetensors, in the chosen dtype."""
import logging
from collections.abc import Iterator

import numpy as np
import torch

from kernels import KernelOps
from replica.executor import gguf_loader, packed_linear
from replica.executor.checkpoint import Checkpoint
from replica.executor.model import LlamaForCausalLM
from replica.executor.parallel import TensorParallel

logger = logging.getLogger(__name__)


def build_model(checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device, ops: KernelOps,
                tp: TensorParallel = TensorParallel()) -> LlamaForCausalLM:
    """The model, or under tensor parallelism the shard of rank tp.rank."""
    # built on the meta device, so no memory is initialized only to be overwritten by the weights
    with torch.device("meta"):
        model = LlamaForCausalLM(checkpoint.config, ops, device, tp).to(dtype)
    # what to_empty does, without the first empty_like from meta importing sympy (0.4 s a process)
    model._apply(lambda tensor: torch.empty(tensor.shape, dtype=tensor.dtype, device=device))
    model.load_weights((name, tensor.to(device)) for name, tensor in iter_weights(checkpoint, dtype))
    if packed_linear.can_pack(device, dtype):
        small_batch = ops.backend == "cpu"
        if small_batch and not packed_linear.small_batch_copy_fits(model):
            logger.warning("the model's weights are too large to hold a second copy for small batches: "
                           "decode steps run on oneDNN alone")
            small_batch = False
        model.pack_linear_weights(small_batch)
    return model.eval()


def iter_weights(checkpoint: Checkpoint, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in dtype) for every tensor of the checkpoint."""
    if checkpoint.is_gguf:
        for name, array in gguf_loader.iter_arrays(str(checkpoint.path), checkpoint.config):
            # the reader's arrays are read-only memmaps or fresh float32 arrays; copy only when needed
            yield name, torch.from_numpy(np.array(array, copy=not array.flags.writeable)).to(dtype)
        return
    from safetensors import safe_open
    files = sorted(checkpoint.path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint.path} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_tensor(name).to(dtype)
