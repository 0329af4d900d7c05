"""bench.model_work's matmul FLOP and byte counts against hand counts and checkpoints; bench.roofline's
yardsticks (GEMM peak, read rate) and the command."""

from __future__ import annotations

import json
import sys

import pytest

from bench import model_work, roofline
from tests.oracle import save_tiny_model

VOCAB = 320  # tests.oracle's tiny models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.models import load_model

    def load(name):
        path = tmp_path_factory.mktemp(name)
        save_tiny_model(name, path)
        return path, load_model(path)

    return {name: load(name) for name in ("llama", "jamba", "zamba2")}


# Hand counts in multiply-adds per token, from tests/oracle.py's configs.
# llama: hidden 64, 4 heads of 16 (2 KV heads), MLP 96, 2 layers.
LLAMA_ATTN_PROJ = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v, o
LLAMA_MLP = 3 * 64 * 96  # gate, up, down
LLAMA_PER_TOKEN = 2 * 2 * (LLAMA_ATTN_PROJ + LLAMA_MLP)
# jamba: 4 layers, Mamba (d_inner 128, d_state 8, dt_rank 8) + top-2-of-4 MoE at 0 and 2,
# attention + dense MLP at 1 and 3.
JAMBA_MAMBA = 64 * 256 + 128 * (8 + 2 * 8) + 8 * 128 + 128 * 64  # in, x, dt, out projections
JAMBA_MOE = 64 * 4 + 2 * (64 * 2 * 96 + 96 * 64)  # router, then two experts' gate+up and down
JAMBA_PER_TOKEN = 2 * 2 * (JAMBA_MAMBA + JAMBA_MOE + LLAMA_ATTN_PROJ + LLAMA_MLP)
PER_KEY = 2 * 2 * 4 * 16  # QK^T and AV, 4 heads of 16, per attention layer
LM_HEAD = 2 * 64 * VOCAB


@pytest.mark.parametrize("name, per_token", [("llama", LLAMA_PER_TOKEN), ("jamba", JAMBA_PER_TOKEN)])
def test_matmul_flops_matches_hand_count(tiny, name, per_token):
    model = tiny[name][1]
    assert model_work.flop_profile(model) == {"per_token": per_token, "attention": [(PER_KEY, None)] * 2,
                                            "lm_head": LM_HEAD}
    # Prompts of 5 and 3 (keys 1+..+5 and 1+2+3), decode tokens at contexts 7 and 9.
    expected = (per_token * (5 + 3 + 2) + 2 * PER_KEY * (15 + 6 + 7 + 9) + LM_HEAD * (2 + 2))
    assert model_work.matmul_flops(model, [5, 3], [7, 9]) == expected
    assert model_work.matmul_flops(model, [], []) == 0


# zamba2: hidden 32, 5 layers (Mamba2 at all, the shared block at 3 of them): Mamba2 with d_inner
# 64, 2 groups of d_state 8, 8 heads; the block reads [h | embeddings] (64) with 4 heads of 16,
# q/k/v adapters of rank 4, an MLP of 48 with its adapter, and each hybrid layer's own linear.
ZAMBA2_MAMBA2 = 32 * (2 * 64 + 2 * 2 * 8 + 8) + 64 * 32  # in_proj (z, xBC, dt), out_proj
ZAMBA2_BLOCK = (3 * 64 * 64 + 64 * 32 + 3 * (64 * 4 + 4 * 64)  # q, k, v, o, their adapters
                + 32 * 96 + (32 * 4 + 4 * 96) + 48 * 32 + 32 * 32)  # gate_up and its adapter, down, linear


def test_zamba2_counts_each_hybrid_use_of_the_shared_block(tiny):
    """The shared block's linears are held by reference (by each use's attention and hybrid
    layer), not as children: each hybrid layer applies them once, with its own adapters."""
    profile = model_work.flop_profile(tiny["zamba2"][1])
    assert profile == {"per_token": 2 * (5 * ZAMBA2_MAMBA2 + 3 * ZAMBA2_BLOCK),
                       "attention": [(2 * 2 * 4 * 16, None)] * 3, "lm_head": 2 * 32 * VOCAB}


