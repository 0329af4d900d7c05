"""Multi-head latent attention as a KV kind (engine.models.mla): one latent row per token in the
cache, decode in the absorbed form held to the expanded form on every decode kernel, and the
cache it declares. Whole-model exactness against transformers is in the zoo tests (kimi_linear)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import DEVICE, enter_kernel_mode, requires_triton  # first: it sets Triton's mode
from engine.cache import bytes_per_block
from engine.kernels import cpu, cpu_kernels_ready, paged_attention_decode_ref
from engine.kernels.paged_attention import paged_attention_decode_triton
from engine.models import load_model
from engine.models import mla as mla_module
from engine.models.mla import LATENT_KIND, LatentAttention


def random_mla(q_lora_rank=None, heads=4, latent=16, nope=8, shared=4, v_dim=12, device="cpu"):
    torch.manual_seed(heads + latent + nope)
    layer = LatentAttention(32, heads, q_lora_rank, latent, nope, shared, v_dim, bias=False, latent_eps=1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer.to(device)


def random_cache(layer, lengths, block_size=4, device="cpu"):
    """A latent pool with each sequence's rows in scattered blocks, and its block tables."""
    width = layer.kv_spec().head_dim
    per_seq = [-(-n // block_size) for n in lengths]
    blocks = torch.randperm(sum(per_seq) + 3)
    cache = torch.randn(len(blocks), block_size, 1, width, device=device)
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.long)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = blocks[start:start + n]
        start += n
    return cache, tables.to(device), torch.tensor(lengths, device=device)


@pytest.mark.parametrize("q_lora_rank", [None, 6])
@pytest.mark.parametrize("nope,shared", [(8, 4), (0, 6), (6, 0)])
def test_absorbed_decode_equals_the_expanded_form(q_lora_rank, nope, shared):
    """Decode rows attending to the cached latent rows directly (absorbed) give the expanded
    form's output: contexts of 1 token, within one block, across blocks."""
    layer = random_mla(q_lora_rank, nope=nope, shared=shared)
    cache, tables, lens = random_cache(layer, [1, 3, 4, 9, 13])
    q = torch.randn(len(lens), layer.num_heads, layer.qk_dim)
    with torch.no_grad():
        absorbed = layer.attend_absorbed(q, cache, tables, lens)
        expanded = layer.decode_expanded(q, cache, tables, lens)
    assert absorbed.shape == (len(lens), layer.num_heads, layer.v_dim)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_on_each_cpu_kernel(monkeypatch):
    """The C++ paged decode and the torch reference both serve the absorbed form (one KV head,
    keys and values the same latent rows, a head width that is no power of two)."""
    layer = random_mla(latent=20, shared=6)
    cache, tables, lens = random_cache(layer, [2, 7, 11])
    q = torch.randn(3, layer.num_heads, layer.qk_dim)
    with torch.no_grad():
        want = layer.decode_expanded(q, cache, tables, lens)
        outs = {}
        for name, kernel in (("ref", paged_attention_decode_ref), ("cpu", cpu.paged_attention_decode_cpu)):
            if name == "cpu" and not cpu_kernels_ready():
                continue
            monkeypatch.setattr(mla_module, "paged_attention_decode", kernel)
            outs[name] = layer.attend_absorbed(q, cache, tables, lens)
    assert outs, "no kernel ran"
    for got in outs.values():
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
@requires_triton
def test_absorbed_decode_on_the_triton_kernel(monkeypatch):
    enter_kernel_mode()
    layer = random_mla(latent=16, shared=8, device=DEVICE)
    cache, tables, lens = random_cache(layer, [1, 6, 17], device=DEVICE)
    q = torch.randn(3, layer.num_heads, layer.qk_dim, device=DEVICE)
    with torch.no_grad():
        want = layer.decode_expanded(q, cache, tables, lens)
        monkeypatch.setattr(mla_module, "paged_attention_decode", paged_attention_decode_triton)
        got = layer.attend_absorbed(q, cache, tables, lens)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_cache_keeps_one_latent_row_per_token(model_factory):
    """What the layer declares is what the engine allocates: one tensor of [latent + shared key]
    per token and MLA layer, never expanded K and V."""
    path, _ = model_factory("kimi_linear")
    model = load_model(path)
    (index,) = model.spec.attention_layers
    spec = model.spec.layers[index].kv
    layer = model.layers[index].mixer
    assert (spec.names, spec.kind, spec.num_kv_heads) == (("latent",), LATENT_KIND, 1)
    assert spec.head_dim == layer.kv_lora_rank + layer.shared_dim == 24
    assert bytes_per_block(model.spec, torch.float32, 4) == 4 * 24 * 4
    expanded = layer.num_heads * (layer.qk_dim + layer.v_dim)  # K and V of every head: 4 * (16 + 12)
    assert layer.latent_cache_ratio() == pytest.approx(expanded / 24)


def test_kimi_linear_48b_latent_rows_are_a_fraction_of_expanded_kv():
    """The released Kimi-Linear-48B-A3B's MLA sizes (32 heads, kv_lora_rank 512, nope 128, shared
    key 64, v 128): 576 values per token and layer instead of 10240."""
    with torch.device("meta"):
        layer = LatentAttention(2304, 32, None, 512, 128, 64, 128, bias=False, latent_eps=1e-6)
    assert layer.kv_spec().head_dim == 576
    assert layer.latent_cache_ratio() == pytest.approx(10240 / 576)
