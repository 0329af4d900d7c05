#!/usr/bin/env python
"""GPU check: what the GPU path must do, checked on one GPU without Ray, in under 9 minutes.

    python scripts/gpu_check.py [--dry-run] [--steps env,kernels,...] [--report PATH]

Steps (scripts/gpu_check_steps.py), each in its own process with its own time limit:
  env       versions, compute capability; NCCL loaded, a unique id, a one-rank communicator,
            a send/recv on a torch stream
  kernels   the Triton kernel tests compiled; every kernel at realistic shapes in bf16 and
            float32 against its reference (error, compile time) and the device's bandwidth
  engine    LLM(cuda) in float32 and bf16 against LLM(cpu) on every zoo family, judged by the
            tie rule, with a prompt longer than the step budget and a prefix-cache repeat;
            bf16 with FP8 KV and bf16 state runs (tokens against plain bf16, for information);
            no C++ CPU library built by a CUDA engine
  graphs    CUDA-graph replay equal to eager bit for bit (dense and MoE hybrids)
  handoff   a prefill worker handing off to a decode worker in another process on the same
            GPU over staged shm, outputs equal to the colocated engine
  speed     per layer kind, an 8k-token prefill and a batch-64 decode step against the floors
            of bytes moved at the device's bandwidth and FLOPs at its matmul rate
--dry-run runs every step's non-CUDA part on CPU (CI does). Prints one table, writes a JSON
report. Exit status: 0 all passed; 1 a step failed; 2 no CUDA device (and not --dry-run).
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
LIMITS_S = {"env": 60, "engine": 150, "handoff": 100, "graphs": 130, "kernels": 280, "speed": 130}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the non-CUDA part of every step, on CPU")
    parser.add_argument("--steps", default=",".join(LIMITS_S), help="comma-separated subset of the steps")
    parser.add_argument("--report", default=None, help="JSON report path (default: gpu_check.json here)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole check: a step gets its own limit or what is left")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.dry_run)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing was checked (--dry-run checks the rest on CPU)")
        return 2
    steps = [s for s in args.steps.split(",") if s]
    unknown = set(steps) - set(LIMITS_S)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {', '.join(LIMITS_S)}")
    started, report = time.monotonic(), {"dry_run": args.dry_run, "steps": {}}
    for step in steps:
        left = args.budget - (time.monotonic() - started)
        if left < 15:
            report["steps"][step] = {"result": "FAIL", "summary": "not run: the time budget is spent", "seconds": 0}
            continue
        result = run_step(step, args.dry_run, min(LIMITS_S[step], left))
        report["steps"][step] = result
        print_result(step, result)
    report["seconds"] = round(time.monotonic() - started, 1)
    rows = [[step, r["result"], r["summary"][:110], f"{r['seconds']:.0f}"] for step, r in report["steps"].items()]
    print_table("gpu_check" + (" --dry-run (CPU)" if args.dry_run else ""), ["step", "result", "summary", "s"], rows)
    print(f"gpu_check: {report['seconds']:.0f} s", flush=True)
    Path(args.report or "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(r["result"] in ("PASS", "INFO") for r in report["steps"].values()) else 1


def run_step(step: str, dry_run: bool, limit_s: float) -> dict:
    """The step in a child process; its last stdout line is its JSON result."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", step] + (["--dry-run"] if dry_run else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
        output, code = done.stdout, done.returncode
        stderr = done.stderr
    except subprocess.TimeoutExpired as timeout:
        output = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else (timeout.stdout or "")
        stderr = timeout.stderr.decode() if isinstance(timeout.stderr, bytes) else (timeout.stderr or "")
        code = None
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if lines:
        result = json.loads(lines[-1][len("RESULT "):])
    elif code is None:
        result = {"result": "FAIL", "summary": f"timed out after {limit_s:.0f} s"}
    else:
        result = {"result": "FAIL", "summary": f"exited {code} without a result"}
    if result["result"] == "FAIL" or not lines:
        result["log_tail"] = (output[-2500:] + "\n" + stderr[-2500:]).strip()
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def child(step: str, dry_run: bool) -> int:
    sys.path.insert(0, str(ROOT))
    import traceback

    from scripts import gpu_check_steps

    try:
        result = getattr(gpu_check_steps, f"step_{step}")(dry_run)
    except Exception as error:  # reported, not raised: the parent prints the table either way
        result = {"result": "FAIL", "summary": f"{type(error).__name__}: {error}"[:300],
                  "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0


def print_result(step: str, result: dict) -> None:
    print(f"\n== {step}: {result['result']} ({result['seconds']:.0f} s) {result['summary']}", flush=True)
    for table in result.get("tables", []):
        print_table(table["title"], table["header"], table["rows"])
    if "log_tail" in result:
        print(result["log_tail"])
    if "traceback" in result:
        print(result["traceback"])


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    for i, row in enumerate([header, *rows]):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
