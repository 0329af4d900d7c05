"""Tensor parallelism (engine.tp): every sharded layer kind against its un-sharded self.

Ranks run as threads of this process (engine.tp.ThreadGroup) except in the one gloo test. Each
test computes the un-sharded result itself and compares: outputs within float32 round-off
(the shards sum in another order), every rank bit-identical to the others, and each rank's
caches equal to the un-sharded caches at exactly the indices the shard map says it owns.
"""

from __future__ import annotations

import copy
import datetime
import os
import time

import pytest
import torch
from torch import nn

from engine.cache import ModelCache, plan_cache
from engine.models import ForwardBatch, load_model
from engine.models.attention import PagedAttention
from engine.models.families_falcon_h1 import FalconH1MLP, FalconH1Mixer
from engine.models.families_lfm2 import Lfm2Attention
from engine.models.families_qwen3_next import GatedAttention, SharedExpertMoE
from engine.models.gated_deltanet import GatedDeltaNetMixer
from engine.models.hybrid import DecoderLayer, HybridLM, LayerCacheSpec, ModelSpec, StateTensorSpec, mixer_cache_spec
from engine.models.layers import GatedMLP, GatedRMSNorm, RMSNorm, RotaryEmbedding, SparseMoE, SummedFFN
from engine.models.mamba2 import Mamba2Mixer
from engine.models.nemotron_moe import NemotronMLP, NemotronMoE
from engine.models.short_conv import ShortConvMixer
from engine.models.ssm import MambaMixer
from engine.phase import Phase
from engine.tp import DistGroup, SingleRank, layer_routes, layer_shards, model_shards, run_in_threads
from engine.tp.shard import shard_model, shard_module

# Float32, shards summed in another order: round-off of ~1e-7..1e-6 of the largest terms (seen
# up to 1.2e-6 through whole tiny models), so the tolerance scales with the tensor's magnitude.
TOL = 1e-5
HIDDEN = 32
BLOCK = 4


# ----------------------------------------------------------------------------- batches and caches

