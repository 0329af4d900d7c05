"""Stacked MoE experts that keep a checkpoint's FP8 (engine.models.fp8_experts), run here on the
CPU with the policy set as a GPU with FP8 units sets it: the same rounding, group split and
scale layout, with reference_grouped standing in for torch's grouped scaled GEMM.

The families' MoE checkpoints with kept experts are held to transformers in
tests.test_fp8_linear (its oracle rounds the experts' inputs as the engine's do, per token or
per token and block of columns); here: the product itself, the cases that keep a scale per
row or stay dense, tensor-parallel shards and the device probe. Where a test says Triton runs
(`triton_runs`), block-wise experts pick the fused Triton kernel as on a GPU, and it runs here
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.kernels import _triton
from engine.kernels.fp8_moe import grouped_block_fp8_triton
from engine.models import fp8_blocks, fp8_experts
from engine.models.fp8_blocks import narrower_groups
from engine.models.fp8_experts import Fp8Experts, grouped_fits, kernel_for, reference_grouped
from engine.models.fp8_linear import FP8, FP8_MAX
from tests import oracle
from tests.test_fp8 import fp8_checkpoint
from tests.test_fp8_linear import (FP8_TIE_TOLERANCE, GREEDY, TEACHER_FORCED, fake_quantized, keeps_float8,  # noqa: F401
                                   kept_experts, kept_linears, oracle_with_fp8_expert_inputs, oracle_with_fp8_inputs,
                                   static_expert_scales)


def random_experts(experts: int, out: int, inputs: int, block, seed: int = 0) -> Fp8Experts:
    generator = torch.Generator().manual_seed(seed)
    stacked = Fp8Experts(experts, out, inputs, torch.float32)
    weight = (torch.randn(experts, out, inputs, generator=generator) * 60).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    shape = (experts, out) if block is None else (experts, -(-out // block[0]), -(-inputs // block[1]))
    stacked.load_float8(weight, torch.rand(shape, generator=generator) * 0.01 + 0.001, block)  # differs per scale
    return stacked


@pytest.fixture
def triton_runs(monkeypatch):
    """FP8 weights pick their kernels as where Triton runs (CUDA): block-wise experts the fused
    kernel, block-wise linears its linear form; nothing probed before counts."""
    if not _triton.available():
        pytest.skip("Triton is not installed")
    monkeypatch.setattr(fp8_blocks, "uses_triton", lambda tensor: True)
    monkeypatch.setattr(fp8_blocks, "_fused", {})
    monkeypatch.setattr(fp8_experts, "_fits", {})


def reference(stacked: Fp8Experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert's rows rounded as the engine rounds them, times its dequantized weight."""
    group = None if stacked.block is None else stacked.block[1]
    out, start = [], 0
    for expert, count in enumerate(counts):
        out.append(F.linear(fake_quantized(rows[start:start + count], None, group), stacked[expert]))
        start += count
    return torch.cat(out)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("block", [None, (16, 16), (32, 16), (1, 16)])
def test_a_grouped_product_is_each_experts_fp8_rounded_product(block, fused, request):
    """48 outputs (with 32-row blocks the last is 16 rows), 80 inputs: five 16-column groups,
    each with a scale of its own per expert; the second expert gets no rows. Block-wise, one
    fused kernel where Triton runs (no per-group scales kept for the split then), else one
    grouped GEMM per group."""
    if fused:
        request.getfixturevalue("triton_runs")
    stacked = random_experts(3, 48, 80, block)
    assert stacked.fused == (fused and block is not None)
    assert (stacked.gemm_scales is None) == (block is None or fused)
    rows = torch.randn(13, 80)
    rows[0, 3] = 50.0  # one group's scale grows; block-wise, that token's other groups keep theirs
    counts = [5, 0, 8]
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    got = stacked.grouped_product(rows, ends)
    torch.testing.assert_close(got, reference(stacked, rows, counts), rtol=1e-5, atol=1e-4)
    if block is not None:  # the product is not one rounded per token alone
        per_token = torch.cat([F.linear(fake_quantized(rows[:5], None), stacked[0]),
                               F.linear(fake_quantized(rows[5:], None), stacked[2])])
        assert not torch.allclose(got[0], per_token[0], rtol=1e-3, atol=1e-3)


