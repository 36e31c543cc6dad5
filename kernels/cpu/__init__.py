"""CPU kernels in C++ (csrc/), built for this machine on first use: the CPU executor's fast path.

One module per op, with the signature of its pure-torch reference; beside them linear (a small batch's
x W^T on weights packed for it, against F.linear) and decoder (a model's layers chained in one call, against
the model's own forward). Importing this package builds nothing; the first call does (kernels.cpu.library).
"""
