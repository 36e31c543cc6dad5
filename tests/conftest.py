import os

# Tests start Ray on loopback only (cluster/local_ray.py), which needs this before ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when @triton.jit runs, i.e. when a kernel module is first
# imported, and any test module may import one: set it here, before all of them. Without a GPU
# the kernels run in the interpreter on CPU tensors; with one they compile and run on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
