"""The replica model: real layer shapes from ``config/models/*.json``, dummy weights, synthetic KV.

One *step* is what the paper times: a verify forward of the target over ``k + 1`` query tokens
through every target layer, then ``k`` draft forwards of the MTP head (fusion projection, one
full-attention layer, its MoE, the shared lm_head), one query token each.  The arms differ only
in the draft's attention: ``mtp`` reads the draft layer's whole KV, ``wmtp`` reads the attention
sink (the first S tokens) and the last W tokens.  Acceptance never enters: tokens are whatever
the argmax of random weights gives, and the timing does not depend on them.  A step over a batch
of B requests at the same context runs every forward over B times as many rows, each request
attending over its own KV and carrying its own recurrent state.

What is real and what is not:

- Weights are random bf16, KV is random bf16 at N tokens; the recurrent state is random float32.
- **Experts are limited to those a step touches**: a MoE layer holds only the expected number
  of distinct experts for the forward's token count under uniform routing,
  ``round(E * (1 - (1 - top_k / E) ** T))``, and runs every held expert on every token (T is
  small, so the arithmetic is cheap; the bytes are those of the touched experts read once).
- The router's top-k is computed (one kernel) but dispatch is fixed; the routed experts' up
  projection, the shared expert's up projection, the router and the shared gate are one GEMM,
  and the routed and shared down projections are one GEMM into the residual.
- RoPE and q/k norms' exact placement are simplified to kernels with the same memory traffic.
- The Gated-DeltaNet / Mamba2 recurrence reads the state once and writes one state per query
  token, as engines do for speculative rollback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from wmtp.analyze import costmodel as cm
from wmtp.replica.kernels import (
    HAVE_TRITON,
    AttnLaunch,
    GemmLaunch,
    KeyRange,
    attn_prep,
    conv4_update,
    decode_attention,
    expert_act,
    fused_recurrence,
    linear,
    moe_act,
    rms,
    rms_norm_into,
    router_topk,
    torch,
)


def _w(shape: Sequence[int], device: torch.device, dtype: torch.dtype, fan_in: int | None = None) -> torch.Tensor:
    fan = fan_in if fan_in is not None else shape[-2] if len(shape) >= 2 else shape[-1]
    return torch.empty(tuple(shape), device=device, dtype=dtype).normal_(0.0, 1.0 / math.sqrt(fan))


@dataclass
class AttnCtx:
    """How an attention layer attends this forward: the backend, its split count and launch choices."""

    backend: str
    splits: int | None = None
    sms: int = 132
    skip_core: bool = False  # "other" timing: everything but the attention kernel
    launch: AttnLaunch = field(default_factory=AttnLaunch)


def experts_touched(spec: cm.ModelSpec, tokens: int) -> int:
    """Distinct routed experts a forward over ``tokens`` tokens reads (expected, uniform routing)."""
    m = spec.moe
    return min(m.num_experts, max(m.top_k, round(cm.expected_distinct_experts(m.num_experts, m.top_k, tokens))))


class _Block:
    """What every block shares: its kernels (``impl``) and its GEMM tiles (``gemm``), both set per replica."""

    impl: str = "torch"
    gemm: GemmLaunch = GemmLaunch()

    def mm(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, w, residual, self.impl, self.gemm)


class Attention(_Block):
    """Full attention (Qwen gated attention or plain GQA) with a KV cache of ``capacity`` tokens per request."""

    def __init__(
        self, spec: cm.ModelSpec, capacity: int, batch: int, device: torch.device, dtype: torch.dtype, impl: str
    ):
        a, h = spec.attention, spec.hidden_size
        self.a, self.impl = a, impl
        self.q_out = a.num_q_heads * a.head_dim
        self.kv_out = a.num_kv_heads * a.head_dim
        self.n_q = self.q_out * (2 if a.output_gate else 1)
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.w_qkv = _w((h, self.n_q + 2 * self.kv_out), device, dtype)
        self.w_o = _w((self.q_out, h), device, dtype)
        self.q_norm = torch.ones(a.head_dim, device=device, dtype=dtype)
        self.k_norm = torch.ones(a.head_dim, device=device, dtype=dtype)
        shape = (batch, capacity, a.num_kv_heads, a.head_dim)
        self.k_cache = torch.empty(shape, device=device, dtype=dtype).normal_()
        self.v_cache = torch.empty_like(self.k_cache).normal_()

    def forward(
        self, x: torch.Tensor, pos: int, ranges: Sequence[KeyRange], ctx: AttnCtx, batch: int = 1
    ) -> torch.Tensor:
        """x [B*T, H] (request-major rows) -> x + attention(x); writes the T new tokens' K and V at ``pos``."""
        a, d = self.a, self.a.head_dim
        nb, t = batch, x.shape[0] // batch
        y = self.mm(rms(x, self.norm, self.impl), self.w_qkv)
        if a.output_gate:
            qg = y[:, : self.n_q].view(nb, t, a.num_q_heads, 2 * d)
            q_src, gate = qg[..., :d], qg[..., d:]
        else:
            q_src, gate = y[:, : self.n_q].view(nb, t, a.num_q_heads, d), None
        k_src = y[:, self.n_q : self.n_q + self.kv_out].view(nb, t, a.num_kv_heads, d)
        v_src = y[:, self.n_q + self.kv_out :].view(nb, t, a.num_kv_heads, d)
        qbuf = torch.empty((nb, a.num_q_heads, t, d), device=x.device, dtype=x.dtype)  # [B, Hq, T, D]
        if self.impl == "triton":
            heads = (a.num_q_heads, a.num_kv_heads, d)
            attn_prep(y, self.q_norm, self.k_norm, qbuf, self.k_cache, self.v_cache, pos, heads, a.output_gate)
        else:
            rms_norm_into(q_src, self.q_norm, qbuf.transpose(1, 2), impl=self.impl)
            rms_norm_into(k_src, self.k_norm, self.k_cache[:nb, pos : pos + t], impl=self.impl)
            self.v_cache[:nb, pos : pos + t].copy_(v_src)
        if ctx.skip_core:
            o = qbuf.transpose(1, 2)
            if gate is not None:
                o = o * torch.sigmoid(gate)
        else:
            o = self.core(qbuf, ranges, ctx, gate).transpose(1, 2)  # [B, T, Hq, D]
        return self.mm(o.reshape(nb * t, self.q_out), self.w_o, x)

    def core(
        self, q: torch.Tensor, ranges: Sequence[KeyRange], ctx: AttnCtx, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [B, Hq, T, D] over the first B requests' caches -> [B, Hq, T, D]."""
        nb = q.shape[0]
        return decode_attention(
            q, self.k_cache[:nb], self.v_cache[:nb], ranges, backend=ctx.backend, splits=ctx.splits, sms=ctx.sms,
            gate=gate, launch=ctx.launch,
        )  # fmt: skip


class Recurrent(_Block):
    """A Gated-DeltaNet or Mamba2 mixer: projections, short causal conv with state, the recurrence."""

    def __init__(
        self,
        spec: cm.ModelSpec,
        kind: str,
        max_tokens: int,
        batch: int,
        device: torch.device,
        dtype: torch.dtype,
        impl: str,
    ):
        h = spec.hidden_size
        self.kind, self.impl = kind, impl
        self.norm = torch.ones(h, device=device, dtype=dtype)
        if kind == "gdn":
            g = spec.gdn
            assert g is not None
            self.hk, self.hv, self.dk, self.dv = g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim
            self.conv_dim, kernel = g.conv_dim, g.conv_kernel
            self.w_in = _w((h, g.conv_dim + self.hv * self.dv + 2 * self.hv), device, dtype)  # qkv, z, b, a
            self.scale = 1.0 / math.sqrt(self.dk)
            self.d_skip = None
        else:
            m = spec.mamba2
            assert m is not None
            self.hk, self.hv, self.dk, self.dv = m.n_groups, m.num_heads, m.state_size, m.head_dim
            self.conv_dim, kernel = m.conv_dim, m.conv_kernel
            self.w_in = _w((h, m.d_inner + m.conv_dim + m.num_heads), device, dtype)  # z, xBC, dt
            self.d_skip = torch.ones(m.num_heads, device=device, dtype=torch.float32)
            self.scale = 1.0
        self.inner = self.hv * self.dv
        self.conv_w = _w((self.conv_dim, kernel), device, dtype, fan_in=kernel)
        self.conv_state = torch.empty((batch, kernel - 1, self.conv_dim), device=device, dtype=dtype).normal_()
        self.a_log = torch.empty(self.hv, device=device, dtype=torch.float32).uniform_(0.0, 1.0)
        self.dt_bias = torch.zeros(self.hv, device=device, dtype=torch.float32)
        self.out_norm = torch.ones(self.dv, device=device, dtype=dtype)
        self.w_out = _w((self.inner, h), device, dtype)
        shape = (batch, self.hv, self.dk, self.dv)
        self.state = torch.empty(shape, device=device, dtype=torch.float32).normal_(0, 0.1)
        self.states_out = torch.empty((batch * max_tokens, *shape[1:]), device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor, batch: int = 1) -> torch.Tensor:
        """x [B*T, H] -> x + mixer(x); the first B requests' states are read, their conv states advance."""
        t, cd, inner, hv = x.shape[0], self.conv_dim, self.inner, self.hv
        y = self.mm(rms(x, self.norm, self.impl), self.w_in)
        xc = torch.empty((t, cd), device=x.device, dtype=x.dtype)
        o = torch.empty((t, hv, self.dv), device=x.device, dtype=x.dtype)
        conv_state, state, states_out = self.conv_state[:batch], self.state[:batch], self.states_out[:t]
        if self.kind == "gdn":
            conv4_update(y[:, :cd], self.conv_w, conv_state, xc, self.impl)
            qk = self.hk * self.dk
            q = xc[:, :qk].view(t, self.hk, self.dk)
            k = xc[:, qk : 2 * qk].view(t, self.hk, self.dk)
            v = xc[:, 2 * qk :].view(t, hv, self.dv)
            z = y[:, cd : cd + inner].view(t, hv, self.dv)
            b, a = y[:, cd + inner : cd + inner + hv], y[:, cd + inner + hv :]
            fused_recurrence(
                False, q, k, v, b, a, self.a_log, self.dt_bias, None, state, states_out, o, self.scale, self.impl
            )
        else:
            z = y[:, :inner].view(t, hv, self.dv)
            conv4_update(y[:, inner : inner + cd], self.conv_w, conv_state, xc, self.impl)
            gs = self.hk * self.dk
            xs = xc[:, :inner].view(t, hv, self.dv)
            bm = xc[:, inner : inner + gs].view(t, self.hk, self.dk)
            cmat = xc[:, inner + gs :].view(t, self.hk, self.dk)
            dt = y[:, inner + cd :]
            fused_recurrence(
                True, cmat, bm, xs, None, dt, self.a_log, self.dt_bias, self.d_skip, state, states_out, o,
                self.scale, self.impl,
            )  # fmt: skip
        on = rms_norm_into(o, self.out_norm, torch.empty_like(o), gate=z, impl=self.impl)
        return self.mm(on.view(t, inner), self.w_out, x)


class MoE(_Block):
    """Router + the touched routed experts + latent projections + shared expert(s), in few large GEMMs.

    Columns of the first GEMM: shared up | router | shared gate | routed up (or the latent
    projection), so a forward that touches n experts reads a column prefix.  Rows of the last
    GEMM: shared down | routed down, so routed and shared outputs land in the residual at once.
    """

    def __init__(
        self,
        spec: cm.ModelSpec,
        n_experts: int,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        impl: str,
    ):
        m, h = spec.moe, spec.hidden_size
        self.m, self.impl = m, impl
        self.width = m.latent_size or h
        self.inter = m.expert_intermediate_size
        self.swiglu = m.activation == "swiglu"
        self.up = 2 * self.inter if self.swiglu else self.inter
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.n_alloc = n_experts
        self.s_inter = m.shared_intermediate_size * m.shared_experts
        s_up = self.s_inter * (2 if self.swiglu else 1)
        self.c_router = s_up
        self.c_gate = s_up + m.num_experts
        # routed columns start 64-aligned: an odd row stride would keep every weight load unvectorised
        self.c_routed = -(-(self.c_gate + (1 if m.shared_expert_gate else 0)) // 64) * 64
        routed_in = m.latent_size if m.latent_size else n_experts * self.up
        self.w_pre = _w((h, self.c_routed + routed_in), device, dtype)
        if m.latent_size:
            self.w_up = _w((self.width, n_experts * self.up), device, dtype)
            self.w_down = _w((n_experts * self.inter, self.width), device, dtype, fan_in=self.inter)
            self.lat_out = _w((m.latent_size, h), device, dtype)
            self.s_down = _w((self.s_inter, h), device, dtype)
        else:
            self.w_down_cat = _w((self.s_inter + n_experts * self.inter, h), device, dtype, fan_in=self.inter)
        self.combine = torch.softmax(torch.randn(n_experts, max_tokens, device=device), 0)

    def forward(self, x: torch.Tensor, n_experts: int) -> torch.Tensor:
        t = x.shape[0]
        n = min(n_experts, self.n_alloc)
        xn = rms(x, self.norm, self.impl)
        width = self.c_routed + (self.m.latent_size or n * self.up)
        pre = self.mm(xn, self.w_pre[:, :width])
        router_topk(pre[:, self.c_router : self.c_gate], self.m.top_k, self.impl)  # routing cost; dispatch fixed
        gate = pre[:, self.c_gate] if self.m.shared_expert_gate else None
        act = torch.empty((t, self.s_inter + n * self.inter), device=x.device, dtype=x.dtype)
        if not self.m.latent_size:
            gate_col = self.c_gate if self.m.shared_expert_gate else None
            moe_act(pre, self.c_routed, n, self.inter, self.s_inter, self.swiglu, self.combine, gate_col, act,
                    self.impl)  # fmt: skip
            return self.mm(act, self.w_down_cat[: self.s_inter + n * self.inter], x)
        expert_act(pre[:, : self.c_router], 1, self.s_inter, self.swiglu, None, act[:, : self.s_inter], self.impl,
                   gate_logit=gate)  # fmt: skip
        u = self.mm(pre[:, self.c_routed :], self.w_up[:, : n * self.up])
        expert_act(u, n, self.inter, self.swiglu, self.combine, act[:, self.s_inter :], self.impl)
        x = self.mm(self.mm(act[:, self.s_inter :], self.w_down[: n * self.inter]), self.lat_out, x)
        return self.mm(act[:, : self.s_inter], self.s_down, x)


@dataclass
class StepPlan:
    """Positions and ranges of one step at context N with draft depth k, over ``batch`` requests."""

    context: int
    k: int
    arm: str  # "mtp" or "wmtp" (or "none": verify of one token, no draft)
    sink: int
    window: int
    batch: int = 1

    @property
    def t_verify(self) -> int:
        return 1 if self.arm == "none" else self.k + 1

    def verify_ranges(self) -> list[KeyRange]:
        end = self.context + self.t_verify
        return [KeyRange(0, end, causal_tail=self.t_verify)]

    def draft_ranges(self, j: int) -> list[KeyRange]:
        """Draft step j (0-based) writes its token at position context + j and attends up to it."""
        end = self.context + j + 1
        if self.arm == "wmtp" and end > self.sink + self.window:
            return [KeyRange(0, self.sink), KeyRange(end - self.window, end, causal_tail=1)]
        return [KeyRange(0, end, causal_tail=1)]


def default_impl(device: torch.device | str) -> str:
    """Fused Triton kernels on CUDA, plain torch elsewhere."""
    return "triton" if HAVE_TRITON and torch.device(device).type == "cuda" else "torch"


class Replica:
    """Target layers + MTP head of one model, dummy weights, synthetic KV up to ``capacity`` tokens for
    each of ``batch`` requests (a step may use fewer)."""

    def __init__(
        self,
        spec: cm.ModelSpec,
        capacity: int,
        max_k: int,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        impl: str | None = None,
        batch: int = 1,
    ):
        dev = torch.device(device)
        dt = dtype or torch.bfloat16
        self.spec, self.device, self.dtype, self.batch = spec, dev, dt, batch
        self.impl = impl or default_impl(dev)
        self.gemm = GemmLaunch()
        self.capacity = capacity + max_k + 2
        t_max = max_k + 1
        h = spec.hidden_size
        self.embed = _w((spec.vocab_size, h), dev, dt, fan_in=1)
        self.lm_head = _w((h, spec.vocab_size), dev, dt)
        self.final_norm = torch.ones(h, device=dev, dtype=dt)
        self.layers: list[list[Any]] = []
        for parts in spec.layers:
            blocks: list[Any] = []
            for p in parts:
                if p == "attn":
                    blocks.append(Attention(spec, self.capacity, batch, dev, dt, self.impl))
                elif p in ("gdn", "mamba2"):
                    blocks.append(Recurrent(spec, p, t_max, batch, dev, dt, self.impl))
                elif p == "moe":
                    blocks.append(MoE(spec, experts_touched(spec, batch * t_max), batch * t_max, dev, dt, self.impl))
            self.layers.append(blocks)
        self.mtp_fc = _w((2 * h, h), dev, dt)
        self.mtp_norm_e = torch.ones(h, device=dev, dtype=dt)
        self.mtp_norm_h = torch.ones(h, device=dev, dtype=dt)
        self.mtp_blocks: list[Any] = []
        for parts in spec.mtp_layers:
            for p in parts:
                if p == "attn":
                    self.mtp_blocks.append(Attention(spec, self.capacity, batch, dev, dt, self.impl))
                elif p == "moe":
                    self.mtp_blocks.append(MoE(spec, experts_touched(spec, batch), batch, dev, dt, self.impl))
        self.mtp_final_norm = torch.ones(h, device=dev, dtype=dt)
        self.tokens = torch.randint(0, spec.vocab_size, (batch * t_max,), device=dev)

    def blocks(self) -> list[Any]:
        return [b for blocks in self.layers for b in blocks] + self.mtp_blocks

    def set_impl(self, impl: str) -> None:
        """Switch every block between the fused Triton kernels and plain torch (for checks)."""
        self.impl = impl
        for b in self.blocks():
            b.impl = impl

    def set_gemm(self, gemm: GemmLaunch) -> None:
        """The skinny GEMM's tiles for every block (a tuner's choice)."""
        self.gemm = gemm
        for b in self.blocks():
            b.gemm = gemm

    def save_conv_states(self) -> list[torch.Tensor]:
        """Copies of the recurrent layers' conv states (the only state a forward mutates)."""
        return [b.conv_state.clone() for b in self.blocks() if isinstance(b, Recurrent)]

    def load_conv_states(self, saved: list[torch.Tensor]) -> None:
        recs = [b for b in self.blocks() if isinstance(b, Recurrent)]
        for b, st in zip(recs, saved, strict=True):
            b.conv_state.copy_(st)

    # ---- pieces ---------------------------------------------------------------------------

    def block_forward(self, b: Any, x: torch.Tensor, pos: int, ranges: Sequence[KeyRange], ctx: AttnCtx, batch: int):
        """One block over x [B*T, H]: attention, a recurrent mixer or a MoE."""
        if isinstance(b, Attention):
            return b.forward(x, pos, ranges, ctx, batch)
        if isinstance(b, Recurrent):
            return b.forward(x, batch)
        return b.forward(x, experts_touched(self.spec, x.shape[0]))

    def target_body(self, plan: StepPlan, ctx: AttnCtx) -> torch.Tensor:
        """All target layers over the verify tokens of every request (no lm_head) -> [B*T, H]."""
        t = plan.t_verify * plan.batch
        x = self.embed[self.tokens[:t]]
        ranges = plan.verify_ranges()
        for blocks in self.layers:
            for b in blocks:
                x = self.block_forward(b, x, plan.context, ranges, ctx, plan.batch)
        return x

    def logits_argmax(self, x: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        return torch.argmax(rms(x, norm, self.impl) @ self.lm_head, dim=-1)

    def target_attn_cores(self, plan: StepPlan, ctx: AttnCtx, q: torch.Tensor) -> list[torch.Tensor]:
        ranges = plan.verify_ranges()
        return [b.core(q, ranges, ctx) for blocks in self.layers for b in blocks if isinstance(b, Attention)]

    def draft_body(self, plan: StepPlan, j: int, token: torch.Tensor, hid: torch.Tensor, ctx: AttnCtx) -> torch.Tensor:
        """One draft forward up to (not including) the lm_head; token [B], hid [B, H] (rows may be strided)."""
        h = self.spec.hidden_size
        buf = torch.empty((token.shape[0], 2 * h), device=hid.device, dtype=hid.dtype)
        rms_norm_into(self.embed[token], self.mtp_norm_e, buf[:, :h], impl=self.impl)
        rms_norm_into(hid, self.mtp_norm_h, buf[:, h:], impl=self.impl)
        x = linear(buf, self.mtp_fc, None, self.impl, self.gemm)
        ranges = plan.draft_ranges(j)
        for b in self.mtp_blocks:
            x = self.block_forward(b, x, plan.context + j, ranges, ctx, plan.batch)
        return x

    def draft_attn_cores(self, plan: StepPlan, ctx: AttnCtx, q: torch.Tensor) -> list[torch.Tensor]:
        ranges = plan.draft_ranges(0)
        return [b.core(q, ranges, ctx) for b in self.mtp_blocks if isinstance(b, Attention)]

    def step(self, plan: StepPlan, ctx: AttnCtx) -> torch.Tensor:
        """Verify forward + k draft forwards; returns each request's last draft token [B]."""
        x = self.target_body(plan, ctx)
        tok = self.logits_argmax(x, self.final_norm)
        t, nb = plan.t_verify, plan.batch
        if plan.arm == "none":
            return tok.view(nb, t)[:, -1]
        token, hid = tok.view(nb, t)[:, -1], x.view(nb, t, -1)[:, -1]
        for j in range(plan.k):
            hid = self.draft_body(plan, j, token, hid, ctx)
            token = self.logits_argmax(hid, self.mtp_final_norm)
        return token
