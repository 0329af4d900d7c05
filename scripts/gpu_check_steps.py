"""The steps of scripts/gpu_check.py: each returns {"result", "summary", "tables"}; with
dry_run=True the same code runs on CPU at small sizes (CI runs it so)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = ["jamba", "mamba", "llama", "mistral_mqa_window", "mamba2", "bamba", "granitemoehybrid", "nemotron_h",
       "nemotron_h_latent", "falcon_h1", "zamba2", "qwen3_next", "lfm2", "lfm2_moe", "olmo_hybrid", "kimi_linear"]
MAMBA2_NORM_FAMILIES = {"mamba2", "bamba", "granitemoehybrid"}  # Mamba2's gated norm, by n_groups


def _table(title, header, rows) -> dict:
    return {"title": title, "header": header, "rows": rows}


def _device(dry_run: bool):
    import torch

    return torch.device("cpu" if dry_run else "cuda")


def _pytest(files: list[str], marker: str, limit_s: int) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "SPLITSERVE_FORCE_TRITON", "SPLITSERVE_DISABLE_TRITON")}
    env["SPLITSERVE_TRITON_ON_GPU"] = "1"  # tests/conftest.py otherwise selects the interpreter
    command = [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", *files]
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {limit_s} s"
    lines = [line for line in (done.stdout + done.stderr).strip().splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    if done.returncode != 0:
        print("\n".join(lines[-60:]))
    return done.returncode == 0 and "passed" in summary, summary


# ---------------------------------------------------------------- env

def step_env(dry_run: bool) -> dict:
    import platform

    import torch

    from kvtransfer import nccl

    rows = [["python", platform.python_version()], ["torch", torch.__version__],
            ["CUDA (torch)", str(torch.version.cuda)], ["triton", _version("triton")],
            ["transformers", _version("transformers")]]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows += [["device", f"{torch.cuda.device_count()} x {props.name}"],
                 ["compute capability", f"{props.major}.{props.minor}"],
                 ["memory", f"{props.total_memory / 2**30:.1f} GiB"]]
    lib = nccl.load_library()
    uid = lib.unique_id()
    rows += [["NCCL", f"{'.'.join(map(str, lib.version()))} from {lib.path}"], ["NCCL unique id", f"{len(uid)} bytes"]]
    if dry_run:
        return {"result": "PASS", "summary": f"NCCL {lib.version()} loaded, unique id (no GPU: no communicator)",
                "tables": [_table("environment", ["what", "value"], rows)]}
    comm = nccl.NcclCommunicator(uid, 0, 1, torch.device("cuda", 0), lib)
    try:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        y = torch.zeros_like(x)
        stream = torch.cuda.Stream()
        raw = lib.raw()
        with torch.cuda.stream(stream), comm.group():  # a one-rank communicator sends to itself
            lib.check(raw.ncclSend(x.data_ptr(), x.numel(), nccl.nccl_dtype(x.dtype), 0, comm._comm,
                                   stream.cuda_stream), "ncclSend")
            lib.check(raw.ncclRecv(y.data_ptr(), y.numel(), nccl.nccl_dtype(y.dtype), 0, comm._comm,
                                   stream.cuda_stream), "ncclRecv")
        stream.synchronize()
        equal = bool(torch.equal(x, y))
    finally:
        comm.destroy()
    rows.append(["NCCL send/recv (1 rank, torch stream)", "equal" if equal else "DIFFERENT"])
    return {"result": "PASS" if equal else "FAIL", "summary": f"NCCL {lib.version()}: communicator and send/recv "
            f"{'ok' if equal else 'wrong'}", "tables": [_table("environment", ["what", "value"], rows)]}


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "not installed"


# ---------------------------------------------------------------- kernels

def step_kernels(dry_run: bool) -> dict:
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    from bench import kernels

    tests_ok, tests = (True, "not run (CI runs them under the interpreter)") if dry_run else _pytest(
        ["tests/test_kernels.py", "tests/test_kernels_mamba2.py", "tests/test_kernels_gdn.py",
         "tests/test_kernels_mamba1_scan.py", "tests/test_kernels_fp8.py", "tests/test_state_format.py",
         "tests/test_kv_format.py", "tests/test_mla.py", "tests/test_narrow_in_place.py", "tests/test_slot_runs.py"],
        "triton", 120)
    if not dry_run:  # torch's paged varlen prefill attention against its reference (CUDA only)
        field_ok, field = _pytest(["tests/test_varlen_attention.py", "tests/test_fla_rule.py",
                                   "tests/test_fp8_linear.py", "tests/test_fp8_experts.py", "tests/test_mtp.py",
                                   "tests/test_prefix_exchange.py"],
                                  "gpu", 120)
        tests_ok, tests = tests_ok and field_ok, \
            f"{tests}; varlen attention, fla, FP8 linears and experts, MTP, prefix fetch: {field}"
    device = _device(dry_run)
    peak = None if dry_run else kernels.copy_bandwidth_gbps(device)
    rows, failed = [], []
    for dtype in (torch.bfloat16, torch.float32):
        for case in kernels.all_cases(device, dtype, scale=64 if dry_run else 1):
            try:
                checked = kernels.check(case)
                timing = ["-", "-", "-", "-"]
                if peak is not None and dtype == torch.bfloat16:  # timed at the serving dtype
                    r = kernels.run(case)
                    timing = [f"{r.kernel_us:.1f}", f"{r.gbps():.0f}", f"{100 * r.gbps() / peak:.0f}%",
                              f"{r.reference_us:.1f} ({r.reference_us / r.kernel_us:.1f}x)"]
                ok = checked.ok()
                rows.append([case.name, case.dtype, case.shape, f"{checked.compile_s:.2f}",
                             f"{checked.error:.1e}/{checked.scale:.1e}", "ok" if ok else "WRONG", *timing])
            except Exception as error:
                ok = False
                rows.append([case.name, case.dtype, case.shape, "-", f"{type(error).__name__}: {error}"[:60],
                             "ERROR", "-", "-", "-", "-"])
            if not ok:
                failed.append(f"{case.name} {case.dtype}")
            del case
    header = ["kernel", "dtype", "shape", "first call s", "max err/max ref", "vs ref", "triton us", "GB/s",
              f"of copy {peak:.0f} GB/s" if peak else "of copy", "torch ref us"]
    ok = tests_ok and not failed
    summary = f"tests: {tests}; {len(rows) - len(failed)}/{len(rows)} cases match their references"
    if failed:
        summary += f" (not: {', '.join(failed[:4])})"
    return {"result": "PASS" if ok else "FAIL", "summary": summary,
            "tables": [_table("kernels against their references" + ("" if dry_run else " and the bandwidth"),
                              header, rows)]}


# ---------------------------------------------------------------- engine

ENGINE_OPTIONS = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=96)
ENGINE_PROMPTS = [[5, 6, 7], [9], list(range(3, 60))]  # 57 tokens: chunked over two steps and more
# a pool that the fillers of _tokens(through_tiers=True) evict, and a host tier that keeps it
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,  # drafts from any repeat
         "adaptive": False}  # in every step, whatever they measure
TIER_OPTIONS = {**ENGINE_OPTIONS, "num_kv_blocks": 40, "max_num_seqs": 2, "enable_prefix_caching": True,
                "prefix_checkpoints": 2, "host_cache_bytes": 1 << 24}


def step_engine(dry_run: bool) -> dict:
    kernel_cache = tempfile.mkdtemp(prefix="splitserve-kernels-")
    os.environ["SPLITSERVE_KERNEL_CACHE"] = kernel_cache  # empty: a CUDA engine must build nothing into it
    from engine import LLM, SamplingParams
    from engine.kernels import native
    from tests import oracle

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    device = "cpu" if dry_run else "cuda"
    names = ZOO[:3] if dry_run else ZOO
    trusted = _mamba2_norm_is_grouped()
    rows, failures, runs = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name in names:
            try:
                models[name] = oracle.save_tiny_model(name, Path(tmp) / name)
            except Exception as error:  # an older transformers without the config's fields
                rows.append([name, f"not built by this transformers: {type(error).__name__}: {error}"[:100], "", ""])
        names = [name for name in names if name in models]
        for name in names:  # the GPU engines first: nothing may have built the CPU library yet
            path = Path(tmp) / name
            runs[name] = {
                "f32": _tokens_or_error(lambda: LLM(path, device=device, dtype="float32", **ENGINE_OPTIONS), params),
                "bf16": _tokens_or_error(lambda: LLM(path, device=device, dtype="bfloat16", **ENGINE_OPTIONS), params),
                "prefix": _tokens_or_error(lambda: LLM(path, device=device, dtype="float32", enable_prefix_caching=True,
                                                       **ENGINE_OPTIONS), params, twice=True),
                # the host tier's page-locked buffer and its queued copies (docs/gpu.md)
                "tiers": _tokens_or_error(lambda: LLM(path, device=device, dtype="float32", **TIER_OPTIONS), params,
                                          through_tiers=True),
                # the cache formats' torch path (docs/cache-formats.md), captured graphs included
                "formats": _tokens_or_error(lambda: LLM(path, device=device, dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                                                        mamba_state_dtype="bfloat16", **ENGINE_OPTIONS), params),
                # verify steps of k+1 rows a request and the recurrent state's rollback (engine.verify)
                "spec": _tokens_or_error(lambda: LLM(path, device=device, dtype="float32", speculative_config=NGRAM,
                                                     **ENGINE_OPTIONS), params, speculating=True),
            }
        built = native.library.cache_info().currsize > 0 or any(Path(kernel_cache).iterdir())
        if not dry_run and built:
            failures.append("a CUDA engine built the C++ CPU library")
        os.environ["SPLITSERVE_DISABLE_CPU_KERNELS"] = "1"  # the CPU references on torch ops: no build to wait for
        for name in names:
            path, hf = Path(tmp) / name, models[name]
            cpu = _tokens(LLM(path, device="cpu", dtype="float32", **ENGINE_OPTIONS), params)
            row = [name]
            for kind in ("f32", "prefix", "tiers", "spec"):
                ours = runs[name][kind]
                verdict = ours if isinstance(ours, str) else judge(
                    hf, ENGINE_PROMPTS, cpu, ours, trust=trusted or name not in MAMBA2_NORM_FAMILIES)
                row.append(verdict)
                if not verdict.startswith(("equal", "ties")):
                    failures.append(f"{name} {kind}: {verdict}")
            for kind, against, what in (("bf16", cpu, "float32 CPU"), ("formats", runs[name]["bf16"], "bf16")):
                ours = runs[name][kind]
                if isinstance(ours, str):
                    failures.append(f"{name} {kind}: {ours}")
                    row.append(ours)
                    continue
                if isinstance(against, str):  # the bf16 run failed: counted once, there
                    row.append("-")
                    continue
                equal = sum(a == b for x, y in zip(ours, against) for a, b in zip(x, y))
                row.append(f"{equal}/{sum(map(len, against))} tokens as {what} (info)")
            rows.append(row)
    header = ["family", f"LLM({device}) float32 vs LLM(cpu)", "prefix cache, prompts twice",
              "host tier, prompts again after eviction", "n-gram speculation", f"LLM({device}) bf16",
              "bf16, FP8 KV e4m3 + bf16 state"]
    note = "" if trusted else "; transformers here normalises Mamba2's gated norm over the full width, so " \
                              "mamba2/bamba/granite are judged by equality to the CPU engine only"
    summary = (f"{len(names) - len({f.split()[0] for f in failures})}/{len(names)} families equal the CPU "
               f"engine or differ only at ties{note}; C++ CPU library built by CUDA engines: "
               f"{'n/a (dry run)' if dry_run else 'yes' if built else 'no'}")
    if failures:
        summary += f"; failed: {'; '.join(failures[:3])}"
    return {"result": "FAIL" if failures else "PASS", "summary": summary,
            "tables": [_table("engine on the device against the CPU engine (tie rule: transformers)", header, rows)]}


def _tokens(llm, params, twice: bool = False, through_tiers: bool = False,
            speculating: bool = False) -> list[list[int]]:
    outs = llm.generate(ENGINE_PROMPTS, params)
    if speculating and llm.engine.stats()["spec_drafts"] == 0:
        raise RuntimeError("no step verified a draft")
    if twice:  # the second run reads the first's prefix blocks and state checkpoints
        outs = llm.generate(ENGINE_PROMPTS, params)
    if through_tiers:  # fillers evict the prompts' prefixes to the host tier; the prompts load them back
        llm.generate([list(range(100 + i, 160 + i)) for i in range(4)], params)
        outs = llm.generate(ENGINE_PROMPTS, params)
        if llm.engine.stats()["tier_host_hits"] == 0:
            raise RuntimeError("no prefix came back from the host tier")
    for out in outs:
        if out.error is not None:
            raise RuntimeError(f"engine error: {out.error}")
    llm.engine.close()
    return [out.token_ids for out in outs]


def _tokens_or_error(make, params, twice: bool = False, through_tiers: bool = False, speculating: bool = False):
    try:
        return _tokens(make(), params, twice, through_tiers, speculating)
    except Exception as error:  # one family's failure must not hide the others'
        return f"ERROR {type(error).__name__}: {error}"[:150]


def judge(hf, prompts, reference: list[list[int]], ours: list[list[int]], trust: bool = True) -> str:
    """"equal", "ties only" (where they differ, transformers finds a genuine near-tie), or why not."""
    from tests import oracle

    if ours == reference:
        return "equal"
    if not trust:
        return "DIFFERENT (no trusted oracle here)"
    try:
        for prompt, a, b in zip(prompts, ours, reference):
            oracle.assert_same_tokens(hf, prompt, a, b)
    except AssertionError as error:
        return f"WRONG: {error}"[:160]
    return "ties only (judged by transformers)"


def _mamba2_norm_is_grouped() -> bool:
    """transformers before 5.2x normalised Mamba2's gated RMSNorm over the whole width; the
    engine (as mamba-ssm and later transformers) normalises each of the n_groups groups."""
    import inspect

    from transformers.models.mamba2 import modeling_mamba2 as m

    norm = getattr(m, "Mamba2RMSNormGated", None) or m.MambaRMSNormGated
    return "group_size" in inspect.signature(norm.__init__).parameters


# ---------------------------------------------------------------- graphs

GRAPH_FAMILIES = ["bamba", "lfm2", "jamba", "qwen3_next", "nemotron_h", "granitemoehybrid"]  # dense, then MoE


def step_graphs(dry_run: bool) -> dict:
    from engine import LLM, SamplingParams
    from tests import oracle

    tests_ok, tests = (True, "not run (CUDA only)") if dry_run else _pytest(
        ["tests/test_static_decode.py"], "gpu", 100)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in GRAPH_FAMILIES[:2] + GRAPH_FAMILIES[2:3] if dry_run else GRAPH_FAMILIES:
            path = Path(tmp) / name
            try:
                oracle.save_tiny_model(name, path)
            except Exception as error:
                rows.append([name, f"not built by this transformers: {error}"[:80], "-"])
                continue
            options = dict(device="cpu" if dry_run else "cuda", dtype="float32", **ENGINE_OPTIONS)
            try:
                graphs = LLM(path, **options)
                if dry_run:
                    graphs.engine.runner.use_static_decode(capture=False)
                static = graphs.engine.runner.static
                replayed = _tokens(graphs, params)
                eager = _tokens(LLM(path, enforce_eager=True, **options), params)
            except Exception as error:
                failed.append(name)
                rows.append([name, f"ERROR {type(error).__name__}: {error}"[:100], "-"])
                continue
            captured = sorted(size for runs, size in static.graphs if not runs) if static is not None else []
            same = replayed == eager
            if not same or (not dry_run and not captured):
                failed.append(name)
            rows.append([name, ", ".join(map(str, captured)) or (static.eager_reason if static else "no static path"),
                         "equal" if same else "DIFFERENT"])
    ok = tests_ok and not failed
    return {"result": "PASS" if ok else "FAIL",
            "summary": f"replay == eager bit for bit: {tests}; engines: {len(rows) - len(failed)}/{len(rows)} "
                       + ("on the static path (not captured on CPU)" if dry_run else "captured")
                       + " and token-identical to eager",
            "tables": [_table("CUDA graphs per padded batch size", ["family", "captured sizes",
                                                                    "tokens vs enforce_eager"], rows)]}


# ---------------------------------------------------------------- handoff and speed

def step_handoff(dry_run: bool) -> dict:
    from scripts.gpu_check_handoff import run_handoff

    return run_handoff(dry_run)


def step_speed(dry_run: bool) -> dict:
    from scripts.gpu_check_speed import run_speed

    return run_speed(dry_run)
