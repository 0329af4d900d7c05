#!/usr/bin/env python
"""GPU check: the Triton kernel tests compiled on the GPU, a 1P1D generation, and a
bandwidth micro-benchmark of each kernel, printed as tables. Budget: under 8 minutes on one GPU.

    python scripts/gpu_check.py [--transport nccl|gloo|shm] [--skip-tests] [--skip-e2e] [--skip-bench]

Exit status: 0 every check passed; 1 a check failed; 2 no CUDA device, nothing was checked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TESTS_LIMIT_S = 200
E2E_LIMIT_S = 200
BENCH_DEADLINE_S = 7 * 60  # no new benchmark case starts after this much total time
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self,"]
MAX_TOKENS = 32


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default=None,
                        help="hand-off transport; default nccl with two or more GPUs, else gloo")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--e2e-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    if args.e2e_child:
        return e2e_child(args.transport)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing was "
              "checked. The CPU side of the kernels is `TRITON_INTERPRET=1 python -m pytest -m triton`.")
        return 2
    started = time.monotonic()
    gpus = torch.cuda.device_count()
    print(f"gpu_check: {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"triton {_triton_version()}", flush=True)
    checks = []
    if not args.skip_tests:
        checks.append(run_kernel_tests())
    if not args.skip_e2e:
        checks.append(run_e2e(args.transport or ("nccl" if gpus >= 2 else "gloo"), gpus))
    if not args.skip_tests:
        checks.append(run_tp_tests(gpus))
    if not args.skip_bench:
        checks.append(run_bench(started))
    print_table("checks", ["check", "result", "detail"], checks)
    print(f"gpu_check: {time.monotonic() - started:.0f} s", flush=True)
    return 0 if all(row[1] in ("PASS", "INFO") for row in checks) else 1


def run_kernel_tests():
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "SPLITSERVE_FORCE_TRITON", "SPLITSERVE_DISABLE_TRITON")}
    env["SPLITSERVE_TRITON_ON_GPU"] = "1"  # tests/conftest.py otherwise selects the interpreter
    command = [sys.executable, "-m", "pytest", "-q", "-m", "triton", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "test_kernels.py"), str(ROOT / "tests" / "test_kernels_mamba2.py"),
               str(ROOT / "tests" / "test_kernels_gdn.py"), str(ROOT / "tests" / "test_kernels_mamba1_scan.py")]
    print("\n== kernel tests on the GPU (compiled, no interpreter):", " ".join(command[1:]), flush=True)
    return _pytest_check("pytest -m triton (cuda)", command, env)


def _pytest_check(name: str, command: list[str], env=None) -> list[str]:
    """A pytest run as one row of the table: PASS only when something passed and it exited 0."""
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TESTS_LIMIT_S)
    except subprocess.TimeoutExpired:
        return [name, "FAIL", f"timed out after {TESTS_LIMIT_S} s"]
    lines = (done.stdout + done.stderr).strip().splitlines()
    if done.returncode != 0:
        print("\n".join(lines[-60:]))
    summary = lines[-1] if lines else "no output"
    passed = done.returncode == 0 and "passed" in summary
    return [name, "PASS" if passed else "FAIL", summary.strip("= ")]


def run_tp_tests(gpus: int):
    """Two NCCL ranks of one engine, judged by transformers (NCCL refuses two ranks on one GPU)."""
    if gpus < 2:
        return ["TP=2 NCCL ranks", "INFO", "not run: needs two GPUs"]
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "test_tp_engine.py")]
    print("\n== tensor-parallel ranks over NCCL:", " ".join(command[1:]), flush=True)
    return _pytest_check("TP=2 NCCL ranks", command)


def run_e2e(transport: str, gpus: int):
    if gpus < 2 and transport == "nccl":
        return ["1P1D generation", "FAIL", "transport nccl needs two GPUs (one per worker)"]
    if gpus < 2:
        print(f"\n== 1P1D generation: one GPU, so no pairwise NCCL hand-off (it needs two); using the "
              f"fallback transport {transport!r}, both workers sharing the GPU", flush=True)
    else:
        print(f"\n== 1P1D generation over {transport!r}, one GPU per worker", flush=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--e2e-child", "--transport", transport]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=E2E_LIMIT_S)
    except subprocess.TimeoutExpired:
        return [f"1P1D generation ({transport})", "FAIL", f"timed out after {E2E_LIMIT_S} s"]
    report = None
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("E2E "):
            report = json.loads(line[4:])
            break
    if report is None:
        print((done.stdout + done.stderr)[-4000:])
        return [f"1P1D generation ({transport})", "FAIL", f"child exited {done.returncode} without a report"]
    for key, value in report.items():
        print(f"  {key}: {value}")
    return [f"1P1D generation ({transport})", "PASS" if report["ok"] else "FAIL", report["summary"]]


def e2e_child(transport: str) -> int:
    """Runs in its own process so a hung Ray start cannot outlive the time limit."""
    import torch

    from engine import LLM, SamplingParams, demo_model_path
    from router.cluster import launch

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    model = demo_model_path()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this function
    report = {"ok": False, "transport": transport, "model": str(model)}
    try:
        started = time.monotonic()
        gpus = torch.cuda.device_count()
        cluster = launch(model, prefill=1, decode=1, transport=transport, address="local",  # own Ray, never a stray one
                         gpus_per_worker=0.0 if gpus == 0 else 0.5 if gpus == 1 else 1.0)
        try:
            split = [out.token_ids for out in cluster.generate(PROMPTS, params)]
            report["cluster_transport"] = getattr(cluster.workers, "transport", transport)
        finally:
            cluster.shutdown()
        report["cluster_s"] = round(time.monotonic() - started, 1)
        if gpus >= 4 and transport == "nccl":  # TP=2 prefill and decode workers, one GPU per rank
            report["TP2->TP2 (rank to rank) == 1P1D"] = _tp_pair_agreement(model, params, split)
        gpu_llm = LLM(model, device=device)
        colocated = [out.token_ids for out in gpu_llm.generate(PROMPTS, params)]
        os.environ["SPLITSERVE_DISABLE_TRITON"] = "1"  # same GPU run on the torch references
        torch_only = [out.token_ids for out in gpu_llm.generate(PROMPTS, params)]
        os.environ.pop("SPLITSERVE_DISABLE_TRITON")
        cpu = [out.token_ids for out in LLM(model, device="cpu").generate(PROMPTS, params)]
        same = sum(a == b for a, b in zip(split, colocated))
        report[f"1P1D == LLM({device})"] = f"{same}/{len(PROMPTS)} prompts token-identical"
        report[f"LLM({device}) kernels == torch refs"] = _agreement(colocated, torch_only)
        report[f"LLM({device}) == LLM(cpu) (info)"] = _agreement(colocated, cpu)
        report["ok"] = same == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in split)
        report["summary"] = (f"{same}/{len(PROMPTS)} prompts x {MAX_TOKENS} tokens identical to "
                             f"LLM({device}); cluster {report['cluster_s']} s")
    except Exception as error:  # reported, not raised: the parent prints the table either way
        report["summary"] = f"{type(error).__name__}: {error}"[:300]
    print("E2E " + json.dumps(report), flush=True)
    return 0


def _tp_pair_agreement(model, params, expected) -> str:
    """Equal TP sizes hand off rank to rank over NCCL (engine.tp.rank_handoffs)."""
    import ray

    from router.cluster import launch

    cluster = launch(model, prefill=1, decode=1, transport="nccl", address="local", gpus_per_worker=1.0,
                     prefill_tp=2, decode_tp=2)
    try:
        tokens = [out.token_ids for out in cluster.generate(PROMPTS, params)]
        stats = ray.get(cluster.workers.prefill[0].handle.stats.remote())
    finally:
        cluster.shutdown()
    return (f"{_agreement(tokens, expected)}; {stats['handoffs_by_rank']} of {stats['handoff_count']} "
            f"hand-offs rank to rank, {stats['handoff_failures']} failed")


def _agreement(a, b) -> str:
    tokens = sum(len(x) for x in a)
    equal = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    return f"{equal}/{tokens} tokens equal"


def run_bench(started: float):
    import torch

    from engine.kernels import bench

    print("\n== kernel micro-benchmark (bytes each call must move / mean time, cold L2)", flush=True)
    device = torch.device("cuda")
    try:
        peak = bench.copy_bandwidth_gbps(device)
    except Exception as error:
        return ["kernel benchmark", "FAIL", f"copy benchmark: {type(error).__name__}: {error}"[:200]]
    rows, failures = [], 0
    for case in bench.all_cases(device):
        if time.monotonic() - started > BENCH_DEADLINE_S:
            rows.append([case.name, case.shape, "-", "-", "-", "-", "skipped: time budget"])
            continue
        try:
            r = bench.run(case)
        except Exception as error:
            failures += 1
            rows.append([case.name, case.shape, "-", "-", "-", "-", f"{type(error).__name__}: {error}"[:80]])
            continue
        rows.append([r.name, r.shape, f"{r.nbytes / 1e6:.1f}", f"{r.kernel_us:.1f}", f"{r.gbps():.0f}",
                     f"{100 * r.gbps() / peak:.0f}%", f"{r.reference_us:.1f} ({r.reference_us / r.kernel_us:.1f}x)"])
    print_table(f"kernels vs copy bandwidth {peak:.0f} GB/s (torch copy of 1 GiB, read + write)",
                ["kernel", "shape", "MB", "triton us", "GB/s", "of copy", "torch ref us (speedup)"], rows)
    return ["kernel benchmark", "INFO" if not failures else "FAIL",
            f"copy {peak:.0f} GB/s; {len(rows) - failures}/{len(rows)} cases ran"]


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for i, row in enumerate([header, *rows]):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
