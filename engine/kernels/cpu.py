"""CPU kernels: the torch-facing side of engine/kernels/cpu_kernels.cpp (engine.kernels.native).

In decode, the Mamba and Mamba2 state updates and attention over paged KV cost more as chains
of torch ops than their arithmetic: each op is a full pass over [B, d_inner, d_state], and
attention first copies every sequence's KV out of the pool. These run each row in one pass,
reading the pool in place. The Mamba prefill scan holds a block of 16 channels' states
transposed in vector registers across tokens, with an inlined exp; the prefill conv streams
token rows; prefill attention scores 12 query rows against 32 keys at a time (6 x 16 without AVX-512).
Mamba2's and Gated DeltaNet's prefills run their recurrences token by token: with a scalar
decay per head, that costs less on a CPU than the chunked forms' matrix products.

The elementwise epilogues (RMSNorm with the residual add, SwiGLU's product, rotary in place,
Mamba's gate and skip, softplus, the MoE combine) replace chains of torch ops, each a full pass
over its tensor in prefill and a dispatch of its own in decode.

Same contracts as the `*_ref` functions or torch code they stand for (engine.kernels.ssm_update,
conv_update, mamba2_update, gdn_scan, paged_attention, ssd_scan,
engine.models.ssm.selective_scan_ref and varlen_causal_conv, engine.models.layers), to float32
rounding: the transformers parity tests judge every model on them.
"""

from __future__ import annotations

import torch

from engine.kernels import native
from engine.kernels.conv_update import check_conv_update
from engine.kernels.gdn_scan import check_rule, check_step
from engine.kernels.mamba2_update import NO_LIMIT, check_state_update
from engine.kernels.ssd_scan import check_chunk_scan


def available() -> bool:
    return native.available()