def test_decode_contexts_cover_outputs_after_the_first():
    assert model_work.decode_contexts(2, 4, 3) == [5, 6, 5, 6]


def test_causal_keys_with_and_without_window():
    for length in (1, 5, 24, 40):
        for window in (None, 1, 7, 24, 100):
            brute = sum(min(i, window or i) for i in range(1, length + 1))
            assert model_work._causal_keys(length, window) == brute


def test_count_agrees_with_torch_flop_counter_on_engine_steps(tiny, monkeypatch):
    """torch's FlopCounterMode sees the engine's real matmuls (not its CPU SDPA): with the
    attention term added, a prefill step and a decode step come out the same as our count.
    (It does not see oneDNN's packed linears, so they are off here: the count is the model's.)"""
    from torch.utils.flop_counter import FlopCounterMode

    from engine import LLM, SamplingParams

    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    engine = LLM(tiny["llama"][0]).engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(3, 10)), params)
    engine.add_request(list(range(3, 8)), params)
    for prefill, decode, keys in (([7, 5], [], 28 + 15), ([], [8, 6], 8 + 6)):
        with FlopCounterMode(display=False) as counter:
            engine.step()
        seen = counter.get_total_flops() + 2 * PER_KEY * keys
        assert model_work.matmul_flops(engine.model, prefill, decode) == seen


@pytest.mark.parametrize("name, state_per_row, kv_per_key", [
    ("jamba", 2 * 4 * 128 * (8 + 4), [4 * 2 * 2 * 16] * 2),  # 2 Mamba layers: d_inner x (d_state + d_conv)
    ("zamba2", 5 * 4 * (8 * 8 * 8 + 96 * 4), [4 * 2 * 4 * 16] * 3),  # heads x head_dim x state, conv of x|B|C
    ("mistral_mqa_window", 0, [4 * 2 * 1 * 24] * 2),
])
def test_byte_profile_matches_the_checkpoint_and_hand_counts(tmp_path, name, state_per_row, kv_per_key):
    """Every tensor of the checkpoint once, but the embedding, the LM head and the experts, which
    count apart; the state and KV sizes from the configs by hand."""
    import math

    from safetensors import safe_open

    from engine.models import load_model

    save_tiny_model(name, tmp_path)
    model = load_model(tmp_path)
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        sizes = {key: 4 * math.prod(f.get_slice(key).get_shape()) for key in f.keys()}
    experts = sum(size for key, size in sizes.items() if ".experts." in key)
    weights = sum(size for key, size in sizes.items()
                  if ".experts." not in key and "embed" not in key and "lm_head" not in key)
    profile = model_work.byte_profile(model)
    assert profile["weights"] == weights
    assert sum(count * one for count, one, _ in profile["experts"]) == experts
    assert profile["lm_head"] == VOCAB * model.spec.hidden_size * 4
    assert profile["state_per_row"] == state_per_row
    assert [per_key for per_key, _ in profile["kv"]] == kv_per_key


