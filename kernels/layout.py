"""Layout checks shared by the Triton and CPU launchers: kernels index the last dimension densely."""
import torch


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {tensor.stride()}")


def check_on_cpu(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"the CPU kernels take CPU tensors; {name} is on {tensor.device}")
