"""The Triton kernels, one module per op (importing any of them imports triton)."""