def test_decode_step_bytes_by_hand(tiny, tmp_path):
    """llama: weights, LM head, two embedding rows, K and V of 7 + 9 keys and 2 writes per layer.
    jamba: all 4 experts of each MoE for 2 rows of top-2, 2 of them for one row; the state read
    and written. A sliding window caps the keys read."""
    from engine.models import load_model

    llama_weights = 2 * 4 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96 + 2 * 64) + 4 * 64
    assert model_work.decode_step_bytes(tiny["llama"][1], [7, 9]) == (
        llama_weights + 4 * 64 * VOCAB + 2 * 4 * 64 + 2 * 256 * (7 + 9 + 2))
    jamba = tiny["jamba"][1]
    expert = 4 * 3 * 64 * 96
    rest = model_work.byte_profile(jamba)["weights"] + 4 * 64 * VOCAB
    assert model_work.decode_step_bytes(jamba, [7, 9]) == (
        rest + 2 * 4 * expert + 2 * 4 * 64 + 2 * 256 * (7 + 9 + 2) + 2 * 2 * 12288)
    assert model_work.decode_step_bytes(jamba, [5]) == rest + 2 * 2 * expert + 4 * 64 + 2 * 256 * 6 + 2 * 12288
    assert model_work.decode_step_bytes(jamba, []) == 0
    save_tiny_model("mistral_mqa_window", tmp_path)
    mistral = load_model(tmp_path)
    base = model_work.decode_step_bytes(mistral, [24])
    assert model_work.decode_step_bytes(mistral, [30]) == base  # 24 keys either way
    assert model_work.decode_step_bytes(mistral, [23]) == base - 2 * 192
    steps = [model_work.decode_step_bytes(mistral, [c, c]) for c in (21, 22, 23)]
    assert model_work.decode_bytes(mistral, 2, 20, 4) == sum(steps)


def test_memory_bandwidth_is_positive():
    rate = roofline.memory_bandwidth(megabytes=8, repeats=2, min_time_s=0.005)
    assert rate["gbps"] > 0 and rate["megabytes"] == 8 and rate["threads"] >= 1


def test_gemm_peak_is_positive():
    peak = roofline.gemm_peak(((64, 64, 64), (32, 128, 64)), repeats=2, min_time_s=0.005)
    assert peak["gflops"] > 0 and set(peak["shapes"]) == {"64x64x64", "32x128x64"}
    assert peak["gflops"] == max(peak["shapes"].values()) and peak["threads"] >= 1
    for shape, rates in peak["by_backend"].items():  # the best of torch.mm, oneDNN and ours, per shape
        assert peak["shapes"][shape] == max(rates.values()) and set(rates) <= {"mm", "onednn", "splitserve"}


def test_roofline_command_quick(tmp_path, capsys, monkeypatch):
    """With vLLM's link pointed at the stand-in (tests/vllm_stand_in.py): a vllm row per phase."""
    from bench.checkpoints import build_checkpoint
    from bench.cli import main
    from tests.vllm_stand_in import stand_in_env

    model = tmp_path / "model"
    build_checkpoint("jamba-test", model)
    out = tmp_path / "out.json"
    monkeypatch.setenv("PYTHONPATH", stand_in_env(tmp_path)["PYTHONPATH"])
    assert main(["roofline", "--model", str(model), "--quick", "--json", str(out),
                 "--vllm-python", sys.executable]) == 0
    result = json.loads(out.read_text())
    assert result["peak_gflops"] > 0 and result["workload"]["prefill_num"] == 2
    assert result["vllm"] == "vllm 0.0.stand-in"
    for phase in ("prefill", "decode"):
        entry = result[phase]
        assert entry["gflop"] > 0 and entry["ratio_ours_over_transformers"] > 0
        assert entry["ratio_ours_over_torch_ops"] > 0
        for system in ("ours", "ours-torch", "transformers"):
            e = entry[system]
            assert set(e) >= {"wall_s", "gflop", "gflops", "mfu"} and e["wall_s"] > 0
            assert 0 < e["mfu"] < 1.5
            assert ("mbu" in e) == (phase == "decode")
        if phase == "decode":
            assert entry["ours"]["gbytes"] > 0 and entry["ours"]["mbu"] > 0
            assert entry["floor_s"]["matmuls_at_peak"] > 0 and entry["floor_s"]["bytes_at_read_rate"] > 0
        # the stand-in answers at once, so its times say nothing: only that the row is there
        assert set(entry["vllm"]) >= {"wall_s", "gflop", "mfu"} and entry["vllm"]["gflop"] == entry["gflop"]
    table = capsys.readouterr().out
    assert "peak fp32 GEMM" in table and "ours/HF MFU" in table and "ours/torch-op" in table and "vllm:" in table
    assert result["memory_gbps"] > 0 and "memory read" in table and "MBU" in table and "decode floors" in table
