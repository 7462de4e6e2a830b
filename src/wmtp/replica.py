"""GPU cost-side replica: real-shape layers, dummy weights, synthetic KV, acceptance-free step cost.

One *step* is what the paper times: a verify forward of the target over ``k + 1`` query tokens
through every target layer, then ``k`` draft forwards of the MTP head (fusion projection, one
full-attention layer, its MoE, the shared lm_head), one query token each.  The arms differ only
in the draft's attention: ``mtp`` reads the draft layer's whole KV, ``wmtp`` reads the attention
sink (the first S tokens) and the last W tokens.  Acceptance never enters: tokens are whatever
the argmax of random weights gives, and the timing does not depend on them.

What is real and what is not:

- Shapes are the model file's (``config/models/*.json``); weights are random bf16, KV is random
  bf16 at N tokens; the recurrent state is random float32.
- **Experts are limited to those a step touches**: a MoE layer holds only the expected number
  of distinct experts for the forward's token count under uniform routing,
  ``round(E * (1 - (1 - top_k / E) ** T))`` (``top_k`` for a draft forward), and runs every
  held expert on every token (T <= 6, so the arithmetic is free; the bytes are those of the
  touched experts read once).  Memory for the full expert set is never allocated.
- RoPE, q/k norms' exact placement, and router-dependent dispatch are simplified to kernels with
  the same memory traffic (norms, an argmax router, the gated outputs); nothing is fused beyond
  what PyTorch does, so small-kernel overheads are somewhat higher than in a tuned engine.
- Decode attention reads each KV byte once for any query length 1..k+1: the grouped query heads
  are folded into rows (q: KV heads x G*T rows), the KV is split into chunks (flash-decoding),
  each chunk is attended with a kernel that returns its log-sum-exp, and the chunks are merged
  with softmax weights of their LSEs.  Chunk kernels: ``triton`` (our split-KV kernel, CUDA),
  ``aten`` (``torch.ops.aten._scaled_dot_product_flash_attention``, whose LSE output makes the
  merge possible; the CPU variant on CPU), or ``math`` (float32 reference, CPU tests).  The
  causal part (the last T keys) is done separately with an explicit mask and merged the same way.
- The Gated-DeltaNet / Mamba2 recurrence is a Triton kernel on CUDA (a float32 torch loop on
  CPU) that reads the state once and writes one state per query token, as engines do for
  speculative rollback.

Timing (CUDA): each piece is captured in a CUDA graph and replayed; every replay is timed with
CUDA events; median and 10/90 % quantiles are reported.  Components (target attention, target
other, lm_head, draft attention, draft other, draft lm_head) are timed as their own graphs behind
an L2 scrub, minus the scrub alone; the full step is timed as one graph.

CLI: ``python -m wmtp.replica sweep ...`` (GPU measurement, CSVs) and ``python -m wmtp.replica
tidy ...`` (raw CSVs + cost-model prediction -> one tidy parquet; needs no torch).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from wmtp import costmodel as cm

try:  # the tidy step runs without torch
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - exercised only where torch is absent
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU dev machines
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

log = logging.getLogger("wmtp.replica")

ATTN_BACKENDS = ("triton", "aten", "math")


# ============================================================================================
# Decode attention: folded GQA rows, split-KV partials with LSE, merge
# ============================================================================================


def fold_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Hq, T, D] -> [Hkv, G*T, D]; row r of KV head h is query head h*G + r // T, token r % T."""
    hq, t, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(num_kv_heads, g * t, d)


def unfold_output(o: torch.Tensor, num_q_heads: int, t: int) -> torch.Tensor:
    """[Hkv, G*T, D] -> [Hq, T, D]."""
    return o.reshape(num_q_heads, t, o.shape[-1])


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention partials over disjoint key sets: outs [P, H, R, D], lses [P, H, R] -> out, lse."""
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m.unsqueeze(0))
    denom = w.sum(dim=0)
    out = (outs.float() * w.unsqueeze(-1)).sum(dim=0) / denom.unsqueeze(-1)
    return out, m + torch.log(denom)


def _math_partial(
    qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: qf [H, R, D], k/v [L, H, D], mask [R, L] (True = visible) -> out [H, R, D], lse [H, R]."""
    s = torch.einsum("hrd,lhd->hrl", qf.float(), k.float()) * scale
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.einsum("hrl,lhd->hrd", p, v.float()), lse


_ATEN_EXPANDED_Q_OK = [True]


