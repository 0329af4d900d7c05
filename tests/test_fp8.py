"""FP8 checkpoints as published (engine.models.fp8): compressed-tensors per-tensor and
per-channel, transformers' fine-grained block-wise, dequantized at load, for every family.

The oracle is transformers running the dequantized weights: the same float8 values times the
same float32 scales, so our weights are bit for bit its weights, and the tie rule holds with
the oracle's own tolerance (tests.oracle.TIE_TOLERANCE): the rounding to FP8 changed the
model, not the comparison.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models import CheckpointError
from tests.oracle import hf_classes, judge_greedy

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
BLOCK = (16, 16)  # fine-grained blocks small enough that tiny weights have several

SCHEMES = {
    "per_tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                       "symmetric": True, "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
        "ignore": ["lm_head"]},
    "per_channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                       "symmetric": True, "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)},
}


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """2-D projection weights; embeddings, the LM head, norms and convolutions stay as they are."""
    return (tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name
            and "norm" not in name)


def quantize(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 weight, its scale, the dequantized float32 weight the oracle runs)."""
    w = weight.float()
    if scheme == "per_tensor":
        scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12).reshape(1)
        expanded = scale
    elif scheme == "per_channel":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        expanded = scale
    else:
        rows, cols = BLOCK
        blocks = torch.nn.functional.pad(w.abs(), (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
        scale = (blocks.reshape(blocks.shape[0] // rows, rows, blocks.shape[1] // cols, cols).amax((1, 3))
                 / FP8_MAX).clamp(min=1e-12)
        expanded = scale.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    q = (w / expanded).to(torch.float8_e4m3fn)
    return q, scale, q.float() * expanded


def fp8_checkpoint(src, dst, scheme: str):
    """`src` (a saved tiny model) as an FP8 checkpoint in `dst`; returns the oracle: transformers'
    model loaded from the same checkpoint with its weights dequantized (saved under `dst`.plain)."""
    shutil.copytree(src, dst)
    plain_dir = dst.with_name(dst.name + ".plain")
    shutil.copytree(src, plain_dir)
    tensors = load_file(dst / "model.safetensors")
    out, plain = {}, {}
    for name, tensor in tensors.items():
        if not quantizable(name, tensor):
            out[name] = plain[name] = tensor
            continue
        q, scale, dequantized = quantize(tensor, scheme)
        out[name], plain[name] = q, dequantized.to(tensor.dtype)
        out[name.removesuffix("weight") + ("weight_scale_inv" if scheme == "block" else "weight_scale")] = scale
        if scheme == "per_tensor":  # a static activation scale: published, unused once dequantized
            out[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
    assert len(out) > len(plain), "nothing was quantized"
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, plain_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": SCHEMES[scheme]}))
    _, model_cls = hf_classes(config["model_type"])
    return model_cls.from_pretrained(plain_dir, dtype=torch.float32).eval()


def test_every_family_serves_its_fp8_checkpoint_as_transformers_runs_it(family_model, tmp_path):
    family, path, _ = family_model
    scheme = list(SCHEMES)[sum(map(ord, family)) % len(SCHEMES)]  # each family one scheme, all covered
    oracle = fp8_checkpoint(path, tmp_path / "fp8", scheme)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 17)]
    for prompt, out in zip(prompts, LLM(str(tmp_path / "fp8"), block_size=4).generate(prompts, GREEDY)):
        judge_greedy(oracle, prompt, out.token_ids)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_each_scheme_dequantizes_to_the_weights_transformers_runs(scheme, model_factory, tmp_path):
    path, _ = model_factory("jamba")
    oracle = fp8_checkpoint(path, tmp_path / "fp8", scheme)
    llm = LLM(str(tmp_path / "fp8"), block_size=4)
    ours = dict(llm.engine.model.named_parameters())
    # a dense projection of the attention layer, by its HF name and ours
    attention = next(i for i, layer in enumerate(llm.engine.model.layers) if layer.kind == "attention")
    theirs = oracle.state_dict()[f"model.layers.{attention}.self_attn.o_proj.weight"]
    assert torch.equal(ours[f"layers.{attention}.mixer.o_proj.weight"], theirs)
    prompt = [5, 9, 14, 200, 31]
    judge_greedy(oracle, prompt, llm.generate([prompt], GREEDY)[0].token_ids)


@pytest.mark.parametrize("change, names", [
    (lambda q: {**q, "quant_method": "awq"}, r"quant_method = 'awq': not supported"),
    (lambda q: {**q, "config_groups": {"g": {"weights": {**q["config_groups"]["group_0"]["weights"], "num_bits": 4}}}},
     r"config_groups.g.weights.num_bits = 4"),
    (lambda q: {**q, "config_groups": {"g": {"weights": {**q["config_groups"]["group_0"]["weights"], "type": "int"}}}},
     r"config_groups.g.weights.type = 'int'"),
    (lambda q: {**q, "config_groups": {"g": {"weights": {**q["config_groups"]["group_0"]["weights"],
                                                         "strategy": "group"}}}}, r"weights.strategy = 'group'"),
])
def test_an_unsupported_scheme_is_refused_naming_the_field(change, names, model_factory, tmp_path):
    path, _ = model_factory("llama")
    fp8_checkpoint(path, tmp_path / "fp8", "per_tensor")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = change(config["quantization_config"])
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=names):
        LLM(str(tmp_path / "fp8"))


@pytest.mark.parametrize("damage, names", [
    ("drop_scale", r"is torch.float8_e4m3fn but the checkpoint has no 'model.layers.0.self_attn.q_proj.weight_scale'"),
    ("bad_scale", r"'model.layers.0.self_attn.q_proj.weight_scale' has shape \[3\]"),
    ("no_config", r"is torch.float8_e4m3fn but config.json has no quantization_config"),
])
def test_a_checkpoint_missing_or_misshaping_its_scales_is_refused_naming_the_tensor(damage, names, model_factory,
                                                                                    tmp_path):
    path, _ = model_factory("llama")
    fp8_checkpoint(path, tmp_path / "fp8", "per_channel")
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    scale = "model.layers.0.self_attn.q_proj.weight_scale"
    if damage == "drop_scale":
        del tensors[scale]
    elif damage == "bad_scale":
        tensors[scale] = torch.ones(3)
    else:
        config = json.loads((tmp_path / "fp8" / "config.json").read_text())
        del config["quantization_config"]
        (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    save_file(tensors, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=names):
        LLM(str(tmp_path / "fp8"))
