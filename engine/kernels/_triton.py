"""Triton as an optional, lazily imported dependency.

Nothing here imports Triton until a kernel is launched, for two reasons: the engine must
import and run on CPU without it, and Triton fixes compiled-vs-interpreted mode
(TRITON_INTERPRET) for its own library functions at the moment it is first imported, so
importing it early would freeze whatever the environment said then.

Kernel modules use `from __future__ import annotations` (Triton reads `tl.constexpr` from the
annotation strings) and import the placeholder `tl` below; the first launch of one of their
kernels rebinds that module's `tl` to `triton.language`.
"""

from __future__ import annotations

import functools
import importlib.util
import os

tl = None  # placeholder; see the module docstring


@functools.cache
def available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def mode_matches() -> bool:
    """False when Triton was imported in the other mode than TRITON_INTERPRET now asks for."""
    import triton.language.standard as standard

    imported_interpreted = type(standard.sum).__name__ == "InterpretedFunction"
    return imported_interpreted == interpreting()


def unit_last_stride(t):
    """Kernels index the last dimension as contiguous; copy only when it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class LazyKernel:
    """`kernel[grid](...)` like a Triton kernel; Triton is imported and the function wrapped at
    first launch."""

    def __init__(self, fn):
        self.fn = fn
        self._kernel = None

    def __getitem__(self, grid):
        if not available():
            raise RuntimeError(f"{self.fn.__name__} needs Triton, which is not installed")
        if not mode_matches():
            raise RuntimeError(
                f"Triton was imported with TRITON_INTERPRET={'0' if interpreting() else '1'} and "
                f"it is now {os.environ.get('TRITON_INTERPRET')!r}; set it before anything imports triton")
        launch = self.jitted()[grid]
        if not _launch_records:
            return launch

        def recorded(*args, **kwargs):
            consumed = [record(self.fn, args, kwargs) for record in _launch_records]
            return None if any(consumed) else launch(*args, **kwargs)
        return recorded

    def jitted(self):
        """The triton.jit function, its module's namespace made ready first."""
        if self._kernel is None:
            import triton

            _bind(self.fn.__globals__, triton, set())
            self._kernel = triton.jit(self.fn)
        return self._kernel


# Callbacks told (function, args, kwargs) of every launch while registered; one that returns
# True consumes the launch, which then does not run. The compile check (bench/kernel_compile.py)
# records the engine's launches on meta tensors this way, to compile them for GPUs.
_launch_records: list = []


def _bind(names: dict, triton, bound: set) -> None:
    """A kernel module's namespace made ready to compile: `tl` rebound to triton.language and
    the device functions it may call wrapped first, with their own modules' namespaces (a
    device function imported from another kernel module) made ready the same way."""
    if id(names) in bound:
        return
    bound.add(id(names))
    names["tl"] = triton.language
    for name, value in list(names.items()):
        if isinstance(value, LazyDeviceFunction):
            _bind(value.fn.__globals__, triton, bound)
            names[name] = triton.jit(value.fn)


class LazyDeviceFunction:
    """A function kernels of its module call on the device; wrapped with triton.jit by the first
    kernel of that module that launches."""

    def __init__(self, fn):
        self.fn = fn


def jit(fn) -> LazyKernel:
    return LazyKernel(fn)


def device_function(fn) -> LazyDeviceFunction:
    return LazyDeviceFunction(fn)
