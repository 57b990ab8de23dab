"""kvbridge's TEST-ONLY pure-torch stand-ins for the state kernels SGLang 0.5.23 calls on CPU for
hybrid models: the causal conv1d of GDN and Mamba2 layers, the gated delta rule (GDN,
Qwen3-Next), the Mamba2 SSD scan and its one-token update, and the gated RMSNorm.

SGLang's CPU kernels come from its kernel package built from source for AMX Xeons; the registry
has no CPU build, so without these a hybrid model cannot serve here at all. Written from the
math (the recurrences below), not from any kernel's code; SGLang's own pure-torch references
(``sglang/test/kits/attention_unittest/attention_methods/{gdn,mamba2}_attention.py``) and
transformers' torch functions are what tests/test_sglang_standins.py checks them against.

What matters beyond the numbers: the state these functions read and write in place, at the slot
indices SGLang gives, is the state kvbridge moves from a prefill server to a decode server. So the
layouts are SGLang 0.5.23's exactly (its ``configs/mamba_utils.py`` shapes, its GDN and Mamba2
backends' calls, its wheel's pure-torch references under ``sglang/test/kits/``):

- conv state: ``conv_states[slot]`` is ``[dim, K-1]``, the last K-1 *inputs* of the sequence
  (before the convolution), in the pool's dtype (bfloat16 by default, even for a float32 model);
- GDN recurrent state: ``ssm[slot]`` is ``[HV, V, K]`` per layer (value rows, key columns), float32;
- Mamba2 SSM state: ``ssm[slot]`` is ``[H, P, N]`` (heads, head dim, state size).

Everything is computed in float32 and cast on store. A path these do not implement (speculative
verify, radix-cache state tracking, a layout SGLang does not use on this path) raises
NotImplementedError naming the stand-in, instead of computing something else.

Numerics are kept independent of the batch a request is in: prefill runs request by request
(chunks counted from each request's first token), and the one-token updates reduce with
elementwise products and sums, so that a request's tokens do not depend on who it was batched
with (one server's batch is not a prefill/decode pair's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1  # SGLang's padding slot: rows with this index are skipped, nothing written
GDN_CHUNK = 64  # the gated delta rule's chunk length (any length gives the same math)


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what}: not implemented by kvbridge's TEST-ONLY sgl_kernel stand-in "
        "(tests/sglang_standins/sgl_kernel); this path needs SGLang's real kernels"
    )


def _refuse_extra(name: str, extra: dict[str, Any]) -> None:
    """Optional features a caller may pass: accepted only when off (None/False/empty)."""
    used = [
        k
        for k, v in extra.items()
        if v is not None and v is not False and not (isinstance(v, torch.Tensor) and v.numel() == 0)
    ]
    if used:
        raise _unsupported(f"{name}({', '.join(used)}=...)")


def _activate(y: torch.Tensor, activation: Any) -> torch.Tensor:
    if activation in (None, False, ""):
        return y
    if activation in (True, "silu", "swish"):
        return F.silu(y)
    raise _unsupported(f"causal conv1d activation {activation!r}")


def _ints(t: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(i) for i in (t.tolist() if isinstance(t, torch.Tensor) else t)]


# --- causal conv1d (GDN and Mamba2 share it) ------------------------------------------------


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: Any = None,
    conv_states: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    cache_indices: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    seq_lens_cpu: Sequence[int] | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **extra: Any,
) -> torch.Tensor:
    """Depthwise causal conv over the packed prefill tokens of several requests.

    ``x`` is ``[dim, T]`` (the requests' tokens back to back, ``query_start_loc`` their
    boundaries), ``weight`` ``[dim, K]``. Each request's window starts from its conv state
    (``conv_states[cache_indices[i]]``, ``[dim, K-1]``) when ``has_initial_state[i]``, from zeros
    otherwise. Writes each request's last K-1 inputs (padded on the left by that start when the
    request is shorter) back to its slot, and returns ``[dim, T]``.
    """
    _refuse_extra("causal_conv1d_fn", extra)
    if x.dim() != 2 or query_start_loc is None or conv_states is None or cache_indices is None:
        raise _unsupported("causal_conv1d_fn without varlen [dim, T] input and a conv state pool")
    dim, width = weight.shape
    bounds = _ints(query_start_loc)
    slots = _ints(cache_indices)
    has_init = _ints(has_initial_state) if has_initial_state is not None else [0] * len(slots)
    w = weight.float()
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    for i, slot in enumerate(slots):
        start, end = bounds[i], bounds[i + 1]
        if slot == pad_slot_id:
            continue
        if has_init[i]:
            history = conv_states[slot].float()
        else:
            history = x.new_zeros((dim, width - 1), dtype=torch.float32)
        padded = torch.cat([history, x[:, start:end].float()], dim=1)  # [dim, K-1+L]
        windows = padded.unfold(1, width, 1)  # [dim, L, K]: token t sees inputs t-K+1..t
        y = (windows * w[:, None, :]).sum(-1)
        if bias is not None:
            y = y + bias.float()[:, None]
        out[:, start:end] = _activate(y, activation).to(out.dtype)
        conv_states[slot] = padded[:, padded.shape[1] - (width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: Any = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **extra: Any,
) -> torch.Tensor:
    """One decode token per request: ``x`` ``[B, dim]``; the window is the request's conv state
    (``conv_state[conv_state_indices[b]]``, ``[dim, K-1]``) then the token; shifts the token into
    the state in place and returns ``[B, dim]``."""
    _refuse_extra("causal_conv1d_update", {"cache_seqlens": cache_seqlens, **extra})
    if x.dim() != 2:
        raise _unsupported(f"causal_conv1d_update of a {x.dim()}-d input (several tokens a row)")
    batch = x.shape[0]
    slots = (
        conv_state_indices.long()
        if conv_state_indices is not None
        else torch.arange(batch, device=x.device)
    )
    valid = slots != pad_slot_id
    out = torch.zeros_like(x)
    if not bool(valid.any()):
        return out
    rows = slots[valid]
    window = torch.cat([conv_state[rows].float(), x[valid].float()[:, :, None]], dim=2)
    y = (window * weight.float()[None]).sum(-1)  # [b, dim]
    if bias is not None:
        y = y + bias.float()
    out[valid] = _activate(y, activation).to(out.dtype)
    conv_state[rows] = window[:, :, 1:].to(conv_state.dtype)
    return out


# --- gated delta rule (GDN: Qwen3-Next, Qwen3.5) ---------------------------------------------
#
# Per value head, with state S ([V, K]), for each token (q, k l2-normalized, q scaled by K^-0.5,
# decay a = exp(g), write strength beta):
#     S <- a S;   u = beta (v - S k);   S <- S + u k^T;   o = S q
# The chunked form below computes the same thing C tokens at a time (see _gdn_chunk).


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (the log decay) and ``beta = sigmoid(b)``,
    float32, for ``a``/``b`` of ``[T, HV]``."""
    x = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def _gdn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens of the delta rule at once, every head: q, k ``[H, C, K]``, v ``[H, C, V]``, g and
    beta ``[H, C]``, state ``[H, V, K]``; returns (o ``[H, C, V]``, the state after the chunk).

    With G the cumulative log decay in the chunk, the state after token i is
    ``exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) u_j k_j^T``, where the u solve the unit lower
    triangular system ``u_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i.k_j) u_j
    = beta_i (v_i - exp(G_i) S0 k_i)``; the outputs and the final state follow from that sum.
    """
    n = g.shape[-1]
    cum = g.cumsum(-1)  # [H, C]
    gap = cum[:, :, None] - cum[:, None, :]  # [H, C, C]: G_i - G_j (<= 0 for j <= i)
    below = torch.ones(n, n, dtype=torch.bool, device=g.device).tril(-1)
    upto = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    decay_below = torch.exp(gap.masked_fill(~below, float("-inf")))
    decay_upto = torch.exp(gap.masked_fill(~upto, float("-inf")))
    state_t = state.transpose(-1, -2)  # [H, K, V]
    lhs = torch.eye(n, dtype=g.dtype, device=g.device) + beta[:, :, None] * (
        decay_below * (k @ k.transpose(-1, -2))
    )
    rhs = beta[:, :, None] * (v - torch.exp(cum)[:, :, None] * (k @ state_t))
    u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)  # [H, C, V]
    o = torch.exp(cum)[:, :, None] * (q @ state_t) + (decay_upto * (q @ k.transpose(-1, -2))) @ u
    last = cum[:, -1]
    weights = torch.exp(last[:, None] - cum)  # [H, C]
    new_state = (
        torch.exp(last)[:, None, None] * state + (u * weights[:, :, None]).transpose(-1, -2) @ k
    )
    return o, new_state


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, heads: int, l2norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[..., HK, K]`` -> float32, normalized, q scaled, repeated to the HV value heads
    (value head h reads key head h // (HV / HK))."""
    q, k = q.float(), k.float()
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * scale
    repeat = heads // q.shape[-2]
    if repeat != 1:
        q = q.repeat_interleave(repeat, dim=-2)
        k = k.repeat_interleave(repeat, dim=-2)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """GDN prefill: q, k ``[1, T, HK, K]``, v ``[1, T, HV, V]``, g (log decay) and beta
    ``[1, T, HV]``, the requests back to back (``cu_seqlens``). Each request starts from
    ``initial_state[initial_state_indices[i]]`` (``[HV, V, K]``; SGLang zeroes a fresh slot) and
    its final state is written back there in place (on CPU SGLang writes nothing back itself).
    Returns (o ``[1, T, HV, V]``, the final states ``[n, HV, V, K]``, None: no per-chunk states)."""
    _refuse_extra("chunk_gated_delta_rule", extra)
    if head_first or q.shape[0] != 1 or cu_seqlens is None:
        raise _unsupported("chunk_gated_delta_rule without varlen [1, T, H, D] inputs")
    if initial_state is None or initial_state_indices is None:
        raise _unsupported("chunk_gated_delta_rule without a state pool and slot indices")
    heads, dv = v.shape[-2], v.shape[-1]
    dk = q.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    qf, kf = _prepare_qk(q[0], k[0], heads, use_qk_l2norm_in_kernel, scale)  # [T, HV, K]
    vf, gf, bf = v[0].float(), g[0].float(), beta[0].float()
    bounds = _ints(cu_seqlens)
    slots = _ints(initial_state_indices)
    out = torch.zeros((1, q.shape[1], heads, dv), dtype=v.dtype, device=v.device)
    finals = []
    for i, slot in enumerate(slots):
        start, end = bounds[i], bounds[i + 1]
        state = initial_state[slot].float()  # [HV, V, K]
        for c in range(start, end, GDN_CHUNK):
            e = min(c + GDN_CHUNK, end)
            o, state = _gdn_chunk(
                qf[c:e].transpose(0, 1),
                kf[c:e].transpose(0, 1),
                vf[c:e].transpose(0, 1),
                gf[c:e].transpose(0, 1),
                bf[c:e].transpose(0, 1),
                state,
            )
            out[0, c:e] = o.transpose(0, 1).to(out.dtype)
        if slot != PAD_SLOT_ID:
            initial_state[slot] = state.to(initial_state.dtype)
        finals.append(state)
    final = (
        torch.stack(finals) if finals else initial_state.new_zeros((0, *initial_state.shape[1:]))
    )
    return out, final.to(initial_state.dtype), None


