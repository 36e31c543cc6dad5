import os

import torch

# Triton reads TRITON_INTERPRET when @triton.jit runs, i.e. when a kernel module is first
# imported, and any test module may import one: set it here, before all of them. Without a GPU
# the kernels run in the interpreter on CPU tensors; with one they compile and run on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
