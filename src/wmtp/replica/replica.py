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

CLI: ``python -m wmtp.replica.replica sweep ...`` (GPU measurement, CSVs) and ``python -m wmtp.replica.replica
tidy ...`` (raw CSVs + cost-model prediction -> one tidy parquet; needs no torch).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
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
from typing import TYPE_CHECKING, Any

from wmtp.analyze import costmodel as cm
from wmtp.analyze.analysis import cost_side_ratio

if TYPE_CHECKING:
    import pandas as pd

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

log = logging.getLogger("wmtp.replica.replica")

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
        cstart,
        chunk,
        p_offset,
        R,
        T,
        stride_kn,
        stride_kh,
        qk_scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D: tl.constexpr,
    ):
        """One (chunk, KV head): R folded query rows (row r is token r % T) over keys [n0, n1).

        Causal to the end: key n is visible to token t iff n - cstart <= t (cstart = end for none).
        Writes the chunk's normalised output and log-sum-exp at split index p_offset + chunk.
        """
        pid_s = tl.program_id(0)
        pid_h = tl.program_id(1)
        n0 = start + pid_s * chunk
        n1 = tl.minimum(n0 + chunk, end)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + pid_h * R * D + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < R, other=0.0)
        tok = offs_m % T
        m_i = tl.zeros([BLOCK_M], tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        k_base = K + pid_h * stride_kh
        v_base = V + pid_h * stride_kh
        for i in range(0, chunk, BLOCK_N):  # the last chunk may be short: masked
            offs_n = n0 + i + tl.arange(0, BLOCK_N)
            kmask = offs_n < n1
            kt = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt)) * qk_scale  # log2 domain
            vis = kmask[None, :] & ((offs_n[None, :] - cstart) <= tok[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        row = ((p_offset + pid_s) * tl.num_programs(1) + pid_h) * R + offs_m
        tl.store(Out + row[:, None] * D + offs_d[None, :], out, mask=offs_m[:, None] < R)
        tl.store(LSE + row, lse, mask=offs_m < R)

    @triton.jit
    def _merge_kernel(
        Part,
        LSE,
        Out,
        Gate,
        P,
        R,
        T,
        G,
        HKV,
        s_ot,
        s_oh,
        s_gt,
        s_gh,
        D: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HAS_GATE: tl.constexpr,
    ):
        """Merge P partials of one (KV head, row) with softmax weights of their LSEs -> out[t, q head]."""
        pid = tl.program_id(0)
        h = pid // R
        r = pid % R
        offs_d = tl.arange(0, D)
        m = tl.zeros([], tl.float32) - 1.0e30
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            lse = tl.load(LSE + (offs_p * HKV + h) * R + r, mask=offs_p < P, other=float("-inf"))
            m = tl.maximum(m, tl.max(lse, 0))
        acc = tl.zeros([D], tl.float32)
        den = tl.zeros([], tl.float32)
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            pm = offs_p < P
            lse = tl.load(LSE + (offs_p * HKV + h) * R + r, mask=pm, other=float("-inf"))
            w = tl.exp(lse - m)
            o = tl.load(Part + ((offs_p * HKV + h) * R + r)[:, None] * D + offs_d[None, :], mask=pm[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o, 0)
            den += tl.sum(w, 0)
        out = acc / den
        qh = h * G + r // T
        t = r % T
        if HAS_GATE:
            gate = tl.load(Gate + t * s_gt + qh * s_gh + offs_d).to(tl.float32)
            out = out * tl.sigmoid(gate)
        tl.store(Out + t * s_ot + qh * s_oh + offs_d, out.to(Out.dtype.element_ty))

    @triton.jit
    def _rmsnorm_kernel(
        X, W, Out, Gate, B, s_xa, s_xb, s_oa, s_ob, s_ga, s_gb, N, eps, BLOCK: tl.constexpr, HAS_GATE: tl.constexpr
    ):
        """RMSNorm of row (a, b) of a strided [A, B, N] view, optionally times silu(gate)."""
        r = tl.program_id(0)
        a = r // B
        b = r % B
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + a * s_xa + b * s_xb + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            z = tl.load(Gate + a * s_ga + b * s_gb + offs, mask=mask, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(Out + a * s_oa + b * s_ob + offs, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv4_kernel(X, s_x, W, S, Out, T, C, BLOCK_C: tl.constexpr):
        """Causal depthwise conv (kernel 4) over T new rows with a 3-row state, SiLU; updates the state."""
        offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = offs < C
        w0 = tl.load(W + offs * 4 + 0, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(W + offs * 4 + 1, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(W + offs * 4 + 2, mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(W + offs * 4 + 3, mask=mask, other=0.0).to(tl.float32)
        s0 = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(S + C + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(S + 2 * C + offs, mask=mask, other=0.0).to(tl.float32)
        for t in range(T):
            x = tl.load(X + t * s_x + offs, mask=mask, other=0.0).to(tl.float32)
            y = w0 * s0 + w1 * s1 + w2 * s2 + w3 * x
            y = y * tl.sigmoid(y)
            tl.store(Out + t * C + offs, y.to(Out.dtype.element_ty), mask=mask)
            s0 = s1
            s1 = s2
            s2 = x
        tl.store(S + offs, s0.to(S.dtype.element_ty), mask=mask)
        tl.store(S + C + offs, s1.to(S.dtype.element_ty), mask=mask)
        tl.store(S + 2 * C + offs, s2.to(S.dtype.element_ty), mask=mask)

    @triton.jit
    def _fused_recurrence_kernel(
        Q,
        K,
        V,
        BRAW,
        GRAW,
        ALOG,
        DTB,
        DSKIP,
        S0,
        SOUT,
        Out,
        s_q,
        s_k,
        s_v,
        s_b,
        s_g,
        T,
        HV,
        RATIO,
        scale,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BV: tl.constexpr,
        MAMBA: tl.constexpr,
    ):
        """Gated DeltaNet (MAMBA=False) or Mamba2 (MAMBA=True) decode over T tokens, gating fused in.

        Reads the state once and writes the state after every token (speculative rollback slots).
        """
        i_v = tl.program_id(0)
        i_h = tl.program_id(1)
        i_hk = i_h // RATIO
        offs_k = tl.arange(0, DK)
        offs_v = i_v * BV + tl.arange(0, BV)
        h = tl.load(S0 + i_h * DK * DV + offs_k[:, None] * DV + offs_v[None, :])
        a = -tl.exp(tl.load(ALOG + i_h).to(tl.float32))
        dtb = tl.load(DTB + i_h).to(tl.float32)
        for t in range(T):
            q = tl.load(Q + t * s_q + i_hk * DK + offs_k).to(tl.float32)
            k = tl.load(K + t * s_k + i_hk * DK + offs_k).to(tl.float32)
            v = tl.load(V + t * s_v + i_h * DV + offs_v).to(tl.float32)
            x = tl.load(GRAW + t * s_g + i_h).to(tl.float32) + dtb
            dt = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            if MAMBA:
                h = h * tl.exp(a * dt) + k[:, None] * (v * dt)[None, :]
                o = tl.sum(h * q[:, None], 0) + tl.load(DSKIP + i_h).to(tl.float32) * v
            else:
                q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
                k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
                beta = tl.sigmoid(tl.load(BRAW + t * s_b + i_h).to(tl.float32))
                h = h * tl.exp(a * dt)
                u = (v - tl.sum(h * k[:, None], 0)) * beta
                h = h + k[:, None] * u[None, :]
                o = tl.sum(h * q[:, None], 0)
            tl.store(Out + (t * HV + i_h) * DV + offs_v, o.to(Out.dtype.element_ty))
            tl.store(SOUT + ((t * HV + i_h) * DK + offs_k[:, None]) * DV + offs_v[None, :], h)

    @triton.jit
    def _act_kernel(
        U, Cw, Out, NE, INTER, s_u, s_c, BLOCK: tl.constexpr, SWIGLU: tl.constexpr, HAS_SCALE: tl.constexpr
    ):
        """Expert activation of token t, expert e: silu(gate) * up (or relu^2), times its routing weight."""
        pid = tl.program_id(0)
        t = pid // NE
        e = pid % NE
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < INTER
        if SWIGLU:
            base = U + t * s_u + e * 2 * INTER
            g = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(base + INTER + offs, mask=mask, other=0.0).to(tl.float32)
            y = g * tl.sigmoid(g) * u
        else:
            g = tl.load(U + t * s_u + e * INTER + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.maximum(g, 0.0)
            y = y * y
        if HAS_SCALE:
            y = y * tl.load(Cw + e * s_c + t).to(tl.float32)
        tl.store(Out + (t * NE + e) * INTER + offs, y.to(Out.dtype.element_ty), mask=mask)


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


#: Split-KV launch knobs: a global override (CLI) and per-(head_dim, BLOCK_M) tuned choices.
TRITON_ATTN_KNOBS: dict[str, int | None] = {"block_n": None, "num_warps": None, "num_stages": None}
#: Probe on an H200 (measurements/h200/replica_attention_bench.csv): d = 256, up to 64 rows.
ATTN_TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (256, 16): (64, 4, 3),
    (256, 32): (64, 4, 3),
    (256, 64): (64, 4, 3),
}
LOG2E = 1.4426950408889634


def attn_smem_bytes(block_m: int, block_n: int, stages: int, d: int) -> int:
    """Shared memory the split-KV kernel needs, roughly: the q tile plus K and V tiles per stage."""
    return 2 * block_m * d + stages * 2 * block_n * d * 2


SMEM_LIMIT = 232448 - 1024  # the H200 allows 227 KiB per block; the estimate matched Triton exactly


def _fit_smem(block_m: int, d: int, v: tuple[int, int, int]) -> tuple[int, int, int]:
    bn, w, st = v
    while attn_smem_bytes(block_m, bn, st, d) > SMEM_LIMIT and st > 2:
        st -= 1
    while attn_smem_bytes(block_m, bn, st, d) > SMEM_LIMIT and bn > 16:
        bn //= 2
    return bn, (8 if block_m * d >= 128 * 256 else w), st


def _attn_launch(d: int, block_m: int) -> tuple[int, int, int]:
    if (d, block_m) in ATTN_TUNED:
        default = ATTN_TUNED[(d, block_m)]
    else:
        tuned = [bm for (dd, bm) in ATTN_TUNED if dd == d]
        # the tuned class nearest in rows, else the probe's best for d = 256 (84-86 % of copy at 1M)
        nearest = min(tuned, key=lambda bm: abs(math.log2(bm / block_m))) if tuned else None
        default = ATTN_TUNED[(d, nearest)] if nearest is not None else (64, 4, 3)
    k = TRITON_ATTN_KNOBS
    v = (k["block_n"] or default[0], k["num_warps"] or default[1], k["num_stages"] or default[2])
    return _fit_smem(block_m, d, v)


def _triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ranges: Sequence[KeyRange],
    splits: int | None,
    sms: int,
    scale: float,
    gate: torch.Tensor | None,
) -> torch.Tensor:
    """Split-KV attention (causal tail masked in-kernel) + one merge kernel -> out [T, Hq, D]."""
    hq, t, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    r = g * t
    qf = q.reshape(hkv, r, d)
    if not qf.is_contiguous():
        qf = qf.contiguous()
    plan = []
    for rng in ranges:
        length = rng.end - rng.start
        if length <= 0:
            continue
        n = splits or auto_splits(length, hkv, sms)
        chunk = -(-length // n)
        plan.append((rng.start, rng.end, rng.end - rng.causal_tail, chunk, -(-length // chunk)))
    p_total = sum(p[-1] for p in plan)
    part = torch.empty((p_total, hkv, r, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((p_total, hkv, r), device=q.device, dtype=torch.float32)
    block_m = max(16, triton.next_power_of_2(r))
    block_n, warps, stages = _attn_launch(d, block_m)
    off = 0
    for start, end, cstart, chunk, n in plan:
        _split_kv_partial_kernel[(n, hkv)](
            qf, k_cache, v_cache, part, lse, start, end, cstart, chunk, off, r, t,
            k_cache.stride(0), k_cache.stride(1), scale * LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, D=d, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        off += n
    out = torch.empty((t, hq, d), device=q.device, dtype=q.dtype)
    gt = gate if gate is not None else out
    _merge_kernel[(hkv * r,)](
        part, lse, out, gt, p_total, r, t, g, hkv, out.stride(0), out.stride(1), gt.stride(0), gt.stride(1),
        D=d, BLOCK_P=32, HAS_GATE=gate is not None, num_warps=4,
    )  # fmt: skip
    return out


# ============================================================================================
# Fused small ops (Triton on CUDA, the same math in torch elsewhere)
# ============================================================================================


def rms_norm_into(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    gate: torch.Tensor | None = None,
    impl: str = "torch",
    eps: float = 1e-6,
) -> torch.Tensor:
    """out = rmsnorm(x) * w (* silu(gate)); x, out, gate: [A, N] or [A, B, N] views with unit last stride."""
    result = out
    if x.dim() == 2:
        x, out = x.unsqueeze(1), out.unsqueeze(1)
        gate = gate.unsqueeze(1) if gate is not None else None
    n = x.shape[-1]
    if impl == "triton":
        gt = gate if gate is not None else x
        _rmsnorm_kernel[(x.shape[0] * x.shape[1],)](
            x, w, out, gt, x.shape[1], x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            gt.stride(0), gt.stride(1), n, eps, BLOCK=triton.next_power_of_2(n), HAS_GATE=gate is not None,
            num_warps=4 if n <= 1024 else 8,
        )  # fmt: skip
        return result
    y = F.rms_norm(x.float(), (n,), w.float(), eps)
    if gate is not None:
        y = y * F.silu(gate.float())
    out.copy_(y)
    return result


def rms(x: torch.Tensor, w: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    return rms_norm_into(x, w, torch.empty_like(x), impl=impl)


def conv4_update(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, out: torch.Tensor, impl: str = "torch") -> None:
    """Causal depthwise conv of width 4 with SiLU over x [T, C] (rows strided), state [3, C] updated."""
    t, c = x.shape
    if w.shape[1] != 4:
        raise ValueError(f"conv kernel width must be 4 (got {w.shape[1]})")
    if impl == "triton":
        _conv4_kernel[(triton.cdiv(c, 512),)](x, x.stride(0), w, state, out, t, c, BLOCK_C=512, num_warps=4)
        return
    buf = torch.cat([state, x], 0)
    win = buf.unfold(0, 4, 1)  # [T, C, 4]
    out.copy_(F.silu((win.float() * w.float()).sum(-1)))
    state.copy_(buf[t:])


def fused_recurrence(
    mamba: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    braw: torch.Tensor | None,
    graw: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    d_skip: torch.Tensor | None,
    state: torch.Tensor,
    states_out: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    impl: str = "torch",
) -> torch.Tensor:
    """Decode step of Gated DeltaNet (delta rule, l2-normed q/k, beta = sigmoid(b)) or Mamba2.

    q, k: [T, HK, DK]; v: [T, HV, DV] (row-strided views, heads packed); braw, graw: [T, HV];
    dt = softplus(graw + dt_bias), decay = exp(-exp(a_log) * dt); state [HV, DK, DV] float32 is
    read, states_out[t] receives the state after token t; out: [T, HV, DV].
    """
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    for name, ten, dim in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
        if ten.stride(2) != 1 or ten.stride(1) != dim:
            raise ValueError(f"fused_recurrence: {name} must be a [T, H, {dim}] view with packed heads")
    if impl == "triton":
        bv = min(32, dv)
        b = braw if braw is not None else graw
        _fused_recurrence_kernel[(dv // bv, hv)](
            q, k, v, b, graw, a_log, dt_bias, d_skip if d_skip is not None else dt_bias, state, states_out, out,
            q.stride(0), k.stride(0), v.stride(0), b.stride(0), graw.stride(0), t, hv, hv // hk, scale,
            DK=dk, DV=dv, BV=bv, MAMBA=mamba, num_warps=4,
        )  # fmt: skip
        return out
    ratio = hv // hk
    h = state.clone()
    a = -torch.exp(a_log.float())
    for i in range(t):
        qi = q[i].float().repeat_interleave(ratio, 0)
        ki = k[i].float().repeat_interleave(ratio, 0)
        vi = v[i].float()
        dt = F.softplus(graw[i].float() + dt_bias.float())
        if mamba:
            assert d_skip is not None
            h = h * torch.exp(a * dt)[:, None, None] + ki[:, :, None] * (vi * dt[:, None])[:, None, :]
            o = torch.einsum("hkv,hk->hv", h, qi) + d_skip.float()[:, None] * vi
        else:
            assert braw is not None
            qi = qi * torch.rsqrt((qi * qi).sum(-1, keepdim=True) + 1e-6) * scale
            ki = ki * torch.rsqrt((ki * ki).sum(-1, keepdim=True) + 1e-6)
            beta = torch.sigmoid(braw[i].float())
            h = h * torch.exp(a * dt)[:, None, None]
            u = (vi - torch.einsum("hkv,hk->hv", h, ki)) * beta[:, None]
            h = h + ki[:, :, None] * u[:, None, :]
            o = torch.einsum("hkv,hk->hv", h, qi)
        out[i] = o.to(out.dtype)
        states_out[i] = h
    return out


def expert_act(
    u: torch.Tensor,
    n_experts: int,
    inter: int,
    swiglu: bool,
    combine: torch.Tensor | None,
    out: torch.Tensor,
    impl: str = "torch",
) -> torch.Tensor:
    """u [T, E*(2I|I)] -> out [T, E*I]: silu(gate)*up or relu^2, times combine[e, t] (routing weight)."""
    t = u.shape[0]
    if impl == "triton":
        block = min(1024, triton.next_power_of_2(inter))
        cw = combine if combine is not None else u
        _act_kernel[(t * n_experts, triton.cdiv(inter, block))](
            u, cw, out, n_experts, inter, u.stride(0), cw.stride(0),
            BLOCK=block, SWIGLU=swiglu, HAS_SCALE=combine is not None, num_warps=4,
        )  # fmt: skip
        return out
    uu = u.reshape(t, n_experts, -1).float()
    y = F.silu(uu[..., :inter]) * uu[..., inter:] if swiglu else torch.square(F.relu(uu))
    if combine is not None:
        y = y * combine[:n_experts, :t].float().transpose(0, 1)[..., None]
    out.copy_(y.reshape(t, n_experts * inter))
    return out


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
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [Hq, T, D] over the union of key ranges of a [Ncap, Hkv, D] cache -> [Hq, T, D].

    A range with ``causal_tail = T`` ends with the T query tokens themselves: query t sees the
    tail's first t + 1 keys.  Every other key is visible to every query.  ``gate`` ([T, Hq, D],
    any strides) multiplies the output by sigmoid(gate) (Qwen's gated attention).
    """
    hq, t, d = q.shape
    hkv = k_cache.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if backend == "triton":
        return _triton_attention(q, k_cache, v_cache, ranges, splits, sms, scale, gate).transpose(0, 1)
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
            if backend == "aten":
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
    o = unfold_output(out, hq, t)
    if gate is not None:
        o = o * torch.sigmoid(gate.float()).transpose(0, 1)
    return o.to(q.dtype)


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
# The replica model
# ============================================================================================


def _w(shape: Sequence[int], device: torch.device, dtype: torch.dtype, fan_in: int | None = None) -> torch.Tensor:
    fan = fan_in if fan_in is not None else shape[-2] if len(shape) >= 2 else shape[-1]
    return torch.empty(tuple(shape), device=device, dtype=dtype).normal_(0.0, 1.0 / math.sqrt(fan))


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
    """How an attention layer attends this forward: the backend and its split count."""

    backend: str
    splits: int | None = None
    sms: int = 132
    skip_core: bool = False  # "other" timing: everything but the attention kernel


class Attention:
    """Full attention (Qwen gated attention or plain GQA) with its own KV cache of ``capacity`` tokens."""

    def __init__(self, spec: cm.ModelSpec, capacity: int, device: torch.device, dtype: torch.dtype, impl: str):
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
        self.k_cache = torch.empty((capacity, a.num_kv_heads, a.head_dim), device=device, dtype=dtype).normal_()
        self.v_cache = torch.empty_like(self.k_cache).normal_()

    def forward(self, x: torch.Tensor, pos: int, ranges: Sequence[KeyRange], ctx: AttnCtx) -> torch.Tensor:
        a, t, d = self.a, x.shape[0], self.a.head_dim
        y = rms(x, self.norm, self.impl) @ self.w_qkv
        if a.output_gate:
            qg = y[:, : self.n_q].view(t, a.num_q_heads, 2 * d)
            q_src, gate = qg[..., :d], qg[..., d:]
        else:
            q_src, gate = y[:, : self.n_q].view(t, a.num_q_heads, d), None
        k_src = y[:, self.n_q : self.n_q + self.kv_out].view(t, a.num_kv_heads, d)
        v_src = y[:, self.n_q + self.kv_out :].view(t, a.num_kv_heads, d)
        qbuf = torch.empty((a.num_q_heads, t, d), device=x.device, dtype=x.dtype)  # [Hq, T, D]
        rms_norm_into(q_src, self.q_norm, qbuf.transpose(0, 1), impl=self.impl)
        rms_norm_into(k_src, self.k_norm, self.k_cache[pos : pos + t], impl=self.impl)
        self.v_cache[pos : pos + t].copy_(v_src)
        if ctx.skip_core:
            o = qbuf.transpose(0, 1)
            if gate is not None:
                o = o * torch.sigmoid(gate)
        else:
            o = self.core(qbuf, ranges, ctx, gate).transpose(0, 1)  # [T, Hq, D]
        return torch.addmm(x, o.reshape(t, self.q_out), self.w_o)

    def core(
        self, q: torch.Tensor, ranges: Sequence[KeyRange], ctx: AttnCtx, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        return decode_attention(
            q, self.k_cache, self.v_cache, ranges, backend=ctx.backend, splits=ctx.splits, sms=ctx.sms, gate=gate
        )


class Recurrent:
    """A Gated-DeltaNet or Mamba2 mixer: projections, short causal conv with state, the recurrence."""

    def __init__(
        self, spec: cm.ModelSpec, kind: str, max_tokens: int, device: torch.device, dtype: torch.dtype, impl: str
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
        self.conv_state = torch.empty((kernel - 1, self.conv_dim), device=device, dtype=dtype).normal_()
        self.a_log = torch.empty(self.hv, device=device, dtype=torch.float32).uniform_(0.0, 1.0)
        self.dt_bias = torch.zeros(self.hv, device=device, dtype=torch.float32)
        self.out_norm = torch.ones(self.dv, device=device, dtype=dtype)
        self.w_out = _w((self.inner, h), device, dtype)
        self.state = torch.empty((self.hv, self.dk, self.dv), device=device, dtype=torch.float32).normal_(0, 0.1)
        self.states_out = torch.empty((max_tokens, self.hv, self.dk, self.dv), device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, cd, inner, hv = x.shape[0], self.conv_dim, self.inner, self.hv
        y = rms(x, self.norm, self.impl) @ self.w_in
        xc = torch.empty((t, cd), device=x.device, dtype=x.dtype)
        o = torch.empty((t, hv, self.dv), device=x.device, dtype=x.dtype)
        if self.kind == "gdn":
            conv4_update(y[:, :cd], self.conv_w, self.conv_state, xc, self.impl)
            qk = self.hk * self.dk
            q = xc[:, :qk].view(t, self.hk, self.dk)
            k = xc[:, qk : 2 * qk].view(t, self.hk, self.dk)
            v = xc[:, 2 * qk :].view(t, hv, self.dv)
            z = y[:, cd : cd + inner].view(t, hv, self.dv)
            b, a = y[:, cd + inner : cd + inner + hv], y[:, cd + inner + hv :]
            fused_recurrence(
                False, q, k, v, b, a, self.a_log, self.dt_bias, None, self.state, self.states_out, o,
                self.scale, self.impl,
            )  # fmt: skip
        else:
            z = y[:, :inner].view(t, hv, self.dv)
            conv4_update(y[:, inner : inner + cd], self.conv_w, self.conv_state, xc, self.impl)
            gs = self.hk * self.dk
            xs = xc[:, :inner].view(t, hv, self.dv)
            bm = xc[:, inner : inner + gs].view(t, self.hk, self.dk)
            cmat = xc[:, inner + gs :].view(t, self.hk, self.dk)
            dt = y[:, inner + cd :]
            fused_recurrence(
                True, cmat, bm, xs, None, dt, self.a_log, self.dt_bias, self.d_skip, self.state, self.states_out, o,
                self.scale, self.impl,
            )  # fmt: skip
        on = rms_norm_into(o, self.out_norm, torch.empty_like(o), gate=z, impl=self.impl)
        return torch.addmm(x, on.view(t, inner), self.w_out)


class MoE:
    """Router + the touched routed experts (one GEMM each way) + latent projections + shared expert(s)."""

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
        self.router = _w((h, m.num_experts), device, dtype)
        self.n_alloc = n_experts
        # experts side by side: x @ w_up[:, :n*up] and hid @ w_down[:n*I] touch exactly n experts
        self.w_up = _w((self.width, n_experts * self.up), device, dtype)
        self.w_down = _w((n_experts * self.inter, self.width), device, dtype, fan_in=self.inter)
        self.combine = torch.softmax(torch.randn(n_experts, max_tokens, device=device), 0)
        if m.latent_size:
            self.lat_in = _w((h, m.latent_size), device, dtype)
            self.lat_out = _w((m.latent_size, h), device, dtype)
        self.s_inter = m.shared_intermediate_size * m.shared_experts
        self.s_up = _w((h, self.s_inter * (2 if self.swiglu else 1)), device, dtype)
        self.s_down = _w((self.s_inter, h), device, dtype)
        self.s_gate = _w((h, 1), device, dtype) if m.shared_expert_gate else None

    def forward(self, x: torch.Tensor, n_experts: int) -> torch.Tensor:
        t = x.shape[0]
        n = min(n_experts, self.n_alloc)
        xn = rms(x, self.norm, self.impl)
        _ = torch.topk(xn @ self.router, self.m.top_k, dim=-1)  # routing cost; dispatch is fixed here
        xin = xn @ self.lat_in if self.m.latent_size else xn
        u = xin @ self.w_up[:, : n * self.up]
        hid = torch.empty((t, n * self.inter), device=x.device, dtype=x.dtype)
        expert_act(u, n, self.inter, self.swiglu, self.combine, hid, self.impl)
        if self.m.latent_size:
            x = torch.addmm(x, hid @ self.w_down[: n * self.inter], self.lat_out)
        else:
            x = torch.addmm(x, hid, self.w_down[: n * self.inter])
        gw = torch.sigmoid(xn @ self.s_gate).view(1, t) if self.s_gate is not None else None
        sh = torch.empty((t, self.s_inter), device=x.device, dtype=x.dtype)
        expert_act(xn @ self.s_up, 1, self.s_inter, self.swiglu, gw, sh, self.impl)
        return torch.addmm(x, sh, self.s_down)


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


def default_impl(device: torch.device | str) -> str:
    """Fused Triton kernels on CUDA, plain torch elsewhere."""
    return "triton" if HAVE_TRITON and torch.device(device).type == "cuda" else "torch"


class Replica:
    """Target layers + MTP head of one model, dummy weights, synthetic KV up to ``capacity`` tokens."""

    def __init__(
        self,
        spec: cm.ModelSpec,
        capacity: int,
        max_k: int,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        impl: str | None = None,
    ):
        dev = torch.device(device)
        dt = dtype or torch.bfloat16
        self.spec, self.device, self.dtype = spec, dev, dt
        self.impl = impl or default_impl(dev)
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
                    blocks.append(Attention(spec, self.capacity, dev, dt, self.impl))
                elif p in ("gdn", "mamba2"):
                    blocks.append(Recurrent(spec, p, t_max, dev, dt, self.impl))
                elif p == "moe":
                    blocks.append(MoE(spec, n_alloc, t_max, dev, dt, self.impl))
            self.layers.append(blocks)
        self.mtp_fc = _w((2 * h, h), dev, dt)
        self.mtp_norm_e = torch.ones(h, device=dev, dtype=dt)
        self.mtp_norm_h = torch.ones(h, device=dev, dtype=dt)
        self.mtp_blocks: list[Any] = []
        for parts in spec.mtp_layers:
            for p in parts:
                if p == "attn":
                    self.mtp_blocks.append(Attention(spec, self.capacity, dev, dt, self.impl))
                elif p == "moe":
                    self.mtp_blocks.append(MoE(spec, m.top_k, 1, dev, dt, self.impl))
        self.mtp_final_norm = torch.ones(h, device=dev, dtype=dt)
        self.tokens = torch.randint(0, spec.vocab_size, (t_max,), device=dev)

    def set_impl(self, impl: str) -> None:
        """Switch every block between the fused Triton kernels and plain torch (for checks)."""
        self.impl = impl
        for b in [b for blocks in self.layers for b in blocks] + self.mtp_blocks:
            b.impl = impl

    def save_conv_states(self) -> list[torch.Tensor]:
        """Copies of the recurrent layers' conv states (the only state a forward mutates)."""
        return [b.conv_state.clone() for blocks in self.layers for b in blocks if isinstance(b, Recurrent)]

    def load_conv_states(self, saved: list[torch.Tensor]) -> None:
        recs = [b for blocks in self.layers for b in blocks if isinstance(b, Recurrent)]
        for b, st in zip(recs, saved, strict=True):
            b.conv_state.copy_(st)

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
        return torch.argmax(rms(x, norm, self.impl) @ self.lm_head, dim=-1)

    def target_attn_cores(self, plan: StepPlan, ctx: AttnCtx, q: torch.Tensor) -> list[torch.Tensor]:
        ranges = plan.verify_ranges()
        return [b.core(q, ranges, ctx) for blocks in self.layers for b in blocks if isinstance(b, Attention)]

    def draft_body(self, plan: StepPlan, j: int, token: torch.Tensor, hid: torch.Tensor, ctx: AttnCtx) -> torch.Tensor:
        """One draft forward up to (not including) the lm_head; token [1], hid [1, H]."""
        h = self.spec.hidden_size
        buf = torch.empty((1, 2 * h), device=hid.device, dtype=hid.dtype)
        rms_norm_into(self.embed[token], self.mtp_norm_e, buf[:, :h], impl=self.impl)
        rms_norm_into(hid, self.mtp_norm_h, buf[:, h:], impl=self.impl)
        x = buf @ self.mtp_fc
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
    sink: int = 64
    window: int = 4032
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


def check_attention(backend: str, sink: CsvSink, device: str = "cuda") -> bool:
    """Correctness of decode attention against float32 with an explicit mask, on fresh random inputs."""
    all_ok = True
    shapes = ((16, 2, 256, 70_000, 4), (32, 2, 256, 30_000, 6), (32, 2, 128, 50_000, 6), (16, 2, 256, 9_000, 1))
    for hq, hkv, d, n, t in shapes:
        n = n if _is_cuda(device) else n // 20
        kc = torch.randn(n + t, hkv, d, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(hq, t, d, device=device, dtype=torch.bfloat16)
        end = n + t
        vis = torch.arange(end, device=device)[None, :] <= (n + torch.arange(t, device=device))[:, None]
        ref = reference_attention(q, kc, vc, vis)
        got = decode_attention(q, kc, vc, [KeyRange(0, end, causal_tail=t)], backend=backend)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        all_ok &= err < 2e-2
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
            all_ok &= err < 2e-2
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
    return all_ok


def _small_spec(spec: cm.ModelSpec) -> cm.ModelSpec:
    """The same shapes with one layer of each kind (for a fused-vs-torch check)."""
    kinds = []
    for layer in spec.layers:
        if layer not in kinds:
            kinds.append(layer)
    return dataclasses.replace(spec, layers=tuple(kinds))


def check_fused(sink: CsvSink, spec: cm.ModelSpec, device: str = "cuda") -> bool:
    """Fused Triton kernels vs the same math in torch: a verify forward and a draft forward, bf16."""
    small = _small_spec(spec)
    rep = Replica(small, 5000, 5, device, impl="triton")
    ctx = AttnCtx("triton")
    plan = StepPlan(4000, 5, "wmtp", 4, 2048)
    outs = {}
    saved = rep.save_conv_states()
    for impl in ("triton", "torch"):
        rep.set_impl(impl)
        rep.load_conv_states(saved)
        x = rep.target_body(plan, ctx)
        d = rep.draft_body(plan, 1, rep.tokens[:1], x[-1:], ctx)
        outs[impl] = (x.float(), d.float())
    all_ok = True
    for i, what in enumerate(("verify", "draft")):
        a, b = outs["triton"][i], outs["torch"][i]
        err = ((a - b).norm() / b.norm()).item()
        all_ok &= err < 5e-2
        sink.write(
            "replica_checks",
            {"check": f"fused_{what}", "backend": "triton", "n": 4000, "t": 6 if what == "verify" else 1,
             "rel_err": err, "ok": err < 5e-2, "note": spec.name},
        )  # fmt: skip
    return all_ok


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


TUNE_VARIANTS: tuple[tuple[int, int, int], ...] = ((64, 4, 3), (128, 4, 3), (32, 8, 3), (64, 8, 2))


def tune_attention(
    rep: Replica, n: int, ts: Sequence[int], timer: GraphTimer, sink: CsvSink, copy_bw: float, reps: int
) -> None:
    """Pick the split-KV launch variant per row block on this model's first KV cache at n tokens."""
    layer = next(b for blocks in rep.layers for b in blocks if isinstance(b, Attention))
    a = rep.spec.attention
    sms = _sms(str(rep.device))
    base = statistics.median(timer.time(_noop, reps, scrub=True))
    for t in ts:
        r = (a.num_q_heads // a.num_kv_heads) * t
        block_m = max(16, triton.next_power_of_2(r))
        if (a.head_dim, block_m) in ATTN_TUNED:
            continue
        q = torch.randn(a.num_q_heads, t, a.head_dim, device=rep.device, dtype=rep.dtype)
        rng = [KeyRange(0, n + t, causal_tail=t)]
        best: tuple[float, tuple[int, int, int]] | None = None
        for variant in sorted({_fit_smem(block_m, a.head_dim, v) for v in TUNE_VARIANTS}):
            ATTN_TUNED[(a.head_dim, block_m)] = variant
            try:
                ms = timer.time(partial(layer.core, q, rng, AttnCtx("triton", None, sms)), reps, scrub=True)
            except Exception as e:  # a variant that does not compile or fit is skipped
                log.warning("tune %s %s: %s", rep.spec.name, variant, e)
                continue
            net = max(1e-6, statistics.median(ms) - base)
            kv_bytes = 2 * (n + t) * a.num_kv_heads * a.head_dim * 2
            sink.write(
                "replica_attention",
                {"model": rep.spec.name, "backend": "triton-tune", "variant": "-".join(map(str, variant)),
                 "context": n, "t": t, "splits": auto_splits(n, a.num_kv_heads, sms), "kv_bytes": kv_bytes,
                 "median_ms": net, "scrub_ms": base, "bandwidth": kv_bytes / (net * 1e-3),
                 "copy_bandwidth": copy_bw, "fraction_of_copy": kv_bytes / (net * 1e-3) / copy_bw},
            )  # fmt: skip
            if best is None or net < best[0]:
                best = (net, variant)
        if best is None:
            ATTN_TUNED.pop((a.head_dim, block_m), None)
        else:
            ATTN_TUNED[(a.head_dim, block_m)] = best[1]
            log.info("tuned %s d=%d rows=%d: %s", rep.spec.name, a.head_dim, block_m, best[1])


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


def sweep_model(
    cfg: SweepConfig, path: Path, sink: CsvSink, copy_bw: float, backend: str, t0: float, impl: str | None = None
) -> None:
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
    rep = Replica(spec, max(contexts), max_k, dev, impl=impl)
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
    if backend == "triton" and _is_cuda(dev):  # classes the probe did not measure
        tune_attention(rep, max(contexts), sorted({1, max_k + 1}), timer, sink, copy_bw, cfg.reps)
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
                    "ratio": cost_side_ratio(step_ms["mtp"], step_ms["wmtp"]),
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
    impl = default_impl(dev)
    if cfg.checks:
        for b in [backend, "aten"] if backend == "triton" else [backend]:
            try:
                ok = check_attention(b, sink, dev)
            except Exception as e:  # a failing backend is data, not a crash
                log.exception("attention check failed for %s", b)
                sink.write("replica_checks", {"check": "attention", "backend": b, "ok": False, "note": str(e)[:200]})
                ok = False
            if not ok and b == backend == "triton":
                log.error("triton attention failed its check: the sweep uses aten")
                backend = "aten"
        if impl == "triton":
            try:
                ok = all(check_fused(sink, cm.load_model(path), dev) for path in cfg.models)
            except Exception as e:
                log.exception("fused-kernel check failed")
                sink.write("replica_checks", {"check": "fused", "backend": "triton", "ok": False, "note": str(e)[:200]})
                ok = False
            if not ok:
                log.error("fused kernels failed their check: the sweep uses plain torch ops and aten attention")
                impl, backend = "torch", "aten"
        _empty_cache(dev)
    manifest["backend"], manifest["impl"] = backend, impl
    (cfg.out / "replica_manifest.json").write_text(json.dumps(manifest, indent=2))
    for path in cfg.models:
        try:
            sweep_model(cfg, path, sink, copy_bw, backend, t0, impl)
        except Exception as e:  # one model's failure must not lose the others
            log.exception("%s failed", path)
            sink.write("replica_checks", {"check": "sweep_model", "ok": False, "note": f"{path.name}: {e}"[:200]})
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


def _cost_side_ratios(nat: pd.DataFrame, win: pd.DataFrame, column: str) -> pd.Series:
    """Native over windowed step time, row by row on the native rows' index."""
    import pandas as pd

    windowed = win[column].reindex(nat.index)
    return pd.Series([cost_side_ratio(n, w) for n, w in zip(nat[column], windowed, strict=True)], index=nat.index)


def tidy(raw: Path, models_dir: Path, out: Path, bandwidth: float | None = None) -> int:
    """Measured steps next to the cost model; one row per (model, context, k, arm).

    ``predicted_ms`` is the pure roofline (bytes / bandwidth).  ``anchored_ms`` adds to the step
    measured at the smallest context the model's *growth* in bytes from there: it tests the
    context-dependent part of the model without the replica's fixed kernel overheads.
    """
    import pandas as pd

    steps = pd.read_csv(raw / "replica_steps.csv")
    bw = bandwidth
    if bw is None:
        bw = float(pd.read_csv(raw / "replica_bandwidth.csv")["bandwidth"].iloc[-1])
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
    anchor = df.loc[df.groupby(["model", "k", "arm"])["context"].idxmin()].set_index(["model", "k", "arm"])
    key = pd.MultiIndex.from_frame(df[["model", "k", "arm"]])
    df["anchored_ms"] = (
        anchor["measured_ms"].reindex(key).to_numpy()
        + df["predicted_ms"].to_numpy()
        - anchor["predicted_ms"].reindex(key).to_numpy()
    )
    nat = df[df.arm == "mtp"].set_index(["model", "context", "k"])
    win = df[df.arm == "wmtp"].set_index(["model", "context", "k"])
    ratios = pd.concat(
        [
            _cost_side_ratios(nat, win, "measured_ms").rename("measured_ratio"),
            _cost_side_ratios(nat, win, "predicted_ms").rename("predicted_ratio"),
            _cost_side_ratios(nat, win, "anchored_ms").rename("anchored_ratio"),
        ],
        axis=1,
    )
    df = df.join(ratios, on=["model", "context", "k"])
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
    ap = argparse.ArgumentParser(prog="python -m wmtp.replica.replica", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="measure on a CUDA GPU; CSVs into --out")
    sw.add_argument("--models", nargs="+", type=Path, required=True, help="config/models/*.json files")
    # No defaults here: the study file's `replica:` (wmtp.config.ReplicaSettings) is the one place they live,
    # and a direct run names its design point in full.
    sw.add_argument("--contexts", type=_ints_or_none, required=True, help="e.g. 2k,32k,1m; none: no sweep points")
    sw.add_argument("--ks", type=_ints, required=True, help="draft depths, e.g. 1,3,5")
    sw.add_argument("--sink", type=int, required=True)
    sw.add_argument("--window", type=int, required=True)
    sw.add_argument("--reps", type=int, required=True, help="timed CUDA-graph replays per piece")
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