def gdn_recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: q, k ``[B, HV, K]`` (prepared), v ``[B, HV, V]``, g,
    beta ``[B, HV]``, state ``[B, HV, V, K]`` (float32); returns (o ``[B, HV, V]``, new state).
    Products and sums, not batched matmuls: a row's result does not depend on the batch."""
    state = state * torch.exp(g)[:, :, None, None]
    recalled = (state * k[:, :, None, :]).sum(-1)  # S k: [B, HV, V]
    u = (v - recalled) * beta[:, :, None]
    state = state + u[:, :, :, None] * k[:, :, None, :]
    return (state * q[:, :, None, :]).sum(-1), state


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """GDN decode, gating included: one token per request (q, k ``[1, B, HK, K]``, v
    ``[1, B, HV, V]``, a, b ``[B, HV]``); reads and updates ``initial_state_source`` in place at
    ``initial_state_indices``; returns o ``[1, B, HV, V]``."""
    tokens = q.shape[1]
    if q.shape[0] != 1:
        raise _unsupported("fused_sigmoid_gating_delta_rule_update of a [B, T, ...] batch")
    if cu_seqlens is not None and _ints(cu_seqlens) != list(range(tokens + 1)):
        raise _unsupported("fused_sigmoid_gating_delta_rule_update of several tokens a request")
    heads, dv = v.shape[-2], v.shape[-1]
    slots = initial_state_indices.long().reshape(-1)
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    qf, kf = _prepare_qk(q[0], k[0], heads, use_qk_l2norm_in_kernel, q.shape[-1] ** -0.5)
    out = torch.zeros((1, tokens, heads, dv), dtype=v.dtype, device=v.device)
    valid = slots != PAD_SLOT_ID
    if bool(valid.any()):
        rows = slots[valid]
        o, state = gdn_recurrent_step(
            qf[valid],
            kf[valid],
            v[0][valid].float(),
            g.reshape(tokens, heads)[valid],
            beta.reshape(tokens, heads)[valid],
            initial_state_source[rows].float(),
        )
        out[0, valid] = o.to(out.dtype)
        initial_state_source[rows] = state.to(initial_state_source.dtype)
    return out


