"""Tiny random checkpoints for benchmarks: built with transformers' config classes, no download.

`jamba` is Jamba-architecture at about 11M parameters (8 layers, attention at 2 and 6, MoE with
4 experts top-2 on odd layers, d_inner 512, d_state 16); `llama` is attention-only at about
8M. Same vocabulary (8192) and hidden size (256), so their costs compare.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 8192
SPECIAL_TOKENS = 3  # 0 pad, 1 bos, 2 eos: workloads draw ids from 3 up
MAX_POSITIONS = 4096

CHECKPOINTS: dict[str, tuple[str, dict]] = {
    "jamba": ("jamba", dict(hidden_size=256, intermediate_size=384, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, attn_layer_period=4,
                            attn_layer_offset=2, num_experts=4, num_experts_per_tok=2,
                            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16,
                            mamba_d_conv=4, mamba_dt_rank=16, tie_word_embeddings=True)),
    "llama": ("llama", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)),
    # For tests: the same families, small enough to load in well under a second.
    "jamba-test": ("jamba", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                 attn_layer_offset=1, num_experts=1, mamba_d_state=8,
                                 mamba_d_conv=4, mamba_dt_rank=8)),
}


def build_checkpoint(name: str, path: str | Path, seed: int = 0):
    """Save checkpoint `name` (random weights, fixed seed) into `path`; returns the HF model."""
    import torch
    import transformers as tf

    if name not in CHECKPOINTS:
        raise ValueError(f"name: {name!r} not in {sorted(CHECKPOINTS)}")
    family, kwargs = CHECKPOINTS[name]
    config_cls, model_cls = {"jamba": (tf.JambaConfig, tf.JambaForCausalLM),
                             "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[family]
    vocab = 320 if name.endswith("-test") else VOCAB
    config = config_cls(vocab_size=vocab, max_position_embeddings=MAX_POSITIONS, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
