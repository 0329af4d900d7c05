"""Checkpoint loading: sharded files, and clear errors for what we cannot load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models import CheckpointError, load_model
from engine.models.ssm import selective_scan, selective_scan_ref


@pytest.fixture()
def jamba_copy(model_factory, tmp_path):
    path, _ = model_factory("jamba")
    dst = tmp_path / "model"
    shutil.copytree(path, dst)
    return dst


def test_sharded_checkpoint_loads_identically(model_factory, tmp_path):
    path, hf = model_factory("jamba")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, b = load_model(path), load_model(tmp_path / "sharded")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_a_model_loads_in_the_dtype_asked_for_with_the_checkpoints_values(model_factory):
    path, hf = model_factory("jamba")
    model = load_model(path, torch.bfloat16)
    assert {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()} == {torch.bfloat16}
    assert torch.equal(model.embed.weight, hf.model.embed_tokens.weight.to(torch.bfloat16))
    assert model.embed.weight.device.type == "cpu"


def test_unknown_model_type_names_the_file_and_key(jamba_copy):
    config = json.loads((jamba_copy / "config.json").read_text())
    config["model_type"] = "gpt_neo_x_42"
    (jamba_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*model_type 'gpt_neo_x_42'"):
        load_model(jamba_copy)


def test_missing_tensor_is_named(jamba_copy):
    tensors = load_file(jamba_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, jamba_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(jamba_copy)


def test_misshapen_tensor_is_named_with_both_shapes(jamba_copy):
    tensors = load_file(jamba_copy / "model.safetensors")
    tensors["model.layers.0.mamba.A_log"] = torch.zeros(3, 3)
    save_file(tensors, jamba_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"A_log' has shape \[3, 3\], expected \[128, 8\]"):
        load_model(jamba_copy)


def test_unused_tensors_mean_config_and_weights_disagree(jamba_copy):
    config = json.loads((jamba_copy / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (jamba_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"not used by the model.*model\.layers\.3"):
        load_model(jamba_copy)


@pytest.mark.parametrize("key,value,pattern", [
    ("num_attention_heads", "four", r"'num_attention_heads' is 'four', expected int"),
    ("hidden_size", -4, r"'hidden_size' is -4, expected a positive integer"),
    ("attn_layer_offset", 9, r"'attn_layer_offset' = 9: must be in \[0, period=2\)"),
])
def test_bad_config_values_are_named(jamba_copy, key, value, pattern):
    config = json.loads((jamba_copy / "config.json").read_text())
    config[key] = value
    (jamba_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(jamba_copy)


def test_unsupported_rope_kind_is_refused(model_factory, tmp_path):
    path, _ = model_factory("llama")
    dst = tmp_path / "m"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"rope_parameters.*unsupported rope_type 'longrope'"):
        load_model(dst)


def test_missing_weights_file(tmp_path, model_factory):
    path, _ = model_factory("llama")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(tmp_path)


def test_fused_expert_layout_loads_too(model_factory, tmp_path):
    """Checkpoints written with stacked experts (gate_up_proj / down_proj) load the same."""
    path, hf = model_factory("jamba")
    dst = tmp_path / "fused"
    shutil.copytree(path, dst)
    tensors = load_file(dst / "model.safetensors")
    for layer in (0, 2):
        p = f"model.layers.{layer}.feed_forward.experts"
        gate_up, down = [], []
        for e in range(4):
            gate_up.append(torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"),
                                      tensors.pop(f"{p}.{e}.up_proj.weight")]))
            down.append(tensors.pop(f"{p}.{e}.down_proj.weight"))
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{p}.down_proj"] = torch.stack(down)
    save_file(tensors, dst / "model.safetensors")
    a, b = load_model(path), load_model(dst)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_olmo_hybrid_loads_in_transformers_names_too(model_factory, tmp_path):
    """transformers writes OLMo Hybrid's own names (attention_layer_norm, feedforward_layer_norm,
    one conv per q, k and v); a checkpoint in the names transformers loads them into (one conv1d
    over q | k | v) loads to the same weights."""
    path, _ = model_factory("olmo_hybrid")
    dst = tmp_path / "renamed"
    shutil.copytree(path, dst)
    tensors = load_file(dst / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in (("attention_layer_norm", "input_layernorm"), ("feedforward_layer_norm",
                                                                       "post_attention_layernorm")):
            name = name.replace(old, new)
        renamed[name] = tensor
    for layer in (0, 1, 3):
        p = f"model.layers.{layer}.linear_attn"
        renamed[f"{p}.conv1d.weight"] = torch.cat([renamed.pop(f"{p}.{x}_conv1d.weight") for x in "qkv"])
    assert set(renamed) != set(tensors)
    save_file(renamed, dst / "model.safetensors")
    a, b = load_model(path), load_model(dst)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_kimi_linear_loads_in_transformers_names_too(model_factory, tmp_path):
    """transformers writes Kimi Linear's original names (block_sparse_moe, experts.E.w1/w2/w3,
    a conv per q, k and v, the forget gate's tensors beside the projections); a checkpoint in the
    names transformers loads them into (mlp, stacked experts, one conv1d, forget_gate.*, A_log of
    [1, 1, heads, 1]) loads to the same weights. Its layer pattern is read from the original
    config's 1-indexed linear_attn_config as well."""
    path, _ = model_factory("kimi_linear")
    dst = tmp_path / "renamed"
    shutil.copytree(path, dst)
    tensors = load_file(dst / "model.safetensors")
    renamed = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in tensors.items()}
    for layer in (0, 2, 3):
        p = f"model.layers.{layer}.self_attn"
        renamed[f"{p}.conv1d.weight"] = torch.cat([renamed.pop(f"{p}.{x}_conv1d.weight") for x in "qkv"])
        for part in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
            renamed[f"{p}.forget_gate.{part}"] = renamed.pop(f"{p}.{part}")
        renamed[f"{p}.forget_gate.A_log"] = renamed[f"{p}.forget_gate.A_log"].reshape(1, 1, -1, 1)
    for layer in (1, 2, 3):
        p = f"model.layers.{layer}.mlp.experts"
        experts = range(6)
        renamed[f"{p}.gate_up_proj"] = torch.stack([torch.cat([renamed.pop(f"{p}.{e}.w1.weight"),
                                                               renamed.pop(f"{p}.{e}.w3.weight")]) for e in experts])
        renamed[f"{p}.down_proj"] = torch.stack([renamed.pop(f"{p}.{e}.w2.weight") for e in experts])
    save_file(renamed, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    del config["layer_types"]
    config["linear_attn_config"] = {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "head_dim": 8, "num_heads": 2,
                                    "short_conv_kernel_size": 3}
    (dst / "config.json").write_text(json.dumps(config))
    a, b = load_model(path), load_model(dst)
    assert [layer.kind for layer in a.spec.layers] == [layer.kind for layer in b.spec.layers]
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("length,block_elements", [(1, 1 << 17), (37, 1 << 17), (300, 64 * 8 * 16), (64, 7 * 8 * 16), (50, 1)])
def test_blocked_scan_matches_token_loop(length, block_elements, monkeypatch):
    import engine.models.ssm as ssm

    monkeypatch.setattr(ssm, "SCAN_BLOCK_ELEMENTS", block_elements)
    g = torch.Generator().manual_seed(length)
    d, n = 8, 16
    x = torch.randn(length, d, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(length, d, generator=g))
    A = -torch.rand(d, n, generator=g) * 4
    B, C = torch.randn(length, n, generator=g), torch.randn(length, n, generator=g)
    h0 = torch.randn(d, n, generator=g)
    y_ref, h_ref = selective_scan_ref(x, dt, A, B, C, h0)
    y, h = selective_scan(x, dt, A, B, C, h0)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,changes,pattern", [
    ("mamba2", {"num_heads": 6}, r"'num_heads'.* = 6: num_heads \* head_dim = 48 is not expand \* hidden_size = 64"),
    ("mamba2", {"n_groups": 3}, r"'n_groups' = 3: does not divide num_heads=8"),
    ("mamba2", {"time_step_limit": [0.5, 0.1]}, r"'time_step_limit' = \[0.5, 0.1\]: low is above high"),
    ("bamba", {"attn_layer_indices": [7]}, r"'attn_layer_indices' = \[7\]: indices must be in \[0, 4\)"),
    ("granitemoehybrid", {"position_embedding_type": "alibi"}, r"'position_embedding_type' = 'alibi'"),
    ("granitemoehybrid", {"layer_types": ["mamba", "conv", "mamba", "mamba"]}, r"'layer_types' = \['mamba', 'conv'"),
    ("nemotron_h", {"sliding_window": 64}, r"'sliding_window' = 64: sliding-window attention is not supported"),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "cross_attention"]}, r"'layers_block_type'"),
    ("nemotron_h", {"n_shared_experts": 2}, r"'n_shared_experts' = 2: only one shared expert"),
    ("falcon_h1", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor"),
    ("zamba2", {"layers_block_type": None}, r"'layers_block_type'"),
    ("zamba2", {"use_shared_mlp_adapter": False}, r"'use_shared_mlp_adapter' = False"),
    ("qwen3_next", {"num_experts_per_tok": 9}, r"'num_experts_per_tok' = 9: exceeds num_experts="),
    ("lfm2_moe", {"num_dense_layers": 9}, r"'num_dense_layers' = 9: must be in \[0, num_hidden_layers=4\]"),
    ("lfm2_moe", {"num_experts_per_tok": 7}, r"'num_experts_per_tok' = 7: exceeds num_experts=6"),
    ("olmo_hybrid", {"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]},
     r"'layer_types' = \['linear_attention', 'sliding_attention'"),
    ("olmo_hybrid", {"linear_num_value_heads": 3}, r"'linear_num_value_heads' = 3: is not a multiple of"),
    ("kimi_linear", {"mla_use_nope": False}, r"'mla_use_nope' = False: only Kimi Linear's position-free MLA"),
    ("kimi_linear", {"layer_types": None, "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [9]}},
     r"'linear_attn_config' = .*1-indexed layers of 4"),
    ("kimi_linear", {"num_experts_per_token": 7}, r"'num_experts_per_token' = 7: must be in \[1, num_experts=6\]"),
    ("kimi_linear", {"num_expert_group": 4}, r"'num_expert_group' = 4: 6 experts cannot form 4 groups"),
    ("kimi_linear", {"moe_router_activation_func": "softmax"}, r"'moe_router_activation_func' = 'softmax'"),
])
def test_unsupported_mamba2_family_variants_are_refused_by_name(model_factory, tmp_path, name, changes, pattern):
    """Never served wrongly: a variant we do not implement is refused at load, naming the field."""
    path, _ = model_factory(name)
    dst = tmp_path / "m"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(dst)
