"""What a model's work costs, counted from the loaded engine model (HybridLM): the matmul FLOPs of
prefill and decode tokens, and the bytes a decode step must move at least. bench.roofline sets
them against the box's GEMM peak and read rate.
"""

from __future__ import annotations


# ----------------------------------------------------------------------------- FLOPs

def _applied(module):
    """`module` and every module it applies. Zamba2 shares by reference: a `_Plus` holds shared
    linears in `_parts`, and a hybrid layer runs its shared block's MLP (`_block`) for its use."""
    yield module
    extra = [part for part in getattr(module, "_parts", ()) if part is not None]
    if getattr(module, "_block", None):
        block = module._block[0]
        extra += [block.gate_up_proj, block.down_proj, block.gate_up_adapters[str(module.use)]]
    for child in [*module.children(), *extra]:
        yield from _applied(child)


def _expert_stacks(module) -> list:
    """An MoE module's own stacked [experts, out, in] weights; [] for any other module."""
    if not hasattr(module, "top_k"):
        return []
    return [p for p in module.parameters(recurse=False) if p.dim() == 3]


def _routed_flops(moe) -> int:
    """Per token: each stacked [experts, out, in] weight is applied for top_k experts; a router
    matrix the module holds itself (Nemotron's gate_weight) in full. nn.Linear routers and shared
    experts are children and count as linears."""
    total = 0
    for p in moe.parameters(recurse=False):
        if p.dim() == 3:
            total += moe.top_k * 2 * p[0].numel()
        elif p.dim() == 2:
            total += 2 * p.numel()
    return total


def flop_profile(model) -> dict:
    """What the count needs from an engine model (HybridLM): per-token FLOPs of linears and routed
    experts, per attention layer (FLOPs per query-key pair, sliding window), LM head per row."""
    from torch import nn

    from engine.models.attention import PagedAttention

    per_token, attention = 0, []
    for layer in model.layers:
        for m in _applied(layer):
            if isinstance(m, nn.Linear):
                per_token += 2 * m.in_features * m.out_features
            elif _expert_stacks(m):
                per_token += _routed_flops(m)
            if isinstance(m, PagedAttention):  # QK^T and AV: 2 * 2 * head_dim per head and key
                attention.append((4 * m.num_heads * m.head_dim, m.sliding_window))
    return {"per_token": per_token, "attention": attention,
            "lm_head": 2 * model.spec.hidden_size * model.spec.vocab_size}


def _causal_keys(length: int, window: int | None) -> int:
    """Keys attended over a whole causal prompt: sum over positions i = 1..length of min(i, window)."""
    w = min(length, window or length)
    return w * (w + 1) // 2 + (length - w) * w


def matmul_flops(model, prefill_lens: list[int], decode_contexts: list[int]) -> int:
    """Matmul FLOPs of prefilling whole prompts of `prefill_lens` (one logits row each) plus one
    decode token per entry of `decode_contexts` (its context length, the token included)."""
    prof = flop_profile(model)
    tokens = sum(prefill_lens) + len(decode_contexts)
    attention = sum(per_key * (sum(_causal_keys(n, w) for n in prefill_lens)
                               + sum(min(c, w or c) for c in decode_contexts))
                    for per_key, w in prof["attention"])
    return prof["per_token"] * tokens + attention + prof["lm_head"] * (len(prefill_lens) + len(decode_contexts))


def decode_contexts(batch: int, prompt_len: int, output_len: int) -> list[int]:
    """The decode tokens of `batch` sequences: output 1 comes from the prefill, outputs 2..O each
    from a decode step at context prompt_len + j."""
    return [prompt_len + j for j in range(1, output_len)] * batch


# ----------------------------------------------------------------------------- bytes moved

def byte_profile(model) -> dict:
    """What a decode step must read or write at least, from an engine model (HybridLM): its
    parameters once each (Zamba2's shared block too, however often applied) but for the
    embedding, the LM head and the expert stacks; each MoE's stacks as (experts, bytes of one
    expert, top_k); the LM head's matrix; one embedding row; per attention layer applied (a
    shared one per use: each has its own cache) the K and V bytes of one key and its sliding
    window; and the recurrent state of one row (read and written each step)."""
    from engine.cache import bytes_per_slot
    from engine.models.attention import PagedAttention

    vocab = model._vocab_weight()
    itemsize = vocab.element_size()  # the KV cache's dtype is the model's
    moes = [(m, stacks) for m in model.modules() if (stacks := _expert_stacks(m))]
    apart = {id(p) for _, stacks in moes for p in stacks} | {id(model.embed.weight), id(vocab)}
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in apart)
    experts = [(stacks[0].shape[0], sum(p[0].numel() * p.element_size() for p in stacks), m.top_k)
               for m, stacks in moes]
    kv = [(2 * m.num_kv_heads * m.head_dim * itemsize, m.sliding_window)
          for layer in model.layers for m in _applied(layer) if isinstance(m, PagedAttention)]
    return {"weights": weights, "experts": experts, "lm_head": vocab.numel() * itemsize,
            "embedding_row": vocab.shape[1] * itemsize, "kv": kv, "state_per_row": bytes_per_slot(model.spec)}


def decode_step_bytes(model, contexts: list[int], profile: dict | None = None) -> int:
    """Bytes one decode step of rows at `contexts` (each its context length, its new token
    included) must move at least, if nothing stays cached from the step before: every weight
    once, the experts its rows can reach (min(experts, rows * top_k) of each MoE), each row's
    keys and values over its context (window) plus its new token's write, each row's state read
    and written. `profile`: byte_profile(model), where the caller has it."""
    prof, rows = profile or byte_profile(model), len(contexts)
    if rows == 0:
        return 0
    experts = sum(min(count, rows * top_k) * one for count, one, top_k in prof["experts"])
    kv = sum(per_key * (sum(min(c, w or c) for c in contexts) + rows) for per_key, w in prof["kv"])
    return (prof["weights"] + experts + prof["lm_head"] + rows * prof["embedding_row"] + kv
            + 2 * rows * prof["state_per_row"])


def decode_bytes(model, batch: int, prompt_len: int, output_len: int) -> int:
    """decode_step_bytes over the bench's decode phase: steps j = 1..O-1, each of `batch` rows
    at context prompt_len + j."""
    profile = byte_profile(model)
    return sum(decode_step_bytes(model, [prompt_len + j] * batch, profile) for j in range(1, output_len))