# --- Mamba2 (Nemotron-H, Falcon-H1, Granite 4 hybrids) --------------------------------------
#
# Per head h (head dim P, state size N, group of B/C = h // (H / G)), with state S ([P, N]):
#     dt = softplus(dt + dt_bias);   S <- exp(dt A_h) S + dt x B^T;   y = S C + D_h x
# (y then gated by silu(z) when z is given).


def _dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool, limit: Any) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    low, high = limit if limit is not None else (0.0, float("inf"))
    if low != 0.0 or high != float("inf"):
        dt = dt.clamp(min=low, max=high)
    return dt


def _ssd_chunk(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """C tokens of the Mamba2 scan (no D, no gate), every head: x ``[H, C, P]``, dt ``[H, C]``,
    A ``[H]``, B and C ``[H, C, N]``, state ``[H, P, N]``; returns (y ``[H, C, P]``, new state).

    With L the cumulative log decay (dt A) in the chunk, ``y_t = exp(L_t) S0 C_t +
    sum_{s<=t} exp(L_t - L_s) (C_t.B_s) dt_s x_s`` and the state after the chunk is
    ``exp(L_end) S0 + sum_s exp(L_end - L_s) dt_s x_s B_s^T``."""
    n = dt.shape[-1]
    cum = (dt * A.float()[:, None]).cumsum(-1)  # [H, C]
    upto = torch.ones(n, n, dtype=torch.bool, device=dt.device).tril()
    decay = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~upto, float("-inf")))
    mix = decay * (C @ B.transpose(-1, -2)) * dt[:, None, :]  # [H, C(t), C(s)]
    y = mix @ x + torch.exp(cum)[:, :, None] * (C @ state.transpose(-1, -2))
    last = cum[:, -1]
    weights = torch.exp(last[:, None] - cum) * dt  # [H, C]
    new_state = (
        torch.exp(last)[:, None, None] * state + (x * weights[:, :, None]).transpose(-1, -2) @ B
    )
    return y, new_state


