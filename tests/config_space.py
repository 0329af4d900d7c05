"""Config spaces per model family for fuzzing against transformers (hypothesis strategies).

Each strategy draws keyword arguments for transformers' own config class of one family, over
the fields that change the math: head counts and dims, KV heads, rotary settings, layer
patterns, SSM groups and widths, expert counts and top-k, biases, tying, norms, multipliers.
Sizes stay tiny (a checkpoint builds in milliseconds). Draws are mostly coherent configs that
transformers runs, with some values just past what is consistent (top-k above the expert
count, a group count that does not divide the heads) so refusals are exercised too.
"""

from __future__ import annotations

from hypothesis import strategies as st

booleans = st.booleans()
acts = st.sampled_from(["silu", "gelu", "relu"])
multipliers = st.sampled_from([0.5, 1.0, 1.7])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _attention_heads(draw, max_heads=4):
    heads = draw(st.integers(1, max_heads))
    return heads, draw(st.sampled_from(_divisors(heads)))


@st.composite
def _rope(draw):
    kind = draw(st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3"]))
    rope = dict(rope_type=kind, rope_theta=draw(st.sampled_from([100.0, 10000.0, 500000.0])))
    if kind in ("linear", "dynamic", "yarn", "llama3"):
        rope["factor"] = draw(st.sampled_from([2.0, 4.0]))
    if kind in ("yarn", "llama3", "dynamic"):
        rope["original_max_position_embeddings"] = 64
    if kind == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return rope


@st.composite
def jamba(draw):
    heads, kv_heads = draw(_attention_heads())
    layers = draw(st.integers(1, 5))
    attn_period = draw(st.integers(1, 4))
    exp_period = draw(st.integers(1, 3))
    experts = draw(st.integers(1, 4))
    return dict(hidden_size=heads * draw(st.sampled_from([4, 8, 12])), num_hidden_layers=layers,
                intermediate_size=draw(st.sampled_from([16, 40])),
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                attn_layer_period=attn_period, attn_layer_offset=draw(st.integers(0, attn_period - 1)),
                expert_layer_period=exp_period, expert_layer_offset=draw(st.integers(0, exp_period - 1)),
                num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts + 1)),
                mamba_d_state=draw(st.sampled_from([2, 4, 8])), mamba_d_conv=draw(st.integers(2, 4)),
                mamba_dt_rank=draw(st.sampled_from(["auto", 1, 3, 8])),
                mamba_expand=draw(st.integers(1, 3)), mamba_proj_bias=draw(booleans),
                mamba_conv_bias=draw(booleans), tie_word_embeddings=draw(booleans),
                hidden_act=draw(acts), use_mamba_kernels=False)


@st.composite
def mamba(draw):
    hidden = draw(st.sampled_from([8, 16, 24, 32]))
    return dict(hidden_size=hidden, num_hidden_layers=draw(st.integers(1, 3)),
                state_size=draw(st.sampled_from([2, 4, 8])), conv_kernel=draw(st.integers(2, 4)),
                expand=draw(st.integers(1, 3)), time_step_rank=draw(st.sampled_from(["auto", 1, 5])),
                use_bias=draw(booleans), use_conv_bias=draw(booleans),
                residual_in_fp32=draw(booleans), tie_word_embeddings=draw(booleans),
                hidden_act=draw(acts), use_mambapy=False)


@st.composite
def _llama_like(draw):
    heads, kv_heads = draw(_attention_heads())
    head_dim = draw(st.sampled_from([4, 8, 12, 16]))
    hidden = draw(st.sampled_from([heads * head_dim, 24, 32]))
    return dict(hidden_size=hidden, intermediate_size=draw(st.sampled_from([16, 40])),
                num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act=draw(acts),
                tie_word_embeddings=draw(booleans), rope_parameters=draw(_rope()))


@st.composite
def llama(draw):
    return dict(draw(_llama_like()), attention_bias=draw(booleans), mlp_bias=draw(booleans))


