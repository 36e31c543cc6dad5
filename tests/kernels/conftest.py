import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when @triton.jit runs, i.e. when a kernel module is first
# imported: set it before any test module imports one. Without a GPU the kernels run in the
# interpreter on CPU tensors; with one they compile and run on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