def _d_term(D: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """D x for x ``[..., H, P]`` and D ``[H]`` or ``[H, P]``."""
    if D is None:
        return torch.zeros_like(x)
    d = D.float()
    return x * (d[:, None] if d.dim() == 1 else d)


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: Any = (0.0, float("inf")),
    out: torch.Tensor | None = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    return_track_states: bool = False,
    track_seq_idx: torch.Tensor | None = None,
    track_end_locs: torch.Tensor | None = None,
) -> Any:
    """Mamba2 prefill: x ``[1, T, H, P]``, dt ``[1, T, H]``, A ``[H]``, B and C ``[1, T, G, N]``,
    the requests back to back (``cu_seqlens``), each from ``initial_states[i]`` (``[n, H, P, N]``)
    or zeros. Fills ``out`` (``[1, T, H, P]``) and returns the final states ``[n, H, P, N]`` as
    SGLang's MambaMixer2 asks for them (varlen states; with ``return_track_states``, the tuple
    (None, states, None): no per-chunk or tracked states). seq_idx, chunk_indices and
    chunk_offsets only describe the packing that cu_seqlens already gives."""
    if track_seq_idx is not None and track_seq_idx.numel() > 0:
        raise _unsupported("mamba_chunk_scan_combined with tracked states (the radix cache)")
    if return_final_states or return_intermediate_states or not return_varlen_states:
        raise _unsupported("mamba_chunk_scan_combined returning other than varlen states")
    if x.shape[0] != 1 or cu_seqlens is None:
        raise _unsupported("mamba_chunk_scan_combined without varlen [1, T, H, P] inputs")
    heads, dhead = x.shape[-2], x.shape[-1]
    groups, dstate = B.shape[-2], B.shape[-1]
    bounds = _ints(cu_seqlens)
    dtf = _dt(dt[0], dt_bias, dt_softplus, dt_limit)  # [T, H]
    xf = x[0].float()
    Bh = B[0].float().repeat_interleave(heads // groups, dim=1)  # [T, H, N]
    Ch = C[0].float().repeat_interleave(heads // groups, dim=1)
    if out is None:
        out = torch.empty_like(x)
    states = []
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        if initial_states is not None:
            state = initial_states[i].float()
        else:
            state = x.new_zeros((heads, dhead, dstate), dtype=torch.float32)
        for c in range(start, end, chunk_size):
            e = min(c + chunk_size, end)
            y, state = _ssd_chunk(
                xf[c:e].transpose(0, 1),
                dtf[c:e].transpose(0, 1),
                A,
                Bh[c:e].transpose(0, 1),
                Ch[c:e].transpose(0, 1),
                state,
            )
            y = y.transpose(0, 1) + _d_term(D, xf[c:e])  # [L, H, P]
            if z is not None:
                y = y * F.silu(z[0, c:e].float())
            out[0, c:e] = y.to(out.dtype)
        states.append(state)
    varlen = torch.stack(states).to(state_dtype or torch.float32)
    return (None, varlen, None) if return_track_states else varlen


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    out: torch.Tensor | None = None,
    disable_state_update: bool = False,
    **extra: Any,
) -> None:
    """Mamba2 decode: one token per request; x and dt ``[B, H, P]``, A ``[H, P, N]``, B and C
    ``[B, G, N]``, D and dt_bias ``[H, P]`` (SGLang expands them per head dim); updates
    ``state[state_batch_indices[b]]`` (``[H, P, N]``) in place and writes y into ``out``."""
    _refuse_extra("selective_state_update", extra)
    if disable_state_update:
        raise _unsupported("selective_state_update(disable_state_update=True) (speculative verify)")
    if x.dim() != 3 or out is None:
        raise _unsupported(f"selective_state_update of a {x.dim()}-d input or without out")
    batch, heads, _ = x.shape
    groups = B.shape[1]
    slots = (
        state_batch_indices.long().reshape(-1)
        if state_batch_indices is not None
        else torch.arange(batch, device=x.device)
    )
    valid = slots != pad_slot_id
    out.zero_()
    if not bool(valid.any()):
        return
    rows = slots[valid]
    xf = x[valid].float()
    dtf = _dt(dt[valid], dt_bias, dt_softplus, None)  # [b, H, P]
    Bh = B[valid].float().repeat_interleave(heads // groups, dim=1)  # [b, H, N]
    Ch = C[valid].float().repeat_interleave(heads // groups, dim=1)
    decay = torch.exp(dtf[..., None] * A.float()[None])  # [b, H, P, N]
    new = state[rows].float() * decay + (dtf * xf)[..., None] * Bh[:, :, None, :]
    y = (new * Ch[:, :, None, :]).sum(-1) + (xf * D.float()[None] if D is not None else 0.0)
    if z is not None:
        y = y * F.silu(z[valid].float())
    state[rows] = new.to(state.dtype)
    out[valid] = y.to(out.dtype)


# --- gated RMSNorm (GDN's output norm) ------------------------------------------------------


def rms_norm_gated(
    x: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str = "swish",
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Norm, then gate: ``rmsnorm(x) * weight (+ bias) * act(g)`` over the last dim, act being
    silu ("swish"/"silu") or sigmoid."""
    if residual is not None or prenorm:
        raise _unsupported("rms_norm_gated with a residual or prenorm")
    xf = x.float()
    y = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    if activation in ("swish", "silu"):
        y = y * F.silu(g.float())
    elif activation == "sigmoid":
        y = y * torch.sigmoid(g.float())
    else:
        raise _unsupported(f"rms_norm_gated activation {activation!r}")
    return y.to(x.dtype)


# --- the shared expert's sigmoid gate (Qwen2-MoE blocks: Qwen3-Next's MoE) ------------------


def gate_sigmoid_mul(
    hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor
) -> torch.Tensor:
    """``sigmoid(hidden . gate_weight) * shared_output`` per token (a scalar gate a token)."""
    gate = torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(-1, keepdim=True))
    return (gate * shared_output.float()).to(shared_output.dtype)


def gate_sigmoid_mul_add(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    final_hidden_states: torch.Tensor,
) -> None:
    """Adds the gated shared-expert output to the routed experts' output, in place."""
    gate = torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(-1, keepdim=True))
    summed = final_hidden_states.float() + gate * shared_output.float()
    final_hidden_states.copy_(summed.to(final_hidden_states.dtype))