@st.composite
def mistral(draw):
    return dict(draw(_llama_like()), sliding_window=draw(st.sampled_from([None, 4, 16])))


@st.composite
def qwen2(draw):
    config = draw(_llama_like())
    config.pop("head_dim")  # Qwen2 derives it from hidden_size
    config["hidden_size"] = config["num_attention_heads"] * draw(st.sampled_from([4, 8]))
    window = draw(st.sampled_from([None, 4]))
    layers = config["num_hidden_layers"]
    return dict(config, use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=draw(st.integers(0, layers)))


@st.composite
def _ssd(draw, heads_key: str, groups_key: str, state_key: str, chunk_key: str,
         conv_key: str | None = None):
    """A Mamba2 mixer: heads, groups (sometimes not dividing them), state size, chunk size."""
    heads = draw(st.integers(1, 8))
    groups = draw(st.sampled_from(_divisors(heads) + [3]))
    out = {heads_key: heads, groups_key: groups, state_key: draw(st.sampled_from([2, 4, 8])),
           chunk_key: draw(st.sampled_from([3, 4, 8, 64]))}
    if conv_key:
        out[conv_key] = draw(st.integers(2, 4))
    return out


@st.composite
def mamba2(draw):
    ssd = draw(_ssd("num_heads", "n_groups", "state_size", "chunk_size", "conv_kernel"))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    expand = draw(st.sampled_from([1, 2]))
    inner = ssd["num_heads"] * head_dim
    hidden = inner // expand if inner % expand == 0 else inner
    limit = draw(st.sampled_from([(0.0, float("inf")), (0.02, 0.3)]))
    return dict(ssd, hidden_size=hidden, head_dim=head_dim, expand=expand,
                num_hidden_layers=draw(st.integers(1, 3)), use_bias=draw(booleans),
                use_conv_bias=draw(booleans), tie_word_embeddings=draw(booleans),
                time_step_limit=limit, rms_norm=True, norm_before_gate=False)


def _layer_pattern(draw, layers: int, kinds: tuple[str, str]) -> list[str]:
    return [draw(st.sampled_from(kinds)) for _ in range(layers)]


@st.composite
def _attention_beside_mamba2(draw):
    """Bamba's and Granite 4.0-H's shared shape: attention heads, a hidden size, layers, and a
    Mamba2 mixer whose heads divide its width (2 x hidden) and whose groups divide its heads."""
    heads, kv_heads = draw(_attention_heads())
    hidden = heads * draw(st.sampled_from([4, 8]))
    ssd = draw(_ssd("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_chunk_size", "mamba_d_conv"))
    ssd["mamba_n_heads"] = draw(st.sampled_from([d for d in _divisors(2 * hidden) if d <= 8]))
    ssd["mamba_n_groups"] = draw(st.sampled_from(_divisors(ssd["mamba_n_heads"])))
    return dict(ssd, hidden_size=hidden, num_hidden_layers=draw(st.integers(1, 4)), num_attention_heads=heads,
                num_key_value_heads=kv_heads, mamba_expand=2, mamba_d_head="auto")


@st.composite
def bamba(draw):
    config = draw(_attention_beside_mamba2())
    layers = config["num_hidden_layers"]
    return dict(config, intermediate_size=draw(st.sampled_from([16, 40])),
                attn_layer_indices=[i for i in range(layers) if draw(booleans)],
                mamba_conv_bias=draw(booleans), mamba_proj_bias=draw(booleans),
                tie_word_embeddings=draw(booleans), partial_rotary_factor=draw(st.sampled_from([0.5, 1.0])))


