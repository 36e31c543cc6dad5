"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

gguf's GGUFReader builds a numpy view for every part of every field: about 5 s for a 49k-token vocabulary and its
merges on one core, paid by every process that loads the model (the ingress and each engine replica). Here the
metadata are read with struct (about 0.1 s), and tensor data stay memory-mapped views, shaped as GGUFReader
shapes them (quantized ones as rows of bytes), for gguf.quants to dequantize.
"""
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_LENGTH = struct.Struct("<Q")
# tensor types stored as plain numbers; the others are blocks of bytes
_PLAIN = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
          GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # a read-only view of the file: numpy's dimension order; quantized types as rows of bytes


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # every field as a plain Python value (strings, numbers, lists)
    tensors: list[GGUFTensor]


def read_gguf(path: str) -> GGUFFile:
    """ValueError for a file that is not GGUF version 2 or 3."""
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    reader = _Reader(buffer)
    if buffer[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    reader.offset = 4
    version, num_tensors, num_fields = reader.scalar("I"), reader.scalar("Q"), reader.scalar("Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    metadata = {}
    for _ in range(num_fields):
        name = reader.string()
        metadata[name] = reader.value(reader.scalar("I"))
    table = [_tensor_entry(reader) for _ in range(num_tensors)]
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-reader.offset // alignment) * alignment
    return GGUFFile(metadata, [_tensor(buffer, data_start, *entry) for entry in table])


class _Reader:
    def __init__(self, buffer: mmap.mmap):
        self.buffer = buffer
        self.offset = 0

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buffer, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """count strings in a row, in one loop: a vocabulary and its merges (98k strings) in half the time
        that a call a string takes."""
        buffer, offset, length_of = self.buffer, self.offset, _LENGTH.unpack_from
        strings = []
        for _ in range(count):
            (length,), start = length_of(buffer, offset), offset + 8
            offset = start + length
            strings.append(buffer[start:offset].decode("utf-8", errors="replace"))
        self.offset = offset
        return strings

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            return self.scalar(_SCALARS[value_type])
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type == _STRING:
            return self.strings(count)
        if item_type == _ARRAY:
            return [self.value(item_type) for _ in range(count)]
        items = np.frombuffer(self.buffer, np.dtype("<" + _SCALARS[item_type]), count, self.offset)
        self.offset += items.nbytes
        return items.tolist()


def _tensor_entry(reader: _Reader) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = reader.string()
    dims = tuple(reader.scalar("Q") for _ in range(reader.scalar("I")))
    return name, dims, GGMLQuantizationType(reader.scalar("I")), reader.scalar("Q")


def _tensor(buffer: mmap.mmap, data_start: int, name: str, dims: tuple[int, ...],
            tensor_type: GGMLQuantizationType, offset: int) -> GGUFTensor:
    shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
    num_elements = int(np.prod(dims))
    if tensor_type in _PLAIN:
        data = np.frombuffer(buffer, _PLAIN[tensor_type], num_elements, data_start + offset)
    else:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        data = np.frombuffer(buffer, np.uint8, num_elements * type_size // block_size, data_start + offset)
        shape = quant_shape_to_byte_shape(shape, tensor_type)
    return GGUFTensor(name, tensor_type, data.reshape(shape))
