"""CPU: linear layers at decode batch sizes, on weights packed once for them (csrc/linear.cpp)."""
from dataclasses import dataclass

import torch

from kernels.cpu.library import DTYPE_CODES, load, operand_dtype_code


@dataclass(frozen=True)
class LinearWeight:
    """A weight [out_features, in_features] in the layout csrc/linear.cpp reads."""
    data: torch.Tensor
    out_features: int
    in_features: int


def small_batch_rows(dtype: torch.dtype) -> int:
    """The most rows to run on linear() rather than oneDNN's packed matmul on this CPU (csrc/linear.cpp)."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"the CPU kernels take one dtype of {sorted(map(str, DTYPE_CODES))}, got {dtype}")
    return load().linear_max_rows(dtype=DTYPE_CODES[dtype])


def pack_linear_weight(weight: torch.Tensor) -> LinearWeight:
    code = operand_dtype_code({"weight": weight})
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is [out_features, in_features], got shape {tuple(weight.shape)}")
    weight = weight.contiguous()
    out_features, in_features = weight.shape
    data = torch.empty(load().packed_linear_size(dtype=code, out_features=out_features, in_features=in_features),
                       dtype=weight.dtype)
    load().pack_linear_weight(dtype=code, packed=data, weight=weight, out_features=out_features,
                              in_features=in_features)
    return LinearWeight(data, out_features, in_features)


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in_features] -> x W^T + bias, [T, out_features]; fastest at a few rows."""
    operands = {"x": x, "weight": weight.data} if bias is None else {"x": x, "weight": weight.data, "bias": bias}
    code = operand_dtype_code(operands)
    if x.dim() != 2 or x.shape[1] != weight.in_features or (bias is not None and bias.shape != (weight.out_features,)):
        raise ValueError(f"x {tuple(x.shape)} and bias {None if bias is None else tuple(bias.shape)} do not fit a "
                         f"weight of {weight.out_features} x {weight.in_features}")
    out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
    load().linear(dtype=code, out=out, x=x, packed=weight.data, bias=bias, num_rows=x.shape[0],
                  in_features=weight.in_features, out_features=weight.out_features, stride_x=x.stride(0))
    return out
