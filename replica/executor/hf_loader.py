"""Reading a local Hugging Face model directory: config.json and *.safetensors."""
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from replica.executor.config import ModelConfig


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no config.json")
    return ModelConfig.from_hf_config(json.loads(path.read_text()))


def iter_weights(directory: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                yield name, tensors.get_tensor(name).to(dtype)
