"""Every Triton kernel the engine launches on a GPU compiles for sm_90 and sm_80, here, without
one (bench.kernel_compile: the launches recorded at serving sizes on meta tensors, compiled to
cubins with the ptxas Triton ships). The interpreter, which the other kernel tests use, does not
run Triton's compiler: a float8 type an architecture lacks or a float8 dot narrower than its MMA
passes there and fails on the device."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvidia_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    spec = importlib.util.find_spec("triton.backends.nvidia")
    return spec is not None and spec.submodule_search_locations is not None and any(
        (Path(p) / "bin" / "ptxas").exists() for p in spec.submodule_search_locations)


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton with its NVIDIA backend (ptxas) is not installed")
def test_every_launch_compiles_for_the_gpus_people_serve_on():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPLITSERVE_FP8_AS_BYTES")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default; set, so it does not warn
    done = subprocess.run([sys.executable, "-m", "bench.kernel_compile"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    total = done.stderr.strip().splitlines()[-1]
    launched, compiled = total.split()[0].split("/")
    assert launched == compiled and int(compiled) >= 60, total  # both archs: every kernel, bf16 and float32
    for kernel in ("paged_attention._decode_split_kernel", "kv_fp8._kv_store_kernel", "fp8_moe._grouped_block_fp8_kernel",
                   "state_round._state_store_kernel", "gdn_triton._gdn_step_kernel"):
        assert kernel in done.stdout, kernel
    assert "sm_80" in done.stdout and "sm_90" in done.stdout


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton with its NVIDIA backend (ptxas) is not installed")
def test_every_bf16_launch_compiles_for_ada():
    """sm_89 (L40S, L4, RTX 4090): FP8 units, so the FP8 weight kernels run there too (the
    block-wise linears torch's scaled matmul does not take there among them), with 99 KB of
    shared memory a block. In bf16 every launch fits; float32 MLA decode does not (docs/gpu.md)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPLITSERVE_FP8_AS_BYTES")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "bench.kernel_compile", "--arch", "89", "--dtype", "bfloat16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "fp8_moe._grouped_block_fp8_kernel" in done.stdout and "fp8_quant." in done.stdout
