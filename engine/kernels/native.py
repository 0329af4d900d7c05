"""The C++ CPU kernels (cpu_kernels.cpp, cpu_fused.cpp, cpu_gemm.cpp, cpu_layers.cpp, cpu_decode.cpp,
cpu_deltanet.cpp, cpu_state.cpp, cpu_kernels.h): compiled on first use into one library, cached on disk, called by ctypes.

Compiled with the machine's C++ compiler for the machine's own CPU (-march=native), so the
cached library is keyed by the source, the flags, the compiler and the CPU. A worker that finds
no compiler, or whose compile fails, logs why once and runs the torch references instead.

Why C++ and not numba (which the row copies of kvtransfer still use): numba keeps a thread pool
of its own, and on a box with as many torch threads as cores its threads and torch's OpenMP
workers (still spinning after the last torch op) fought for the cores; this library links
libgomp, which resolves to the copy torch has loaded, so its loops run on torch's own threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # first: its libgomp must be the one the library's libgomp.so.1 resolves to

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_kernels.cpp", "cpu_fused.cpp", "cpu_gemm.cpp", "cpu_layers.cpp", "cpu_decode.cpp",
                         "cpu_deltanet.cpp", "cpu_state.cpp")]
HEADERS = [Path(__file__).with_name("cpu_kernels.h")]
# Fast math lets the compiler vectorise exp and the reductions; it is passed to the compile step
# only: linked with it, the library would turn on flush-to-zero for the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17"]
LINK_FLAGS = ["-shared", "-fopenmp"]
P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_CTYPES = {"int64_t": I64, "int": INT, "float": F32}


def _parameters(text: str, where: str) -> list[tuple[str | None, type]]:
    """(name, ctypes type) of each parameter of a C declaration's parameter list."""
    out = []
    for part in filter(None, (p.strip() for p in text.replace("\n", " ").split(","))):
        if "*" in part:
            name = part.rsplit("*", 1)[1].split()
            out.append((name[-1] if name else None, P))
            continue
        words = part.split()
        if words[0] not in _CTYPES:
            raise RuntimeError(f"{where}: parameter {part!r} is of a type the binding does not know")
        out.append((words[1] if len(words) > 1 else None, _CTYPES[words[0]]))
    return out


def read_signatures(sources=None) -> dict[str, list[tuple[str | None, type]]]:
    """Every exported entry's parameters, read from the C++ itself (the functions defined in an
    `extern "C" { ... }` block or declared `extern "C"`): one contract, no mirrored lists. Each
    entry's last parameter is the thread count, which `call` passes."""
    signatures = {}
    for source in sources or SOURCES:
        text = source.read_text()
        blocks = re.findall(r'^extern "C" \{\n(.*?)^\}  // extern "C"', text, re.S | re.M)
        defined = [m for block in blocks for m in re.finditer(r"^void (\w+)\(([^)]*)\)", block, re.M)]
        defined += re.finditer(r'^extern "C" void (\w+)\(([^)]*)\)', text, re.M)
        for match in defined:
            name = match.group(1)
            params = _parameters(match.group(2), f"{source.name}: {name}")
            if not params or params[-1][1] is not INT:
                raise RuntimeError(f"{source.name}: {name} must end with its int thread count")
            if any(param is None for param, _ in params[:-1]):
                raise RuntimeError(f"{source.name}: {name} has an unnamed parameter")
            signatures[name] = params
    return signatures


SIGNATURES = read_signatures()
_ARGUMENTS = {name: tuple(param for param, _ in params[:-1]) for name, params in SIGNATURES.items()}


def cache_dir() -> Path:
    """$SPLITSERVE_KERNEL_CACHE, else ~/.cache/splitserve/kernels, else (a home that cannot be
    written, as in some containers) a directory of this user's under the system's temp dir."""
    configured = os.environ.get("SPLITSERVE_KERNEL_CACHE")
    if configured:
        return Path(configured)
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "splitserve" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"splitserve-kernels-{os.getuid()}"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES + HEADERS), " ".join(COMPILE_FLAGS + LINK_FLAGS), version,
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a private directory, then rename into place: workers starting together on
    one node may all build, and none may load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in SOURCES]
        lib = Path(scratch) / "k.so"
        commands = [[compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)] for source, obj in zip(SOURCES, objects)]
        for command in commands + [[compiler, *LINK_FLAGS, *map(str, objects), "-o", str(lib)]]:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, target)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) where they cannot be built here."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler (c++, g++ or $CXX): CPU decode kernels fall back to torch ops")
        return None
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("CPU decode kernels unavailable, falling back to torch ops: %s", error)
        return None
    for name, params in SIGNATURES.items():
        getattr(lib, name).argtypes = [kind for _, kind in params]
        getattr(lib, name).restype = None
    lib.decoder_layer_plan_bytes.argtypes, lib.decoder_layer_plan_bytes.restype = [], I64
    return lib


def available() -> bool:
    return library() is not None


def call(name: str, **args) -> None:
    """Run kernel `name`, its arguments named as its C++ parameters (all of them but the thread
    count, each exactly once: the contract is checked at every call); tensors pass as pointers
    (the caller keeps them alive and contiguous), and the thread count is torch's, so the loop
    reuses torch's OpenMP team."""
    names = _ARGUMENTS[name]
    if len(args) != len(names) or not all(param in args for param in names):
        raise TypeError(f"kernel {name}: missing {sorted(set(names) - set(args))}, "
                        f"unexpected {sorted(set(args) - set(names))}")
    getattr(library(), name)(*[v.data_ptr() if isinstance(v := args[param], torch.Tensor) else v
                               for param in names], torch.get_num_threads())
