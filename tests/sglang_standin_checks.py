"""Checks of kvbridge's test-only kernel stand-ins (tests/sglang_standins/sgl_kernel) against
independent pure-torch references, run inside the SGLang venv (where the stand-ins are on the
path, and SGLang and transformers 5.19 are installed) by tests/test_sglang_standins.py:

    SGLANG_USE_CPU_ENGINE=1 "$KVBRIDGE_SGLANG_PY" tests/sglang_standin_checks.py

prints one JSON object: check name -> "ok" or the traceback.

The references: ``torch.nn.functional.conv1d`` over the explicit history (causal conv),
transformers' ``torch_recurrent_gated_delta_rule`` (Qwen3-Next; its state is [K, V], SGLang's
[V, K]), transformers' ``mamba2_chunk_scan`` and ``mamba2_selective_state_update`` (Nemotron-H),
and ``Qwen3NextRMSNormGated``. Each kernel check is the way SGLang drives the kernels: several
requests packed into one prefill (chunked where the kernel chunks), states read from and written
to scattered slots of a pool, then one decode token per request; the outputs and the state left in
each slot must equal the reference's all-at-once run, and the other slots must be untouched.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1.0)
    if not err <= tol * scale:
        raise AssertionError(f"{what}: max |diff| {err:.3g} > {tol * scale:.3g}")


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def untouched(pool: torch.Tensor, before: torch.Tensor, slots: list[int], what: str) -> None:
    others = [s for s in range(pool.shape[0]) if s not in slots]
    if not torch.equal(pool[others], before[others]):
        raise AssertionError(f"{what}: a slot no request owns was written")


@check
def conv_prefill_then_update() -> None:
    """causal_conv1d_fn_cpu over three packed requests (one shorter than K-1, two resuming
    from their slots' state), then causal_conv1d_update_cpu with one token each, in a float32
    pool and in a bfloat16 one (SGLang's default conv dtype)."""
    from sgl_kernel.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

    torch.manual_seed(0)
    dim, width = 24, 4
    lens, slots, resume = [2, 9, 30], [5, 1, 3], [False, True, True]
    weight, bias = torch.randn(dim, width), torch.randn(dim)
    x = torch.randn(dim, sum(lens))
    step = torch.randn(len(lens), dim)
    for dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(8, dim, width - 1).to(dtype)
        before = pool.clone()
        out = causal_conv1d_fn_cpu(
            x,
            weight,
            bias,
            activation="silu",
            conv_states=pool,
            has_initial_state=torch.tensor(resume),
            cache_indices=torch.tensor(slots, dtype=torch.int32),
            query_start_loc=cu(lens),
            seq_lens_cpu=lens,
        )
        after_prefill = pool.clone()
        out_step = causal_conv1d_update_cpu(
            step, pool, weight, bias, "silu", conv_state_indices=torch.tensor(slots)
        )
        bounds = cu(lens).tolist()
        for i, slot in enumerate(slots):
            s, e = bounds[i], bounds[i + 1]
            history = before[slot].float() if resume[i] else torch.zeros(dim, width - 1)
            full = torch.cat([history, x[:, s:e], step[i][:, None]], dim=1)
            ref = F.silu(F.conv1d(full[None], weight[:, None, :], bias, groups=dim))[0]
            close(out[:, s:e], ref[:, :-1], f"{dtype} request {i}: prefill output")
            # The state is the last K-1 inputs, in the pool's dtype.
            want = torch.cat([history, x[:, s:e]], dim=1)[:, -(width - 1) :].to(dtype)
            if not torch.equal(after_prefill[slot], want):
                raise AssertionError(f"{dtype} request {i}: conv state after prefill")
            if not torch.equal(pool[slot], full[:, -(width - 1) :].to(dtype)):
                raise AssertionError(f"{dtype} request {i}: conv state after the decode step")
            # The decode step reads the stored (possibly rounded) state.
            stored = torch.cat([want.float(), step[i][:, None]], dim=1)
            ref_step = F.silu((stored * weight).sum(-1) + bias)
            close(out_step[i], ref_step, f"{dtype} request {i}: decode output")
            if dtype == torch.float32:
                close(out_step[i], ref[:, -1], f"request {i}: decode output vs all-at-once")
        untouched(pool, before, slots, f"{dtype} conv")


@check
def gdn_prefill_then_decode() -> None:
    """fused_gdn_gating_cpu + chunk_gated_delta_rule_cpu over three packed requests (1, 70 and
    130 tokens: across the 64-token chunks), then fused_sigmoid_gating_delta_rule_update_cpu
    with one token each (called by keyword, as SGLang does), against transformers' token-by-token
    gated delta rule on each request's 1 + L + 1 tokens. K != V so that a transposed state
    shows."""
    from sgl_kernel.mamba import chunk_gated_delta_rule_cpu
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    torch.manual_seed(1)
    hk, hv, dk, dv = 2, 4, 16, 8
    lens, slots = [1, 70, 130], [4, 0, 2]
    n, total = len(lens), sum(lens)
    pool = torch.randn(6, hv, dv, dk) * 0.1  # [slot, HV, V, K]
    before = pool.clone()
    q, k = torch.randn(1, total, hk, dk), torch.randn(1, total, hk, dk)
    v = torch.randn(1, total, hv, dv)
    a, b = torch.randn(total, hv), torch.randn(total, hv)
    A_log, dt_bias = torch.randn(hv) * 0.5, torch.randn(hv) * 0.5  # noqa: N806
    q1, k1 = torch.randn(1, n, hk, dk), torch.randn(1, n, hk, dk)
    v1, a1, b1 = torch.randn(1, n, hv, dv), torch.randn(n, hv), torch.randn(n, hv)

    g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    want_g = -A_log.exp() * F.softplus(a + dt_bias)
    close(g, want_g[None], "gating g")
    close(beta, torch.sigmoid(b)[None], "gating beta")
    o, finals, _ = chunk_gated_delta_rule_cpu(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=pool,
        cu_seqlens=cu(lens),
        head_first=False,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=torch.tensor(slots, dtype=torch.int32),
    )
    after_prefill = pool.clone()
    o1 = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log,
        dt_bias=dt_bias,
        q=q1,
        k=k1,
        v=v1,
        a=a1,
        b=b1,
        initial_state_source=pool,
        initial_state_indices=torch.tensor(slots, dtype=torch.int32),
        cu_seqlens=torch.arange(n + 1, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True,
        softplus_beta=1.0,
        softplus_threshold=20.0,
    )
    bounds = cu(lens).tolist()
    rep = hv // hk
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]

        def seq(t: torch.Tensor, t1: torch.Tensor, s: int = s, e: int = e, i: int = i):
            return torch.cat([t[:, s:e], t1[:, i : i + 1]], dim=1)  # the prompt, then its step

        ref_o, ref_state = torch_recurrent_gated_delta_rule(
            seq(q, q1).repeat_interleave(rep, dim=2),
            seq(k, k1).repeat_interleave(rep, dim=2),
            seq(v, v1),
            g=torch.cat([want_g[s:e], -A_log.exp() * F.softplus(a1[i : i + 1] + dt_bias)])[None],
            beta=torch.sigmoid(torch.cat([b[s:e], b1[i : i + 1]]))[None],
            initial_state=before[slot].transpose(-1, -2)[None],  # HF's state is [H, K, V]
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        close(o[0, s:e], ref_o[0, :-1], f"request {i}: prefill output")
        close(o1[0, i], ref_o[0, -1], f"request {i}: decode output")
        close(pool[slot], ref_state[0].transpose(-1, -2), f"request {i}: state after decode")
        # The state after the prefill: the reference on the prompt alone.
        _, ref_mid = torch_recurrent_gated_delta_rule(
            q[:, s:e].repeat_interleave(rep, dim=2),
            k[:, s:e].repeat_interleave(rep, dim=2),
            v[:, s:e],
            g=want_g[s:e][None],
            beta=torch.sigmoid(b[s:e])[None],
            initial_state=before[slot].transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        close(after_prefill[slot], ref_mid[0].transpose(-1, -2), f"request {i}: state in slot")
        close(finals[i], ref_mid[0].transpose(-1, -2), f"request {i}: returned final state")
    untouched(pool, before, slots, "GDN")


@check
def mamba2_prefill_then_decode() -> None:
    """The Mamba2 kernels as SGLang's MambaMixer2 calls them (through the names the stand-in
    sets on sglang.srt.layers.attention.mamba.mamba): mamba_chunk_scan_combined over three packed
    requests (3, 20 and 40 tokens, chunks of 16; two resuming from their slots), the caller
    storing the varlen states in the slots, then selective_state_update with one token each;
    against transformers' mamba2_chunk_scan on each request's L + 1 tokens."""
    from sglang.srt.layers.attention.mamba import mamba as mixer
    from transformers.models.nemotron_h.modeling_nemotron_h import (
        mamba2_chunk_scan,
        mamba2_selective_state_update,
    )

    torch.manual_seed(2)
    heads, dhead, groups, dstate, chunk = 4, 8, 2, 6, 16
    lens, slots, resume = [3, 20, 40], [1, 4, 2], [False, True, True]
    n, total = len(lens), sum(lens)
    pool = torch.randn(6, heads, dhead, dstate) * 0.1
    before = pool.clone()
    x, dt = torch.randn(1, total, heads, dhead), torch.randn(1, total, heads)
    A = -torch.exp(torch.randn(heads) * 0.5)  # noqa: N806
    B, C = torch.randn(1, total, groups, dstate), torch.randn(1, total, groups, dstate)  # noqa: N806
    D, dt_bias = torch.randn(heads), torch.randn(heads) * 0.5  # noqa: N806
    x1, dt1 = torch.randn(n, heads, dhead), torch.randn(n, heads)
    B1, C1 = torch.randn(n, groups, dstate), torch.randn(n, groups, dstate)  # noqa: N806

    has_init = torch.tensor(resume)
    index = torch.tensor(slots, dtype=torch.int32)
    initial = torch.where(has_init[:, None, None, None], pool[index.long()], 0)
    out = torch.empty_like(x)
    _, varlen, _ = mixer.mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=chunk,
        D=D,
        z=None,
        dt_bias=dt_bias,
        seq_idx=None,
        chunk_indices=None,
        chunk_offsets=None,
        cu_seqlens=cu(lens),
        initial_states=initial,
        return_varlen_states=True,
        return_final_states=False,
        return_track_states=True,
        track_seq_idx=None,
        track_end_locs=None,
        dt_softplus=True,
        dt_limit=(0.0, float("inf")),
        out=out,
        state_dtype=pool.dtype,
    )
    pool[index.long()] = varlen  # what MambaMixer2 does with them
    after_prefill = pool.clone()
    out1 = torch.empty(n, heads, dhead)
    # MambaMixer2's decode call: per-head parameters expanded over the head dim.
    A_d = A[:, None, None].expand(-1, dhead, dstate)  # noqa: N806
    mixer.selective_state_update(
        pool,
        x1,
        dt1[:, :, None].expand(-1, -1, dhead),
        A_d,
        B1,
        C1,
        D[:, None].expand(-1, dhead),
        z=None,
        dt_bias=dt_bias[:, None].expand(-1, dhead),
        dt_softplus=True,
        state_batch_indices=index,
        out=out1,
    )
    bounds = cu(lens).tolist()
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]

        def seq(t: torch.Tensor, t1: torch.Tensor, s: int = s, e: int = e, i: int = i):
            return torch.cat([t[:, s:e], t1[i : i + 1][None]], dim=1)  # the prompt, then its step

        start = before[slot][None] if resume[i] else torch.zeros(1, heads, dhead, dstate)
        ref_y, ref_state = mamba2_chunk_scan(
            seq(x, x1),
            seq(dt, dt1),
            A,
            seq(B, B1),
            seq(C, C1),
            chunk,
            D=D,
            dt_bias=dt_bias,
            initial_states=start,
            dt_softplus=True,
            return_final_states=True,
        )
        close(out[0, s:e], ref_y[0, :-1], f"request {i}: prefill output")
        close(out1[i], ref_y[0, -1], f"request {i}: decode output")
        close(pool[slot], ref_state[0], f"request {i}: state after decode")
        _, ref_mid = mamba2_chunk_scan(
            x[:, s:e],
            dt[:, s:e],
            A,
            B[:, s:e],
            C[:, s:e],
            chunk,
            D=D,
            dt_bias=dt_bias,
            initial_states=start,
            dt_softplus=True,
            return_final_states=True,
        )
        close(after_prefill[slot], ref_mid[0], f"request {i}: state in slot after prefill")
        # And transformers' own one-token update from that state.
        state = after_prefill[slot][None].clone()
        ref_step = mamba2_selective_state_update(
            state,
            x1[i : i + 1],
            dt1[i : i + 1, :, None].expand(-1, -1, dhead),
            A_d,
            B1[i : i + 1],
            C1[i : i + 1],
            D=D[:, None].expand(-1, dhead),
            dt_bias=dt_bias[:, None].expand(-1, dhead),
            dt_softplus=True,
        )
        close(out1[i], ref_step[0], f"request {i}: decode output vs transformers' update")
        close(pool[slot], state[0], f"request {i}: state vs transformers' update")
    untouched(pool, before, slots, "Mamba2")


@check
def gated_norm_and_shared_expert_gate() -> None:
    """rms_norm_gated (GDN's output norm) against transformers' Qwen3NextRMSNormGated, and the
    shared expert's sigmoid gate (Qwen2-MoE blocks) against its formula, both through the names
    the stand-in sets on SGLang's modules."""
    from sglang.kernels.ops.attention.fla import fused_norm_gate
    from sglang.srt.models import qwen2_moe
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    torch.manual_seed(3)
    x, gate = torch.randn(10, 32), torch.randn(10, 32)
    ref = Qwen3NextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32))
        want = ref(x, gate)
    norm = fused_norm_gate.FusedRMSNormGated(32, eps=1e-6, activation="silu")
    with torch.no_grad():
        norm.weight.copy_(ref.weight)
        close(norm(x, gate), want, "FusedRMSNormGated")

    hidden, weight = torch.randn(5, 16), torch.randn(16)
    shared, routed = torch.randn(5, 16), torch.randn(5, 16)
    want = routed + torch.sigmoid(hidden @ weight)[:, None] * shared
    close(qwen2_moe.fused_gate_sigmoid_mul(hidden, weight, shared), want - routed, "gate mul")
    qwen2_moe.fused_gate_sigmoid_mul_add(hidden, weight, shared, routed)
    close(routed, want, "gate mul add (in place)")