def _f32(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32 and t.is_contiguous():  # the usual case (weights): no torch calls
        return t
    return t.detach().float().contiguous()


def ids(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64 and t.is_contiguous():  # the usual case (the step's index tensors): no torch calls
        return t
    return t.detach().to(torch.int64).contiguous()


def _in_place(name: str, *tensors: torch.Tensor | None) -> None:
    """Tensors handed to a kernel as they are (written in place, or read through strides, so
    not converted by _f32) must be float32 on the CPU: anything else would be misread."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name}: needs float32 CPU tensors, got {t.dtype} on {t.device}")


def _writable(out: torch.Tensor | None, shape) -> bool:
    """`out` can take a kernel's float32 result as it is (no copy through a temporary)."""
    return (out is not None and out.dtype == torch.float32 and out.device.type == "cpu" and out.is_contiguous()
            and out.shape == shape)


def _pool(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"{name}: the CPU kernel updates it in place and needs a contiguous "
                         f"float32 pool, got {t.dtype}")
    return t.detach()


def selective_state_update_cpu(ssm_state, slots, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                               dt_softplus=False, out=None, slot_runs=False):
    """See engine.kernels.ssm_update.selective_state_update_ref. Rows that share a slot run in
    order whether `slot_runs` says so or not (cpu_kernels.cpp state_threads)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    direct = D is None and z is None and _writable(out, x.shape)
    y = out if direct else torch.empty(x.shape, dtype=torch.float32)
    if x.shape[0]:
        native.call("ssm_state_update", state=_pool(ssm_state, "ssm_state"), slots=ids(slots), x=_f32(x),
                    dt=_f32(dt), A=_f32(A), B=_f32(B), C=_f32(C), y=y, batch=x.shape[0], d_inner=x.shape[1],
                    d_state=ssm_state.shape[2])
    if direct:
        return out
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * torch.nn.functional.silu(z.float())
    if out is None:
        return y
    out.copy_(y)
    return out


def causal_conv1d_update_cpu(conv_state, slots, x, weight, bias=None, activation=None, out=None, slot_runs=False):
    """See engine.kernels.conv_update.causal_conv1d_update_ref; rows that share a slot run in
    order either way."""
    check_conv_update(conv_state, slots, x, weight, bias, activation)
    direct = _writable(out, x.shape)
    y = out if direct else torch.empty(x.shape, dtype=torch.float32)
    rows = x if rows_with_stride(x) else _f32(x)  # a column block of a projection is read in place
    if x.shape[0]:
        native.call("conv_update", state=_pool(conv_state, "conv_state"), slots=ids(slots), x=rows,
                    x_stride=rows.stride(0), weight=_f32(weight), bias=_f32(bias) if bias is not None else None,
                    y=y, batch=x.shape[0], channels=x.shape[1], width=weight.shape[1],
                    silu=int(activation == "silu"))
    if direct:
        return out
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def selective_scan_cpu(x, dt, A, B, C, h0, out=None):
    """See engine.models.ssm.selective_scan_ref: one sequence's Mamba prefill from h0 [D, N];
    returns y [L, D] (into `out` if given: contiguous float32) and h_L [D, N], float32."""
    length, d_inner = x.shape
    y = torch.empty(length, d_inner, dtype=torch.float32) if out is None else _pool(out, "out")
    h = h0.detach().float().clone().contiguous()
    if length:
        native.call("selective_scan", x=_f32(x), dt=_f32(dt), A=_f32(A), B=_f32(B), C=_f32(C), h=h, y=y,
                    length=length, d_inner=d_inner, d_state=A.shape[1])
    return y, h


def mamba2_state_update_cpu(ssm_state, slots, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False,
                            dt_limit=NO_LIMIT, out=None, slot_runs=False):
    """See engine.kernels.mamba2_update.mamba2_state_update_ref; rows that share a slot run in
    order either way."""
    check_state_update(ssm_state, slots, x, dt, A, B, C, D, dt_bias)
    dt = mamba2_dt_cpu(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.empty(x.shape, dtype=torch.float32)
    if x.shape[0]:
        batch, heads, head_dim = x.shape
        native.call("mamba2_state_update", state=_pool(ssm_state, "ssm_state"), slots=ids(slots), x=_f32(x),
                    dt=_f32(dt), A=_f32(A), B=_f32(B), C=_f32(C), y=y, batch=batch, heads=heads,
                    head_dim=head_dim, groups=B.shape[1], d_state=B.shape[2])
    if D is not None:
        y = y + x.float() * D.float()[None, :, None]
    if out is None:
        return y
    out.copy_(y)
    return out


def mamba2_dt_cpu(dt: torch.Tensor, dt_bias=None, dt_softplus: bool = False, dt_limit=NO_LIMIT) -> torch.Tensor:
    """process_dt of a decode step's dt [rows, heads] in one C++ pass (the kernel Mamba2's one-call
    decode runs, so both give the same bits); rows may be a column block of the projection."""
    rows = dt if rows_with_stride(dt) else _f32(dt)
    out = torch.empty(dt.shape, dtype=torch.float32)
    if dt.shape[0]:
        lo, hi = dt_bounds(dt_limit)
        native.call("mamba2_dt", dt=rows, dt_stride=rows.stride(0), bias=None if dt_bias is None else _f32(dt_bias),
                    softplus=int(dt_softplus), lo=lo, hi=hi, out=out, rows=dt.shape[0], heads=dt.shape[1])
    return out


def dt_bounds(dt_limit) -> tuple[float, float]:
    """The (low, high) mamba2_dt clamps to: process_dt clamps only where a limit is set, and the
    kernel, built with fast math, is given finite bounds."""
    low, high = dt_limit
    most = torch.finfo(torch.float32).max
    return (float(low), min(float(high), most)) if low > 0.0 or high != float("inf") else (-most, most)


def ssd_scan_cpu(x, dt, A, B, C, h0):
    """See engine.kernels.ssd_scan.ssd_scan_ref: one sequence's Mamba2 prefill from h0 [H, P, N],
    one token at a time; returns y [L, H, P] and h_L [H, P, N], float32. x [L, H, P] and B, C
    [L, G, N] may be column blocks of the projection (any token stride, heads contiguous)."""
    check_chunk_scan(x, dt, A, B, C, h0)
    x, B, C = (t if rows_of_heads(t) else t.float().contiguous() for t in (x, B, C))
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    length, heads, head_dim = x.shape
    y = torch.empty(length, heads, head_dim, dtype=torch.float32)
    h = h0.detach().float().clone().contiguous()
    if length:
        native.call("ssd_scan", x=x, x_stride=x.stride(0), dt=_f32(dt), A=_f32(A), B=B, C=C,
                    bc_stride=B.stride(0), state=h, y=y, length=length, heads=heads, head_dim=head_dim,
                    groups=B.shape[1], d_state=B.shape[2])
    return y, h


def prepare_qk_cpu(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.kernels.gdn_scan.prepare_qk in one C++ pass (the kernel the one-call Gated DeltaNet
    decode runs, so both give the same bits): q, k [rows, Hk, dk] -> [rows, Hv, dk] float32; rows
    may be column blocks of one tensor (views into the conv's output)."""
    if not (rows_of_heads(q) and rows_of_heads(k) and q.stride(0) == k.stride(0)):
        q, k = _f32(q), _f32(k)
    rows, k_heads, k_dim = q.shape
    q_out, k_out = torch.empty(rows, num_v_heads, k_dim), torch.empty(rows, num_v_heads, k_dim)
    if rows:
        native.call("gdn_prepare_qk", q=q, k=k, stride=q.stride(0), rows=rows, k_heads=k_heads,
                    v_heads=num_v_heads, k_dim=k_dim, q_out=q_out, k_out=k_out)
    return q_out, k_out


def gdn_gates_cpu(b: torch.Tensor, a: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's beta = sigmoid(b) and g = A softplus(a + dt_bias) (A = -exp(A_log)), each
    [rows, heads] float32, in one C++ pass (the one-call decode's kernel)."""
    if b.shape != a.shape or b.dim() != 2 or A.shape != b.shape[1:] or dt_bias.shape != b.shape[1:]:
        raise ValueError(f"gdn_gates: b, a [rows, heads], A and dt_bias [heads]; got {tuple(b.shape)}, "
                         f"{tuple(a.shape)}, {tuple(A.shape)}, {tuple(dt_bias.shape)}")
    beta, g = torch.empty(b.shape), torch.empty(b.shape)
    if b.numel():
        native.call("gdn_gates", b=_f32(b), a=_f32(a), A=_f32(A), dt_bias=_f32(dt_bias), beta=beta, g=g,
                    rows=b.shape[0], heads=b.shape[1])
    return beta, g


def gated_delta_step_cpu(state, slots, q, k, v, g, beta, slot_runs=False):
    """See engine.kernels.gdn_scan.gated_delta_step_ref; rows that share a slot run in order
    either way."""
    check_step(state, slots, q, k, v, g, beta)
    q, k = prepare_qk_cpu(q, k, v.shape[1])
    o = torch.empty(v.shape, dtype=torch.float32)
    if v.shape[0]:
        native.call("gated_delta_step", state=_pool(state, "state"), slots=ids(slots), q=_f32(q), k=_f32(k),
                    v=_f32(v), g=_f32(g), beta=_f32(beta), o=o, batch=v.shape[0], heads=v.shape[1],
                    k_dim=q.shape[2], v_dim=v.shape[2], g_per_channel=int(g.dim() == 3))
    return o


def gated_delta_rule_cpu(q, k, v, g, beta, h0):
    """See engine.kernels.gdn_scan.gated_delta_rule_ref: one sequence's prefill from h0
    [Hv, dk, dv], one token at a time; returns o [L, Hv, dv] and S_L, float32."""
    check_rule(q, k, v, g, beta, h0)
    q, k = prepare_qk_cpu(q, k, v.shape[1])
    length, heads, v_dim = v.shape
    o = torch.empty(length, heads, v_dim, dtype=torch.float32)
    S = h0.detach().float().clone().contiguous()
    if length:
        native.call("gated_delta_scan", state=S, q=_f32(q), k=_f32(k), v=_f32(v), g=_f32(g), beta=_f32(beta),
                    o=o, length=length, heads=heads, k_dim=q.shape[2], v_dim=v_dim, g_per_channel=int(g.dim() == 3))
    return o, S


def paged_attention_decode_cpu(q, k_cache, v_cache, block_tables, context_lens, scale,
                               sliding_window=None, out=None):
    """See engine.kernels.paged_attention.paged_attention_decode_ref."""
    result = torch.empty(q.shape, dtype=torch.float32)
    if q.shape[0]:
        tables = ids(block_tables)
        native.call("paged_attention_decode", q=_f32(q), k_cache=_pool(k_cache, "k_cache"),
                    v_cache=_pool(v_cache, "v_cache"), tables=tables, table_width=tables.shape[1],
                    lens=ids(context_lens), out=result, batch=q.shape[0], heads=q.shape[1],
                    kv_heads=k_cache.shape[2], head_dim=q.shape[2], block_size=k_cache.shape[1],
                    scale=float(scale), window=int(sliding_window or 0))
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def group_rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the mean within each group of `group` columns of a
    contiguous float32 x [rows, cols]; a new tensor."""
    _in_place("group_rms_norm", x, weight)
    rows, cols = x.shape
    if not x.is_contiguous() or group <= 0 or cols % group or weight.shape != (cols,):
        raise ValueError(f"group_rms_norm: x {tuple(x.shape)} contiguous, groups of {group} columns, "
                         f"weight {tuple(weight.shape)} one per column")
    out = torch.empty(x.shape, dtype=torch.float32)
    if x.numel():
        native.call("group_rms_norm", x=x, weight=weight.detach().contiguous(), out=out, rows=rows, cols=cols,
                    group=group, eps=float(eps))
    return out


def skip_norm_gate_cpu(y: torch.Tensor, x: torch.Tensor | None, D: torch.Tensor | None, z: torch.Tensor,
                       weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """Mamba2's output with the norm before the gate: weight * group_rms(y + x D) * silu(z), as
    GatedRMSNorm(norm_before_gate=True) gives it; without x and D, weight * group_rms(y) * silu(z)
    (Gated DeltaNet's HeadGatedRMSNorm, its weight repeated per head). y [rows, cols] contiguous
    float32, x and z float32 with unit column stride (views into the projections are fine). A new
    tensor."""
    _in_place("skip_norm_gate", y, x, z, weight)
    rows, cols = y.shape
    skip_ok = (x is None and D is None) or (x is not None and D is not None and x.shape == y.shape and x.stride(1) == 1)
    if not y.is_contiguous() or not skip_ok or z.shape != y.shape or z.stride(1) != 1 or weight.shape != (cols,) \
            or group <= 0 or cols % group:
        raise ValueError(f"skip_norm_gate: y {tuple(y.shape)} contiguous, z (and x with D, or neither) of its shape "
                         f"with unit column stride, a weight per column, groups of {group} columns")
    out = torch.empty(y.shape, dtype=torch.float32)
    if y.numel():
        native.call("skip_norm_gate", y=y, x=x, x_stride=0 if x is None else x.stride(0),
                    D=None if D is None else _f32(D), z=z, z_stride=z.stride(0),
                    weight=weight.detach().contiguous(), group=group, eps=float(eps), out=out, rows=rows,
                    cols=cols)
    return out


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None):
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of float32 x: contiguous, or a matrix
    with its own row stride (a column block of a projection). With `add` (same shape and
    strides), x += add first, in place, and the sum is what gets normalised: the residual add and
    the next norm in one pass. Returns a new contiguous tensor."""
    _in_place("rms_norm", x, add)
    if not rows_with_stride(x) and not x.is_contiguous():
        raise ValueError(f"rms_norm: x {tuple(x.shape)} with strides {x.stride()} is neither contiguous "
                         "nor a matrix with contiguous rows")
    if add is not None and (add.shape != x.shape or add.stride() != x.stride()):
        raise ValueError(f"rms_norm: add {tuple(add.shape)}/{add.stride()} differs from x "
                         f"{tuple(x.shape)}/{x.stride()}")
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    row_stride = x.stride(0) if x.dim() == 2 else cols
    out = torch.empty(x.shape, dtype=torch.float32)
    if rows:
        native.call("rms_norm", x=x, add=add, weight=_f32(weight), out=out, rows=rows, cols=cols,
                    x_stride=row_stride, eps=float(eps))
    return out


def rms_norm_3_cpu(x: torch.Tensor, weights, eps: float) -> tuple[torch.Tensor, ...]:
    """Three RMSNorms of consecutive column blocks of float32 x [rows, >= sum of widths] (rows
    with any stride), block i sized by weights[i]: contiguous results, as three calls of
    rms_norm_cpu on the blocks would give, in one pass."""
    _in_place("rms_norm_3", x)
    weights = [_f32(w) for w in weights]
    widths = [w.shape[0] for w in weights]
    if len(weights) != 3 or not rows_with_stride(x) or sum(widths) > x.shape[1]:
        raise ValueError(f"rms_norm_3: x {tuple(x.shape)}/{x.stride()} does not hold 3 blocks of {widths}")
    rows = x.shape[0]
    outs = [torch.empty(rows, n, dtype=torch.float32) for n in widths]
    if rows:
        (w0, w1, w2), (n0, n1, n2), (o0, o1, o2) = weights, widths, outs
        native.call("rms_norm_3", x=x, x_stride=x.stride(0), w0=w0, w1=w1, w2=w2, n0=n0, n1=n1, n2=n2,
                    o0=o0, o1=o1, o2=o2, rows=rows, eps=float(eps))
    return tuple(outs)


def rows_with_stride(x: torch.Tensor) -> bool:
    """A float32 CPU matrix whose rows are each contiguous (any row stride)."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1


def silu_mul_cpu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, cols] float32 gate and up with unit column stride and one row
    stride (two contiguous projections, or the halves of one gate-up projection read in place)."""
    _in_place("silu_mul", gate, up)
    rows, cols = gate.shape
    if up.shape != gate.shape or up.stride() != gate.stride() or gate.stride(1) != 1:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)}/{gate.stride()} and up "
                         f"{tuple(up.shape)}/{up.stride()} need one shape, unit column stride, one row stride")
    out = torch.empty(rows, cols, dtype=torch.float32)
    if out.numel():
        native.call("silu_mul", gate=gate, up=up, out=out, rows=rows, cols=cols, in_stride=gate.stride(0))
    return out


def rotary_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of float32 x [tokens, heads, head_dim] in place on its first
    cos.shape[1] dims (each token's heads contiguous, any token stride: a column block of a
    fused projection will do), cos and sin [tokens, rotary_dim] contiguous float32; returns x."""
    _in_place("rotary", x, cos, sin)
    tokens, heads, head_dim = x.shape
    if cos.shape != sin.shape or cos.shape[0] != tokens or cos.shape[1] > head_dim or cos.shape[1] % 2:
        raise ValueError(f"rotary: tables {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    if not rows_of_heads(x) or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError(f"rotary: x {tuple(x.shape)} with strides {x.stride()} needs each token's heads contiguous")
    if x.numel():
        native.call("rotary", x=x, x_stride=x.stride(0), cos=cos, sin=sin, tokens=tokens, heads=heads,
                    head_dim=head_dim, rotary_dim=cos.shape[1])
    return x


def rows_of_heads(x: torch.Tensor) -> bool:
    """A float32 CPU [tokens, heads, head_dim] whose tokens each hold their heads contiguously."""
    return (x.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.stride(2) == 1 and x.stride(1) == x.shape[2])


def sigmoid_gate_cpu(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) into contiguous float32 x [tokens, heads * head_dim], returned; gate
    [tokens, heads, head_dim] float32 with unit column stride (each head's gate beside its query
    in the projection is fine)."""
    _in_place("head_gate", x, gate)
    tokens, heads, head_dim = gate.shape
    if not x.is_contiguous() or x.shape != (tokens, heads * head_dim) or gate.stride(2) != 1:
        raise ValueError(f"head_gate: x {tuple(x.shape)} contiguous, gate {tuple(gate.shape)} with unit column stride")
    if x.numel():
        native.call("head_gate", x=x, gate=gate, gate_row_stride=gate.stride(0),
                    gate_head_stride=gate.stride(1), rows=tokens, heads=heads, head_dim=head_dim)
    return x


def sigmoid_gated_add_cpu(out: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out += sigmoid(gate) * x in place and returned: out, x [rows, cols] and gate [rows, 1], all
    contiguous float32 (Qwen3-Next's gated shared expert onto the routed experts' output)."""
    _in_place("sigmoid_gated_add", out, gate, x)
    rows, cols = out.shape
    if not (out.is_contiguous() and x.is_contiguous() and gate.is_contiguous()) or x.shape != out.shape \
            or gate.shape != (rows, 1):
        raise ValueError(f"sigmoid_gated_add: out and x {tuple(out.shape)}, gate [rows, 1], contiguous; "
                         f"got x {tuple(x.shape)}, gate {tuple(gate.shape)}")
    if out.numel():
        native.call("sigmoid_gated_add", out=out, gate=gate, x=x, rows=rows, cols=cols)
    return out


def gated_skip_cpu(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Mamba's (y + x * D) * silu(z), written into contiguous float32 y [rows, cols] and returned;
    x and z float32 with unit column stride (views into the projections are fine)."""
    _in_place("gated_skip", y, x, z)
    rows, cols = y.shape
    if not y.is_contiguous() or x.shape != y.shape or z.shape != y.shape or x.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError(f"gated_skip: y {tuple(y.shape)} contiguous, x and z of its shape with unit column stride")
    if y.numel():
        native.call("gated_skip", y=y, x=x, x_stride=x.stride(0), D=_f32(D), z=z, z_stride=z.stride(0), out=y,
                    rows=rows, cols=cols)
    return y


def bias_softplus_cpu(dt: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """softplus(dt + bias) (bias None: softplus(dt)) into contiguous float32 dt [rows, cols], returned."""
    _in_place("bias_softplus", dt)
    if not dt.is_contiguous() or dt.dim() != 2 or (bias is not None and bias.shape != dt.shape[1:]):
        raise ValueError(f"bias_softplus: dt {tuple(dt.shape)} contiguous 2-D, bias one per column")
    if dt.numel():
        native.call("bias_softplus", dt=dt, bias=None if bias is None else _f32(bias), rows=dt.shape[0],
                    cols=dt.shape[1])
    return dt


def causal_conv_prefill_cpu(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            fresh: bool, silu: bool, out: torch.Tensor) -> torch.Tensor:
    """One sequence's causal depthwise conv (see engine.models.ssm.varlen_causal_conv), its
    state [channels, width] (the last width inputs, oldest first; read unless `fresh`) updated in
    place; x [length, channels] with unit column stride, out contiguous; silu applied if asked."""
    _in_place("causal_conv_prefill", x, out)
    length, channels = x.shape
    width = weight.shape[1]
    if (x.stride(1) != 1 or state.shape != (channels, width) or not state.is_contiguous()
            or out.shape != x.shape or not out.is_contiguous()):
        raise ValueError(f"causal_conv_prefill: x {tuple(x.shape)}, state {tuple(state.shape)}, "
                         f"out {tuple(out.shape)} do not fit weight {tuple(weight.shape)}")
    if length:
        native.call("causal_conv_prefill", x=x, x_stride=x.stride(0), state=_pool(state, "conv state"),
                    weight=_f32(weight), bias=_f32(bias) if bias is not None else None, out=out, length=length,
                    channels=channels, width=width, fresh=int(fresh), silu=int(silu))
    return out


def prefill_attention_cpu(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                          sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of a sequence's last n queries q [n, H, Dh] over its context's keys and
    values [context, KVH, Dh] (float32, each token's heads contiguous, any token stride): the
    query at row i sits at position context - n + i. Returns [n, H, Dh] float32."""
    n, heads, head_dim = q.shape
    context, kv_heads = keys.shape[0], keys.shape[1]
    if not (rows_of_heads(q) and rows_of_heads(keys) and rows_of_heads(values)) or heads % kv_heads \
            or keys.shape != values.shape or keys.shape[2] != head_dim or n > context:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)} do not fit")
    out = torch.empty(n, heads, head_dim, dtype=torch.float32)
    if n:
        # Keys transposed, [KVH, Dh, context padded to 32]: scores vectorise across keys.
        padded = -(-context // 32) * 32
        kt = torch.zeros(kv_heads, head_dim, padded, dtype=torch.float32)
        kt[:, :, :context] = keys.permute(1, 2, 0)
        native.call("prefill_attention", q=q, q_stride=q.stride(0), kt=kt, padded=padded, v=values,
                    v_stride=values.stride(0), out=out, n=n, context=context, heads=heads, kv_heads=kv_heads,
                    head_dim=head_dim, scale=float(scale), window=int(sliding_window or 0))
    return out


def moe_group_cpu(experts: torch.Tensor, num_experts: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The (token, k) picks of experts [tokens, top_k] grouped by expert, stably (a counting sort):
    (picks per expert, the token each grouped row reads [tokens * top_k], each pick's grouped row
    [tokens * top_k]); what argsort, bincount and an inverse permutation give, in one pass."""
    tokens, top_k = experts.shape
    picks = tokens * top_k
    counts = torch.empty(num_experts, dtype=torch.long)
    token_of_row, position = torch.empty(picks, dtype=torch.long), torch.empty(picks, dtype=torch.long)
    native.call("moe_group", experts=ids(experts), counts=counts, token_of_row=token_of_row, position=position,
                picks=picks, top_k=top_k, num_experts=num_experts)
    per_expert = counts.tolist()
    if sum(per_expert) != picks:
        raise ValueError(f"moe_group: expert ids outside [0, {num_experts}) in {experts.tolist()}")
    return per_expert, token_of_row, position


def moe_route_cpu(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [tokens, top_k], their weights) from router logits [tokens, experts]: the
    softmax's top_k, largest first, divided by their sum where `normalize`; one C++ pass for what
    softmax, topk and the division do as torch ops."""
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"moe_route: top_k {top_k} of {experts} experts")
    ids, weights = torch.empty(tokens, top_k, dtype=torch.long), torch.empty(tokens, top_k)
    native.call("moe_route", logits=_f32(logits), tokens=tokens, experts=experts, top_k=top_k,
                normalize=int(normalize), ids=ids, weights=weights)
    return ids, weights


def moe_combine_cpu(picks: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * picks[position[t * top_k + k]] (k in order) for picks
    [tokens * top_k, hidden] (the experts' outputs grouped by expert) and weights [tokens, top_k]."""
    tokens, top_k = weights.shape
    hidden = picks.shape[1]
    if picks.shape[0] != tokens * top_k or position.shape != (tokens * top_k,):
        raise ValueError(f"moe_combine: picks {tuple(picks.shape)}, position {tuple(position.shape)} "
                         f"do not fit weights {tuple(weights.shape)}")
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    if out.numel():
        native.call("moe_combine", picks=_f32(picks), position=ids(position), weights=_f32(weights), out=out,
                    tokens=tokens, top_k=top_k, hidden=hidden)
    return out


def row_argmax_cpu(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a float32 matrix [rows, cols > 0], ties and NaN as torch has them."""
    _in_place("row_argmax", x)
    rows, cols = x.shape
    if not cols:
        raise ValueError("row_argmax: no columns to take the argmax of")
    out = torch.empty(rows, dtype=torch.long)
    if rows:
        native.call("row_argmax", x=x.contiguous(), out=out, rows=rows, cols=cols)
    return out