class Seqs:
    """Sequences with disjoint, non-contiguous block tables, stepped through ForwardBatches.
    A step's phase per sequence follows from its position: fresh, continued prefill, decode."""

    def __init__(self, count: int, max_blocks: int = 8):
        self.pos = [0] * count
        self.tables = [[i * max_blocks + j for j in reversed(range(max_blocks))] for i in range(count)]
        self.num_blocks = count * max_blocks

    def step(self, plan: list[tuple[int, int]], ids: list[int] | None = None) -> ForwardBatch:
        """plan: (sequence, tokens) per row; ids: the batch's tokens (zeros if not given)."""
        starts, positions, write, phases, ctx = [0], [], [], [], []
        for seq, n in plan:
            p = self.pos[seq]
            phases.append(Phase.FRESH_PREFILL if p == 0 else Phase.DECODE if n == 1 else Phase.CONTINUED_PREFILL)
            positions += range(p, p + n)
            write += [self.tables[seq][q // BLOCK] * BLOCK + q % BLOCK for q in range(p, p + n)]
            starts.append(starts[-1] + n)
            ctx.append(p + n)
            self.pos[seq] = p + n
        total = starts[-1]
        return ForwardBatch(
            input_ids=torch.tensor(ids if ids is not None else [0] * total), positions=torch.tensor(positions),
            query_starts=starts, context_lens=ctx, phases=phases, state_slots=[seq + 1 for seq, _ in plan],
            block_tables=torch.tensor([self.tables[seq] for seq, _ in plan]),
            kv_write_index=torch.tensor(write), block_size=BLOCK,
            logits_indices=torch.tensor(starts[1:]) - 1)


# Fresh prefills, a mixed step (decodes + a fresh prefill), a continued prefill, then decodes.
SCHEDULE = [[(0, 7), (1, 5)], [(0, 1), (1, 1), (2, 9)], [(0, 1), (2, 4)], [(0, 1), (1, 1), (2, 1)],
            [(0, 1), (1, 1), (2, 1)]]


def layer_cache(spec: LayerCacheSpec, num_blocks: int, slots: int = 4):
    if spec.kv is not None:
        shape = (num_blocks + 1, BLOCK, spec.kv.num_kv_heads, spec.kv.head_dim)
        return torch.zeros(shape), torch.zeros(shape)
    return tuple(torch.zeros(slots, *t.shape) for t in spec.state)


def randomize(module: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return module.eval()


def run_mixer(mixer: nn.Module, inputs: list[torch.Tensor]):
    """Run SCHEDULE; per step the output and a copy of the cache (KV pair or state tensors)."""
    spec = mixer_cache_spec("layer", mixer)
    seqs = Seqs(3)
    cache = layer_cache(spec, seqs.num_blocks)
    outs, snapshots = [], []
    with torch.inference_mode():
        for plan, x in zip(SCHEDULE, inputs):
            outs.append(mixer(x, seqs.step(plan), cache))
            snapshots.append(tuple(t.clone() for t in cache))
    return outs, snapshots, spec


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max(1, max |want|)."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item()) if want.numel() else 0.0


def assert_ranks_agree(per_rank: list[torch.Tensor]):
    for rank, t in enumerate(per_rank[1:], 1):
        assert torch.equal(t, per_rank[0]), f"rank {rank} differs from rank 0 (collectives must agree bit for bit)"


def check_mixer(make, size: int, seed: int = 0):
    """make() -> an un-sharded mixer; its TP=`size` shards must reproduce its outputs and caches."""
    full = randomize(make(), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = [torch.randn(sum(n for _, n in plan), HIDDEN, generator=gen) for plan in SCHEDULE]
    want, want_caches, spec = run_mixer(full, inputs)

    def rank(group):
        return run_mixer(shard_module(copy.deepcopy(full), group), inputs)

    results = run_in_threads(size, rank)
    shards = layer_shards(spec, size)
    for step in range(len(SCHEDULE)):
        outs = [r[0][step] for r in results]
        assert_ranks_agree(outs)
        err = max_err(outs[0], want[step])
        assert err < TOL, f"step {step}: max |diff| {err}"
        check_caches(spec, shards, want_caches[step], [r[1][step] for r in results], f"step {step}")
    for r, (_, _, local) in enumerate(results):  # the sharded mixer declares what the map says
        assert [t.shape for t in local.state] == [t.shape for t in shards[r].state]
        if spec.kv is not None:
            assert (local.kv.num_kv_heads, local.kv.head_dim) == shards[r].kv.shape
    return results


def check_caches(spec: LayerCacheSpec, shards, full, per_rank, where: str):
    """Each rank's cache = the un-sharded cache at the map's indices; reassembled from the ranks
    it is the whole cache; an index several ranks hold is bit-identical on all of them."""
    if spec.kv is not None:
        pairs = [(t, [s.kv.indices() for s in shards], 2) for t in range(2)]  # [block, slot, head, dim]
    else:
        pairs = [(t, [s.state[t].indices() for s in shards], 1) for t in range(len(spec.state))]
    for t, indices, dim in pairs:
        assembled = torch.full_like(full[t], float("nan"))
        seen: dict[int, torch.Tensor] = {}
        for r, idx in enumerate(indices):
            local = per_rank[r][t]
            want = full[t].index_select(dim, torch.tensor(idx))
            err = max_err(local, want)
            assert err < TOL, f"{where}: rank {r} tensor {t} max |diff| {err}"
            for j, i in enumerate(idx):
                part = local.select(dim, j)
                if i in seen:
                    assert torch.equal(seen[i], part), f"{where}: replicated index {i} differs across ranks"
                seen[i] = part
                assembled.select(dim, i).copy_(part)
        assert max_err(assembled, full[t]) < TOL, f"{where}: reassembled tensor {t}"


def check_ffn(make, size: int, seed: int = 0, tokens: int = 23):
    full = randomize(make(), seed)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    with torch.inference_mode():
        want = full(x)

    def rank(group):
        sharded = shard_module(copy.deepcopy(full), group)
        with torch.inference_mode():
            return sharded(x)

    outs = run_in_threads(size, rank)
    assert_ranks_agree(outs)
    assert max_err(outs[0], want) < TOL, f"max |diff| {max_err(outs[0], want)}"


# ----------------------------------------------------------------------------- attention

def rotary(head_dim=8):
    return RotaryEmbedding(head_dim, head_dim, 10000.0, None, 1024)


@pytest.mark.parametrize("heads,kv_heads,size,window", [
    (4, 2, 2, None), (4, 4, 4, None), (8, 2, 2, 5),
    (4, 1, 4, None),  # MQA: the one KV head on every rank
    (4, 2, 4, None),  # each KV head on two ranks
    (8, 2, 4, 6),
])
def test_attention(heads, kv_heads, size, window):
    check_mixer(lambda: PagedAttention(HIDDEN, heads, kv_heads, 8, True, True, rotary(), window), size)


def test_qwen3_next_gated_attention():
    check_mixer(lambda: GatedAttention(HIDDEN, 4, 2, 8, True, rotary(), 1e-6), 2)
    check_mixer(lambda: GatedAttention(HIDDEN, 4, 1, 8, False, rotary(), 1e-6), 4)


def test_lfm2_attention():
    check_mixer(lambda: Lfm2Attention(HIDDEN, 4, 2, 8, 1e-5, rotary()), 2)


# ----------------------------------------------------------------------------- FFNs

@pytest.mark.parametrize("size", [2, 4])
def test_gated_mlp(size):
    check_ffn(lambda: GatedMLP(HIDDEN, 48, "silu", bias=True), size)
    check_ffn(lambda: FalconH1MLP(HIDDEN, 48, "silu", True, 1.5, 0.6), size)
    check_ffn(lambda: NemotronMLP(HIDDEN, 24, "relu2", bias=True), size)


@pytest.mark.parametrize("size", [2, 4])
def test_moe(size):
    check_ffn(lambda: SparseMoE(HIDDEN, 16, 4, 2, "silu", normalize_top_k=True), size)
    check_ffn(lambda: SummedFFN(SparseMoE(HIDDEN, 16, 4, 2, "silu", False), GatedMLP(HIDDEN, 24, "silu")), size)
    check_ffn(lambda: SharedExpertMoE(SparseMoE(HIDDEN, 8, 3, 1, "silu", False), GatedMLP(HIDDEN, 24, "silu"),
                                      HIDDEN), size)


def test_nemotron_moe():
    check_ffn(lambda: NemotronMoE(HIDDEN, 12, 8, 4, 2, 1, 1, True, 2.5, None, "relu2", False), 2)
    # latent experts with biases (fc2_latent's bias must be added once), grouped routing
    check_ffn(lambda: NemotronMoE(HIDDEN, 12, 8, 4, 2, 2, 1, True, 1.0, 16, "relu2", True), 2)
    check_ffn(lambda: NemotronMoE(HIDDEN, 12, 8, 4, 2, 2, 1, False, 1.5, 16, "relu2", True), 4)


# ----------------------------------------------------------------------------- recurrent mixers

@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("jamba", [True, False])
def test_mamba(size, jamba):
    # Jamba: dt/B/C norms (after x_proj's all-reduce), no projection bias; Mamba: biases.
    check_mixer(lambda: MambaMixer(HIDDEN, 64, 8, 4, 6, conv_bias=True, proj_bias=not jamba, act="silu",
                                   bcdt_norm_eps=1e-6 if jamba else None), size)


def mamba2(heads: int, groups: int, d_state: int = 8, head_dim: int = 8, **kw) -> Mamba2Mixer:
    d_ssm = heads * head_dim
    return Mamba2Mixer(HIDDEN, heads, head_dim, groups, d_state, 4, 8, True, False, "silu", (0.0, float("inf")),
                       GatedRMSNorm(d_ssm, d_ssm // groups, 1e-5), **kw)


@pytest.mark.parametrize("heads,groups,size", [
    (8, 1, 2), (8, 1, 4),  # one group: B and C on every rank, the norm spans all ranks
    (8, 2, 2),  # groups split
    (8, 4, 2),  # two groups per rank
    (8, 2, 4),  # each group on two ranks: B/C partly replicated, the norm spans pairs of ranks
])
def test_mamba2(heads, groups, size):
    results = check_mixer(lambda: mamba2(heads, groups), size)
    conv_channels = [r[2].state[0].shape[0] for r in results]
    assert conv_channels == [heads * 8 // size + 2 * max(1, groups // size) * 8] * size


def test_mamba2_replicated_groups_trap():
    """n_groups=1 at TP 2: a contiguous half of the conv channels would hand rank 1 half of B and
    all of C. The shard map keeps x's half plus all of B and C; the conv state follows it."""
    spec = mixer_cache_spec("mamba2", mamba2(8, 1))
    shards = layer_shards(spec, 2)
    d_ssm, n = 64, 8
    assert shards[1].state[0].spans == ((32, 64), (d_ssm, d_ssm + n), (d_ssm + n, d_ssm + 2 * n))
    assert shards[0].state[0].replicated and not shards[0].state[1].replicated


@pytest.mark.parametrize("norm", ["before_gate", "after_gate", "none"])
def test_falcon_h1_mixer(norm):
    def make():
        d_ssm = 64
        gated = None if norm == "none" else GatedRMSNorm(d_ssm, d_ssm // 2, 1e-5, norm == "before_gate")
        return FalconH1Mixer(HIDDEN, 8, 8, 2, 8, 4, 8, True, True, "silu", (0.0, float("inf")), gated,
                             in_scale=1.4, part_scales=(0.9, 1.2, 0.5, 1.6, 0.75), out_bias=True)
    check_mixer(make, 2)
    check_mixer(make, 4)


@pytest.mark.parametrize("k_heads,v_heads,size", [
    (2, 4, 2),  # key heads split
    (1, 4, 2), (2, 4, 4),  # key heads replicated: every rank / pairs of ranks
    (3, 6, 3),
])
def test_gated_deltanet(k_heads, v_heads, size):
    check_mixer(lambda: GatedDeltaNetMixer(HIDDEN, k_heads, v_heads, 6, 4, 4, "silu", 1e-6, chunk_size=4), size)


@pytest.mark.parametrize("size", [2, 4])
def test_short_conv(size):
    check_mixer(lambda: ShortConvMixer(HIDDEN, 3, bias=True), size)


# ----------------------------------------------------------------------------- whole models

def generate(model, steps: int = 4, prompt_len: int = 11):
    """Greedy: a fresh prefill of a fixed prompt, then `steps` decodes. (logits per step, tokens)."""
    spec = model.spec
    sizes = plan_cache(spec, torch.float32, BLOCK, 2, 64, 1 << 26, 16)
    cache = ModelCache(spec, sizes, BLOCK, torch.float32, "cpu")
    seqs = Seqs(1, max_blocks=16)
    ids = [(7 * i + 3) % spec.vocab_size for i in range(prompt_len)]
    all_logits, tokens = [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            logits = model(seqs.step([(0, len(ids))], ids), cache.layers)
            all_logits.append(logits)
            ids = [int(logits[-1].argmax())]
            tokens.append(ids[0])
    return all_logits, tokens, cache


def check_model(full: HybridLM, size: int):
    want, want_tokens, _ = generate(full)
    results = run_in_threads(size, lambda group: generate(shard_model(copy.deepcopy(full), group)))
    for step, expected in enumerate(want):
        got = [r[0][step] for r in results]
        assert_ranks_agree(got)
        err = max_err(got[0], expected)
        assert err < TOL, f"step {step}: max |logit diff| {err}"
    for r in results:
        assert r[1] == want_tokens
    return want, results


WHOLE_MODELS = ["jamba", "llama", "granitemoehybrid", "bamba", "mamba", "falcon_h1", "nemotron_h", "zamba2",
                "qwen3_next", "lfm2", "lfm2_moe", "olmo_hybrid", "kimi_linear"]


@pytest.mark.parametrize("name", WHOLE_MODELS)
def test_whole_model_tp2(name, model_factory):
    path, _ = model_factory(name)
    full = load_model(path)
    check_model(full, 2)


@pytest.mark.parametrize("name", ["jamba", "granitemoehybrid", "qwen3_next", "zamba2"])
def test_whole_model_tp4(name, model_factory):
    """TP 4: KV heads, Mamba2 groups and Gated DeltaNet key heads replicated over rank pairs."""
    path, _ = model_factory(name)
    check_model(load_model(path), 4)


def test_single_rank_is_the_model(model_factory):
    path, _ = model_factory("jamba")
    full = load_model(path)
    want, tokens, _ = generate(full)
    model = shard_model(copy.deepcopy(full), SingleRank())
    got, got_tokens, _ = generate(model)
    assert got_tokens == tokens and all(torch.equal(a, b) for a, b in zip(got, want))
    assert model.full_spec == model.spec == full.spec


def test_sharded_model_spec(model_factory):
    path, _ = model_factory("granitemoehybrid")
    full = load_model(path)
    shards = model_shards(full.spec, 2)
    models = run_in_threads(2, lambda group: shard_model(copy.deepcopy(full), group))
    for rank, model in enumerate(models):
        assert model.full_spec == full.spec
        for layer, planned in zip(model.spec.layers, shards[rank]):
            assert [t.shape for t in layer.state] == [t.shape for t in planned.state]
            assert (layer.kv is None) == (planned.kv is None)
        params = sum(p.numel() for p in model.parameters())
        assert params < 0.75 * sum(p.numel() for p in full.parameters()), "weights were not sharded"


@pytest.mark.parametrize("name", ["jamba", "granitemoehybrid", "falcon_h1"])
def test_handoff_routes_between_tp_sizes(name, model_factory):
    """Caches prefilled at one TP size, routed to another's layout by layer_routes, equal what
    that TP size computes itself (TP 2 -> 4, 4 -> 2, 2 -> 1)."""
    path, _ = model_factory(name)
    full = load_model(path)

    def tensors(cache):  # "layer{i}.{k|v|state name}" -> the hand-off view of that tensor
        return {n: t for n, _, _, _, t in cache.handoff_tensors()}

    caches = {1: [tensors(generate(full, steps=0)[2])]}
    for size in (2, 4):
        caches[size] = [tensors(r[2]) for r in run_in_threads(
            size, lambda group: generate(shard_model(copy.deepcopy(full), group), steps=0))]
    for src, dst in ((2, 4), (4, 2), (2, 1)):
        for dst_rank in range(dst):
            for i, layer in enumerate(full.spec.layers):
                routes = layer_routes(layer, src, dst, dst_rank)
                for which in ["k", "v"] * (layer.kv is not None) + [t.name for t in layer.state]:
                    name_ = f"layer{i}.{which}"
                    # KV pools are [blocks, block_size, kv_heads, head_dim]; state pools [slots, ...].
                    key, dim = ("kv", 2) if which in ("k", "v") else (which, 1)
                    want = caches[dst][dst_rank][name_]
                    built = torch.full_like(want, float("nan"))
                    for p in routes[key]:
                        source = caches[src][p.src_rank][name_]
                        built.narrow(dim, p.dst_start, p.length).copy_(source.narrow(dim, p.src_start, p.length))
                    assert max_err(built, want) < TOL, f"{name_} {src}->{dst} rank {dst_rank}"


# ----------------------------------------------------------------------------- torch.distributed

def _gloo_rank(rank: int, path: str, rendezvous: str, out_dir: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["SPLITSERVE_DISABLE_CPU_KERNELS"] = "1"  # torch decode paths: no JIT compile per process
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = shard_model(load_model(path), DistGroup())
    logits, tokens, _ = generate(model, steps=3)
    torch.save({"logits": logits, "tokens": tokens}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    # Without teardown: gloo's threads, destroyed at interpreter exit while the peer goes away,
    # sometimes abort the process ("terminate called without an active exception") after the
    # results are written, which would fail a correct run.
    os._exit(0)


def test_gloo_process_group_matches_unsharded(model_factory, tmp_path):
    import torch.multiprocessing as mp

    path, _ = model_factory("jamba")
    want, want_tokens, _ = generate(load_model(path), steps=3)
    ctx = mp.start_processes(_gloo_rank, args=(str(path), str(tmp_path / "rendezvous"), str(tmp_path)),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail("gloo ranks did not finish within 180 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for step, expected in enumerate(want):
        assert torch.equal(ranks[0]["logits"][step], ranks[1]["logits"][step])
        assert max_err(ranks[0]["logits"][step], expected) < TOL
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == want_tokens


# ----------------------------------------------------------------------------- refusals

def shard_fails(module, size: int, match: str):
    def rank(group):
        with pytest.raises(ValueError, match=match):
            shard_module(module if group.size == 1 else copy.deepcopy(module), group)
    run_in_threads(size, rank)


def test_indivisible_sizes_are_refused():
    shard_fails(PagedAttention(HIDDEN, 6, 6, 8, False, False, None), 4, r"attention heads \(6\) is not divisible by 4")
    shard_fails(PagedAttention(HIDDEN, 6, 3, 8, False, False, None), 2, r"KV heads \(3\)")
    shard_fails(PagedAttention(HIDDEN, 12, 3, 8, False, False, None), 4, r"KV heads \(3\)")
    shard_fails(GatedMLP(HIDDEN, 10, "silu"), 4, r"MLP intermediate size \(10\)")
    shard_fails(SparseMoE(HIDDEN, 6, 4, 2, "silu", True), 4, r"MoE expert intermediate size \(6\)")
    shard_fails(MambaMixer(HIDDEN, 30, 8, 4, 4, True, False, "silu", None), 4, r"Mamba d_inner channels \(30\)")
    shard_fails(mamba2(3, 1), 2, r"Mamba2 heads \(3\)")
    shard_fails(mamba2(6, 3), 2, r"Mamba2 n_groups \(3\)")
    shard_fails(GatedDeltaNetMixer(HIDDEN, 3, 6, 4, 4, 4, "silu", 1e-6), 2, r"Gated DeltaNet key heads \(3\)")
    shard_fails(ShortConvMixer(30, 3, False), 4, r"short conv channels \(30\)")


class CustomMixer(nn.Module):
    state_kind = "custom"

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def state_spec(self):
        return [StateTensorSpec("h", (HIDDEN,))]

    def forward(self, x, batch, state):
        return self.proj(x)


class Mamba2Variant(Mamba2Mixer):
    """A subclass the sharding does not know: its forward could differ from its base's."""


def tiny_model(kind: str, mixer: nn.Module) -> HybridLM:
    layers = [DecoderLayer("attention", RMSNorm(HIDDEN, 1e-5), PagedAttention(HIDDEN, 4, 2, 8, False, False, None),
                           RMSNorm(HIDDEN, 1e-5), GatedMLP(HIDDEN, 48, "silu")),
              DecoderLayer(kind, RMSNorm(HIDDEN, 1e-5), mixer)]
    return randomize(HybridLM(ModelSpec("tiny", 64, HIDDEN), layers, RMSNorm(HIDDEN, 1e-5), False), 3)


@pytest.mark.parametrize("kind,mixer,match", [
    ("custom", CustomMixer,
     r"layer 1 \(custom\).*layer kind 'custom' \(mixer CustomMixer\) is not supported at TP size 2"),
    ("mamba2", lambda: Mamba2Variant(HIDDEN, 4, 8, 1, 8, 4, 8, True, False, "silu", (0.0, 1.0), None),
     r"layer 1 \(mamba2\).*Mamba2Variant\) is not supported at TP size 2"),
    ("mamba2", lambda: mamba2(6, 3), r"layer 1 \(mamba2\).*Mamba2 n_groups \(3\)"),
])
def test_unsupported_layers_are_refused_before_anything_changes(kind, mixer, match):
    full = tiny_model(kind, mixer())
    before = {k: v.clone() for k, v in full.state_dict().items()}

    def rank(group):
        model = copy.deepcopy(full)
        with pytest.raises(ValueError, match=match):
            shard_model(model, group)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert model.spec == full.spec and type(model) is HybridLM

    run_in_threads(2, rank)


def test_shard_map_refuses_unknown_state_kinds():
    layer = LayerCacheSpec("custom", None, "custom", (StateTensorSpec("h", (8,)),))
    with pytest.raises(ValueError, match=r"layer kind 'custom' with state kind 'custom'.*TP size 2"):
        layer_shards(layer, 2)


def test_unknown_ffn_is_refused():
    class Other(nn.Module):
        def forward(self, x):
            return x
    shard_fails(Other(), 2, r"FFN kind Other is not supported at TP size 2")
