"""Recurrent state stored at half width (engine.state_format, mamba_state_dtype).

The oracle here is the float32 engine, itself held to transformers by the rest of the suite:
a narrow layer must compute exactly what the float32 layer computes from the same (rounded)
state, and store exactly the stochastic rounding of it. Both are checked bit for bit, on the
layer path and on the one-call CPU decode stack, for every family with recurrent state. What
the rounding then changes over many steps is drift, bounded here loosely (a misread slot
moves logits by whole units) and measured by `splitserve bench quant` (docs/benchmarks.md).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernel_support import DEVICE, enter_kernel_mode  # first: it sets Triton's mode

from bench.kernels import decode_updates
from bench.quant import forced_logits
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kernels import _triton, native
from engine.kernels.state_round import state_load_triton, state_store_triton
from engine.llm_engine import LLMEngine
from engine.state_format import stochastic_round
from kvtransfer import CacheTensors, LayoutMismatchError
from tests import oracle
from tests.test_handoff_engine import run_disaggregated

NARROW = (torch.bfloat16, torch.float16)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
STATE_FAMILIES = ["jamba", "mamba", *oracle.RECURRENT_FAMILIES]


def edge_and_random_values(rows: int = 3, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 7e4, -7e4, 6e-8, -6e-8, 1e-9, 3e-5,
                          float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-38])
    spread = torch.cat([torch.randn(rows, 400) * scale for scale in (1e-6, 1e-3, 1.0, 1e2, 3e4)], 1)
    return torch.cat([edges.repeat(rows, 1), spread], 1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan() & b.isnan()  # NaN payloads may differ
    return torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan]) and torch.equal(a.isnan(), b.isnan())


# --------------------------------------------------------------------- the rounding itself

@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_the_cpu_kernel_rounds_bit_for_bit_as_the_torch_path(dtype):
    if not native.available():
        pytest.skip("no C++ compiler: the CPU kernels are not built here")
    from engine.state_format import FORMATS

    values = edge_and_random_values()
    slots, positions = torch.tensor([2, 0, 1]), torch.tensor([1, 77, 123456])
    working = torch.zeros(4, values.shape[1])
    working[slots] = values
    pool = torch.zeros(4, values.shape[1], dtype=dtype)
    native.call("state_store", working=working, pool=pool, slots=slots, positions=positions, rows=3,
                row_numel=values.shape[1], format=FORMATS[dtype])
    assert same_bits(pool[slots], stochastic_round(values, dtype, positions, torch.arange(values.shape[1])))
    back = torch.zeros_like(working)
    native.call("state_load", pool=pool, working=back, slots=slots, rows=3, row_numel=values.shape[1],
                format=FORMATS[dtype])
    assert torch.equal(back[slots].nan_to_num(0.5), pool[slots].float().nan_to_num(0.5))


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_the_triton_kernels_round_bit_for_bit_as_the_torch_path(dtype):
    """The one-pass store and load CUDA runs (engine.kernels.state_round), compiled on a GPU,
    under the interpreter here: the torch path's bits at the slots, rows 2.5 blocks long, and
    every other pool row and working row left as it was."""
    if not _triton.available():
        pytest.skip("Triton is not installed")
    enter_kernel_mode()
    values = torch.cat([edge_and_random_values()] * 2, 1)[:, :2560]
    slots, positions = torch.tensor([4, 0, 2]), torch.tensor([1, 77, 2 ** 33 + 123456])  # past 32 bits: its low ones
    working = torch.full((5, values.shape[1]), 7.0)
    working[slots] = values
    pool = torch.full((5, values.shape[1]), -3.0, dtype=dtype)
    working, pool, slots, positions = (t.to(DEVICE) for t in (working, pool, slots, positions))
    state_store_triton(working, pool, slots, positions)
    want = stochastic_round(values, dtype, positions.cpu(), torch.arange(values.shape[1]))
    assert same_bits(pool[slots].cpu(), want)
    assert (pool[[1, 3]] == -3.0).all()
    back = torch.full_like(working, 5.0)
    state_load_triton(pool, back, slots)
    assert torch.equal(back[slots].nan_to_num(0.5), pool[slots].float().nan_to_num(0.5))
    assert (back[[1, 3]] == 5.0).all()


@pytest.mark.triton
@pytest.mark.parametrize("kernel", ["causal_conv1d_update", "selective_state_update", "mamba2_state_update",
                                    "gated_delta_step"])
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_decode_kernels_update_a_half_width_pool_as_load_and_store_would(kernel, dtype):
    """Each decode kernel that takes a half-width pool in place (an all-decode step on CUDA:
    engine.state_format) reads it exactly and stores each slot stochastically rounded: its output
    and the pool are bit for bit those of the kernel on float32 working rows followed by the
    rounded store, and slots outside the batch are left as they were."""
    if not _triton.available():
        pytest.skip("Triton is not installed")
    enter_kernel_mode()
    slots, positions = torch.tensor([5, 1, 3], device=DEVICE), torch.tensor([17, 4, 260], device=DEVICE)
    shape, run = decode_updates(DEVICE, 3, scale=256)[kernel]  # bench.kernels' inputs, small
    narrow = (torch.randn(7, *shape, device=DEVICE) * 3).to(dtype)
    working = narrow.float()
    want = run(working, slots, None)
    stored = narrow.clone()
    state_store_triton(working, stored, slots, positions)
    got = run(narrow, slots, positions)
    assert torch.equal(got, want)
    assert torch.equal(narrow.view(torch.int16), stored.view(torch.int16))
    with pytest.raises(ValueError, match="needs int64 positions"):
        run(narrow, slots, None)


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_rounding_picks_a_neighbour_keeps_what_the_format_holds_and_is_unbiased(dtype):
    values = edge_and_random_values()[:, 19:]  # finite, in range
    values = values[:, values[0].abs() < 6e4]
    rounded = stochastic_round(values, dtype, torch.tensor([5, 6, 7]), torch.arange(values.shape[1])).float()
    down = torch.where(values.to(dtype).float() <= values, values.to(dtype),
                       torch.nextafter(values.to(dtype), torch.tensor(float("-inf"), dtype=dtype))).float()
    up = torch.where(values.to(dtype).float() >= values, values.to(dtype),
                     torch.nextafter(values.to(dtype), torch.tensor(float("inf"), dtype=dtype))).float()
    assert bool(((rounded == down) | (rounded == up)).all())
    exact = values.to(dtype).float()
    assert torch.equal(stochastic_round(exact, dtype, torch.tensor([5, 6, 7]), torch.arange(values.shape[1])).float(),
                       exact)
    # One value a third of the way between two neighbours, rounded at 20,000 positions: the mean
    # is the value (to a few standard errors), where round-to-nearest is off by a third of a gap.
    one = torch.tensor(1.0, dtype=dtype)
    gap = float(torch.nextafter(one, torch.tensor(2.0, dtype=dtype))) - 1.0
    x = torch.full((20000, 1), 1.0 + gap / 3)
    mean = float(stochastic_round(x, dtype, torch.arange(20000), torch.zeros(1, dtype=torch.long)).double().mean())
    assert abs(mean - (1.0 + gap / 3)) < 4 * gap * (2 / 9 / 20000) ** 0.5
    assert abs(float(x.to(dtype)[0, 0]) - (1.0 + gap / 3)) > gap / 4


def test_a_decay_smaller_than_half_a_unit_still_decays():
    """h <- 0.9999 h per token: bfloat16's round-to-nearest returns 1.0 every time (the step is
    below half a unit), stochastic rounding follows float32's 0.9999^t: over 512 elements (each
    its own draws) the mean is within 5 standard errors (each element's spread after 3000
    roundings is about 0.09)."""
    h_nearest, h_stochastic = torch.ones(1, 512), torch.ones(1, 512)
    for t in range(1, 3001):
        h_nearest = (h_nearest * 0.9999).to(torch.bfloat16).float()
        h_stochastic = stochastic_round(h_stochastic * 0.9999, torch.bfloat16, torch.tensor([t]),
                                        torch.arange(512)).float()
    assert float(h_nearest.min()) == 1.0
    assert abs(float(h_stochastic.mean()) - 0.9999 ** 3000) < 5 * 0.09 / 512 ** 0.5


def test_rounding_is_a_function_of_value_position_and_element_alone():
    values = torch.randn(4, 300)
    a = stochastic_round(values, torch.bfloat16, torch.tensor([9, 9, 9, 9]), torch.arange(300))
    b = stochastic_round(values.flip(0), torch.bfloat16, torch.tensor([9, 9, 9, 9]), torch.arange(300)).flip(0)
    assert torch.equal(a, b)  # row order (the batch) does not matter
    c = stochastic_round(values, torch.bfloat16, torch.tensor([10, 10, 10, 10]), torch.arange(300))
    assert not torch.equal(a, c)  # the next position draws again


# --------------------------------------------------------------------- the engine

def rows_of(engine: LLMEngine, request_id: str) -> list[torch.Tensor]:
    slot = engine.slots.slot_of[request_id]
    return [t[slot].clone() for _, t in engine.cache.slot_tensors()]


@pytest.mark.parametrize("family", STATE_FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_narrow_layer_computes_and_stores_exactly_what_float32_would(family, dtype, model_factory):
    """Prefill, then two decode steps on the one-call stack and one on the layer path. Before each
    step the float32 engine's slot is given the narrow engine's (widened) state; then both steps'
    logits must be equal bit for bit, and the narrow slot must hold exactly the stochastic rounding
    of the float32 slot."""
    path, _ = model_factory(family)
    prompt = [random.Random(3).randrange(3, 300) for _ in range(13)]
    wide = LLMEngine(EngineConfig(str(path), block_size=4))
    narrow = LLMEngine(EngineConfig(str(path), block_size=4, mamba_state_dtype=dtype))
    torch_dtype = getattr(torch, dtype)
    assert narrow.cache.sizes.bytes_per_slot * 2 == wide.cache.sizes.bytes_per_slot
    assert all(t.dtype == torch_dtype for _, t in narrow.cache.slot_tensors())
    # an all-decode step on Triton hands every recurrent mixer its pool (tests/test_narrow_in_place.py)
    recurrent = [i for i, layer in enumerate(narrow.spec.layers) if layer.state]
    assert recurrent and all("state" in narrow.model.in_place_readers(i) for i in recurrent)
    logits = {}
    for engine in (wide, narrow):
        engine.add_request(prompt, GREEDY, request_id="r")
        execute = engine.runner.execute
        engine.runner.execute = lambda seqs, e=engine, run=execute: logits.setdefault(id(e), []).append(
            run(seqs).clone()) or logits[id(e)][-1]
    for step, layer_path in enumerate([False, False, False, True]):
        if step:  # the float32 engine resumes from exactly the state the narrow one holds
            slot = wide.slots.slot_of["r"]
            for (_, w), value in zip(wide.cache.slot_tensors(), rows_of(narrow, "r")):
                w[slot] = value.float()
        for engine in (wide, narrow):
            engine.runner.decode_stack, kept = (None, engine.runner.decode_stack) if layer_path else \
                (engine.runner.decode_stack, None)
            engine.step()
            if kept is not None:
                engine.runner.decode_stack = kept
        assert torch.equal(logits[id(wide)][-1], logits[id(narrow)][-1]), f"step {step}"
        length = len(prompt) + step
        for stored, computed in zip(rows_of(narrow, "r"), rows_of(wide, "r")):
            expected = stochastic_round(computed[None], torch_dtype, torch.tensor([length]),
                                        torch.arange(computed.numel()).view(computed.shape))[0]
            assert same_bits(stored, expected), f"step {step}"


@pytest.mark.parametrize("family", ["jamba", "bamba", "qwen3_next"])
def test_drift_over_many_steps_stays_within_the_formats_precision(family, model_factory):
    path, _ = model_factory(family)
    prompt = [random.Random(4).randrange(3, 300) for _ in range(20)]
    base = LLM(str(path))
    tokens = base.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    reference = forced_logits(base, prompt, tokens)
    # Measured on these models (bench quant's method): bfloat16 up to 0.32 (a MoE route flipped),
    # float16 under 0.01; a state read from the wrong slot or row moves logits by whole units.
    for dtype, bound in (("bfloat16", 0.5), ("float16", 0.05)):
        drift = (forced_logits(LLM(str(path), mamba_state_dtype=dtype), prompt, tokens) - reference).abs()
        assert float(drift.max()) < bound, (dtype, float(drift.max()))
        assert float(drift[0].max()) == 0.0  # the prefill's logits read no stored state


def test_split_with_narrow_state_equals_colocated_and_the_handshake_names_a_format_mismatch(model_factory):
    path, _ = model_factory("bamba")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 40)]
    engines = [LLMEngine(EngineConfig(str(path), block_size=4, mode=mode, max_num_batched_tokens=16,
                                      mamba_state_dtype="bfloat16")) for mode in ("prefill", "decode")]
    split = run_disaggregated(path, prompts, GREEDY, engines=engines)
    colocated = LLM(str(path), block_size=4, mamba_state_dtype="bfloat16",
                    max_num_batched_tokens=16).generate(prompts, GREEDY)
    # The rounding hashes value, position and element: the same state on either side of the split.
    assert [o.token_ids for o in split] == [o.token_ids for o in colocated]
    wide = LLMEngine(EngineConfig(str(path), block_size=4, mode="decode"))
    layouts = [CacheTensors.from_named(4, engine.cache.handoff_tensors()).layout for engine in (engines[0], wide)]
    with pytest.raises(LayoutMismatchError, match=r"layer0\.conv: dtype bfloat16 vs float32"):
        layouts[0].check_compatible(layouts[1], "prefill", "decode")


def test_prefix_cache_hits_resume_from_the_stored_narrow_checkpoint(model_factory, tmp_path):
    path, _ = model_factory("mamba2")
    prompt = [random.Random(6).randrange(3, 300) for _ in range(37)]
    llm = LLM(str(path), block_size=4, enable_prefix_caching=True, mamba_state_dtype="float16")
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens > 0
    # The first run stored its checkpoint rounded at the same position the hit resumes from.
    assert second.token_ids == first.token_ids
    from engine.tiered_cache import cache_fingerprint

    wide = LLM(str(path), block_size=4, enable_prefix_caching=True)
    assert cache_fingerprint(str(path), "float32", 4, llm.engine.cache) != \
        cache_fingerprint(str(path), "float32", 4, wide.engine.cache)  # a disk entry of one is not the other's


def test_bad_state_dtype_is_refused_naming_the_field(model_factory):
    path, _ = model_factory("mamba")
    with pytest.raises(ValueError, match=r"mamba_state_dtype: 'float8' not in \['float32', 'bfloat16', 'float16'\]"):
        EngineConfig(str(path), mamba_state_dtype="float8")


def test_tensor_parallel_ranks_keep_the_same_format_and_hand_it_off(model_factory):
    """Two ranks, bfloat16 state: the follower builds its cache in the leader's format (a
    hand-off's staging rows gathered from both ranks are bfloat16, what the leader's shard holds
    and the follower's shard too), and decoding stays within the drift bound of one rank."""
    from engine.staging import HandoffStaging

    path, _ = model_factory("granitemoehybrid")
    prompt = [random.Random(7).randrange(3, 300) for _ in range(19)]
    one = LLM(str(path), block_size=4, mamba_state_dtype="bfloat16")
    tokens = one.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    two = LLM(str(path), block_size=4, mamba_state_dtype="bfloat16", tensor_parallel_size=2)
    try:
        drift = (forced_logits(two, prompt, tokens) - forced_logits(one, prompt, tokens)).abs()
        assert float(drift.max()) < 0.5
        engine = two.engine
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), request_id="h")
        engine.step()
        staging = HandoffStaging(engine, requests=1)
        staged = staging.take("h", len(engine.blocks.table("h")))
        staging.gather(staged, list(engine.blocks.table("h")), engine.slots.slot_of["h"])
        full = staging.cache.slot_tensors()
        assert full and all(t.dtype == torch.bfloat16 for _, t in full)
        assert all(bool(torch.isfinite(t[staged.slot].float()).all()) for _, t in full)
    finally:
        two.engine.close()


def test_the_static_decode_path_and_the_torch_rounding_give_the_same_tokens(model_factory):
    """The GPU's ways, run here: decode steps on the static (padded) path, whose slots and
    lengths come from its persistent tensors alone, and the torch rounding instead of the C++
    one. Both must give the plain narrow engine's tokens and its stored bits."""
    path, _ = model_factory("jamba")
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 4, 9, 17)]
    runs = []
    for static, torch_rounding in ((False, False), (True, False), (False, True)):
        llm = LLM(str(path), block_size=4, mamba_state_dtype="bfloat16")
        if static:
            llm.engine.runner.use_static_decode(capture=False)
        if torch_rounding:  # and no one-call C++ decode stack, which rounds in C++
            llm.engine.cache.layers.narrow.state.native = False
            llm.engine.runner.decode_stack = None
        runs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
    assert runs[1] == runs[0] and runs[2] == runs[0]
