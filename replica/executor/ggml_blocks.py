"""The default model's ggml block types (Q4_1, Q8_0) dequantized in torch, on every core: gguf.quants does it in
numpy on one core, 16 rows at a time, 3.5x slower over SmolLM2's tensors. Values are identical."""
import gguf
import numpy as np
import torch

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def dequantize_rows(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """data: rows of bytes, as a GGUF holds a Q4_1 or Q8_0 tensor; float32 values, one row for each."""
    rows = torch.from_numpy(np.array(data))  # a writable copy of the mapped bytes
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rows.reshape(-1, type_size)
    values = _q4_1(blocks) if tensor_type == Q4_1 else _q8_0(blocks)
    return values.reshape(*rows.shape[:-1], rows.shape[-1] // type_size * block_size).numpy()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """block_q4_1: scale and minimum (float16), then 32 4-bit values, the first 16 in the low nibbles."""
    scale, minimum = blocks[:, 0:2].view(torch.float16).float(), blocks[:, 2:4].view(torch.float16).float()
    nibbles = blocks[:, 4:]
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float() * scale + minimum


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """block_q8_0: a scale (float16), then 32 signed 8-bit values."""
    return blocks[:, 2:].view(torch.int8).float() * blocks[:, 0:2].view(torch.float16).float()
