"""Compile the engine's Triton kernels for NVIDIA GPUs on a machine without one.

Triton's interpreter runs the kernels' logic on CPU tensors (the tests), but not Triton's
compiler: a kernel the interpreter runs can still fail to compile for a GPU (a float8 type the
architecture lacks, a float8 dot narrower than its MMA). This records each kernel launch as the
engine makes it at serving sizes, from bench.kernels' cases on meta tensors (nothing is
computed, nothing is read back) with the choices a GPU makes (tile, context splits), and
compiles each distinct launch to a cubin with the ptxas Triton ships, for the GPUs people serve
on: sm_90 (H100, H200) and sm_80 (A100). A launch whose kernel needs more shared memory than the
architecture gives a block (it would fail with OutOfResources) fails the check too.

A kernel module may say it is not for every GPU (MIN_CAPABILITY: the FP8 weight kernels, which
run only where FP8 weights stay FP8); on a GPU below 8.9 an e4m3 cache moves as bytes
(engine.kernels.float_bits.fp8_as_bytes), so sm_80's launches are recorded that way.

    python -m bench.kernel_compile [--arch 90 --arch 80] [--dtype bfloat16] [--all]

--all adds the prefill kernels CUDA runs only as an A/B (SPLITSERVE_FORCE_TRITON=1: the SSD
and chunked Gated DeltaNet scans, engine.kernels._prefill_scan_on_triton), whose compiles take
seconds each. Needs Triton and runs without TRITON_INTERPRET (it refuses otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

from engine.kernels import _triton

ARCHS = (90, 80)
# the most shared memory a block may use (bytes), past which a launch fails with OutOfResources
SHARED_BYTES = {90: 232448, 89: 101376, 80: 166912}
SMS = 132  # an H100 SXM's, for the context splits a GPU's decode attention picks
DTYPES = (torch.bfloat16, torch.float32)  # the serving dtypes the check records launches in
AB_ONLY = {"ssd_chunk_scan", "chunk_gated_delta_rule"}  # bench.kernels cases CUDA runs as an A/B only
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


@dataclass(frozen=True)
class Launch:
    """One kernel as launched: its module and name, argument types, constexpr values."""

    module: str
    name: str
    signature: tuple  # ((argument, Triton type), ...)
    constexprs: tuple  # ((argument, value), ...)
    options: tuple = ()  # the launch's compile options: ((num_warps, n), (num_stages, n))

    @classmethod
    def of(cls, fn, args, kwargs) -> Launch:
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        return cls(fn.__module__, fn.__name__, tuple((name, _type(fn, name, arg)) for name, arg in zip(names, args)),
                   tuple(sorted((k, v) for k, v in kwargs.items() if k in names)),
                   tuple(sorted((k, v) for k, v in kwargs.items() if k not in names)))

    def runs_on(self, arch: int) -> bool:
        lowest = getattr(importlib.import_module(self.module), "MIN_CAPABILITY", (0, 0))
        return (arch // 10, arch % 10) >= lowest


def _type(fn, name: str, arg) -> str:
    if isinstance(arg, torch.Tensor):
        return "*" + _TYPES[arg.dtype]
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, int):
        return "i32" if -2 ** 31 <= arg < 2 ** 31 else "i64"
    if isinstance(arg, float):
        return "fp32"
    raise TypeError(f"{fn.__name__}: argument {name} of type {type(arg).__name__}")


@contextlib.contextmanager
def as_on_a_gpu(arch: int):
    """Launch choices as a GPU of `arch` makes them, on meta tensors: decode attention's tile and
    context splits; below 8.9, e4m3 caches as bytes."""
    from engine.kernels import paged_attention

    saved = paged_attention._on_gpu, paged_attention._sm_count, os.environ.get("SPLITSERVE_FP8_AS_BYTES")
    paged_attention._on_gpu, paged_attention._sm_count = (lambda q: True), (lambda q: SMS)
    os.environ["SPLITSERVE_FP8_AS_BYTES"] = "1" if arch < 89 else "0"
    try:
        yield
    finally:
        paged_attention._on_gpu, paged_attention._sm_count, as_bytes = saved
        os.environ.pop("SPLITSERVE_FP8_AS_BYTES") if as_bytes is None else os.environ.update(
            SPLITSERVE_FP8_AS_BYTES=as_bytes)


def record(arch: int, everything: bool = False, dtypes=DTYPES) -> list[Launch]:
    """The distinct launches of bench.kernels' cases at serving sizes, in `dtypes` (serving
    dtypes: bf16 and float32), as a GPU of `arch` makes them; none runs."""
    from bench import kernels

    launches: dict[Launch, None] = {}

    def consume(fn, args, kwargs) -> bool:
        launches[Launch.of(fn, args, kwargs)] = None
        return True  # recorded, not launched

    _triton._launch_records.append(consume)
    try:
        with as_on_a_gpu(arch):
            for dtype in dtypes:
                for case in kernels.all_cases(torch.device("meta"), dtype):
                    if everything or case.name not in AB_ONLY:
                        case.kernel()
    finally:
        _triton._launch_records.remove(consume)
    return [launch for launch in launches if launch.runs_on(arch)]


def compile_launch(launch: Launch, arch: int):
    """A cubin for `arch`; raises what Triton's compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch.module), launch.name)
    fn = kernel.jitted()
    constexprs = dict(launch.constexprs)
    signature = {**dict(launch.signature), **{name: "constexpr" for name in constexprs}}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def check(archs=ARCHS, everything: bool = False, dtypes=DTYPES) -> list[tuple[str, int, float, str]]:
    """(kernel, arch, seconds, "ok" or the compiler's last line) for every distinct launch."""
    if _triton.interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: the compile check needs Triton's compiler")
    rows = []
    for arch in archs:
        for launch in record(arch, everything, dtypes):
            started = time.perf_counter()
            try:
                shared = compile_launch(launch, arch).metadata.shared
                outcome = "ok" if shared <= SHARED_BYTES[arch] else \
                    f"needs {shared} B of shared memory; sm_{arch} has {SHARED_BYTES[arch]}"
            except Exception as error:  # noqa: BLE001 - Triton's compile errors are of many kinds
                lines = str(error).strip().splitlines() or [type(error).__name__]
                outcome = lines[-1][:200]
            rows.append((f"{launch.module.rsplit('.', 1)[-1]}.{launch.name}", arch,
                         time.perf_counter() - started, outcome))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="sm_XY as XY (default: 90 and 80)")
    parser.add_argument("--dtype", action="append", choices=("bfloat16", "float32"),
                        help="serving dtype (default: both)")
    parser.add_argument("--all", action="store_true", help="also the prefill kernels CUDA runs as an A/B only")
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args(argv)
    dtypes = tuple(getattr(torch, name) for name in args.dtype) if args.dtype else DTYPES
    rows = check(tuple(args.arch or ARCHS), args.all, dtypes)
    if args.json:
        print(json.dumps(rows))
    else:
        for name, arch, seconds, outcome in rows:
            print(f"sm_{arch}  {seconds:6.2f}s  {name:45s}  {outcome}")
    failed = [row for row in rows if row[3] != "ok"]
    print(f"{len(rows) - len(failed)}/{len(rows)} launches compile", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