def test_indexing_gives_the_dequantized_weights():
    stacked = random_experts(2, 32, 48, (16, 16))
    scale = stacked.weight_scale.repeat_interleave(16, 1).repeat_interleave(16, 2)
    expected = stacked.qweight.float() * scale
    assert torch.equal(stacked[:], expected) and torch.equal(stacked[1], expected[1])


PROMPT = [5, 9, 14, 200, 31, 77, 3]


def scored_as(judge, llm, prompt: list[int]) -> list[int]:
    """llm's greedy continuation of `prompt`, each position teacher-forced and scored against
    `judge`'s logprobs: within the FP8 tie tolerance everywhere and float32 agreement at most
    positions (the same products). Returns the continuation."""
    out = llm.generate([prompt], GREEDY)[0].token_ids
    tokens = prompt + out
    logprobs = torch.log_softmax(oracle.hf_logits(judge, tokens).float(), -1)
    scored = llm.generate([tokens], TEACHER_FORCED)[0].prompt_logprobs
    gaps = [abs(scored[p]["token"] - float(logprobs[p - 1, tokens[p]])) for p in range(1, len(tokens))]
    assert max(gaps) <= FP8_TIE_TOLERANCE and sorted(gaps)[len(gaps) // 2] <= 1e-4, gaps
    return out


def with_fp8_linear_inputs(hf, llm):
    """The oracle's linears that the engine keeps in FP8 rounding their inputs as well."""
    return oracle_with_fp8_inputs(hf, hf.config.model_type, kept_linears(llm))


def with_static_expert_scales(directory, scale_of) -> None:
    """Each expert projection's `input_scale` in the checkpoint set to scale_of(expert, projection)."""
    tensors = load_file(directory / "model.safetensors")
    for name in tensors:
        if name.endswith(".input_scale") and ".experts." in name:
            expert, projection = name.split(".experts.")[1].split(".")[:2]
            tensors[name] = torch.tensor([scale_of(int(expert), projection)])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_static_input_scales_round_each_row_by_its_experts_scale(keeps_float8, model_factory, tmp_path):
    """Qwen3-Next's tiny per-tensor checkpoint with a static activation scale of its own per
    expert and projection (gate's and up's equal, as calibration gives them; not powers of two,
    which FP8 would round the same): the experts keep FP8 with those scales, judged by
    transformers rounding each expert's inputs by the same scales."""
    path, _ = model_factory("qwen3_next")
    hf = fp8_checkpoint(path, tmp_path / "fp8", "per_tensor")
    scale_of = lambda expert, projection: 0.011 * (1 + 0.37 * expert) * (1.6 if projection == "down_proj" else 1)  # noqa: E731
    with_static_expert_scales(tmp_path / "fp8", scale_of)
    llm = LLM(str(tmp_path / "fp8"), block_size=4)
    experts = kept_experts(llm)
    assert experts and all(m.kept and m.input_scale is not None for m in experts.values()), experts
    for name, m in experts.items():
        projection = "down_proj" if name.endswith(".down") else "gate_proj"
        want = torch.tensor([scale_of(e, projection) for e in range(m.shape[0])])
        torch.testing.assert_close(m.input_scale, want)
    judge = with_fp8_linear_inputs(oracle_with_fp8_expert_inputs(hf, None, static=static_expert_scales(experts)),
                                   llm)
    scored_as(judge, llm, PROMPT)


def test_experts_whose_stacked_scales_differ_or_off_the_gemm_rule_stay_dense(keeps_float8, model_factory,
                                                                              tmp_path):
    path, _ = model_factory("qwen3_next")
    fp8_checkpoint(path, tmp_path / "static", "per_tensor")
    # expert 2's up projection calibrated otherwise than its gate: gate_up cannot round one input two ways
    with_static_expert_scales(tmp_path / "static", lambda e, p: 0.02 if (e, p) == (2, "up_proj") else 0.01)
    kept = kept_experts(LLM(str(tmp_path / "static"), block_size=4))
    assert kept and all(name.endswith(".down") for name in kept), kept  # down's scales are one per expert
    path, _ = model_factory("nemotron_h")  # relu2 experts [4, 24, 32] and [4, 32, 24]: 24 is off the rule
    fp8_checkpoint(path, tmp_path / "odd", "block")
    assert not kept_experts(LLM(str(tmp_path / "odd"), block_size=4))


def test_stacked_projections_that_end_inside_a_block_keep_a_scale_per_row(keeps_float8, model_factory, tmp_path):
    """LFM2-MoE's experts: gate and up of 24 rows each, in 16-row blocks: the stacked gate_up's
    third block would hold rows of both, so its scales stay one per row and column group; down
    [32, 24] is off the GEMM rule and stays dense beside it."""
    path, _ = model_factory("lfm2_moe")
    hf = fp8_checkpoint(path, tmp_path / "fp8", "block")
    llm = LLM(str(tmp_path / "fp8"), block_size=4)
    kept = kept_experts(llm)
    assert kept and all(name.endswith(".gate_up") and m.block == (1, 16) and m.kept for name, m in kept.items())
    judge = with_fp8_linear_inputs(oracle_with_fp8_expert_inputs(hf, 16, down=False), llm)
    scored_as(judge, llm, PROMPT)


def test_experts_whose_product_the_device_miscomputes_are_never_kept(keeps_float8, model_factory, tmp_path,
                                                                     monkeypatch):
    """The device check runs on the meta model, before storage: experts it fails load dense
    (the plain stacked parameter, as without the policy), and the model serves."""
    import engine.models.fp8_experts as fp8_experts

    checked = []
    monkeypatch.setattr(fp8_experts, "kernel_for", lambda *shape: checked.append(shape) and None)
    path, _ = model_factory("qwen3_next")
    fp8_checkpoint(path, tmp_path / "fp8", "block")
    llm = LLM(str(tmp_path / "fp8"), block_size=4)
    assert checked and not kept_experts(llm)
    assert kept_linears(llm)  # the linears' own check is theirs
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_without_the_policy_fp8_experts_are_dequantized(model_factory, tmp_path):
    path, _ = model_factory("qwen3_next")
    fp8_checkpoint(path, tmp_path / "fp8", "block")
    assert not kept_experts(LLM(str(tmp_path / "fp8"), block_size=4))


@pytest.mark.parametrize("dim, positions, block, stays", [
    (1, list(range(16, 48)), (16, 16), True), (2, list(range(32)), (16, 16), True),
    (1, list(range(8, 24)) + list(range(32, 48)), (1, 16), True),  # rows cutting blocks: a scale per row
    (2, list(range(8, 40)), None, False)])  # columns cutting groups: dequantized
@pytest.mark.parametrize("fused", [False, True])
def test_tensor_parallel_shards_keep_fp8_where_their_products_stay_the_same(dim, positions, block, stays, fused,
                                                                           request):
    if fused:
        request.getfixturevalue("triton_runs")
    stacked = random_experts(2, 48, 64, (16, 16))
    shard = stacked.tp_take(dim, positions)
    index = torch.tensor(positions)
    assert torch.equal(shard[:], stacked[:].index_select(dim, index))
    assert shard.kept == stays and (not stays or shard.block == block) and shard.fused == (stays and fused)
    if stays:  # the shard's own product (a dequantized shard runs as plain weights: shard[:] above)
        rows = torch.randn(6, shard.shape[2])
        ends = torch.tensor([2, 6], dtype=torch.int32)
        torch.testing.assert_close(shard.grouped_product(rows, ends), reference(shard, rows, [2, 4]),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("positions, width", [
    (list(range(16, 48)), 16),  # the second half of one 32-column block and the first of the next
    (list(range(32, 48)) + list(range(64, 80)), 16),
    (list(range(0, 80)), 16),  # two whole blocks, then half of one
    (list(range(8, 40)), None)])  # 8-column pieces: narrower than the grouped GEMM takes
@pytest.mark.parametrize("fused", [False, True])
def test_input_shards_that_cut_blocks_keep_fp8_in_narrower_groups(positions, width, fused, request):
    """Input columns that cut 32-column blocks (Qwen3-Next's 128-column blocks at TP 8 are cut
    the same way): the shard keeps FP8 in `width`-column groups, each with its block's weight
    scale, its weights and the product from them those of the columns taken; its input rounds
    per narrower group, so against the un-sharded weight's partial product over those columns
    it differs by FP8 rounding of the input alone."""
    if fused:
        request.getfixturevalue("triton_runs")
    stacked = random_experts(2, 48, 112, (16, 32))  # the last block 16 wide
    shard = stacked.tp_take(2, positions)
    index = torch.tensor(positions)
    assert torch.equal(shard[:], stacked[:].index_select(2, index))
    assert shard.kept == (width is not None)
    if width is None:
        return
    assert shard.block == (16, width) and shard.fused == fused and shard.weight_scale.shape == (2, 3, len(positions) // width)
    rows = torch.randn(6, len(positions))
    ends = torch.tensor([2, 6], dtype=torch.int32)
    got = shard.grouped_product(rows, ends)
    torch.testing.assert_close(got, reference(shard, rows, [2, 4]), rtol=1e-5, atol=1e-4)
    exact_input = torch.cat([F.linear(rows[:2], stacked[0][:, index]), F.linear(rows[2:], stacked[1][:, index])])
    assert float((got - exact_input).abs().max()) <= 0.07 * float(exact_input.abs().max())  # e4m3: 2^-4 a value


def test_narrower_groups_are_the_widest_the_columns_are_whole_groups_of():
    assert narrower_groups(list(range(192, 256)), 512, 128) == (64, [3])  # Qwen3-Next's experts, rank 3 of 8
    assert narrower_groups(list(range(32, 64)) + list(range(96, 128)), 256, 128) == (32, [1, 3])
    assert narrower_groups(list(range(0, 80)), 112, 32) == (16, [0, 1, 2, 3, 4])
    assert narrower_groups(list(range(8, 40)), 64, 32) is None  # 8 wide: under the grouped GEMM's 16
    assert narrower_groups(list(range(0, 48)), 96, 96) == (48, [0])  # a width off the powers of two


@pytest.mark.parametrize("dim, positions", [(None, None), (1, list(range(16, 48))), (2, list(range(16, 48)))])
def test_static_scales_round_each_row_by_its_expert_whole_or_sharded(dim, positions):
    """Two experts with static activation scales 0.013 and 0.021: each row is rounded by its own
    expert's, in the whole weight and in either tensor-parallel shard (a static scale rounds
    each element alone, so a shard's inputs round as the whole weight's)."""
    stacked = random_experts(2, 48, 64, None)
    stacked.load_float8(stacked.qweight.data, stacked.weight_scale, None, torch.tensor([0.013, 0.021]))
    experts = stacked if dim is None else stacked.tp_take(dim, positions)
    assert experts.kept and torch.equal(experts.input_scale, torch.tensor([0.013, 0.021]))
    rows = torch.randn(9, experts.shape[2])
    ends = torch.tensor([4, 9], dtype=torch.int32)
    want = torch.cat([F.linear(fake_quantized(rows[:4], torch.tensor(0.013)), experts[0]),
                      F.linear(fake_quantized(rows[4:], torch.tensor(0.021)), experts[1])])
    torch.testing.assert_close(experts.grouped_product(rows, ends), want, rtol=1e-5, atol=1e-4)


def test_tensor_parallel_ranks_keep_fp8_experts_and_match_the_unsharded_model(keeps_float8, model_factory,
                                                                              tmp_path):
    """Two ranks shard Jamba's block-wise FP8 experts (intermediate 96: 48 rows of gate and of
    up and 48 columns of down each, whole 16-wide blocks): every rank's logits equal the
    un-sharded FP8 model's."""
    from engine.models import load_model
    from engine.tp import run_in_threads
    from engine.tp.shard import shard_model
    from tests.test_tp_layers import check_model

    path, _ = model_factory("jamba")
    fp8_checkpoint(path, tmp_path / "fp8", "block")
    full = load_model(tmp_path / "fp8")
    assert any(isinstance(m, Fp8Experts) and m.kept for m in full.modules())
    check_model(full, 2)
    shards = run_in_threads(2, lambda group: [m for m in shard_model(copy.deepcopy(full), group).modules()
                                              if isinstance(m, Fp8Experts)])
    for kept in shards:
        assert kept and all(m.kept and m.block == (16, 16) and m.shape[1:] in ((96, 64), (64, 48)) for m in kept), kept


def test_two_input_shards_sum_to_the_whole_weights_product_in_their_groups():
    """The down projection's two rank shards (48 of 96 columns each: a whole 32-column block and
    half of one) add up to the un-sharded experts' product with the input rounded per 16
    columns, the weight's scales each its block's."""
    stacked = random_experts(2, 48, 96, (16, 32))
    shards = [stacked.tp_take(2, range(0, 48)), stacked.tp_take(2, range(48, 96))]
    assert all(shard.kept and shard.block == (16, 16) for shard in shards)
    finer = copy.deepcopy(stacked)
    finer.load_float8(stacked.qweight.data, stacked.weight_scale.repeat_interleave(2, 2), (16, 16))
    rows = torch.randn(7, 96)
    ends = torch.tensor([3, 7], dtype=torch.int32)
    total = shards[0].grouped_product(rows[:, :48], ends) + shards[1].grouped_product(rows[:, 48:], ends)
    torch.testing.assert_close(total, finer.grouped_product(rows, ends), rtol=1e-5, atol=1e-4)


def test_ranks_keep_fp8_experts_whose_input_columns_cut_blocks(keeps_float8, model_factory, tmp_path, monkeypatch):
    """Jamba's experts quantized in 32x32 blocks, sharded over two ranks as served: each rank's
    48 columns of the down projection (a whole block and half of one) stay FP8 in 16-column
    groups, its 48 rows of gate and up (half a block) with a scale per row."""
    import tests.test_fp8 as test_fp8
    from engine.models import load_model
    from engine.tp import run_in_threads
    from engine.tp.shard import shard_model

    monkeypatch.setattr(test_fp8, "BLOCK", (32, 32))
    monkeypatch.setitem(test_fp8.SCHEMES["block"], "weight_block_size", [32, 32])
    path, _ = model_factory("jamba")
    fp8_checkpoint(path, tmp_path / "fp8", "block")
    full = load_model(tmp_path / "fp8")
    assert any(isinstance(m, Fp8Experts) and m.kept and m.block == (32, 32) for m in full.modules())
    shards = run_in_threads(2, lambda group: [m for m in shard_model(copy.deepcopy(full), group).modules()
                                              if isinstance(m, Fp8Experts)])
    for experts in shards:
        assert experts and all(m.kept and m.dense is None for m in experts)
        assert {(m.block, m.shape[1:]) for m in experts} == {((1, 32), (96, 64)), ((32, 16), (64, 48))}


def emulated_kernel(kind: str):
    """CPU stand-ins for torch._scaled_grouped_mm: the right product, or one that reads the
    weight scale of the first expert for every group."""
    def kernel(quantized, weights, scale_rows, scale_cols, offs, out_dtype):
        cols = scale_cols if kind == "right" else scale_cols[:1].expand_as(scale_cols)
        return reference_grouped(quantized, weights, scale_rows, cols, offs=offs, out_dtype=out_dtype)
    return kernel


@pytest.mark.parametrize("kind, fits", [("right", True), ("wrong scale", False)])
def test_the_grouped_gemm_is_checked_on_the_device_before_it_is_used(kind, fits, monkeypatch):
    """The probe's rows run through what the device calls (here a stand-in) and are compared
    with the product from dequantized operands; a wrong one leaves the experts dequantized."""
    import engine.models.fp8_experts as fp8_experts

    monkeypatch.setattr(fp8_experts, "reference_grouped", emulated_kernel(kind))
    monkeypatch.setattr(fp8_experts, "_fits", {})
    assert grouped_fits(torch.device("cpu"), torch.float32, 64, 48, None) == fits
    assert grouped_fits(torch.device("cpu"), torch.float32, 64, 48, (16, 16)) == fits


class _CompileError(Exception):
    """Like Triton's compile errors: an Exception, not a RuntimeError."""


@pytest.mark.parametrize("kernel, logged", [
    (lambda q, s, w, ws, block, ends, dtype: grouped_block_fp8_triton(
        q, s, w, ws[:1].expand_as(ws), block, ends, dtype), "relative error"),  # the first expert's scales
    (lambda *args: (_ for _ in ()).throw(_CompileError("out of shared memory")), "_CompileError")])
def test_a_fused_kernel_the_device_check_refuses_leaves_the_split_products(kernel, logged, triton_runs,
                                                                           monkeypatch, caplog):
    monkeypatch.setattr(fp8_experts, "grouped_block_fp8_triton", kernel)
    assert kernel_for(torch.device("cpu"), torch.float32, 48, 80, (16, 16)) == "split"
    assert logged in caplog.text and "one grouped GEMM per input group" in caplog.text
    stacked = random_experts(3, 48, 80, (16, 16))
    assert stacked.kept and not stacked.fused and stacked.gemm_scales is not None


def test_the_fused_kernel_takes_what_the_split_gemms_refuse(triton_runs):
    """Widths off torch's 16-byte rule (Nemotron-H's 24-wide experts) stay FP8 through the fused
    kernel; per-channel experts never take it (torch's grouped GEMM runs them in one)."""
    assert kernel_for(torch.device("cpu"), torch.float32, 24, 32, (16, 16)) == "fused"
    assert kernel_for(torch.device("cpu"), torch.float32, 24, 32, None) is None
    assert kernel_for(torch.device("cpu"), torch.float32, 48, 80, (16, 24)) == "split"  # groups not a power of 2


@pytest.mark.parametrize("scheme", ["block", "per_channel"])
def test_where_torchs_scaled_gemms_take_no_scale_per_row_block_wise_experts_keep_fp8_fused(
        scheme, keeps_float8, triton_runs, model_factory, tmp_path, monkeypatch):
    """As on a GPU of compute capability 8.9, or with a float16 serving dtype: block-wise experts
    keep FP8 on the fused Triton kernel; per-channel ones, which only torch's grouped GEMM
    computes, are dequantized."""
    from engine.models import fp8_experts_loading

    monkeypatch.setattr(fp8_experts_loading, "runs_scaled", lambda device, dtype, rowwise, block=None: False)
    path, _ = model_factory("qwen3_next")
    fp8_checkpoint(path, tmp_path / "fp8", scheme)
    experts = kept_experts(LLM(str(tmp_path / "fp8"), block_size=4))
    assert bool(experts) == (scheme == "block") and all(m.kept and m.fused for m in experts.values())


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2_moe"])
def test_fused_block_wise_experts_serve_as_transformers_runs_them(name, keeps_float8, triton_runs, model_factory,
                                                                  tmp_path, monkeypatch):
    """The families' tiny block-wise FP8 checkpoints with every expert projection on the fused
    kernel (LFM2-MoE's: gate_up with a scale per row, and down, which the split GEMMs refuse,
    kept too), judged by transformers rounding the experts' inputs the same way. Where the
    split products keep the same experts (Qwen3-Next), their engine gives the same tokens."""
    path, _ = model_factory(name)
    hf = fp8_checkpoint(path, tmp_path / "fp8", "block")
    llm = LLM(str(tmp_path / "fp8"), block_size=4)
    experts = kept_experts(llm)
    assert experts and all(m.kept and m.fused and m.gemm_scales is None for m in experts.values()), experts
    assert len(experts) == 2 * sum(1 for m in hf.modules() if hasattr(m, "gate_up_proj"))  # both projections
    judge = with_fp8_linear_inputs(oracle_with_fp8_expert_inputs(hf, 16), llm)
    out = scored_as(judge, llm, PROMPT)
    monkeypatch.setattr(fp8_blocks, "uses_triton", lambda tensor: False)
    split = LLM(str(tmp_path / "fp8"), block_size=4)
    split_kept = {n for n, m in kept_experts(split).items() if m.kept}
    assert not any(m.fused for m in kept_experts(split).values())
    if name == "lfm2_moe":  # its 24-wide down stays dense there: another rounding, other tokens
        assert split_kept == {n for n in experts if n.endswith(".gate_up")}
    else:
        assert split_kept == set(experts) and split.generate([PROMPT], GREEDY)[0].token_ids == out


# ---------------------------------------------------------------- on a GPU with FP8 units

def fp8_grouped_gpu() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
            and hasattr(torch, "_scaled_grouped_mm"))


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_grouped_gpu(), reason="needs a CUDA GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_the_gpu_grouped_gemm_is_the_fp8_rounded_product(block):
    """torch's grouped scaled GEMM on the device, against the same rounding from dequantized
    operands: within bfloat16 output rounding (one rounding per 128-column group block-wise)."""
    assert grouped_fits(torch.device("cuda"), torch.bfloat16, 512, 256, block)
    cpu = random_experts(4, 512, 256, block)
    stacked = Fp8Experts(4, 512, 256, torch.bfloat16, device="cuda")
    stacked.load_float8(cpu.qweight.cuda(), cpu.weight_scale.cuda(), block)
    assert stacked.kept
    rows = torch.randn(37, 256)
    counts = [9, 0, 27, 1]
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    got = stacked.grouped_product(rows.cuda().bfloat16(), ends).float().cpu()
    want = reference(cpu, rows.bfloat16().float(), counts)
    assert (got - want).norm() <= 2e-2 * want.norm()


BF16_TIE_TOLERANCE = 0.15  # bfloat16 activations against the float32 oracle, on top of the FP8 rounding


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_grouped_gpu(), reason="needs a CUDA GPU of compute capability 9.0 or later")
@pytest.mark.parametrize("scheme", ["per_channel", "per_tensor", "block"])
def test_an_fp8_moe_checkpoint_keeps_its_experts_on_the_gpu_and_serves_as_transformers_runs_it(scheme,
                                                                                               model_factory,
                                                                                               tmp_path):
    """Qwen3-Next's tiny FP8 checkpoints in bfloat16 on the device (per-tensor: static activation
    scales): linears and experts stay FP8 (the probe found a kernel right for both expert
    shapes: block-wise, the fused one or the split GEMMs), and each greedy token is the oracle's choice within bfloat16's tolerance (the
    oracle: float32 transformers whose kept linears and experts round their inputs as the
    engine's do)."""
    path, _ = model_factory("qwen3_next")
    hf = fp8_checkpoint(path, tmp_path / "fp8", scheme)
    llm = LLM(str(tmp_path / "fp8"), block_size=4, device="cuda", dtype="bfloat16")
    experts = kept_experts(llm)
    assert experts and all(m.kept and m.qweight.is_cuda for m in experts.values()), experts
    judge = with_fp8_linear_inputs(oracle_with_fp8_expert_inputs(hf, 16 if scheme == "block" else None,
                                                                 static=static_expert_scales(experts)), llm)
    prompts = [[5, 9, 14, 200, 31], [7, 3, 250, 18, 40, 41, 42, 43, 44]]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        tokens = prompt + out.token_ids
        logprobs = torch.log_softmax(oracle.hf_logits(judge, tokens).float(), -1)
        for i, token in enumerate(out.token_ids):
            row = logprobs[len(prompt) - 1 + i]
            assert float(row.max() - row[token]) <= BF16_TIE_TOLERANCE, (i, out.token_ids)


@pytest.mark.parametrize("kept", [True, False])
@pytest.mark.parametrize("scheme, scale_name", [("block", "weight_scale_inv"), ("per_channel", "weight_scale")])
def test_a_misshapen_or_missing_expert_scale_is_refused_naming_it_kept_or_dequantized(kept, scheme, scale_name,
                                                                                     model_factory, tmp_path,
                                                                                     monkeypatch):
    from safetensors.torch import save_file

    import engine.models.fp8_linear as fp8_linear
    from engine.models import CheckpointError

    monkeypatch.setattr(fp8_linear, "keeps_float8", lambda device: kept)
    path, _ = model_factory("qwen3_next")
    fp8_checkpoint(path, tmp_path / "fp8", scheme)
    weights = load_file(tmp_path / "fp8" / "model.safetensors")
    name = f"model.layers.1.mlp.experts.2.up_proj.{scale_name}"
    weights[name] = torch.ones(3, 1)
    save_file(weights, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"experts\.2\.up_proj\.{scale_name}' has shape \[3, 1\]"):
        LLM(str(tmp_path / "fp8"), block_size=4)
    del weights[name]
    save_file(weights, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"experts\.2\.up_proj\.weight' is torch.float8_e4m3fn but the "
                                              rf"checkpoint has no '.*{scale_name}'"):
        LLM(str(tmp_path / "fp8"), block_size=4)
