"""No host reads in a decode step, on any family: the forward a CUDA graph captures.

The static decode path's forward (engine.cuda_graphs.StaticDecode: what every replay runs) is
run on CPU tensors the way it runs on CUDA: Triton kernels (under the interpreter), no C++ CPU
kernels, MoE without the per-expert loop. A guard fails on any host read of a tensor value
(tests/host_reads.py); the tokens are judged by transformers as everywhere else.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import enter_kernel_mode, requires_triton  # first: it sets Triton's mode
from engine import LLM, SamplingParams
from engine.cuda_graphs import capture_blockers
from engine.models.expert_dispatch import STATIC_ENV
from tests.host_reads import no_host_reads
from tests.oracle import judge_greedy

FAMILIES = ["jamba", "mamba", "llama", "mistral_mqa_window", "mamba2", "bamba", "granitemoehybrid",
            "nemotron_h", "nemotron_h_latent", "falcon_h1", "zamba2", "qwen3_next", "lfm2", "lfm2_moe", "olmo_hybrid",
            "kimi_linear"]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)  # three decode steps under the guard


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("name", FAMILIES)
def test_the_decode_forward_reads_nothing_on_the_host(model_factory, monkeypatch, name):
    path, hf = model_factory(name)
    llm = cuda_like_engine(path, monkeypatch)
    for prompt, out in zip(PROMPTS, decode_guarded(llm, monkeypatch)):
        judge_greedy(hf, prompt, out)
    assert capture_blockers(llm.engine.model, torch.device("cpu")) == []  # Triton forced, as on CUDA


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("name, options, fp8_scheme", [
    ("jamba", dict(kv_cache_dtype="fp8_e4m3", mamba_state_dtype="bfloat16"), None),
    ("qwen3_next", dict(kv_cache_dtype="fp8_e5m2", mamba_state_dtype="float16"), None),
    ("kimi_linear", dict(kv_cache_dtype="fp8_e4m3"), None),
    ("llama", {}, "per_channel"),
    ("qwen3_next", {}, "block"),  # the fused MoE kernel, its linear form and the rounding kernel
    ("qwen3_next", {}, "per_tensor"),  # static scales: each row's found on the device
])
def test_narrow_formats_and_fp8_weights_read_nothing_on_the_host(model_factory, monkeypatch, tmp_path, name, options,
                                                                   fp8_scheme):
    """The cache formats' load and store around a layer (engine.state_format, engine.kv_format)
    and FP8 linears and experts (engine.models.fp8_linear, fp8_experts, under the GPU's policy)
    inside the forward a CUDA graph captures; the tokens are those of the same engine on its
    eager path."""
    import engine.models.fp8_linear as fp8_linear
    from engine.models.fp8_experts import Fp8Experts
    from tests.test_fp8 import fp8_checkpoint

    path, _ = model_factory(name)
    if fp8_scheme is not None:
        monkeypatch.setattr(fp8_linear, "keeps_float8", lambda device: True)
        fp8_checkpoint(path, tmp_path / "fp8", fp8_scheme)
        path = str(tmp_path / "fp8")
    eager = cuda_like_engine(path, monkeypatch, static=False, **options)
    expected = [out.token_ids for out in eager.generate(PROMPTS, GREEDY)]
    llm = cuda_like_engine(path, monkeypatch, **options)
    assert decode_guarded(llm, monkeypatch) == expected
    if fp8_scheme is not None:
        modules = list(llm.engine.model.modules())
        linears = [m for m in modules if isinstance(m, fp8_linear.Fp8Linear)]
        assert linears and all(m.fused == (fp8_scheme == "block") for m in linears)
        experts = [m for m in modules if isinstance(m, Fp8Experts)]
        assert (name == "llama") != bool(experts) and all(m.kept for m in experts)
        assert all(m.fused == (fp8_scheme == "block") and (m.input_scale is not None) == (fp8_scheme == "per_tensor")
                   for m in experts)


@requires_triton
@pytest.mark.triton
@pytest.mark.parametrize("name", ["jamba", "kimi_linear"])  # conv, Mamba, gated delta step, attention, MLA
def test_a_verify_step_runs_the_decode_kernels_and_reads_nothing_on_the_host(model_factory, monkeypatch, name):
    """A step with VERIFY rows, as on CUDA: each row's tokens are decode rows of its slot on the
    static path's verify buffers (what a verify step's CUDA graph captures), the Triton state
    kernels run a slot's rows in order (engine.kernels.slot_runs), and nothing in its forward
    reads the host; the tokens are the plain engine's, drafts accepted and rejected
    (tests.test_speculative's scripted drafts)."""
    from tests.test_speculative import NGRAM, ScriptedProposer

    path, _ = model_factory(name)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [out.token_ids for out in cuda_like_engine(path, monkeypatch).generate(PROMPTS, params)]
    llm = cuda_like_engine(path, monkeypatch, speculative_config=NGRAM)
    llm.engine.speculation.proposer = ScriptedProposer(PROMPTS, plain)
    static, verified = llm.engine.runner.static, []
    forward = static.model

    def model(batch, caches):
        if batch.decode_slot_runs:
            verified.append(len(batch.input_ids))
        with no_host_reads():
            return forward(batch, caches)

    monkeypatch.setattr(static, "model", model)
    outs = llm.generate(PROMPTS, params)
    assert [out.token_ids for out in outs] == plain, [out.error for out in outs]
    stats = llm.engine.stats()
    assert verified and max(verified) > len(PROMPTS), verified  # padded sizes of rows sharing slots
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats


PROMPTS = [[5, 6, 7], [9], list(range(3, 14))]


def cuda_like_engine(path, monkeypatch, static: bool = True, **options) -> LLM:
    """An engine that runs as on CUDA (run_as_on_cuda); its decode steps on the static path
    unless `static` is False."""
    run_as_on_cuda(monkeypatch)
    llm = LLM(str(path), block_size=4, max_num_seqs=4, num_kv_blocks=48, **options)
    if static:
        llm.engine.runner.use_static_decode(capture=False)
    return llm


def run_as_on_cuda(monkeypatch) -> None:
    """Engines built after this run as on CUDA: Triton kernels, no C++ CPU kernels, MoE without
    the per-expert loop."""
    enter_kernel_mode()
    monkeypatch.setenv("SPLITSERVE_FORCE_TRITON", "1")
    monkeypatch.setenv("SPLITSERVE_DISABLE_CPU_KERNELS", "1")
    monkeypatch.setenv(STATIC_ENV, "1")


def decode_guarded(llm: LLM, monkeypatch) -> list[list[int]]:
    """PROMPTS' greedy tokens, every static decode forward under the host-read guard."""
    static = llm.engine.runner.static
    forward, guarded = static.model, []

    def model(batch, caches):
        with no_host_reads():
            guarded.append(len(batch.input_ids))
            return forward(batch, caches)

    monkeypatch.setattr(static, "model", model)
    outs = llm.generate(PROMPTS, GREEDY)
    assert guarded, "no decode step took the static path"
    for out in outs:
        assert out.error is None and len(out.token_ids) == GREEDY.max_tokens, out.error  # a guard's error fails the request
    return [out.token_ids for out in outs]