@st.composite
def granitemoehybrid(draw):
    config = draw(_attention_beside_mamba2())
    experts = draw(st.sampled_from([0, 2, 4]))
    return dict(config, intermediate_size=draw(st.sampled_from([16, 24])),
                layer_types=_layer_pattern(draw, config["num_hidden_layers"], ("mamba", "attention")),
                num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, max(1, experts))),
                shared_intermediate_size=draw(st.sampled_from([8, 24])),
                position_embedding_type=draw(st.sampled_from([None, "rope"])),
                embedding_multiplier=draw(multipliers), residual_multiplier=draw(multipliers),
                attention_multiplier=draw(multipliers), logits_scaling=draw(multipliers),
                tie_word_embeddings=draw(booleans))


@st.composite
def nemotron_h(draw):
    heads, kv_heads = draw(_attention_heads())
    layers = draw(st.integers(1, 5))
    experts = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([1, 2]))
    mamba_heads = draw(st.sampled_from([2, 4, 6]))
    head_dim = draw(st.sampled_from([4, 8]))
    return dict(hidden_size=draw(st.sampled_from([16, 24])),
                intermediate_size=draw(st.sampled_from([16, 40])),
                hybrid_override_pattern="".join(draw(st.sampled_from("M*-E")) for _ in range(layers)),
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                mamba_num_heads=mamba_heads, mamba_head_dim=draw(st.sampled_from([2, 4])),
                ssm_state_size=draw(st.sampled_from([2, 4])), n_groups=groups,
                chunk_size=draw(st.sampled_from([3, 8])), conv_kernel=draw(st.integers(2, 4)),
                n_routed_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)),
                n_group=draw(st.sampled_from([1, 2])), topk_group=1,
                moe_intermediate_size=8, moe_shared_expert_intermediate_size=draw(st.sampled_from([8, 12])),
                routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])), norm_topk_prob=draw(booleans),
                mlp_bias=draw(booleans), attention_bias=draw(booleans), use_bias=draw(booleans),
                use_conv_bias=draw(booleans), tie_word_embeddings=draw(booleans))


@st.composite
def falcon_h1(draw):
    heads, kv_heads = draw(_attention_heads())
    ssd = draw(_ssd("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_chunk_size",
                    "mamba_d_conv"))
    head_dim = draw(st.sampled_from([4, 8]))
    d_ssm = ssd["mamba_n_heads"] * draw(st.sampled_from([2, 4]))
    return dict(ssd, hidden_size=heads * head_dim, intermediate_size=draw(st.sampled_from([16, 40])),
                num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
                num_key_value_heads=kv_heads, mamba_d_ssm=draw(st.sampled_from([None, d_ssm])),
                mamba_rms_norm=draw(booleans), mamba_norm_before_gate=draw(booleans),
                mamba_conv_bias=draw(booleans), mamba_proj_bias=draw(booleans),
                projectors_bias=draw(booleans), attention_bias=draw(booleans), mlp_bias=draw(booleans),
                tie_word_embeddings=draw(booleans), embedding_multiplier=draw(multipliers),
                lm_head_multiplier=draw(multipliers), key_multiplier=draw(multipliers),
                attention_in_multiplier=draw(multipliers), attention_out_multiplier=draw(multipliers),
                ssm_in_multiplier=draw(multipliers), ssm_out_multiplier=draw(multipliers),
                ssm_multipliers=[draw(multipliers) for _ in range(5)],
                mlp_multipliers=[draw(multipliers) for _ in range(2)])


