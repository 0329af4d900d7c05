"""KV blocks stored in FP8 (engine.kv_format, kv_cache_dtype fp8_e4m3 / fp8_e5m2).

As for narrow state (tests/test_state_format.py), the oracle is the engine in the model's dtype,
itself held to transformers by the rest of the suite: with the same (dequantized) context an FP8
layer must compute exactly what the plain layer computes, and store exactly the quantization of
what it wrote, for every family with attention (MLA's latent rows, normed and shared attention
included). What the format then changes is drift, measured by `splitserve bench quant`.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.kernel_support import DEVICE, enter_kernel_mode  # first: it sets Triton's mode
from safetensors.torch import load_file, save_file

from bench.quant import forced_logits
from engine import LLM, SamplingParams
from engine.cache import plan_cache
from engine.config import EngineConfig
from engine.kernels import _triton
from engine.kernels.kv_fp8 import kv_load_triton, kv_store_rows_triton, kv_store_triton
from engine.kv_format import dequantize, quantize, scale_tensor
from engine.llm_engine import LLMEngine
from engine.models import CheckpointError
from kvtransfer import CacheTensors, LayoutMismatchError
from tests.test_handoff_engine import run_disaggregated

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ATTENTION_FAMILIES = ["jamba", "llama", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2", "lfm2",
                      "qwen3_next", "lfm2_moe", "olmo_hybrid", "kimi_linear"]


def with_kv_scales(source, target, scales: dict[int, tuple], scheme: bool = True):
    """A copy of checkpoint `source` whose attention layers carry k_scale / v_scale tensors
    (each a number, or a list of one per KV head)."""
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    for layer, (k, v) in scales.items():
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(weights, target / "model.safetensors")
    if scheme:
        per_head = any(isinstance(scale, list) for pair in scales.values() for scale in pair)
        config = json.loads((target / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "compressed-tensors",
                                         "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                             "strategy": "attn_head" if per_head else "tensor",
                                                             "dynamic": False, "symmetric": True}}
        (target / "config.json").write_text(json.dumps(config))
    return target


def blocks_of(engine: LLMEngine, request_id: str) -> list[int]:
    return list(engine.blocks.table(request_id))


@pytest.mark.parametrize("family", ATTENTION_FAMILIES)
def test_an_fp8_layer_computes_and_stores_exactly_what_the_plain_layer_would(family, model_factory):
    """Prefill, then decode steps. Before each decode step the plain engine's blocks are given the
    FP8 engine's (dequantized) rows and its recurrent state; then both steps' logits must be equal
    bit for bit, and the FP8 pool must hold exactly the quantization of the plain pool's rows."""
    path, _ = model_factory(family)
    prompt = [random.Random(3).randrange(3, 300) for _ in range(13)]
    plain = LLMEngine(EngineConfig(str(path), block_size=4))
    fp8 = LLMEngine(EngineConfig(str(path), block_size=4, kv_cache_dtype="fp8_e4m3"))
    assert all(t.dtype == torch.float8_e4m3fn for _, t in fp8.cache.block_tensors())
    # every attention layer may read its blocks in place in an all-decode step on Triton
    assert all("kv" in fp8.model.in_place_readers(i) for i in fp8.spec.attention_layers)
    assert fp8.cache.sizes.bytes_per_block * 4 == plain.cache.sizes.bytes_per_block
    logits = {}
    for engine in (plain, fp8):
        engine.add_request(prompt, GREEDY, request_id="r")
        execute = engine.runner.execute
        engine.runner.execute = lambda seqs, e=engine, run=execute: logits.setdefault(id(e), []).append(
            run(seqs).clone()) or logits[id(e)][-1]
    for step in range(4):
        if step:  # the plain engine resumes from exactly what the FP8 engine holds
            for (_, p), (_, q) in zip(plain.cache.block_tensors(), fp8.cache.block_tensors()):
                ids = torch.tensor(blocks_of(fp8, "r"))
                p[torch.tensor(blocks_of(plain, "r"))] = dequantize(q.view(torch.uint8)[ids].view(q.dtype), 1.0,
                                                                    torch.float32)
            slot_p, slot_q = plain.slots.slot_of["r"], fp8.slots.slot_of["r"]
            for (_, p), (_, q) in zip(plain.cache.slot_tensors(), fp8.cache.slot_tensors()):
                p[slot_p] = q[slot_q]
        plain.step()
        fp8.step()
        assert torch.equal(logits[id(plain)][-1], logits[id(fp8)][-1]), f"step {step}"
        tokens = len(prompt) + step
        table_p, table_q = blocks_of(plain, "r"), blocks_of(fp8, "r")
        for (_, p), (_, q) in zip(plain.cache.block_tensors(), fp8.cache.block_tensors()):
            for position in range(tokens):
                wrote = p[table_p[position // 4], position % 4]
                held = q.view(torch.uint8)[table_q[position // 4], position % 4]
                assert torch.equal(held, quantize(wrote, 1.0, q.dtype).view(torch.uint8)), (step, position)


def test_quantization_saturates_scales_and_round_trips_within_the_format():
    x = torch.tensor([0.0, 0.3, -1.7, 5e5, -5e5, 1e-3])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = quantize(x, 0.5, dtype)
        assert q.dtype == dtype and bool(torch.isfinite(q.float()).all())  # saturated, not inf or nan
        back = dequantize(q, 0.5, torch.float32)
        assert float(back[3]) == torch.finfo(dtype).max * 0.5 and float(back[4]) == -torch.finfo(dtype).max * 0.5
        mantissa = 3 if dtype == torch.float8_e4m3fn else 2
        inside = x.abs() < 100
        assert bool(((back - x).abs() <= x.abs() * 2.0 ** -mantissa + 1e-3)[inside].all())


@pytest.mark.triton
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("as_bytes", [False, True], ids=["float8", "bytes"])
def test_the_triton_load_and_store_are_the_torch_path_bit_for_bit(fp8, per_head, compute, as_bytes, monkeypatch):
    """The one-pass load and store CUDA runs (engine.kernels.kv_fp8), compiled on a GPU, under the
    interpreter here: blocks of [4 tokens, 2 heads, 96] with values that saturate, a block table
    that repeats its padding block, and every block and token row outside them left as it was.
    `bytes`: the pool moved as bytes, as on a GPU whose Triton has no e4m3 type."""
    if not _triton.available():
        pytest.skip("Triton is not installed")
    enter_kernel_mode()
    monkeypatch.setenv("SPLITSERVE_FP8_AS_BYTES", str(int(as_bytes)))
    generator = torch.Generator().manual_seed(3)
    largest = torch.finfo(fp8).max
    scale = scale_tensor((0.37, 2.5), "cpu") if per_head else 0.61
    values = torch.randn(6, 4, 2, 96, generator=generator) * largest / 4
    values[1, 0, 0, :4] = torch.tensor([0.0, -0.0, 3 * largest, -3 * largest])  # zeros keep their sign; saturated
    tiny = torch.finfo(fp8).smallest_normal  # a block of the format's subnormals and smallest normals
    values[3] = torch.randn(4, 2, 96, generator=generator) * tiny
    pool = quantize(values, scale, fp8)
    blocks, written = torch.tensor([3, 1, 0, 0, 5]), torch.tensor([4, 5, 6, 13, 14, 22])
    device_scale = scale if isinstance(scale, float) else scale.to(DEVICE)

    working = torch.full((6, 4, 2, 96), 9.0, dtype=compute).to(DEVICE)
    kv_load_triton(pool.to(DEVICE), blocks.to(DEVICE), working, device_scale)
    want = torch.full((6, 4, 2, 96), 9.0, dtype=compute)
    want[blocks] = dequantize(pool[blocks], scale, compute)
    assert torch.equal(working.cpu().view(torch.int8), want.view(torch.int8))

    rows = torch.randn(6, 4, 2, 96, generator=generator) * largest / 3
    rows[3] = torch.randn(4, 2, 96, generator=generator) * tiny
    rows = rows.to(compute)
    stored = pool.clone().to(DEVICE)
    kv_store_triton(rows.to(DEVICE), written.to(DEVICE), stored, device_scale)
    want = pool.clone().view(-1, 2, 96)
    want[written] = quantize(rows.view(-1, 2, 96)[written], scale, fp8)
    assert torch.equal(stored.cpu().view(torch.uint8), want.view(pool.shape).view(torch.uint8))

    # the step's rows stored straight from a projection's output (rows strided, each contiguous)
    projected = torch.zeros(written.numel(), 2 * 96 + 5, dtype=compute)
    projected[:, 5:] = rows.view(-1, 2 * 96)[written]
    straight = pool.clone().to(DEVICE)
    kv_store_rows_triton(projected.to(DEVICE)[:, 5:].view(-1, 2, 96), written.to(DEVICE), straight, device_scale)
    assert torch.equal(straight.cpu().view(torch.uint8), want.view(pool.shape).view(torch.uint8))


@pytest.mark.triton
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_bit_pattern_moves_as_bytes_exactly(fp8, monkeypatch):
    """As bytes (engine.kernels.float_bits.fp8_value / fp8_bits), all 256 patterns of the format
    load as torch widens them, NaNs as NaN, and every finite value (both zeros, the subnormals,
    the largest) stores back as its own pattern."""
    if not _triton.available():
        pytest.skip("Triton is not installed")
    enter_kernel_mode()
    monkeypatch.setenv("SPLITSERVE_FP8_AS_BYTES", "1")
    pool = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).view(4, 4, 1, 16)
    working = torch.zeros(4, 4, 1, 16, device=DEVICE)
    kv_load_triton(pool.to(DEVICE), torch.arange(4, device=DEVICE), working, 1.0)
    want = pool.float()
    assert torch.equal(working.cpu().isnan(), want.isnan()) and bool(want.isnan().any())
    numbers = ~want.isnan()  # e5m2's infinities too
    assert torch.equal(working.cpu()[numbers].view(torch.int32), want[numbers].view(torch.int32))  # -0.0 too
    stored = torch.zeros_like(pool).to(DEVICE)
    kv_store_triton(working.nan_to_num(0.0), torch.arange(16, device=DEVICE), stored, 1.0)  # every token row
    finite = want.isfinite()  # an infinity saturates at the largest value, as quantize does
    assert torch.equal(stored.cpu().view(torch.uint8)[finite], pool.view(torch.uint8)[finite])


def test_checkpoint_scales_are_used_named_in_the_layout_and_refused_when_they_differ(model_factory, tmp_path):
    path, _ = model_factory("jamba")
    plain_engine = LLMEngine(EngineConfig(str(path), block_size=4))
    layer = plain_engine.spec.attention_layers[0]
    scaled = with_kv_scales(path, tmp_path / "scaled", {i: (0.5, 2.0) for i in plain_engine.spec.attention_layers})
    engine = LLMEngine(EngineConfig(str(scaled), block_size=4, kv_cache_dtype="fp8_e4m3"))
    assert engine.cache.layers.narrow.working is not None
    kinds = {kind for _, i, kind, role, _ in engine.cache.handoff_tensors() if i == layer}
    assert kinds == {"attention in float8_e4m3fn scaled k=0.5,v=2"}
    # The stored rows are the written rows over their scale: K at 0.5, V at 2.
    engine.add_request([5, 6, 7, 8, 9], GREEDY, request_id="r")
    plain_engine.add_request([5, 6, 7, 8, 9], GREEDY, request_id="r")
    engine.step()
    plain_engine.step()
    (_, k8), (_, v8) = [(n, t) for n, t in engine.cache.block_tensors() if n.startswith(f"layer{layer}.")]
    (_, k), (_, v) = [(n, t) for n, t in plain_engine.cache.block_tensors() if n.startswith(f"layer{layer}.")]
    b8, b = blocks_of(engine, "r")[0], blocks_of(plain_engine, "r")[0]
    assert torch.equal(k8.view(torch.uint8)[b8], quantize(k[b], 0.5, k8.dtype).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8)[b8], quantize(v[b], 2.0, v8.dtype).view(torch.uint8))
    unscaled = LLMEngine(EngineConfig(str(path), block_size=4, kv_cache_dtype="fp8_e4m3", mode="decode"))
    layouts = [CacheTensors.from_named(4, e.cache.handoff_tensors()).layout for e in (engine, unscaled, plain_engine)]
    with pytest.raises(LayoutMismatchError, match=rf"layer {layer}: attention in float8_e4m3fn scaled k=0.5,v=2 vs "
                                                  r"attention in float8_e4m3fn scaled k=1,v=1"):
        layouts[0].check_compatible(layouts[1], "prefill", "decode")
    with pytest.raises(LayoutMismatchError, match=rf"layer {layer}: attention in float8_e4m3fn scaled k=1,v=1 vs "
                                                  r"attention(;|$)"):
        layouts[1].check_compatible(layouts[2], "prefill", "decode")


def test_scales_per_kv_head_scale_each_heads_rows(model_factory, tmp_path):
    """The attn_head strategy: k_scale with one value per KV head divides each head's rows by
    its own; named in the layout. With tensor parallelism each rank stores its heads with their
    own scales, and its rows put together are the one-rank engine's."""
    path, _ = model_factory("llama")  # 2 KV heads, 2 attention layers
    plain = LLMEngine(EngineConfig(str(path), block_size=4))
    per_head = with_kv_scales(path, tmp_path / "per_head", {0: ([0.5, 4.0], 2.0), 1: ([1.0, 0.25], [3.0, 1.0])})
    engine = LLMEngine(EngineConfig(str(per_head), block_size=4, kv_cache_dtype="fp8_e4m3"))
    kinds = {i: kind for _, i, kind, role, _ in engine.cache.handoff_tensors()}
    assert kinds[0] == "attention in float8_e4m3fn scaled k=[0.5,4],v=2", kinds
    assert kinds[1] == "attention in float8_e4m3fn scaled k=[1,0.25],v=[3,1]", kinds
    for e in (engine, plain):
        e.add_request([5, 6, 7, 8, 9, 10], GREEDY, request_id="r")
        e.step()
    b8, b = blocks_of(engine, "r")[0], blocks_of(plain, "r")[0]
    expected = {"layer0.k": [0.5, 4.0], "layer0.v": 2.0, "layer1.k": [1.0, 0.25], "layer1.v": [3.0, 1.0]}
    stored, written = dict(engine.cache.block_tensors()), dict(plain.cache.block_tensors())
    assert sorted(stored) == sorted(expected)
    for name, scale in expected.items():
        rows = quantize(written[name][b], scale_tensor(scale if isinstance(scale, float) else tuple(scale), "cpu"),
                        stored[name].dtype)
        assert torch.equal(stored[name].view(torch.uint8)[b8], rows.view(torch.uint8)), name
        if isinstance(scale, list):  # a head's rows over its own scale, not the other head's
            head0 = quantize(written[name][b][:, 0], scale[0], stored[name].dtype)
            assert torch.equal(stored[name].view(torch.uint8)[b8][:, 0], head0.view(torch.uint8))
    two = LLMEngine(EngineConfig(str(per_head), block_size=4, kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2))
    try:  # 2 KV heads: each rank keeps one, scaled by its own
        kinds = {i: kind for _, i, kind, role, _ in two.cache.handoff_tensors()}
        assert kinds[0] == "attention in float8_e4m3fn scaled k=[0.5],v=2", kinds
        two.add_request([5, 6, 7, 8, 9, 10], GREEDY, request_id="r")
        two.step()
        from engine.staging import HandoffStaging

        staging = HandoffStaging(two, requests=1)  # every rank's rows, in the un-sharded layout
        staged = staging.take("r", 2)
        staging.gather(staged, blocks_of(two, "r"), None)
        gathered = dict(staging.cache.block_tensors())
        for name in expected:  # the same bytes, up to a rounding the float sums may move
            same = gathered[name][staged.blocks[0]].view(torch.uint8) == stored[name][b8].view(torch.uint8)
            assert float(same.float().mean()) > 0.95, name
    finally:
        two.close()


def test_bad_scales_and_flags_are_refused_naming_them(model_factory, tmp_path):
    path, _ = model_factory("llama")  # 2 KV heads
    wrong = with_kv_scales(path, tmp_path / "wrong", {0: (0.5, 1.0)})
    weights = load_file(wrong / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.ones(3)
    save_file(weights, wrong / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_scale: a KV scale must be one "
                                              r"number or one per KV head \(2\), got shape \(3,\)"):
        LLM(str(wrong), kv_cache_dtype="fp8_e4m3")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor([1.0, -1.0])
    save_file(weights, wrong / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_scale: a KV scale must be positive and finite"):
        LLM(str(wrong), kv_cache_dtype="fp8_e4m3")
    config = json.loads((wrong / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"kv_cache_scheme\.strategy = 'channel': only 'tensor' .* and "
                                              r"'attn_head' \(one per KV head\) are supported"):
        LLM(str(wrong), kv_cache_dtype="fp8_e4m3")
    missing = with_kv_scales(path, tmp_path / "missing", {0: (0.5, 1.0)})  # layer 1 has none
    with pytest.raises(CheckpointError, match="kv_cache_scheme is static, but layer 1 has no k_scale tensor"):
        LLM(str(missing), kv_cache_dtype="fp8_e4m3")
    LLM(str(missing))  # the model's own dtype reads no scales
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'int8' not in \['auto', 'fp8_e4m3', 'fp8_e5m2'\]"):
        EngineConfig(str(path), kv_cache_dtype="int8")


def test_a_fixed_budget_holds_more_blocks(model_factory):
    """An FP8 layer keeps a quarter of the float32 bytes per block, and the layers share one
    layer's working rows in float32 (engine.kv_format): for Llama's two attention layers a block
    costs 2 x 1/4 + 1 of a float32 layer's, so a budget holds 4/3 as many."""
    path, _ = model_factory("llama")
    plain, fp8 = (LLMEngine(EngineConfig(str(path), block_size=4, kv_cache_dtype=kv)) for kv in ("auto", "fp8_e4m3"))
    budget = 64 << 10
    sizes = [plan_cache(e.cache.spec, torch.float32, 4, 8, 64, budget, None) for e in (plain, fp8)]
    per_block = sizes[0].bytes_per_block
    assert sizes[1].bytes_per_block * 4 == per_block
    used = per_block // 4 + per_block // 2  # its own bytes, and one of the two layers' working rows
    assert sizes[0].num_blocks == budget // per_block - 1  # less the scratch block
    assert sizes[1].num_blocks == budget // used - 1


def test_split_with_fp8_kv_equals_colocated(model_factory):
    path, _ = model_factory("jamba")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 40)]
    engines = [LLMEngine(EngineConfig(str(path), block_size=4, mode=mode, max_num_batched_tokens=16,
                                      kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16"))
               for mode in ("prefill", "decode")]
    split = run_disaggregated(path, prompts, GREEDY, engines=engines)
    colocated = LLM(str(path), block_size=4, kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16",
                    max_num_batched_tokens=16).generate(prompts, GREEDY)
    assert [o.token_ids for o in split] == [o.token_ids for o in colocated]


def test_drift_over_many_steps_stays_within_the_formats_precision(model_factory):
    path, _ = model_factory("llama")
    prompt = [random.Random(4).randrange(3, 300) for _ in range(20)]
    base = LLM(str(path))
    tokens = base.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    reference = forced_logits(base, prompt, tokens)
    # Measured on the tiny models (bench quant's method): e4m3 up to 0.37, e5m2 up to 0.65; a
    # block read from the wrong place moves logits by whole units.
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        drift = (forced_logits(LLM(str(path), kv_cache_dtype=dtype), prompt, tokens) - reference).abs()
        assert float(drift.max()) < 1.0, (dtype, float(drift.max()))
        assert float(drift[0].max()) == 0.0  # the prefill attends to its own rows at full precision


@pytest.mark.parametrize("family", ["jamba", "llama"])
def test_prefix_cache_hits_read_the_fp8_blocks_the_first_run_stored(family, model_factory):
    """The second run attends to the first run's FP8 blocks; the first run's later tokens read
    the same blocks through the format only where a pass boundary lay before them, so the two
    agree wherever their passes did (a recurrent model's save points: jamba), and stay within
    the drift bound otherwise."""
    path, _ = model_factory(family)
    prompt = [random.Random(6).randrange(3, 300) for _ in range(37)]
    llm = LLM(str(path), block_size=4, enable_prefix_caching=True, kv_cache_dtype="fp8_e4m3")
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens >= 32
    if family == "jamba":
        assert second.token_ids == first.token_ids
    llm.engine.check_integrity()


def test_tensor_parallel_ranks_store_fp8_kv(model_factory):
    path, _ = model_factory("llama")
    prompt = [random.Random(7).randrange(3, 300) for _ in range(19)]
    one = LLM(str(path), block_size=4, kv_cache_dtype="fp8_e4m3")
    tokens = one.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    two = LLM(str(path), block_size=4, kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2)
    try:
        drift = (forced_logits(two, prompt, tokens) - forced_logits(one, prompt, tokens)).abs()
        assert float(drift.max()) < 1.0
        # A follower whose blocks were not FP8 would not meet rank 0's staging rows (sizes differ).
        from engine.staging import HandoffStaging

        engine = two.engine
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), request_id="h")
        engine.step()
        staging = HandoffStaging(engine, requests=1)
        staged = staging.take("h", len(engine.blocks.table("h")))
        staging.gather(staged, list(engine.blocks.table("h")), None)
        assert all(t.dtype == torch.float8_e4m3fn for _, t in staging.cache.block_tensors())
    finally:
        two.engine.close()


def test_tier_entries_carry_the_narrow_formats_exactly(model_factory, tmp_path):
    """FP8 blocks and half-width checkpoints spilled to host memory and disk come back bit for
    bit: each entry as spilled from the pool is what a later load reads (from the host tier or
    from its file), and what the load leaves in the pool."""
    from engine.tiered_cache import TieredCache
    from tests.test_tiered_cache import SMALL_POOL, chat_trace, one_by_one

    path, _ = model_factory("jamba")
    prompts, _ = chat_trace(path)
    llm = LLM(str(path), **SMALL_POOL, kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16",
              host_cache_bytes=1 << 14, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24)
    tiers, spilled, loaded = llm.engine.tiers, {}, []

    def as_bytes(t):
        return t.contiguous().view(torch.uint8)

    def spill(keys, blocks, checkpoint, end):  # what the pool holds as it lets the prefix go
        rows = {f"kv:{n}": as_bytes(t[torch.tensor(blocks)]).clone() for n, t in tiers.rows.kv_tensors}
        if checkpoint is not None:
            row = tiers.rows.cache.checkpoint_row(checkpoint)
            rows.update({f"state:{n}": as_bytes(t[row]).clone() for n, t in tiers.rows.state_tensors})
        spilled[keys[-1]] = rows
        TieredCache.spill(tiers, keys, blocks, checkpoint, end)

    def load(entry):
        done = TieredCache._load(tiers, entry)
        if done:
            assert {t.dtype for t in entry.tensors.values()} == {torch.float8_e4m3fn, torch.bfloat16}
            assert all(torch.equal(as_bytes(t), spilled[entry.keys[-1]][n]) for n, t in entry.tensors.items())
            for i, key in enumerate(entry.keys):
                block = tiers.prefix_cache.nodes[key].block
                for name, t in tiers.rows.kv_tensors:
                    assert torch.equal(as_bytes(t[block]), as_bytes(entry.tensors[f"kv:{name}"][i]))
            loaded.append(entry.keys[-1])
        return done

    tiers.prefix_cache.on_evict, tiers._load = spill, load
    one_by_one(llm, prompts)
    stats = llm.engine.stats()
    assert stats["tier_disk_hits"] > 0 and len(loaded) >= 6, (stats, len(loaded))


def test_a_format_that_saves_nothing_is_named_at_start(model_factory, caplog):
    """One attention layer: FP8 blocks plus one layer of working rows in float32 cost 1/4 + 1 of
    the plain layer, so the engine says so (it still serves)."""
    import logging

    from engine.cache import wasted_formats
    from engine.cache_formats import CacheFormat
    from engine.models.hybrid import KVSpec, LayerCacheSpec, ModelSpec

    one = ModelSpec("x", 10, 8, layers=(LayerCacheSpec("attention", KVSpec(2, 8)), LayerCacheSpec("mlp")))
    two = ModelSpec("x", 10, 8, layers=(LayerCacheSpec("attention", KVSpec(2, 8)),) * 2)
    fp8 = CacheFormat(kv_dtype="fp8_e4m3")
    assert wasted_formats(one, fp8.apply(one), torch.float32, 4)[0].startswith("kv_cache_dtype: with 1 attention")
    assert wasted_formats(two, fp8.apply(two), torch.float32, 4) == []
    path, _ = model_factory("llama")
    with caplog.at_level(logging.WARNING):
        LLM(str(path), kv_cache_dtype="fp8_e4m3")
    assert "no more blocks fit" not in caplog.text  # llama's two attention layers: 2/4 + 1 < 2
