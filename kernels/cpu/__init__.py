"""CPU kernels in C++ (csrc/), built for this machine on first use: the CPU executor's fast path.

One module per op, with the signature of its pure-torch reference. Importing this package builds
nothing; the first call does (kernels.cpu.library).
"""
