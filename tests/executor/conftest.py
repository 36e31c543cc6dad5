import os

import torch

# Triton reads TRITON_INTERPRET when a kernel module is first imported: set it before then, so the
# Triton backend runs in the interpreter on CPU tensors when there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
