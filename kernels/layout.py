"""Layout checks shared by the Triton and CPU launchers: kernels index the last dimension densely."""
import torch


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {tensor.stride()}")


def check_on_cpu(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if not tensor.is_cpu:
            raise ValueError(f"the CPU kernels take CPU tensors; {name} is on {tensor.device}")


def dense_like(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialized row-major tensor of tensor's shape, dtype and device (an output the kernels fill)."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)