@st.composite
def zamba2(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    hidden = draw(st.sampled_from([16, 24, 32]))
    layers = draw(st.integers(1, 5))
    kinds = _layer_pattern(draw, layers, ("mamba", "hybrid"))
    adapters = draw(booleans)
    mamba_heads = draw(st.sampled_from([d for d in _divisors(2 * hidden) if d <= 8]))
    config = dict(hidden_size=hidden, intermediate_size=draw(st.sampled_from([16, 40])),
                  num_hidden_layers=layers, layers_block_type=kinds, num_attention_heads=heads,
                  num_mem_blocks=draw(st.integers(1, 2)), use_shared_attention_adapter=adapters,
                  adapter_rank=draw(st.sampled_from([2, 4])), use_mem_rope=draw(booleans),
                  n_mamba_heads=mamba_heads,
                  mamba_ngroups=draw(st.sampled_from(_divisors(mamba_heads))),
                  mamba_d_state=draw(st.sampled_from([2, 4, 8])), mamba_d_conv=draw(st.integers(2, 4)),
                  chunk_size=draw(st.sampled_from([3, 8])), add_bias_linear=draw(booleans),
                  tie_word_embeddings=draw(booleans))
    if not adapters:
        config["num_key_value_heads"] = draw(st.sampled_from(_divisors(heads)))
        config["attention_head_dim"] = draw(st.sampled_from([None, 4, 12]))
    return {k: v for k, v in config.items() if v is not None}


@st.composite
def qwen3_next(draw):
    heads, kv_heads = draw(_attention_heads())
    layers = draw(st.integers(1, 4))
    key_heads = draw(st.integers(1, 3))
    experts = draw(st.sampled_from([0, 2, 4]))
    return dict(hidden_size=draw(st.sampled_from([16, 32])), intermediate_size=draw(st.sampled_from([16, 40])),
                num_hidden_layers=layers,
                layer_types=_layer_pattern(draw, layers, ("linear_attention", "full_attention")),
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=draw(st.sampled_from([4, 8, 12])), attention_bias=draw(booleans),
                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                     partial_rotary_factor=draw(st.sampled_from([0.25, 0.5, 1.0]))),
                linear_num_key_heads=key_heads,
                linear_num_value_heads=key_heads * draw(st.integers(1, 2)),
                linear_key_head_dim=draw(st.sampled_from([4, 8])),
                linear_value_head_dim=draw(st.sampled_from([4, 6])),
                linear_conv_kernel_dim=draw(st.integers(2, 4)),
                num_experts=experts, num_experts_per_tok=draw(st.integers(1, max(1, experts))),
                norm_topk_prob=draw(booleans), decoder_sparse_step=draw(st.integers(1, 2)),
                moe_intermediate_size=8, shared_expert_intermediate_size=draw(st.sampled_from([12, 8, 0])),
                tie_word_embeddings=draw(booleans))


@st.composite
def lfm2(draw):
    heads, kv_heads = draw(_attention_heads())
    layers = draw(st.integers(1, 4))
    auto = draw(booleans)
    head_dim = draw(st.sampled_from([None, 12]))
    config = dict(hidden_size=heads * draw(st.sampled_from([4, 8])), num_hidden_layers=layers,
                intermediate_size=draw(st.sampled_from([24, 40])), num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                layer_types=_layer_pattern(draw, layers, ("conv", "full_attention")),
                conv_L_cache=draw(st.integers(2, 4)), conv_bias=draw(booleans),
                block_auto_adjust_ff_dim=auto, block_multiple_of=draw(st.sampled_from([4, 16])),
                block_ffn_dim_multiplier=draw(st.sampled_from([1.0, 0.75, 1.5])),
                tie_word_embeddings=draw(booleans),
                rope_parameters=dict(rope_type="default", rope_theta=draw(st.sampled_from([100.0, 10000.0]))))
    return config if head_dim is None else dict(config, head_dim=head_dim)


@st.composite
def lfm2_moe(draw):
    heads, kv_heads = draw(_attention_heads())
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(1, 6))
    return dict(hidden_size=heads * draw(st.sampled_from([4, 8])), num_hidden_layers=layers,
                intermediate_size=draw(st.sampled_from([16, 40])), moe_intermediate_size=draw(st.sampled_from([8, 24])),
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                layer_types=_layer_pattern(draw, layers, ("conv", "full_attention")),
                conv_L_cache=draw(st.integers(2, 4)), conv_bias=draw(booleans),
                num_dense_layers=draw(st.integers(0, layers)), num_experts=experts,
                num_experts_per_tok=draw(st.integers(1, experts + 1)), use_expert_bias=draw(booleans),
                norm_topk_prob=draw(booleans), routed_scaling_factor=draw(multipliers),
                tie_word_embeddings=draw(booleans),
                rope_parameters=dict(rope_type="default", rope_theta=draw(st.sampled_from([100.0, 10000.0]))))


