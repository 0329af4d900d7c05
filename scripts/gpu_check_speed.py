"""gpu_check's speed step: one model per layer kind (bf16, random weights, 4 layers at hidden
2048), an 8k-token prefill and a batch-64 decode step, each against its floor: decode against
the bytes it must move at the device's copy bandwidth, prefill against its matmul FLOPs at the
device's bf16 matmul rate (both measured in the same run). Dry run: tiny models on CPU."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

HIDDEN, LAYERS, VOCAB = 2048, 4, 32000
PREFILL_TOKENS, DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS = 8000, 64, 1024, 16  # 8000 + 1 fits 8192


def _configs(hidden: int, layers: int, vocab: int) -> dict:
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    heads = max(2, hidden // 128)
    return {
        "attention (llama)": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
            intermediate_size=hidden * 11 // 4, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
            max_position_embeddings=16384)),
        "mamba": (tf.MambaConfig, tf.MambaForCausalLM, dict(state_size=16, expand=2)),
        "mamba2": (tf.Mamba2Config, tf.Mamba2ForCausalLM, dict(
            num_heads=2 * hidden // 64, head_dim=64, state_size=128, n_groups=8 if hidden >= 1024 else 1, expand=2,
            chunk_size=256)),
        "gated deltanet (qwen3_next)": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(
            intermediate_size=hidden * 3, layer_types=["linear_attention"] * layers, mlp_only_layers=list(range(layers)),
            linear_num_key_heads=max(1, hidden // 256), linear_num_value_heads=max(2, hidden // 128),
            linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 4), max_position_embeddings=16384)),
        "short conv (lfm2)": (tf.Lfm2Config, tf.Lfm2ForCausalLM, dict(
            intermediate_size=hidden * 4, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
            layer_types=["conv"] * layers, max_position_embeddings=16384)),
    }, common


def _save(kind: str, folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    configs, common = _configs(hidden, layers, vocab)
    config_cls, model_cls, extra = configs[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common, **extra)).to(torch.bfloat16)
    path = folder / kind.split()[0]
    model.save_pretrained(path)
    return path


def matmul_tflops(device) -> float:
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, warmup=25, rep=100)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def run_speed(dry_run: bool) -> dict:
    from bench.kernels import copy_bandwidth_gbps
    from bench.model_work import decode_step_bytes, matmul_flops
    from engine import LLM, SamplingParams

    device = torch.device("cpu" if dry_run else "cuda")
    hidden, layers, vocab = (64, 2, 512) if dry_run else (HIDDEN, LAYERS, VOCAB)
    prefill_tokens, batch, context, steps = (64, 4, 32, 2) if dry_run else (
        PREFILL_TOKENS, DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS)
    bandwidth = None if dry_run else copy_bandwidth_gbps(device)
    tflops = None if dry_run else matmul_tflops(device)
    rows, failed = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in _configs(hidden, layers, vocab)[0]:
            try:
                path = _save(kind, Path(tmp), hidden, layers, vocab)
                llm = LLM(path, device=device.type, dtype="bfloat16" if not dry_run else "float32",
                          max_num_seqs=batch, max_num_batched_tokens=prefill_tokens, block_size=16,
                          max_model_len=prefill_tokens + 64, num_kv_blocks=batch * (context + 64) // 16 + 1024)
                engine, rng = llm.engine, torch.Generator().manual_seed(0)
                once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                llm.generate([[5] * 64], once)  # compile on a short prompt
                prompt = torch.randint(3, vocab, (prefill_tokens,), generator=rng).tolist()
                sync()
                started = time.perf_counter()
                llm.generate([prompt], once)
                sync()
                prefill_s = time.perf_counter() - started
                params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
                for _ in range(batch):
                    engine.add_request(torch.randint(3, vocab, (context,), generator=rng).tolist(), params)
                while any(r.num_output_tokens == 0 for r in engine.requests.values()):
                    engine.step()
                engine.step()  # the first all-decode step (graph replay warm)
                sync()
                started = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                sync()
                step_s = (time.perf_counter() - started) / steps
                contexts = [r.num_tokens for r in engine.requests.values()]
                flops = matmul_flops(engine.model, [prefill_tokens], [])
                nbytes = decode_step_bytes(engine.model, contexts)
                prefill_floor = flops / (tflops * 1e12) if tflops else None
                decode_floor = nbytes / (bandwidth * 1e9) if bandwidth else None
                rows.append([kind, f"{prefill_s * 1e3:.1f}", f"{prefill_tokens / prefill_s:,.0f}",
                             f"{prefill_floor / prefill_s:.0%}" if prefill_floor else "-",
                             f"{step_s * 1e3:.2f}", f"{nbytes / 2**20:.0f}",
                             f"{decode_floor / step_s:.0%}" if decode_floor else "-"])
                while engine.has_unfinished():
                    engine.step()
                del llm, engine
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as error:
                failed.append(kind)
                rows.append([kind, f"{type(error).__name__}: {error}"[:90], "", "", "", "", ""])
    header = ["layer kind", f"prefill {prefill_tokens} ms", "tokens/s", "of FLOP floor",
              f"decode step x{batch} ms", "MiB moved", "of byte floor"]
    rates = "" if dry_run else f"; device: copy {bandwidth:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s"
    return {"result": "FAIL" if failed else "INFO",
            "summary": f"{len(rows) - len(failed)}/{len(rows)} layer kinds timed{rates}",
            "tables": [{"title": f"speed per layer kind ({'tiny, CPU' if dry_run else f'{layers} layers, hidden {hidden}, bf16'}; "
                                 f"decode at context {context})", "header": header, "rows": rows}]}