def raises(exc: type[BaseException], fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{what}: did not raise {exc.__name__}")


@check
def patched_and_loud() -> None:
    """SGLang's modules carry the stand-ins (the GDN backend's kernel names too), and what
    the stand-ins do not implement fails loudly."""
    import sgl_kernel
    from sgl_kernel import _torch_ops
    from sglang.srt.layers.attention.linear import gdn_backend
    from sglang.srt.layers.attention.linear.kernels import gdn_triton
    from sglang.srt.layers.attention.mamba import mamba as mixer

    names = [
        "causal_conv1d_fn",
        "causal_conv1d_fn_triton",
        "causal_conv1d_update",
        "causal_conv1d_update_triton",
        "mamba_chunk_scan_combined",
        "selective_state_update",
    ]
    for name in names:
        if getattr(mixer, name).__module__ != _torch_ops.__name__:
            raise AssertionError(f"mamba.{name} is not the stand-in")
    if gdn_backend.causal_conv1d_fn is not _torch_ops.causal_conv1d_fn:
        raise AssertionError("gdn_backend.causal_conv1d_fn is not the stand-in")
    if gdn_triton.chunk_gated_delta_rule is not _torch_ops.chunk_gated_delta_rule:
        raise AssertionError("gdn_triton.chunk_gated_delta_rule is not the stand-in")

    x = torch.randn(2, 8)
    state, weight = torch.zeros(4, 8, 3), torch.randn(8, 4)
    raises(  # speculative decoding's verify path
        NotImplementedError,
        lambda: mixer.causal_conv1d_update_triton(
            x, state, weight, None, "silu", intermediate_conv_window=state
        ),
        "conv update with an intermediate window",
    )
    raises(
        NotImplementedError,
        lambda: mixer.selective_state_update(
            torch.zeros(4, 2, 3, 5),
            torch.randn(1, 2, 3),
            torch.randn(1, 2, 3),
            torch.randn(2, 3, 5),
            torch.randn(1, 1, 5),
            torch.randn(1, 1, 5),
            out=torch.empty(1, 2, 3),
            disable_state_update=True,
        ),
        "selective_state_update(disable_state_update=True)",
    )
    raises(RuntimeError, lambda: sgl_kernel.fused_experts_cpu(), "another sgl_kernel name")
    raises(AttributeError, lambda: torch.ops.sgl_kernel.fused_sigmoid_mul_cpu, "another op")

    def other_mamba_name() -> None:
        from sgl_kernel.mamba import causal_conv1d_fwd  # noqa: F401

    raises(ImportError, other_mamba_name, "another sgl_kernel.mamba name")


def main() -> None:
    results = {}
    for name, fn in CHECKS.items():
        try:
            with torch.no_grad():
                fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
