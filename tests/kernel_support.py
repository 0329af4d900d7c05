"""What every Triton kernel test module shares; import it before anything imports triton.

Kernel tests (marker `triton`) run compiled on CUDA when there is a GPU, else under
TRITON_INTERPRET=1 on CPU tensors, and skip without Triton. Triton fixes interpreted-vs-compiled
mode when first imported (engine.kernels._triton), hence the environment is set at import here.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels import _triton  # noqa: E402 - after the mode is set

DEVICE = "cuda" if ON_GPU else "cpu"
NAN = float("nan")

requires_triton = pytest.mark.skipif(not _triton.available(), reason="Triton is not installed")


def enter_kernel_mode() -> None:
    """Skip when Triton was imported in the other mode; seed the test."""
    if not _triton.mode_matches():
        pytest.skip("triton was imported before this module set TRITON_INTERPRET=1; "
                    "run `TRITON_INTERPRET=1 python -m pytest -m triton`")
    torch.manual_seed(0)


@pytest.fixture
def kernel_mode():
    enter_kernel_mode()


def strided(rows, *shape, dtype=torch.float32):
    """A [rows, *shape] view into a wider buffer, as the engine's projections are split."""
    width = math.prod(shape)
    return torch.randn(rows, 2 * width + 3, device=DEVICE).to(dtype)[:, 3:3 + width].view(rows, *shape)
