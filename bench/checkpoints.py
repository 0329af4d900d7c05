"""Tiny random checkpoints for benchmarks: built with transformers' config classes, no download.

`jamba` is Jamba-architecture at about 11M parameters (8 layers, attention at 2 and 6, MoE with
4 experts top-2 on odd layers, d_inner 512, d_state 16); `llama` is attention-only at about
8M; `granite4h` (Granite 4.0-H layout: Mamba2 with attention at 2 and 6, MoE + shared expert),
`nemotron_h` (Mamba2 / attention / squared-ReLU MLP blocks), `mamba2`, `bamba`, `falcon_h1`
(attention and Mamba2 side by side in every layer) and `zamba2` (one shared attention block) are
the Mamba2 (SSD) families at the same scale; `qwen3_next` (Gated DeltaNet, gated attention at 2
and 6, MoE + shared expert) and `lfm2` (short convolutions, attention at 2 and 6) the other
recurrent kinds. Same vocabulary (8192) and hidden size (256), so their costs compare.
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
    "granite4h": ("granitemoehybrid", dict(
        hidden_size=256, intermediate_size=384, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, layer_types=["mamba", "mamba", "attention", "mamba"] * 2,
        mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=256,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=256,
        position_embedding_type="nope", tie_word_embeddings=True)),
    "nemotron_h": ("nemotron_h", dict(
        hidden_size=256, intermediate_size=768, hybrid_override_pattern="M-M*M-M-", num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64,
        n_groups=1, chunk_size=256, tie_word_embeddings=True)),
    "mamba2": ("mamba2", dict(hidden_size=256, num_hidden_layers=8, num_heads=8, head_dim=64,
                              state_size=64, n_groups=1, expand=2, chunk_size=256,
                              tie_word_embeddings=True)),
    "bamba": ("bamba", dict(
        hidden_size=256, intermediate_size=384, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, attn_layer_indices=[2, 6], mamba_n_heads=8, mamba_d_head=64, mamba_d_state=64,
        mamba_n_groups=1, mamba_chunk_size=256, tie_word_embeddings=True)),
    "falcon_h1": ("falcon_h1", dict(
        hidden_size=256, intermediate_size=384, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, mamba_d_ssm=None, mamba_expand=2, mamba_n_heads=8, mamba_n_groups=1,
        mamba_d_state=64, mamba_chunk_size=256, mamba_rms_norm=True, tie_word_embeddings=True)),
    "zamba2": ("zamba2", dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        layers_block_type=["mamba", "mamba", "hybrid", "mamba"] * 2, num_attention_heads=8,
        num_mem_blocks=1, n_mamba_heads=8, mamba_ngroups=1, mamba_d_state=64, chunk_size=256,
        tie_word_embeddings=True)),
    "qwen3_next": ("qwen3_next", dict(
        hidden_size=256, intermediate_size=384, num_hidden_layers=8,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"] * 2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=192, shared_expert_intermediate_size=256,
        tie_word_embeddings=True)),
    "lfm2": ("lfm2", dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, conv_L_cache=3, layer_types=["conv", "conv", "full_attention", "conv"] * 2,
        block_auto_adjust_ff_dim=False, tie_word_embeddings=True)),
    # For tests: the same families, small enough to load in well under a second.
    "jamba-test": ("jamba", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                 attn_layer_offset=1, num_experts=1, mamba_d_state=8,
                                 mamba_d_conv=4, mamba_dt_rank=8)),
    "granite4h-test": ("granitemoehybrid", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
        mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=8, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, position_embedding_type="rope")),
}
BENCH_CHECKPOINTS = tuple(name for name in CHECKPOINTS if not name.endswith("-test"))
MODEL_CLASSES = {  # family -> (transformers config class, model class) names
    "jamba": ("JambaConfig", "JambaForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM"),
    "bamba": ("BambaConfig", "BambaForCausalLM"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
}


def build_checkpoint(name: str, path: str | Path, seed: int = 0):
    """Save checkpoint `name` (random weights, fixed seed) into `path`; returns the HF model."""
    import torch
    import transformers as tf

    if name not in CHECKPOINTS:
        raise ValueError(f"name: {name!r} not in {sorted(CHECKPOINTS)}")
    family, kwargs = CHECKPOINTS[name]
    config_cls, model_cls = (getattr(tf, n) for n in MODEL_CLASSES[family])
    vocab = 320 if name.endswith("-test") else VOCAB
    config = config_cls(vocab_size=vocab, max_position_embeddings=MAX_POSITIONS, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
