"""Builds the CPU kernels (csrc/*.cpp) into a shared library on first use and loads it with ctypes.

The library is compiled for this machine's CPU (-march=native) and cached under
$PREFIXSERVE_CACHE_DIR (default ~/.cache/prefixserve/kernels), keyed by the sources, the compiler,
its flags and the CPU, so a second process (or a Ray replica) loads it in milliseconds. It links
the OpenMP runtime that torch has already loaded, so it shares torch's threads and their count.
"""
import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import operator
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from kernels.layout import check_last_dim_contiguous, check_on_cpu

logger = logging.getLogger(__name__)
SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/common.h DType
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the head dims csrc/attention.cpp instantiates

# The C types the kernels' extern "C" declarations use; any pointer binds as void*.
_C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "void": None}
_DECLARATION = re.compile(r'extern "C" (\w+) prefixserve_(\w+)\(([^)]*)\)')


class BuildError(RuntimeError):
    """The CPU kernels cannot be built here (no C++ compiler, or it failed)."""


class Kernel:
    """One extern "C" function of the library, called with its C parameter names as keywords;
    a tensor given for a pointer parameter passes its data pointer."""

    def __init__(self, function: ctypes._CFuncPtr, restype: str, params: list[tuple[str, str]]):
        self.name, self.arg_names = function.__name__, [name for _, name in params]
        self._arg_set = frozenset(self.arg_names)  # checked on every call: a layer calls each kernel per step
        in_order = operator.itemgetter(*self.arg_names)  # of one name, the value rather than a 1-tuple
        self._in_order = in_order if len(self.arg_names) > 1 else lambda args: (in_order(args),)
        self._pointer_at = [i for i, (c_type, _) in enumerate(params) if "*" in c_type]
        function.restype = _C_TYPES[restype]
        function.argtypes = [ctypes.c_void_p if "*" in c_type else _C_TYPES[c_type] for c_type, _ in params]
        self._function = function

    def __call__(self, **args):
        if args.keys() != self._arg_set:
            raise TypeError(f"{self.name} takes {self.arg_names}; missing {sorted(self._arg_set - args.keys())}, "
                            f"unknown {sorted(args.keys() - self._arg_set)}")
        values = list(self._in_order(args))
        for i in self._pointer_at:
            if values[i] is not None:
                values[i] = values[i].data_ptr()
        return self._function(*values)


@functools.cache
def load(source_dir: Path = SOURCE_DIR) -> SimpleNamespace:
    """The kernels (paged_attention, rms_norm, ...), built first if this machine has no up-to-date
    copy; BuildError if they cannot be. Each binds the signature its csrc/*.cpp declaration states.
    Another checkout's source_dir gives its own kernels beside these (a benchmark's baseline)."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    compiler = next(filter(None, map(shutil.which, candidates)), None)
    if compiler is None:
        raise BuildError(f"no C++ compiler found (tried {', '.join(candidates)}; set CXX, or install g++)")
    sources = sorted(Path(source_dir).glob("*.cpp"))
    headers = sorted(Path(source_dir).glob("*.h"))
    path = _cache_dir() / f"libprefixserve_cpu-{_build_key(compiler, [*sources, *headers])}.so"
    if not path.exists():
        _build(compiler, sources, path)
    lib = ctypes.CDLL(str(path))
    return SimpleNamespace(**{name: Kernel(getattr(lib, f"prefixserve_{name}"), restype, params)
                              for name, (restype, params) in declarations(sources).items()})


def declarations(sources: list[Path]) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """name -> (return type, [(C type, parameter name)]) of every extern "C" kernel in the sources."""
    found = {}
    for source in sources:
        for restype, name, params in _DECLARATION.findall(source.read_text()):
            found[name] = (restype, [_split_param(param) for param in params.split(",")])
    return found


def _split_param(param: str) -> tuple[str, str]:
    c_type, name = " ".join(param.split()).removeprefix("const ").rsplit(" ", 1)
    if "*" not in c_type and c_type not in _C_TYPES:
        raise TypeError(f"no ctypes binding for the C type {c_type!r} of parameter {name!r}")
    return c_type, name


def available() -> bool:
    try:
        load()
    except BuildError:
        return False
    return True


def operand_dtype_code(operands: dict[str, torch.Tensor]) -> int:
    """The element type of operands that must all be CPU tensors, dense in their last dimension (the
    kernels index it directly) and of one dtype, as the kernels name it; ValueError otherwise. Cheap when
    they are: every layer checks its operands on every kernel call of every step."""
    if not all(tensor.is_cpu and tensor.stride(-1) == 1 for tensor in operands.values()):
        check_on_cpu(**operands)  # raises, naming the tensor
        check_last_dim_contiguous(**operands)
    dtype = next(iter(operands.values())).dtype
    if dtype not in DTYPE_CODES or any(tensor.dtype != dtype for tensor in operands.values()):
        raise ValueError(f"the CPU kernels take one dtype of {sorted(map(str, DTYPE_CODES))}, got "
                         f"{ {name: str(tensor.dtype) for name, tensor in operands.items()} }")
    return DTYPE_CODES[dtype]


def _cache_dir() -> Path:
    root = os.environ.get("PREFIXSERVE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                           "prefixserve")
    directory = Path(root) / "kernels"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _build_key(compiler: str, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + path.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update(" ".join([compiler, version, *FLAGS, platform.machine(), _cpu_flags()]).encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))), "")


def _build(compiler: str, sources: list[Path], path: Path) -> None:
    # each source compiled on a core of its own (attention.cpp alone takes two thirds of a serial build), then
    # linked; beside the target and renamed: concurrent builders each finish with a whole library
    logger.info("building the CPU kernels for this machine into %s", path)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        objects = [Path(scratch, f"{source.stem}.o") for source in sources]
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(lambda source, built: _compile(compiler, "-c", source, "-o", built), sources, objects))
        output = Path(scratch) / path.name
        _compile(compiler, *objects, "-o", output)
        os.replace(output, path)


def _compile(compiler: str, *args: str | Path) -> None:
    result = subprocess.run([compiler, *FLAGS, *map(str, args)], capture_output=True, text=True)
    if result.returncode:
        raise BuildError(f"building the CPU kernels failed:\n{result.stderr[-4000:]}")
