"""`--model` as a Hugging Face Hub id, offline, against a cache laid out as huggingface_hub lays it
out (models--org--name/{blobs,refs/main,snapshots/<commit>}): nothing is downloaded."""

from __future__ import annotations

import shutil

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.hub import resolve_model
from router.cluster import ClusterConfig

REPO = "tiny-org/tiny-jamba"
OLD, NEW = "a" * 40, "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, api_model_path):
    """refs/main -> NEW; snapshots OLD and NEW both hold the tiny API model."""
    storage = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    for commit in (OLD, NEW):
        shutil.copytree(api_model_path, storage / "snapshots" / commit)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(NEW)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return storage


def test_hub_id_resolves_to_the_cached_snapshot_of_main(hub_cache):
    assert resolve_model(REPO) == (str(hub_cache / "snapshots" / NEW), NEW)
    assert resolve_model(REPO, OLD) == (str(hub_cache / "snapshots" / OLD), OLD)
    config = EngineConfig(REPO, revision="main")
    assert (config.model, config.revision) == (str(hub_cache / "snapshots" / NEW), NEW)


def test_llm_from_a_hub_id_generates_like_from_the_folder(hub_cache, api_model_path):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    by_id = LLM(REPO, num_kv_blocks=32).generate([[5, 6, 7]], params)[0].token_ids
    assert by_id == LLM(str(api_model_path), num_kv_blocks=32).generate([[5, 6, 7]], params)[0].token_ids


def test_cluster_passes_the_commit_so_every_node_loads_the_same_snapshot(hub_cache):
    config = ClusterConfig(REPO)
    # workers get the id and the commit main meant here, whatever main points to on their node
    assert config.model == REPO and config.engine_options["revision"] == NEW
    assert config.model_path == str(hub_cache / "snapshots" / NEW)


def test_wrong_id_is_a_clear_error(hub_cache):
    with pytest.raises(ValueError, match=r"model: 'tiny-org/no-such-model' is not a directory, and the Hub "
                                         r"id tiny-org/no-such-model@main is not in the cache .* HF_HUB_OFFLINE"):
        EngineConfig("tiny-org/no-such-model")
    with pytest.raises(ValueError, match=r"neither a directory nor a Hugging Face Hub id"):
        EngineConfig("/no/such/folder")
    with pytest.raises(ValueError, match=r"revision: only for a Hub id"):
        EngineConfig(str(hub_cache / "snapshots" / NEW), revision="main")


def test_missing_file_in_the_snapshot_is_a_clear_error(hub_cache):
    for weights in (hub_cache / "snapshots" / OLD).glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match=rf"model: {REPO}@aaaaaaaaaaaa .* has no \*\.safetensors weights"):
        EngineConfig(REPO, revision=OLD)
    (hub_cache / "snapshots" / NEW / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"model: {REPO}@bbbbbbbbbbbb .* has no config.json"):
        EngineConfig(REPO)


def test_serve_app_options_are_the_cli_options():
    from router.serve_app import parse_options

    model, launch, door = parse_options({"model": REPO, "revision": OLD, "prefill": "2", "decode": 3,
                                         "transport": "gloo", "pack_pairs": "true", "max_queued": 7})
    assert model == REPO and launch["revision"] == OLD and (launch["prefill"], launch["decode"]) == (2, 3)
    assert launch["transport"] == "gloo" and launch["pack_pairs"] is True and door.max_queued == 7
    assert "address" not in launch
    with pytest.raises(ValueError, match="http_port: not an application option under Ray Serve"):
        parse_options({"http_port": 8000})
    with pytest.raises(ValueError, match="prefil: not an option of `splitserve serve`"):
        parse_options({"prefil": 1})
    with pytest.raises(ValueError, match="transport"):
        parse_options({"transport": "carrier-pigeon"})