def _aten_chunks(
    qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_chunks: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split [L, H, D] keys into n_chunks equal chunks (L divisible) in the batch dim of a flash call."""
    length, h, d = k.shape
    c = length // n_chunks
    kc = k.view(n_chunks, c, h, d).transpose(1, 2)  # [P, H, C, D], a strided view
    vc = v.view(n_chunks, c, h, d).transpose(1, 2)
    qc = qf.unsqueeze(0).expand(n_chunks, *qf.shape)
    if qf.is_cuda:
        if not _ATEN_EXPANDED_Q_OK[0]:
            qc = qc.contiguous()
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qc, kc, vc, 0.0, False, False, scale=scale)
        except RuntimeError:
            if not _ATEN_EXPANDED_Q_OK[0]:
                raise
            _ATEN_EXPANDED_Q_OK[0] = False  # learnt eagerly, before any graph capture
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qc.contiguous(), kc, vc, 0.0, False, False, scale=scale
            )
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qc.contiguous(), kc, vc, 0.0, False, scale=scale
        )
    return res[0], res[1]


if HAVE_TRITON:

    @triton.jit
    def _split_kv_partial_kernel(
        Q,
        K,
        V,
        Out,
        LSE,
        start,
        end,
        chunk,
        R,
        stride_kn,
        stride_kh,
        qk_scale,
        n_splits,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D: tl.constexpr,
    ):
        """One (chunk, KV head): attention of R folded query rows over keys [n0, n1)."""
        pid_s = tl.program_id(0)
        pid_h = tl.program_id(1)
        n0 = start + pid_s * chunk
        n1 = tl.minimum(n0 + chunk, end)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + pid_h * R * D + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < R, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        k_base = K + pid_h * stride_kh
        v_base = V + pid_h * stride_kh
        for i in range(0, chunk, BLOCK_N):  # the last chunk may be short: masked
            offs_n = n0 + i + tl.arange(0, BLOCK_N)
            kmask = offs_n < n1
            kt = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt)) * qk_scale  # log2 domain
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        out = acc / l_i[:, None]
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural log
        row = (pid_s * tl.num_programs(1) + pid_h) * R + offs_m
        tl.store(Out + row[:, None] * D + offs_d[None, :], out, mask=offs_m[:, None] < R)
        tl.store(LSE + row, lse, mask=offs_m < R)

    @triton.jit
    def _recurrent_kernel(
        Q,
        K,
        V,
        G,
        B,
        S0,
        SOUT,
        Out,
        T,
        HV,
        HK,
        RATIO,
        scale,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BV: tl.constexpr,
        DELTA: tl.constexpr,
    ):
        """Gated (delta-rule) linear recurrence over T tokens; one program per (value block, head)."""
        i_v = tl.program_id(0)
        i_h = tl.program_id(1)
        i_hk = i_h // RATIO
        offs_k = tl.arange(0, DK)
        offs_v = i_v * BV + tl.arange(0, BV)
        h = tl.load(S0 + i_h * DK * DV + offs_k[:, None] * DV + offs_v[None, :])
        for t in range(T):
            q = tl.load(Q + (t * HK + i_hk) * DK + offs_k).to(tl.float32)
            k = tl.load(K + (t * HK + i_hk) * DK + offs_k).to(tl.float32)
            v = tl.load(V + (t * HV + i_h) * DV + offs_v).to(tl.float32)
            g = tl.load(G + t * HV + i_h).to(tl.float32)
            h = h * tl.exp(g)
            if DELTA:
                beta = tl.load(B + t * HV + i_h).to(tl.float32)
                v = (v - tl.sum(h * k[:, None], 0)) * beta
            h = h + k[:, None] * v[None, :]
            o = tl.sum(h * q[:, None], 0) * scale
            tl.store(Out + (t * HV + i_h) * DV + offs_v, o.to(Out.dtype.element_ty))
            tl.store(SOUT + ((t * HV + i_h) * DK + offs_k[:, None]) * DV + offs_v[None, :], h)


#: Launch knobs of the split-KV kernel (block_n, num_warps, num_stages); None = heuristic.
TRITON_ATTN_KNOBS: dict[str, int | None] = {"block_n": None, "num_warps": None, "num_stages": None}


def _triton_partials(
    qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int, n_splits: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    qf = qf.contiguous()
    h, r, d = qf.shape
    length = end - start
    chunk = -(-length // n_splits)
    n_splits = -(-length // chunk)  # no empty chunk
    block_m = max(16, triton.next_power_of_2(r))
    out = torch.empty((n_splits, h, r, d), device=qf.device, dtype=torch.float32)
    lse = torch.empty((n_splits, h, r), device=qf.device, dtype=torch.float32)
    block_n = TRITON_ATTN_KNOBS["block_n"] or (64 if d <= 128 or block_m <= 32 else 32)
    warps = TRITON_ATTN_KNOBS["num_warps"] or (8 if block_m * d >= 64 * 256 else 4)
    stages = TRITON_ATTN_KNOBS["num_stages"] or 2
    _split_kv_partial_kernel[(n_splits, h)](
        qf,
        k,
        v,
        out,
        lse,
        start,
        end,
        chunk,
        r,
        k.stride(0),
        k.stride(1),
        scale * 1.4426950408889634,
        n_splits,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D=d,
        num_warps=warps,
        num_stages=stages,
    )
    return out, lse


@dataclass(frozen=True)
class KeyRange:
    """Keys [start, end) of a cache; ``causal_tail`` = the last ``tail`` keys are the query tokens."""

    start: int
    end: int
    causal_tail: int = 0


def auto_splits(length: int, num_kv_heads: int, sms: int = 132, min_chunk: int = 256) -> int:
    """Chunks so that chunks x KV heads is about two waves of the GPU, chunks of >= min_chunk keys."""
    want = max(1, -(-2 * sms // num_kv_heads))
    return max(1, min(want, length // min_chunk))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ranges: Sequence[KeyRange],
    *,
    scale: float | None = None,
    backend: str = "math",
    splits: int | None = None,
    sms: int = 132,
) -> torch.Tensor:
    """Attention of q [Hq, T, D] over the union of key ranges of a [Ncap, Hkv, D] cache -> [Hq, T, D].

    A range with ``causal_tail = T`` ends with the T query tokens themselves: query t sees the
    tail's first t + 1 keys.  Every other key is visible to every query.
    """
    hq, t, d = q.shape
    hkv = k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qf = fold_queries(q, hkv)
    r = qf.shape[1]
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []

    def add(o: torch.Tensor, lse: torch.Tensor) -> None:
        outs.append(o.float().reshape(-1, hkv, r, d))
        lses.append(lse.float().reshape(-1, hkv, r))

    for rng in ranges:
        body_end = rng.end - rng.causal_tail
        length = body_end - rng.start
        if length > 0:
            n = splits or auto_splits(length, hkv, sms)
            if backend == "triton":
                add(*_triton_partials(qf, k_cache, v_cache, rng.start, body_end, n, scale))
            elif backend == "aten":
                c = max(1, length // n)
                n_even = length // c
                even_end = rng.start + n_even * c
                add(*_aten_chunks(qf, k_cache[rng.start : even_end], v_cache[rng.start : even_end], n_even, scale))
                if even_end < body_end:
                    add(*_aten_chunks(qf, k_cache[even_end:body_end], v_cache[even_end:body_end], 1, scale))
            elif backend == "math":
                c = -(-length // n)
                for s0 in range(rng.start, body_end, c):
                    s1 = min(s0 + c, body_end)
                    add(*_math_partial(qf, k_cache[s0:s1], v_cache[s0:s1], scale))
            else:
                raise ValueError(f"attention backend must be one of {ATTN_BACKENDS} (got {backend!r})")
        if rng.causal_tail:
            tail = rng.causal_tail
            rows_t = torch.arange(r, device=q.device) % t
            keys = torch.arange(tail, device=q.device)
            mask = keys.unsqueeze(0) <= (rows_t + (tail - t)).unsqueeze(1)
            add(*_math_partial(qf, k_cache[body_end : rng.end], v_cache[body_end : rng.end], scale, mask))
    out, _ = merge_partials(torch.cat(outs), torch.cat(lses))
    return unfold_output(out.to(q.dtype), hq, t)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    visible: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Float32 attention with an explicit mask visible [T, Ncap] (True = query t sees key n)."""
    hq, _t, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    k = k_cache.float().repeat_interleave(g, dim=1)  # [N, Hq, D]
    v = v_cache.float().repeat_interleave(g, dim=1)
    s = torch.einsum("htd,nhd->htn", q.float(), k) * scale
    s = s.masked_fill(~visible.unsqueeze(0), float("-inf"))
    return torch.einsum("htn,nhd->htd", torch.softmax(s, dim=-1), v).to(q.dtype)


# ============================================================================================
# Recurrent layers (Gated DeltaNet, Mamba2): state read once, one state written per token
# ============================================================================================


def recurrent_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None,
    state: torch.Tensor,
    states_out: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """h_t = exp(g_t) h_{t-1} + k_t (x) u_t with u = v (Mamba2) or beta (v - h^T k) (delta rule).

    q, k: [T, HK, DK]; v: [T, HV, DV]; g, beta: [T, HV]; state: [HV, DK, DV] float32 (read);
    states_out: [>=T, HV, DK, DV] float32 (state after each token, written). Returns o [T, HV, DV].
    """
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    o = torch.empty_like(v)
    if use_triton is None:
        use_triton = HAVE_TRITON and q.is_cuda
    if use_triton:
        q, k, v, g = q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous()
        beta = beta.float().contiguous() if beta is not None else None
        bv = min(32, dv)
        _recurrent_kernel[(dv // bv, hv)](
            q,
            k,
            v,
            g,
            beta if beta is not None else g,
            state,
            states_out,
            o,
            t,
            hv,
            hk,
            hv // hk,
            scale,
            DK=dk,
            DV=dv,
            BV=bv,
            DELTA=beta is not None,
            num_warps=4,
        )
        return o
    ratio = hv // hk
    h = state.clone()
    for i in range(t):
        qi = q[i].float().repeat_interleave(ratio, 0)  # [HV, DK]
        ki = k[i].float().repeat_interleave(ratio, 0)
        vi = v[i].float()
        h = h * torch.exp(g[i].float())[:, None, None]
        if beta is not None:
            vi = (vi - torch.einsum("hkv,hk->hv", h, ki)) * beta[i].float()[:, None]
        h = h + ki[:, :, None] * vi[:, None, :]
        o[i] = (torch.einsum("hkv,hk->hv", h, qi) * scale).to(o.dtype)
        states_out[i] = h
    return o


# ============================================================================================
# The replica model
# ============================================================================================


def _w(shape: Sequence[int], device: torch.device, dtype: torch.dtype, fan_in: int | None = None) -> torch.Tensor:
    fan = fan_in if fan_in is not None else shape[-2] if len(shape) >= 2 else shape[-1]
    return torch.empty(tuple(shape), device=device, dtype=dtype).normal_(0.0, 1.0 / math.sqrt(fan))


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


@dataclass
class Timings:
    """Per-replay times (ms) of one piece."""

    name: str
    ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    def q(self, f: float) -> float:
        s = sorted(self.ms)
        return s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]


@dataclass
class AttnCtx:
    """How an attention layer attends this forward: the key ranges and the backend."""

    backend: str
    splits: int | None = None
    sms: int = 132
    skip_core: bool = False  # "other" timing: everything but the attention kernel


class Attention:
    """Full attention (Qwen gated attention or plain GQA) with its own KV cache of ``capacity`` tokens."""

    def __init__(self, spec: cm.ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype):
        a, h = spec.attention, spec.hidden_size
        self.a = a
        self.q_out = a.num_q_heads * a.head_dim
        self.kv_out = a.num_kv_heads * a.head_dim
        n_q = self.q_out * (2 if a.output_gate else 1)
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.w_qkv = _w((h, n_q + 2 * self.kv_out), device, dtype)
        self.w_o = _w((self.q_out, h), device, dtype)
        self.q_norm = torch.ones(a.head_dim, device=device, dtype=dtype)
        self.k_norm = torch.ones(a.head_dim, device=device, dtype=dtype)
        self.k_cache = torch.empty((capacity, a.num_kv_heads, a.head_dim), device=device, dtype=dtype).normal_()
        self.v_cache = torch.empty_like(self.k_cache).normal_()

    def forward(self, x: torch.Tensor, pos: int, ranges: Sequence[KeyRange], ctx: AttnCtx) -> torch.Tensor:
        a, t = self.a, x.shape[0]
        y = _rms(x, self.norm) @ self.w_qkv
        n_q = self.q_out * (2 if a.output_gate else 1)
        qg = y[:, :n_q]
        k = y[:, n_q : n_q + self.kv_out].view(t, a.num_kv_heads, a.head_dim)
        v = y[:, n_q + self.kv_out :].view(t, a.num_kv_heads, a.head_dim)
        if a.output_gate:
            qg = qg.view(t, a.num_q_heads, 2 * a.head_dim)
            q, gate = qg[..., : a.head_dim], qg[..., a.head_dim :]
        else:
            q, gate = qg.view(t, a.num_q_heads, a.head_dim), None
        q = _rms(q, self.q_norm)
        self.k_cache[pos : pos + t] = _rms(k, self.k_norm)
        self.v_cache[pos : pos + t] = v
        qh = q.transpose(0, 1)  # [Hq, T, D]
        if ctx.skip_core:
            o = qh
        else:
            o = decode_attention(
                qh, self.k_cache, self.v_cache, ranges, backend=ctx.backend, splits=ctx.splits, sms=ctx.sms
            )
        o = o.transpose(0, 1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return x + o.reshape(t, self.q_out) @ self.w_o

    def core(self, q: torch.Tensor, ranges: Sequence[KeyRange], ctx: AttnCtx) -> torch.Tensor:
        return decode_attention(
            q, self.k_cache, self.v_cache, ranges, backend=ctx.backend, splits=ctx.splits, sms=ctx.sms
        )


class Recurrent:
    """A Gated-DeltaNet or Mamba2 mixer: projections, short causal conv with state, the recurrence."""

    def __init__(self, spec: cm.ModelSpec, kind: str, max_tokens: int, device: torch.device, dtype: torch.dtype):
        h = spec.hidden_size
        self.kind = kind
        self.norm = torch.ones(h, device=device, dtype=dtype)
        if kind == "gdn":
            g = spec.gdn
            assert g is not None
            self.hk, self.hv, self.dk, self.dv = g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim
            self.conv_dim, kernel = g.conv_dim, g.conv_kernel
            self.w_in = _w((h, g.conv_dim + self.hv * self.dv + 2 * self.hv), device, dtype)  # qkv, z, b, a
            self.scale = 1.0 / math.sqrt(self.dk)
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
        self.conv_state = torch.empty((kernel - 1, self.conv_dim), device=device, dtype=dtype).normal_()
        self.a_log = torch.empty(self.hv, device=device, dtype=torch.float32).uniform_(0.0, 1.0)
        self.dt_bias = torch.zeros(self.hv, device=device, dtype=torch.float32)
        self.out_norm = torch.ones(self.dv, device=device, dtype=dtype)
        self.w_out = _w((self.inner, h), device, dtype)
        self.state = torch.empty((self.hv, self.dk, self.dv), device=device, dtype=torch.float32).normal_(0, 0.1)
        self.states_out = torch.empty((max_tokens, self.hv, self.dk, self.dv), device=device, dtype=torch.float32)

    def _conv(self, xc: torch.Tensor) -> torch.Tensor:
        t = xc.shape[0]
        buf = torch.cat([self.conv_state, xc], 0)  # [K-1+T, C]
        win = buf.unfold(0, self.conv_w.shape[1], 1)  # [T, C, K]
        y = F.silu((win * self.conv_w).sum(-1))
        self.conv_state.copy_(buf[t:])
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        y = _rms(x, self.norm) @ self.w_in
        if self.kind == "gdn":
            xc = self._conv(y[:, : self.conv_dim])
            qk = self.hk * self.dk
            q = F.normalize(xc[:, :qk].view(t, self.hk, self.dk), dim=-1)
            k = F.normalize(xc[:, qk : 2 * qk].view(t, self.hk, self.dk), dim=-1)
            v = xc[:, 2 * qk :].view(t, self.hv, self.dv)
            z = y[:, self.conv_dim : self.conv_dim + self.inner]
            ba = y[:, self.conv_dim + self.inner :].float()
            beta = torch.sigmoid(ba[:, : self.hv])
            g = -torch.exp(self.a_log) * F.softplus(ba[:, self.hv :] + self.dt_bias)
            o = recurrent_scan(q, k, v, g, beta, self.state, self.states_out, self.scale)
        else:
            z = y[:, : self.inner]
            xc = self._conv(y[:, self.inner : self.inner + self.conv_dim])
            dt = F.softplus(y[:, self.inner + self.conv_dim :].float() + self.dt_bias)  # [T, HV]
            xs = xc[:, : self.inner].view(t, self.hv, self.dv)
            gs = self.hk * self.dk
            bmat = xc[:, self.inner : self.inner + gs].view(t, self.hk, self.dk)
            cmat = xc[:, self.inner + gs :].view(t, self.hk, self.dk)
            g = -torch.exp(self.a_log) * dt
            v = (xs.float() * dt[..., None]).to(xs.dtype)
            o = recurrent_scan(cmat, bmat, v, g, None, self.state, self.states_out, self.scale)
            o = o + xs * self.d_skip[:, None].to(xs.dtype)
        o = _rms(o, self.out_norm) * F.silu(z.view(t, self.hv, self.dv))
        return x + o.reshape(t, self.inner) @ self.w_out


class MoE:
    """Router + the touched routed experts (batched) + latent projections + shared expert(s)."""

    def __init__(self, spec: cm.ModelSpec, n_experts: int, max_tokens: int, device: torch.device, dtype: torch.dtype):
        m, h = spec.moe, spec.hidden_size
        self.m = m
        width = m.latent_size or h
        inter = m.expert_intermediate_size
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.router = _w((h, m.num_experts), device, dtype)
        self.n_alloc = n_experts
        up = 2 * inter if m.activation == "swiglu" else inter
        self.w_up = _w((n_experts, width, up), device, dtype)
        self.w_down = _w((n_experts, inter, width), device, dtype)
        self.combine = torch.softmax(torch.randn(n_experts, max_tokens, device=device), 0).to(dtype)
        if m.latent_size:
            self.lat_in = _w((h, m.latent_size), device, dtype)
            self.lat_out = _w((m.latent_size, h), device, dtype)
        s_up = 2 * m.shared_intermediate_size if m.activation == "swiglu" else m.shared_intermediate_size
        self.s_up = _w((h, s_up * m.shared_experts), device, dtype)
        self.s_down = _w((m.shared_intermediate_size * m.shared_experts, h), device, dtype)
        self.s_gate = _w((h, 1), device, dtype) if m.shared_expert_gate else None

    def _act(self, u: torch.Tensor) -> torch.Tensor:
        if self.m.activation == "swiglu":
            a, b = u.chunk(2, dim=-1)
            return F.silu(a) * b
        return torch.square(F.relu(u))

    def forward(self, x: torch.Tensor, n_experts: int) -> torch.Tensor:
        t = x.shape[0]
        n = min(n_experts, self.n_alloc)
        xn = _rms(x, self.norm)
        logits = xn @ self.router
        _ = torch.topk(logits, self.m.top_k, dim=-1)  # routing cost; dispatch is fixed in the replica
        xin = xn @ self.lat_in if self.m.latent_size else xn
        hid = self._act(torch.matmul(xin, self.w_up[:n]))  # [n, T, I]
        out = (torch.matmul(hid, self.w_down[:n]) * self.combine[:n, :t, None]).sum(0)  # [T, width]
        if self.m.latent_size:
            out = out @ self.lat_out
        sh = self._act(xn @ self.s_up) @ self.s_down
        if self.s_gate is not None:
            sh = sh * torch.sigmoid(xn @ self.s_gate)
        return x + out + sh


@dataclass
class StepPlan:
    """Positions and ranges of one step at context N with draft depth k."""

    context: int
    k: int
    arm: str  # "mtp" or "wmtp" (or "none": verify of one token, no draft)
    sink: int
    window: int

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


class Replica:
    """Target layers + MTP head of one model, dummy weights, synthetic KV up to ``capacity`` tokens."""

    def __init__(
        self,
        spec: cm.ModelSpec,
        capacity: int,
        max_k: int,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
    ):
        dev = torch.device(device)
        dt = dtype or torch.bfloat16
        self.spec, self.device, self.dtype = spec, dev, dt
        self.capacity = capacity + max_k + 2
        t_max = max_k + 1
        m = spec.moe
        self.n_exp_verify = {
            t: max(m.top_k, round(cm.expected_distinct_experts(m.num_experts, m.top_k, t))) for t in range(1, t_max + 1)
        }
        n_alloc = self.n_exp_verify[t_max]
        h = spec.hidden_size
        self.embed = _w((spec.vocab_size, h), dev, dt, fan_in=1)
        self.lm_head = _w((h, spec.vocab_size), dev, dt)
        self.final_norm = torch.ones(h, device=dev, dtype=dt)
        self.layers: list[list[Any]] = []
        for parts in spec.layers:
            blocks: list[Any] = []
            for p in parts:
                if p == "attn":
                    blocks.append(Attention(spec, self.capacity, dev, dt))
                elif p in ("gdn", "mamba2"):
                    blocks.append(Recurrent(spec, p, t_max, dev, dt))
                elif p == "moe":
                    blocks.append(MoE(spec, n_alloc, t_max, dev, dt))
            self.layers.append(blocks)
        self.mtp_fc = _w((2 * h, h), dev, dt)
        self.mtp_norm_e = torch.ones(h, device=dev, dtype=dt)
        self.mtp_norm_h = torch.ones(h, device=dev, dtype=dt)
        self.mtp_blocks: list[Any] = []
        for parts in spec.mtp_layers:
            for p in parts:
                if p == "attn":
                    self.mtp_blocks.append(Attention(spec, self.capacity, dev, dt))
                elif p == "moe":
                    self.mtp_blocks.append(MoE(spec, m.top_k, 1, dev, dt))
        self.mtp_final_norm = torch.ones(h, device=dev, dtype=dt)
        self.tokens = torch.randint(0, spec.vocab_size, (t_max,), device=dev)
        self.hidden = torch.randn(t_max, h, device=dev, dtype=dt)

    # ---- pieces ---------------------------------------------------------------------------

    def target_body(self, plan: StepPlan, ctx: AttnCtx) -> torch.Tensor:
        """All target layers over the verify tokens (no lm_head)."""
        t = plan.t_verify
        x = self.embed[self.tokens[:t]]
        ranges = plan.verify_ranges()
        for blocks in self.layers:
            for b in blocks:
                if isinstance(b, Attention):
                    x = b.forward(x, plan.context, ranges, ctx)
                elif isinstance(b, Recurrent):
                    x = b.forward(x)
                else:
                    x = b.forward(x, self.n_exp_verify[t])
        return x

    def logits_argmax(self, x: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        return torch.argmax(_rms(x, norm) @ self.lm_head, dim=-1)

    def target_attn_cores(self, plan: StepPlan, ctx: AttnCtx, q: torch.Tensor) -> list[torch.Tensor]:
        ranges = plan.verify_ranges()
        return [b.core(q, ranges, ctx) for blocks in self.layers for b in blocks if isinstance(b, Attention)]

    def draft_body(self, plan: StepPlan, j: int, token: torch.Tensor, hid: torch.Tensor, ctx: AttnCtx) -> torch.Tensor:
        """One draft forward up to (not including) the lm_head; token [1], hid [1, H]."""
        e = self.embed[token]
        x = torch.cat([_rms(e, self.mtp_norm_e), _rms(hid, self.mtp_norm_h)], -1) @ self.mtp_fc
        ranges = plan.draft_ranges(j)
        for b in self.mtp_blocks:
            if isinstance(b, Attention):
                x = b.forward(x, plan.context + j, ranges, ctx)
            else:
                x = b.forward(x, self.spec.moe.top_k)
        return x

    def draft_attn_cores(self, plan: StepPlan, ctx: AttnCtx, q: torch.Tensor) -> list[torch.Tensor]:
        ranges = plan.draft_ranges(0)
        return [b.core(q, ranges, ctx) for b in self.mtp_blocks if isinstance(b, Attention)]

    def step(self, plan: StepPlan, ctx: AttnCtx) -> torch.Tensor:
        """Verify forward + k draft forwards; returns the last draft token."""
        x = self.target_body(plan, ctx)
        tok = self.logits_argmax(x, self.final_norm)
        if plan.arm == "none":
            return tok
        token, hid = tok[-1:], x[-1:]
        for j in range(plan.k):
            hid = self.draft_body(plan, j, token, hid, ctx)
            token = self.logits_argmax(hid, self.mtp_final_norm)
        return token


# ============================================================================================
# Timing (CUDA)
# ============================================================================================


def _is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _sync(device: str) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize()


def _sms(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if _is_cuda(device) else 132


def _free_bytes(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if _is_cuda(device) else 1 << 40


def _empty_cache(device: str) -> None:
    if _is_cuda(device):
        torch.cuda.empty_cache()


class GraphTimer:
    """Capture a callable in a CUDA graph (or run eagerly) and time replays with CUDA events.

    On CPU (the test path) it runs eagerly and times with the host clock.
    """

    def __init__(self, use_graphs: bool = True, scrub_bytes: int = 256 << 20, device: str = "cuda"):
        self.device = device
        self.cuda = _is_cuda(device)
        self.use_graphs = use_graphs and self.cuda
        self.scrub = torch.empty((scrub_bytes if self.cuda else 1 << 20) // 4, device=device, dtype=torch.float32)

    def _scrub(self) -> None:
        self.scrub.fill_(1.0)

    def time(self, fn: Callable[[], Any], reps: int, warmup: int = 3, scrub: bool = False) -> list[float]:
        def body() -> None:
            if scrub:
                self._scrub()
            fn()

        if not self.cuda:
            body()
            out = []
            for _ in range(reps):
                t = time.perf_counter()
                body()
                out.append((time.perf_counter() - t) * 1e3)
            return out
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        run: Callable[[], Any]
        graph = None
        if self.use_graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            run = graph.replay
        else:
            run = body
        for _ in range(warmup):
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        out = [a.elapsed_time(b) for a, b in zip(starts, ends, strict=True)]
        del graph
        return out


def copy_bandwidth(n_bytes: int = 4 << 30, reps: int = 20, device: str = "cuda") -> dict[str, float]:
    """Device-to-device copy: (read + write bytes) / time, median of reps."""
    if not _is_cuda(device):
        n_bytes = min(n_bytes, 64 << 20)
    src = torch.empty(n_bytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    timer = GraphTimer(use_graphs=False, device=device)
    ms = timer.time(partial(dst.copy_, src), reps)
    med = statistics.median(ms)
    del src, dst
    _empty_cache(device)
    return {"bytes": 2.0 * n_bytes, "median_ms": med, "bandwidth": 2.0 * n_bytes / (med * 1e-3), "reps": reps}


# ============================================================================================
# The sweep
# ============================================================================================


#: Columns of each table the sweep writes (fixed, so rows written in any order share a header).
TABLES: dict[str, list[str]] = {
    "replica_bandwidth": ["bytes", "median_ms", "bandwidth", "reps"],
    "replica_checks": ["check", "backend", "hq", "hkv", "d", "n", "t", "rel_err", "ok", "note"],
    "replica_attention": [
        "model",
        "backend",
        "variant",
        "context",
        "t",
        "splits",
        "kv_bytes",
        "median_ms",
        "p10_ms",
        "p90_ms",
        "scrub_ms",
        "bandwidth",
        "copy_bandwidth",
        "fraction_of_copy",
    ],
    "replica_steps": [
        "model",
        "context",
        "k",
        "sink",
        "window",
        "backend",
        "arm",
        "median_ms",
        "p10_ms",
        "p90_ms",
        "reps",
        "predicted_ms",
        "predicted_bytes",
    ],
    "replica_summary": [
        "model",
        "context",
        "k",
        "sink",
        "window",
        "backend",
        "step_nat_ms",
        "step_win_ms",
        "ratio",
        "predicted_ratio",
        "predicted_nat_ms",
        "predicted_win_ms",
        "copy_bandwidth",
    ],
    "replica_components": [
        "model",
        "context",
        "k",
        "sink",
        "window",
        "backend",
        "component",
        "median_ms",
        "p10_ms",
        "p90_ms",
        "reps",
        "scrub_ms",
    ],
}


class CsvSink:
    """Append rows to <out>/<table>.csv as they come, so a timeout still leaves data."""

    def __init__(self, out: Path):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self._ready: set[str] = set()

    def write(self, name: str, row: dict[str, Any]) -> None:
        fields = TABLES[name]
        path = self.out / f"{name}.csv"
        if name not in self._ready:
            self._ready.add(name)
            header = ",".join(fields)
            if not (path.exists() and path.read_text().split("\n", 1)[0].strip() == header):
                with open(path, "w", newline="") as f:
                    csv.DictWriter(f, fields).writeheader()
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, fields, extrasaction="ignore").writerow(row)


@dataclass
class SweepConfig:
    models: list[Path]
    contexts: list[int]
    ks: list[int]
    sink: int = 4
    window: int = 2048
    reps: int = 30
    backend: str = "auto"
    splits: int | None = None
    use_graphs: bool = True
    components: bool = True
    deadline_s: float = 1e9
    checks: bool = True
    device: str = "cuda"
    out: Path = field(default_factory=lambda: Path("."))


def _noop() -> None:
    return None


def _stats(name: str, ms: list[float]) -> dict[str, float]:
    t = Timings(name, ms)
    return {"median_ms": t.median, "p10_ms": t.q(0.1), "p90_ms": t.q(0.9), "reps": len(ms)}


def check_attention(backend: str, sink: CsvSink, device: str = "cuda") -> None:
    """Correctness of decode attention against float32 with an explicit mask, on fresh random inputs."""
    for hq, hkv, d, n, t in ((16, 2, 256, 70_000, 4), (32, 2, 128, 50_000, 6), (16, 2, 256, 9_000, 1)):
        n = n if _is_cuda(device) else n // 20
        kc = torch.randn(n + t, hkv, d, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(hq, t, d, device=device, dtype=torch.bfloat16)
        end = n + t
        vis = torch.arange(end, device=device)[None, :] <= (n + torch.arange(t, device=device))[:, None]
        ref = reference_attention(q, kc, vc, vis)
        got = decode_attention(q, kc, vc, [KeyRange(0, end, causal_tail=t)], backend=backend)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        sink.write(
            "replica_checks",
            {
                "check": "attention_full",
                "backend": backend,
                "hq": hq,
                "hkv": hkv,
                "d": d,
                "n": n,
                "t": t,
                "rel_err": err,
                "ok": err < 2e-2,
            },
        )
        if t == 1:
            s_, w_ = 4, min(2048, n // 4)
            vis_w = torch.zeros(1, end, dtype=torch.bool, device=device)
            vis_w[:, :s_] = True
            vis_w[:, end - w_ :] = True
            ref = reference_attention(q, kc, vc, vis_w)
            got = decode_attention(
                q, kc, vc, [KeyRange(0, s_), KeyRange(end - w_, end, causal_tail=1)], backend=backend
            )
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            sink.write(
                "replica_checks",
                {
                    "check": "attention_window",
                    "backend": backend,
                    "hq": hq,
                    "hkv": hkv,
                    "d": d,
                    "n": n,
                    "t": t,
                    "rel_err": err,
                    "ok": err < 2e-2,
                },
            )


def check_recurrence(sink: CsvSink, device: str = "cuda") -> None:
    for hk, hv, dk, dv, delta in ((16, 32, 128, 128, True), (8, 128, 128, 64, False)):
        t = 6
        q = F.normalize(torch.randn(t, hk, dk, device=device), dim=-1).bfloat16()
        k = F.normalize(torch.randn(t, hk, dk, device=device), dim=-1).bfloat16()
        v = torch.randn(t, hv, dv, device=device, dtype=torch.bfloat16)
        g = -torch.rand(t, hv, device=device)
        beta = torch.rand(t, hv, device=device) if delta else None
        s0 = torch.randn(hv, dk, dv, device=device) * 0.1
        so1, so2 = torch.empty(t, hv, dk, dv, device=device), torch.empty(t, hv, dk, dv, device=device)
        o1 = recurrent_scan(q, k, v, g, beta, s0, so1, 0.1, use_triton=True)
        o2 = recurrent_scan(q, k, v, g, beta, s0, so2, 0.1, use_triton=False)
        err = ((o1.float() - o2.float()).norm() / o2.float().norm()).item()
        serr = ((so1 - so2).norm() / so2.norm()).item()
        sink.write(
            "replica_checks",
            {
                "check": "recurrence_delta" if delta else "recurrence_mamba2",
                "backend": "triton",
                "hq": hv,
                "hkv": hk,
                "d": dk,
                "n": 0,
                "t": t,
                "rel_err": max(err, serr),
                "ok": max(err, serr) < 2e-2,
            },
        )


#: Split-KV launch variants the attention bench tries: (block_n, num_warps, num_stages).
TRITON_VARIANTS: tuple[tuple[int | None, int | None, int | None], ...] = (
    (None, None, None),
    (64, 8, 2),
    (32, 4, 3),
    (64, 4, 3),
)


def attention_bandwidth(
    spec: cm.ModelSpec,
    contexts: Sequence[int],
    ts: Sequence[int],
    timer: GraphTimer,
    sink: CsvSink,
    copy_bw: float,
    reps: int,
    *,
    backends: Sequence[str] = ("triton", "aten"),
    split_factors: Sequence[float] = (1.0,),
    variants: Sequence[tuple[int | None, int | None, int | None]] = ((None, None, None),),
) -> None:
    """Achieved bandwidth of one layer's decode attention: KV bytes (read once) / time, vs copy."""
    a = spec.attention
    cap = max(contexts) + 8
    device = timer.device
    kc = torch.empty(cap, a.num_kv_heads, a.head_dim, device=device, dtype=torch.bfloat16).normal_()
    vc = torch.empty_like(kc).normal_()
    sms = _sms(device)
    base = statistics.median(timer.time(_noop, reps, scrub=True))
    saved = dict(TRITON_ATTN_KNOBS)
    for backend in backends:
        for variant in variants if backend == "triton" else ((None, None, None),):
            TRITON_ATTN_KNOBS.update(zip(("block_n", "num_warps", "num_stages"), variant, strict=True))
            for n in contexts:
                for t in ts:
                    for f in split_factors:
                        splits = max(1, round(auto_splits(n, a.num_kv_heads, sms) * f))
                        q = torch.randn(a.num_q_heads, t, a.head_dim, device=device, dtype=torch.bfloat16)
                        rng = [KeyRange(0, n + t, causal_tail=t)]
                        fn = partial(decode_attention, q, kc, vc, rng, backend=backend, splits=splits, sms=sms)
                        try:
                            ms = timer.time(fn, reps, scrub=True)
                        except Exception as e:  # a variant that does not compile is data
                            log.warning("attn %s %s variant %s failed: %s", spec.name, backend, variant, e)
                            break
                        net = max(1e-6, statistics.median(ms) - base)
                        kv_bytes = 2 * (n + t) * a.num_kv_heads * a.head_dim * 2
                        bw = kv_bytes / (net * 1e-3)
                        sink.write(
                            "replica_attention",
                            {
                                "model": spec.name,
                                "backend": backend,
                                "variant": "-".join(str(v) for v in variant),
                                "context": n,
                                "t": t,
                                "splits": splits,
                                "kv_bytes": kv_bytes,
                                "median_ms": net,
                                "p10_ms": Timings("", ms).q(0.1) - base,
                                "p90_ms": Timings("", ms).q(0.9) - base,
                                "scrub_ms": base,
                                "bandwidth": bw,
                                "copy_bandwidth": copy_bw,
                                "fraction_of_copy": bw / copy_bw,
                            },
                        )
                        log.info(
                            "attn %s %s %s N=%d T=%d P=%d: %.3f ms %.2f TB/s (%.0f%% of copy)",
                            spec.name,
                            backend,
                            variant,
                            n,
                            t,
                            splits,
                            net,
                            bw / 1e12,
                            100 * bw / copy_bw,
                        )
    TRITON_ATTN_KNOBS.update(saved)


def _fits(spec: cm.ModelSpec, context: int, max_k: int, free_bytes: int) -> bool:
    """Whether the replica (touched weights, KV of target and draft, states) fits in free memory."""
    t = max_k + 1
    h = spec.hidden_size
    w = sum(cm.layer_params_touched(spec, p, t) for p in spec.layers)
    w += sum(cm.layer_params_touched(spec, p, 1) for p in spec.mtp_layers) + 2 * h * h
    w += 2 * spec.vocab_size * h
    kv = (spec.n_attn + spec.n_draft_attn) * (context + max_k + 2) * cm.kv_bytes_per_token_layer(spec)
    state = sum((t + 1) * cm.recurrent_state_bytes(spec, c)[0] * spec.count(c) for c in ("gdn", "mamba2"))
    return w * spec.weight_bytes * 1.1 + kv + state + (6 << 30) < free_bytes


def sweep_model(cfg: SweepConfig, path: Path, sink: CsvSink, copy_bw: float, backend: str, t0: float) -> None:
    spec = cm.load_model(path)
    max_k = max(cfg.ks)
    dev = cfg.device
    free = _free_bytes(dev)
    contexts = [n for n in cfg.contexts if _fits(spec, n, max_k, free)]
    skipped = [n for n in cfg.contexts if n not in contexts]
    if skipped:
        log.warning("%s: contexts %s do not fit in %.1f GiB; skipped", spec.name, skipped, free / 2**30)
        for n in skipped:
            sink.write("replica_checks", {"check": "fits_memory", "n": n, "ok": False, "note": spec.name})
    if not contexts:
        return
    tb = time.time()
    rep = Replica(spec, max(contexts), max_k, dev)
    _sync(dev)
    log.info(
        "%s: replica built in %.1f s, %.1f GiB allocated",
        spec.name,
        time.time() - tb,
        torch.cuda.memory_allocated() / 2**30 if _is_cuda(dev) else 0.0,
    )
    timer = GraphTimer(cfg.use_graphs, device=dev)
    sms = _sms(dev)
    a = spec.attention
    for n in contexts:
        for k in cfg.ks:
            if time.time() - t0 > cfg.deadline_s:
                log.warning("deadline reached; stopping before %s N=%d k=%d", spec.name, n, k)
                return
            row = {
                "model": spec.name,
                "context": n,
                "k": k,
                "sink": cfg.sink,
                "window": cfg.window,
                "backend": backend,
            }
            step_ms: dict[str, float] = {}
            for arm in ("mtp", "wmtp", "none"):
                if arm == "none" and k != cfg.ks[0]:
                    continue
                plan = StepPlan(n, k, arm, cfg.sink, cfg.window)
                ctx = AttnCtx(backend, cfg.splits, sms)
                ms = timer.time(partial(rep.step, plan, ctx), cfg.reps)
                st = _stats(arm, ms)
                step_ms[arm] = st["median_ms"]
                pred = cm.step_cost(spec, n, k, arm, sink=cfg.sink, window=cfg.window, bandwidth=copy_bw)
                sink.write(
                    "replica_steps",
                    {
                        **row,
                        "k": 0 if arm == "none" else k,
                        "arm": arm,
                        **st,
                        "predicted_ms": pred.time_s * 1e3,
                        "predicted_bytes": pred.bytes.total,
                    },
                )
            p = cm.predict(spec, n, k, cfg.sink, cfg.window, copy_bw)
            sink.write(
                "replica_summary",
                {
                    **row,
                    "step_nat_ms": step_ms["mtp"],
                    "step_win_ms": step_ms["wmtp"],
                    "ratio": step_ms["mtp"] / step_ms["wmtp"],
                    "predicted_ratio": p.ratio,
                    "predicted_nat_ms": p.native.time_s * 1e3,
                    "predicted_win_ms": p.windowed.time_s * 1e3,
                    "copy_bandwidth": copy_bw,
                },
            )
            log.info(
                "%s N=%d k=%d: nat %.3f ms, win %.3f ms, ratio %.3f (model %.3f)",
                spec.name,
                n,
                k,
                step_ms["mtp"],
                step_ms["wmtp"],
                step_ms["mtp"] / step_ms["wmtp"],
                p.ratio,
            )
            if not cfg.components:
                continue
            plan_nat = StepPlan(n, k, "mtp", cfg.sink, cfg.window)
            ctx = AttnCtx(backend, cfg.splits, sms)
            ctx_skip = AttnCtx(backend, cfg.splits, sms, skip_core=True)
            qv = torch.randn(a.num_q_heads, k + 1, a.head_dim, device=dev, dtype=torch.bfloat16)
            q1 = torch.randn(a.num_q_heads, 1, a.head_dim, device=dev, dtype=torch.bfloat16)
            xv = torch.randn(k + 1, spec.hidden_size, device=dev, dtype=torch.bfloat16)
            x1 = xv[:1]
            tok = rep.tokens[:1]
            pieces: dict[str, Callable[[], Any]] = {
                "target_attn": partial(rep.target_attn_cores, plan_nat, ctx, qv),
                "target_other": partial(rep.target_body, plan_nat, ctx_skip),
                "lm_head": partial(rep.logits_argmax, xv, rep.final_norm),
            }
            if k == cfg.ks[0]:
                plan_win = StepPlan(n, k, "wmtp", cfg.sink, cfg.window)
                pieces |= {
                    "draft_attn_nat": partial(rep.draft_attn_cores, plan_nat, ctx, q1),
                    "draft_attn_win": partial(rep.draft_attn_cores, plan_win, ctx, q1),
                    "draft_other": partial(rep.draft_body, plan_nat, 0, tok, x1, ctx_skip),
                    "draft_lm_head": partial(rep.logits_argmax, x1, rep.mtp_final_norm),
                }
            base = statistics.median(timer.time(_noop, cfg.reps, scrub=True))
            for name, fn in pieces.items():
                ms = timer.time(fn, cfg.reps, scrub=True)
                st = _stats(name, [max(0.0, x - base) for x in ms])
                sink.write("replica_components", {**row, "component": name, **st, "scrub_ms": base})
        _empty_cache(dev)


def choose_backend(requested: str, device: str = "cuda") -> str:
    if requested != "auto":
        return requested
    return "triton" if HAVE_TRITON and _is_cuda(device) else "aten"


def run_sweep(cfg: SweepConfig) -> int:
    dev = cfg.device
    if torch is None or (_is_cuda(dev) and not torch.cuda.is_available()):
        log.error("replica sweep: --device %s needs a CUDA GPU (torch.cuda.is_available() is False)", dev)
        return 2
    t0 = time.time()
    sink = CsvSink(cfg.out)
    props = torch.cuda.get_device_properties(0) if _is_cuda(dev) else None
    manifest = {
        "gpu": props.name if props else platform.processor() or "cpu",
        "sms": props.multi_processor_count if props else None,
        "memory_bytes": props.total_memory if props else None,
        "torch": torch.__version__,
        "triton": triton.__version__ if HAVE_TRITON else None,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "start": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "argv": sys.argv,
        "config": {k: str(v) for k, v in cfg.__dict__.items()},
    }
    (cfg.out / "replica_manifest.json").write_text(json.dumps(manifest, indent=2))
    bw = copy_bandwidth(device=dev)
    sink.write("replica_bandwidth", bw)
    copy_bw = bw["bandwidth"]
    log.info("copy bandwidth %.2f TB/s", copy_bw / 1e12)
    backend = choose_backend(cfg.backend, dev)
    if cfg.checks:
        for b in [backend, "aten"] if backend == "triton" else [backend]:
            try:
                check_attention(b, sink, dev)
            except Exception as e:  # a failing backend is data, not a crash
                log.exception("attention check failed for %s", b)
                sink.write("replica_checks", {"check": "attention", "backend": b, "ok": False, "note": str(e)[:200]})
        if HAVE_TRITON and _is_cuda(dev):
            try:
                check_recurrence(sink, dev)
            except Exception as e:
                log.exception("recurrence check failed")
                sink.write(
                    "replica_checks", {"check": "recurrence", "backend": "triton", "ok": False, "note": str(e)[:200]}
                )
    for path in cfg.models:
        try:
            sweep_model(cfg, path, sink, copy_bw, backend, t0)
        except torch.cuda.OutOfMemoryError:
            log.exception("%s: out of memory", path)
        _empty_cache(dev)
        if time.time() - t0 > cfg.deadline_s:
            break
    log.info("sweep done in %.0f s", time.time() - t0)
    print_summary(cfg.out)
    return 0


def print_summary(out: Path) -> None:
    path = out / "replica_summary.csv"
    if not path.exists():
        return
    with open(path) as f:
        rows = list(csv.DictReader(f))
    lines = [f"{'model':36s} {'N':>8s} {'k':>2s} {'nat ms':>8s} {'win ms':>8s} {'ratio':>6s} {'model':>6s}"]
    for r in rows:
        lines.append(
            f"{r['model']:36s} {int(r['context']):8d} {int(r['k']):2d} {float(r['step_nat_ms']):8.3f} "
            f"{float(r['step_win_ms']):8.3f} {float(r['ratio']):6.3f} {float(r['predicted_ratio']):6.3f}"
        )
    sys.stdout.write("\n".join(lines) + "\n")


# ============================================================================================
# Tidy: raw CSVs + prediction -> one parquet (no torch needed)
# ============================================================================================


def tidy(raw: Path, models_dir: Path, out: Path, bandwidth: float | None = None) -> int:
    """Join measured steps with the cost model's prediction; one row per (model, context, k, arm)."""
    import pandas as pd

    steps = pd.read_csv(raw / "replica_steps.csv")
    steps = steps[~steps["arm"].astype(str).str.startswith("skipped")]
    bw = bandwidth
    if bw is None:
        bw = float(pd.read_csv(raw / "replica_bandwidth.csv")["bandwidth"].iloc[0])
    by_name = {cm.load_model(p).name: p for p in sorted(models_dir.glob("*.json"))}
    rows = []
    for r in steps.itertuples(index=False):
        spec_path = by_name.get(r.model)
        if spec_path is None:
            raise ValueError(f"tidy: no config/models/*.json has name {r.model!r} (have {sorted(by_name)})")
        k, n = int(r.k), int(r.context)
        sc = cm.step_cost(spec_path, n, k, r.arm, sink=int(r.sink), window=int(r.window), bandwidth=bw)
        rows.append(
            {
                "model": r.model,
                "context": n,
                "k": k,
                "arm": r.arm,
                "sink": int(r.sink),
                "window": int(r.window),
                "measured_ms": float(r.median_ms),
                "measured_p10_ms": float(r.p10_ms),
                "measured_p90_ms": float(r.p90_ms),
                "predicted_ms": sc.time_s * 1e3,
                "predicted_bytes": sc.bytes.total,
                "bandwidth": bw,
            }
        )
    df = pd.DataFrame(rows)
    nat = df[df.arm == "mtp"].set_index(["model", "context", "k"])
    win = df[df.arm == "wmtp"].set_index(["model", "context", "k"])
    ratio = (nat["measured_ms"] / win["measured_ms"]).rename("measured_ratio")
    pratio = (nat["predicted_ms"] / win["predicted_ms"]).rename("predicted_ratio")
    df = df.join(pd.concat([ratio, pratio], axis=1), on=["model", "context", "k"])
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out, index=False)
    return 0


# ============================================================================================
# CLI
# ============================================================================================


def _ints(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        elif part.endswith("m"):
            part, mult = part[:-1], 1 << 20
        out.append(int(float(part) * mult))
    return out


def _ints_or_none(s: str) -> list[int]:
    return [] if s.strip().lower() in ("", "none") else _ints(s)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wmtp.replica", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="measure on a CUDA GPU; CSVs into --out")
    sw.add_argument("--models", nargs="+", type=Path, required=True, help="config/models/*.json files")
    sw.add_argument("--contexts", type=_ints_or_none, default=_ints("2k,32k,128k,256k,512k,1m"))
    sw.add_argument("--ks", type=_ints, default=[1, 3, 5])
    sw.add_argument("--sink", type=int, default=4)
    sw.add_argument("--window", type=int, default=2048)
    sw.add_argument("--reps", type=int, default=30)
    sw.add_argument("--backend", choices=("auto", *ATTN_BACKENDS), default="auto")
    sw.add_argument("--splits", type=int, default=None, help="KV chunks per range (default: auto)")
    sw.add_argument("--no-graphs", action="store_true")
    sw.add_argument("--no-components", action="store_true")
    sw.add_argument("--no-checks", action="store_true")
    sw.add_argument("--attn-bench", type=_ints, default=[], help="contexts for the attention bandwidth table")
    sw.add_argument("--attn-block-n", type=int, default=None, help="split-KV kernel: keys per block")
    sw.add_argument("--attn-warps", type=int, default=None)
    sw.add_argument("--attn-stages", type=int, default=None)
    sw.add_argument("--deadline-s", type=float, default=1e9, help="stop starting new points after this")
    sw.add_argument("--device", default="cuda", help="cuda (measurements) or cpu (a dry run at tiny shapes)")
    sw.add_argument("--out", type=Path, required=True)
    td = sub.add_parser("tidy", help="raw replica CSVs + cost model -> tidy parquet")
    td.add_argument("--raw", type=Path, required=True)
    td.add_argument("--models-dir", type=Path, default=Path("config/models"))
    td.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: the measured copy rate)")
    td.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    if args.cmd == "tidy":
        return tidy(args.raw, args.models_dir, args.out, args.bandwidth)
    cfg = SweepConfig(
        models=args.models,
        contexts=args.contexts,
        ks=args.ks,
        sink=args.sink,
        window=args.window,
        reps=args.reps,
        backend=args.backend,
        splits=args.splits,
        use_graphs=not args.no_graphs,
        components=not args.no_components,
        deadline_s=args.deadline_s,
        checks=not args.no_checks,
        device=args.device,
        out=args.out,
    )
    TRITON_ATTN_KNOBS.update(
        {"block_n": args.attn_block_n, "num_warps": args.attn_warps, "num_stages": args.attn_stages}
    )
    if args.attn_bench:
        if torch is None or (_is_cuda(cfg.device) and not torch.cuda.is_available()):
            log.error("--attn-bench needs a CUDA GPU")
            return 2
        sink = CsvSink(cfg.out)
        bw = copy_bandwidth(device=cfg.device)
        sink.write("replica_bandwidth", bw)
        timer = GraphTimer(cfg.use_graphs, device=cfg.device)
        seen = set()
        for i, path in enumerate(cfg.models):
            spec = cm.load_model(path)
            shape = (spec.attention.num_q_heads, spec.attention.num_kv_heads, spec.attention.head_dim)
            if shape in seen:
                continue
            seen.add(shape)
            attention_bandwidth(
                spec,
                args.attn_bench,
                (1, 4, 6),
                timer,
                sink,
                bw["bandwidth"],
                cfg.reps,
                backends=("triton", "aten") if HAVE_TRITON and _is_cuda(cfg.device) else ("aten",),
                split_factors=(1.0, 2.0, 4.0) if i == 0 else (1.0,),
                variants=TRITON_VARIANTS if i == 0 else ((None, None, None),),
            )
        if not cfg.contexts:
            return 0
    return run_sweep(cfg)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
