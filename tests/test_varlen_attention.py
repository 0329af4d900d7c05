"""Prefill attention in one varlen call over the paged cache (engine.kernels.varlen_attention).

The kernel is torch's FlashAttention (CUDA, half precision); what can go wrong on our side is the
bookkeeping around it: which tokens are the prefill rows' queries, their cumulative lengths,
contexts and block tables, the causal alignment and window, and where the output lands. On CPU
the kernel is replaced by a stand-in that checks the arguments as the kernel documents them and
computes the documented semantics (varlen_attention_ref), and whole engines run through it,
judged by transformers. On a GPU the real kernel is held to the reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import varlen_attention
from engine.kernels.varlen_attention import VarlenRows, varlen_attention_ref
from tests.oracle import judge_greedy


def stand_in(calls: list):
    """torch's varlen_attn as documented, on any device: checks its arguments, records the call."""

    def kernel(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa, seqused_k, block_table):
        assert cu_seq_q.dtype == cu_seq_k.dtype == seqused_k.dtype == block_table.dtype == torch.int32
        lens = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
        assert int(cu_seq_q[-1]) == q.shape[0] and max_q == max(lens)
        assert (cu_seq_k[1:] - cu_seq_k[:-1]).tolist() == seqused_k.tolist() and max_k == int(seqused_k.max())
        assert all(n <= c for n, c in zip(lens, seqused_k.tolist())), "more queries than context"
        assert enable_gqa == (q.shape[1] != k.shape[2]) and window_size[1] == 0
        calls.append(len(lens))
        rows = VarlenRows(slice(None), cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k)
        window = None if window_size[0] == -1 else window_size[0] + 1
        return varlen_attention_ref(q, k, v, rows, scale, window)
    return kernel


@pytest.fixture
def one_call(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(varlen_attention, "_kernel", stand_in(calls))
    monkeypatch.setattr(varlen_attention, "available", lambda q, k_cache: True)
    return calls


@pytest.mark.parametrize("name", ["llama", "mistral_mqa_window", "jamba", "qwen3_next"])
def test_engines_through_the_one_call_path_match_transformers(model_factory, one_call, name):
    """Chunked prompts (continued chunks read the cache), prompts beside decodes, a prefix-cache
    hit and a sliding window, every token judged by transformers, every prefill through one call."""
    path, hf = model_factory(name)
    llm = LLM(path, block_size=4, max_num_batched_tokens=24, enable_prefix_caching=True)
    rng = random.Random(7)
    system = [rng.randrange(3, 300) for _ in range(30)]
    prompts = [system + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 9, 17)]
    prompts += [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    again = llm.generate([system + [7, 8]], params)[0]
    judge_greedy(hf, system + [7, 8], again.token_ids)
    assert again.num_cached_tokens > 0
    assert one_call and max(one_call) > 1, "no step put several prefill rows in one call"
    llm.engine.check_integrity()


def test_rows_of_a_mixed_batch(model_factory, one_call):
    """Only the prefill rows' tokens go to the call, in row order, with their own tables."""
    path, _ = model_factory("llama")
    llm = LLM(path, block_size=4, max_num_batched_tokens=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request([5, 6, 7, 8, 9], params, request_id="a")
    engine.step()  # a prefills; its next step is a decode
    engine.add_request(list(range(10, 23)), params, request_id="b")
    seen = []
    original = VarlenRows._build

    def build(batch):
        rows = original(batch)
        seen.append((list(batch.phases), rows))
        return rows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VarlenRows, "_build", classmethod(lambda cls, batch: build(batch)))
        engine.step()
    (phases, rows), = seen
    assert [p.name for p in phases] == ["DECODE", "FRESH_PREFILL"]
    assert rows.tokens.tolist() == list(range(1, 14))  # a's one token first, then b's 13
    assert rows.cu_seq_q.tolist() == [0, 13] and rows.seqused_k.tolist() == [13] and rows.max_k == 13


def test_without_the_kernel_the_rows_attend_one_by_one(model_factory, monkeypatch):
    """CPU, float32 or an older torch: the per-row path serves every prefill (nothing is probed)."""
    path, hf = model_factory("llama")
    monkeypatch.setattr(varlen_attention, "_kernel", lambda *a, **kw: pytest.fail("the kernel was called"))
    prompt = [3, 9, 27, 81, 243, 100, 200]
    out = LLM(path, block_size=4).generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    judge_greedy(hf, prompt, out.token_ids)


def test_a_shape_the_kernel_refuses_falls_back_once(model_factory, monkeypatch):
    path, hf = model_factory("llama")
    tries = []

    def refuses(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("paged KV needs a block size that is a multiple of 256")
    monkeypatch.setattr(varlen_attention, "_kernel", refuses)
    monkeypatch.setattr(varlen_attention, "_refused", {})
    monkeypatch.setattr(varlen_attention, "available",
                        lambda q, k: varlen_attention._key(q, k) not in varlen_attention._refused)
    prompts = [[3, 9, 27, 81], [5, 10, 15, 20, 25, 30]]
    outs = LLM(path, block_size=4).generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        judge_greedy(hf, prompt, out.token_ids)
    assert len(tries) == 1 and len(varlen_attention._refused) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(varlen_attention._kernel is None, reason="this torch's varlen attention takes no block table")
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [(8, 2, 128, 16, None), (4, 4, 64, 256, None),
                                                                       (8, 1, 128, 16, 48)])
def test_the_kernel_matches_the_reference_on_cuda(heads, kv_heads, head_dim, block_size, window):
    torch.manual_seed(0)
    lens, contexts = [37, 1, 200, 64], [37, 300, 1000, 64]
    blocks_per = [-(-c // block_size) for c in contexts]
    pool = sum(blocks_per) + 4
    k_cache = torch.randn(pool, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(pool, device="cuda")
    table = torch.zeros(len(lens), max(blocks_per), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks_per):
        table[i, :n] = order[start:start + n]
        start += n
    cu_q = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    rows = VarlenRows(slice(None), cu_q, cu_k, torch.tensor(contexts, dtype=torch.int32, device="cuda"), table,
                      max(lens), max(contexts))
    q = torch.randn(sum(lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    if not varlen_attention.available(q, k_cache):
        pytest.skip("the kernel does not run this dtype here")
    got = varlen_attention.varlen_attention(q, k_cache, v_cache, rows, head_dim ** -0.5, window)
    if got is None:
        pytest.skip(f"the kernel refused: {varlen_attention._refused}")
    want = varlen_attention_ref(q.float(), k_cache.float(), v_cache.float(), rows, head_dim ** -0.5, window)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