@st.composite
def olmo_hybrid(draw):
    heads, kv_heads = draw(_attention_heads())
    layers = draw(st.integers(2, 4))
    types = _layer_pattern(draw, layers, ("linear_attention", "full_attention"))
    if len(set(types)) == 1:  # transformers wants both kinds
        types[draw(st.integers(0, layers - 1))] = "full_attention" if types[0] == "linear_attention" else "linear_attention"
    key_heads = draw(st.integers(1, 3))
    rope = draw(st.sampled_from([None, dict(rope_type="default", rope_theta=10000.0)]))
    return dict(hidden_size=heads * draw(st.sampled_from([4, 8])), intermediate_size=draw(st.sampled_from([16, 40])),
                num_hidden_layers=layers, layer_types=types,
                num_attention_heads=heads, num_key_value_heads=kv_heads, attention_bias=draw(booleans),
                linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * draw(st.integers(1, 2)),
                linear_key_head_dim=draw(st.sampled_from([4, 8])), linear_value_head_dim=draw(st.sampled_from([4, 6])),
                linear_conv_kernel_dim=draw(st.integers(2, 4)), linear_allow_neg_eigval=draw(booleans),
                rope_parameters=rope, tie_word_embeddings=draw(booleans))


@st.composite
def kimi_linear(draw):
    layers = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 4))
    experts_per_group = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    experts = experts_per_group * groups
    return dict(hidden_size=draw(st.sampled_from([16, 24, 32])), intermediate_size=draw(st.sampled_from([16, 40])),
                moe_intermediate_size=draw(st.sampled_from([8, 12])), num_hidden_layers=layers,
                layer_types=_layer_pattern(draw, layers, ("linear_attention", "full_attention")),
                mlp_layer_types=_layer_pattern(draw, layers, ("dense", "sparse")),
                num_attention_heads=heads, num_key_value_heads=heads,  # MLA: one latent for every head
                kv_lora_rank=draw(st.sampled_from([4, 12])),
                q_lora_rank=draw(st.sampled_from([None, 6])), qk_nope_head_dim=draw(st.sampled_from([0, 4, 8])),
                qk_rope_head_dim=draw(st.sampled_from([2, 4])), v_head_dim=draw(st.sampled_from([4, 6])),
                attention_bias=draw(booleans), num_local_experts=experts,
                num_experts_per_tok=draw(st.integers(1, experts + 1)), n_group=groups,
                topk_group=draw(st.integers(1, groups)), n_shared_experts=draw(st.integers(0, 2)),
                norm_topk_prob=draw(booleans), routed_scaling_factor=draw(multipliers),
                linear_num_heads=draw(st.integers(1, 3)), linear_head_dim=draw(st.sampled_from([4, 6, 8])),
                linear_conv_kernel_dim=draw(st.integers(2, 4)), hidden_act=draw(st.sampled_from(["silu", "gelu"])),
                tie_word_embeddings=draw(booleans))


SPACES = {
    "jamba": jamba, "mamba": mamba, "llama": llama, "mistral": mistral, "qwen2": qwen2,
    "mamba2": mamba2, "bamba": bamba, "granitemoehybrid": granitemoehybrid,
    "nemotron_h": nemotron_h, "falcon_h1": falcon_h1, "zamba2": zamba2,
    "qwen3_next": qwen3_next, "lfm2": lfm2, "lfm2_moe": lfm2_moe,
    "olmo_hybrid": olmo_hybrid, "kimi_linear": kimi_linear,
}
