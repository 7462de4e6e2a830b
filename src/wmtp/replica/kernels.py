"""Kernels of the replica: split-KV decode attention and the fused small ops, Triton on CUDA, torch elsewhere.

Decode attention reads each KV byte once for any query length 1..k+1: the grouped query heads are
folded into rows (q: KV heads x G*T rows), the KV is split into chunks (flash-decoding), each chunk
is attended with a kernel that returns its log-sum-exp, and the chunks are merged with softmax
weights of their LSEs.  Chunk kernels: ``triton`` (our split-KV kernel, CUDA), ``aten``
(``torch.ops.aten._scaled_dot_product_flash_attention``, whose LSE output makes the merge
possible; the CPU variant on CPU), or ``math`` (float32 reference, CPU tests).

A batch of B requests at the same context: caches are ``[B, Ncap, Hkv, D]`` and queries
``[B, Hq, T, D]``; the Triton kernels run every (request, KV head) as one program column, so a
batch costs no extra launches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - the tidy step runs without torch
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

ATTN_BACKENDS = ("triton", "aten", "math")
LOG2E = 1.4426950408889634
SMEM_LIMIT = 232448 - 1024  # the H200 allows 227 KiB per block; the estimate matched Triton exactly

Launch = tuple[int, int, int]  # (block_n, num_warps, num_stages)

#: Probe on an H200 (measurements/h200/replica_attention_bench.csv): d = 256, up to 64 rows.
ATTN_TUNED_H200: Mapping[tuple[int, int], Launch] = MappingProxyType(
    {(256, 16): (64, 4, 3), (256, 32): (64, 4, 3), (256, 64): (64, 4, 3)}
)


@dataclass(frozen=True)
class AttnLaunch:
    """How the split-KV kernel is launched: tuned choices per (head_dim, BLOCK_M) and an optional override.

    Immutable: a tuner returns a new one (``with_tuned``), so two sweeps never see each other's choices.
    """

    tuned: Mapping[tuple[int, int], Launch] = field(default_factory=lambda: ATTN_TUNED_H200)
    override: tuple[int | None, int | None, int | None] = (None, None, None)

    def with_tuned(self, d: int, block_m: int, launch: Launch) -> AttnLaunch:
        return replace(self, tuned=MappingProxyType({**self.tuned, (d, block_m): launch}))

    def with_override(self, override: tuple[int | None, int | None, int | None]) -> AttnLaunch:
        return replace(self, override=override)

    def has(self, d: int, block_m: int) -> bool:
        return (d, block_m) in self.tuned

    def choose(self, d: int, block_m: int) -> Launch:
        if (d, block_m) in self.tuned:
            default = self.tuned[(d, block_m)]
        else:
            rows = [bm for (dd, bm) in self.tuned if dd == d]
            # the tuned class nearest in rows, else the probe's best for d = 256 (84-86 % of copy at 1M)
            nearest = min(rows, key=lambda bm: abs(math.log2(bm / block_m))) if rows else None
            default = self.tuned[(d, nearest)] if nearest is not None else (64, 4, 3)
        o = self.override
        return fit_smem(block_m, d, (o[0] or default[0], o[1] or default[1], o[2] or default[2]))


def attn_smem_bytes(block_m: int, block_n: int, stages: int, d: int) -> int:
    """Shared memory the split-KV kernel needs, roughly: the q tile plus K and V tiles per stage."""
    return 2 * block_m * d + stages * 2 * block_n * d * 2


def fit_smem(block_m: int, d: int, v: Launch) -> Launch:
    """Shrink stages, then keys per block, until the kernel fits in shared memory."""
    bn, w, st = v
    while attn_smem_bytes(block_m, bn, st, d) > SMEM_LIMIT and st > 2:
        st -= 1
    while attn_smem_bytes(block_m, bn, st, d) > SMEM_LIMIT and bn > 16:
        bn //= 2
    return bn, (8 if block_m * d >= 128 * 256 else w), st


@dataclass(frozen=True)
class GemmLaunch:
    """Tiles of the skinny GEMM (few rows, a weight read once): keys and columns per block, warps, stages."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    min_rows: int = 1  # outside [min_rows, max_rows] the library GEMM is used
    max_rows: int = 64
    waves: int = 4  # split K until about this many programs per SM

    def splits(self, n: int, k: int, sms: int) -> tuple[int, int]:
        """(split count, keys per split): enough programs to keep every SM streaming weights."""
        n_prog = cdiv(n, self.block_n)
        want = max(1, min(cdiv(self.waves * sms, n_prog), cdiv(k, 2 * self.block_k)))
        per = cdiv(cdiv(k, want), self.block_k) * self.block_k
        return cdiv(k, per), per


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive integers."""
    return -(-a // b)


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


@functools.cache
def _aten_takes_expanded_q(device: str) -> bool:
    """Whether the CUDA flash kernel accepts a stride-0 (expanded) query batch; asked once, eagerly."""
    q = torch.zeros(1, 2, 16, 64, device=device, dtype=torch.bfloat16).expand(2, 2, 16, 64)
    k = torch.zeros(2, 2, 16, 64, device=device, dtype=torch.bfloat16)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, False, False, scale=1.0)
    except RuntimeError:
        return False
    return True


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
        if not _aten_takes_expanded_q(str(qf.device)):
            qc = qc.contiguous()
        res = torch.ops.aten._scaled_dot_product_flash_attention(qc, kc, vc, 0.0, False, False, scale=scale)
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
        HKV,
        stride_kb,
        stride_kn,
        stride_kh,
        qk_scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D: tl.constexpr,
    ):
        """One (chunk, request x KV head): R folded query rows (row r is token r % T) over keys [n0, n1).

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
        kv_off = (pid_h // HKV) * stride_kb + (pid_h % HKV) * stride_kh
        k_base = K + kv_off
        v_base = V + kv_off
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
        HTOT,
        s_ob,
        s_ot,
        s_oh,
        s_gb,
        s_gt,
        s_gh,
        D: tl.constexpr,
        BLOCK_P: tl.constexpr,
        HAS_GATE: tl.constexpr,
    ):
        """Merge P partials of one (request x KV head, row) with softmax weights of their LSEs -> out[b, t, q head]."""
        pid = tl.program_id(0)
        h = pid // R
        r = pid % R
        offs_d = tl.arange(0, D)
        m = tl.zeros([], tl.float32) - 1.0e30
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            lse = tl.load(LSE + (offs_p * HTOT + h) * R + r, mask=offs_p < P, other=float("-inf"))
            m = tl.maximum(m, tl.max(lse, 0))
        acc = tl.zeros([D], tl.float32)
        den = tl.zeros([], tl.float32)
        for p0 in range(0, P, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            pm = offs_p < P
            lse = tl.load(LSE + (offs_p * HTOT + h) * R + r, mask=pm, other=float("-inf"))
            w = tl.exp(lse - m)
            o = tl.load(
                Part + ((offs_p * HTOT + h) * R + r)[:, None] * D + offs_d[None, :], mask=pm[:, None], other=0.0
            )
            acc += tl.sum(w[:, None] * o, 0)
            den += tl.sum(w, 0)
        out = acc / den
        b = h // HKV
        qh = (h % HKV) * G + r // T
        t = r % T
        if HAS_GATE:
            gate = tl.load(Gate + b * s_gb + t * s_gt + qh * s_gh + offs_d).to(tl.float32)
            out = out * tl.sigmoid(gate)
        tl.store(Out + b * s_ob + t * s_ot + qh * s_oh + offs_d, out.to(Out.dtype.element_ty))

    @triton.jit
    def _rmsnorm_kernel(
        X, W, Out, Gate, B, C, s_xa, s_xb, s_xc, s_oa, s_ob, s_oc, s_ga, s_gb, s_gc, N, eps,
        BLOCK: tl.constexpr, HAS_GATE: tl.constexpr,
    ):  # fmt: skip
        """RMSNorm of row (a, b, c) of a strided [A, B, C, N] view, optionally times silu(gate)."""
        r = tl.program_id(0)
        a = r // (B * C)
        b = (r // C) % B
        c = r % C
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + a * s_xa + b * s_xb + c * s_xc + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps) * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            z = tl.load(Gate + a * s_ga + b * s_gb + c * s_gc + offs, mask=mask, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(Out + a * s_oa + b * s_ob + c * s_oc + offs, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv4_kernel(X, s_x, W, S, Out, T, C, BLOCK_C: tl.constexpr):
        """Causal depthwise conv (kernel 4) over T new rows of request b with its 3-row state, SiLU."""
        offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        b = tl.program_id(1)
        X += b * T * s_x
        S += b * 3 * C
        Out += b * T * C
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
        i_b = tl.program_id(2)
        i_hk = i_h // RATIO
        Q += i_b * T * s_q
        K += i_b * T * s_k
        V += i_b * T * s_v
        BRAW += i_b * T * s_b
        GRAW += i_b * T * s_g
        S0 += i_b * HV * DK * DV
        SOUT += i_b * T * HV * DK * DV
        Out += i_b * T * HV * DV
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
        U, Cw, Out, NE, INTER, s_u, s_ce, s_ct, s_o, BLOCK: tl.constexpr, SWIGLU: tl.constexpr, SCALE: tl.constexpr
    ):
        """Expert activation of token t, expert e: silu(gate) * up (or relu^2), times its routing weight.

        SCALE: 0 none, 1 the weight Cw[e, t], 2 sigmoid(Cw[e, t]) (a shared expert's gate logit).
        """
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
        if SCALE == 1:
            y = y * tl.load(Cw + e * s_ce + t * s_ct).to(tl.float32)
        if SCALE == 2:
            y = y * tl.sigmoid(tl.load(Cw + e * s_ce + t * s_ct).to(tl.float32))
        tl.store(Out + t * s_o + e * INTER + offs, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _skinny_mm_kernel(
        X, W, Out, Res, Part, M, N, K, s_xm, s_wk, s_om, s_rm, k_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        HAS_RES: tl.constexpr,
    ):  # fmt: skip
        """Out[M, N] = X[M, K] @ W[K, N] (+ Res) for few rows: each program streams a K-slice of BLOCK_N
        weight columns once; with SPLIT > 1 it writes a float32 partial for the reduce kernel."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mm = offs_m < M
        nn = offs_n < N
        k0 = pid_k * k_per_split
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kk in range(0, k_per_split, BLOCK_K):
            offs_k = k0 + kk + tl.arange(0, BLOCK_K)
            km = offs_k < K
            x = tl.load(X + offs_m[:, None] * s_xm + offs_k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            w = tl.load(W + offs_k[:, None] * s_wk + offs_n[None, :], mask=km[:, None] & nn[None, :], other=0.0)
            acc += tl.dot(x, w)
        mask = mm[:, None] & nn[None, :]
        if SPLIT == 1:
            if HAS_RES:
                acc += tl.load(Res + offs_m[:, None] * s_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(Out + offs_m[:, None] * s_om + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=mask)
        else:
            tl.store(Part + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)

    @triton.jit
    def _split_reduce_kernel(
        Part, Out, Res, M, N, s_om, s_rm, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr
    ):
        """Out[m, :] = sum of the SPLIT float32 partials (+ Res[m, :])."""
        m = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLIT):
            acc += tl.load(Part + (s * M + m) * N + offs, mask=mask, other=0.0)
        if HAS_RES:
            acc += tl.load(Res + m * s_rm + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + m * s_om + offs, acc.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _moe_act_kernel(
        P, s_p, C_ROUTED, Cw, s_ce, s_ct, GATE_COL, Out, s_o, NE, INTER, S_INTER,
        BLOCK: tl.constexpr, SWIGLU: tl.constexpr, SHARED_GATE: tl.constexpr,
    ):  # fmt: skip
        """Shared expert (e = 0) and routed experts (e >= 1) of token t in one launch, from the MoE's first GEMM
        P (shared up | router | gate | routed up): activation times sigmoid(gate) or the routing weight."""
        pid = tl.program_id(0)
        t = pid // (NE + 1)
        e = pid % (NE + 1)
        shared = e == 0
        width = tl.where(shared, S_INTER, INTER)
        src = tl.where(shared, 0, C_ROUTED + (e - 1) * INTER * (2 if SWIGLU else 1))
        dst = tl.where(shared, 0, S_INTER + (e - 1) * INTER)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < width
        base = P + t * s_p + src
        if SWIGLU:
            g = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(base + width + offs, mask=mask, other=0.0).to(tl.float32)
            y = g * tl.sigmoid(g) * u
        else:
            g = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.maximum(g, 0.0)
            y = y * y
        if shared:
            if SHARED_GATE:
                y = y * tl.sigmoid(tl.load(P + t * s_p + GATE_COL).to(tl.float32))
        else:
            y = y * tl.load(Cw + (e - 1) * s_ce + t * s_ct).to(tl.float32)
        tl.store(Out + t * s_o + dst + offs, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _attn_prep_kernel(
        Y, s_y, QN, KN, Qo, Kc, Vc, T, HQ, HKV, pos, q_stride, k_off, v_off,
        s_qb, s_qh, s_qt, s_cb, s_cn, s_ch, eps, D: tl.constexpr,
    ):  # fmt: skip
        """Row (b, t) of the QKV projection, head j: q heads RMS-normed into Qo[b, j, t], K heads normed into
        the cache at pos + t, V heads copied there: three small ops in one launch."""
        row = tl.program_id(0)
        j = tl.program_id(1)
        b = row // T
        t = row % T
        offs = tl.arange(0, D)
        # each branch names its own values: the compiler wants one type per name across branches
        if j < HQ:
            xq = tl.load(Y + row * s_y + j * q_stride + offs).to(tl.float32)
            yq = xq * tl.rsqrt(tl.sum(xq * xq, 0) / D + eps) * tl.load(QN + offs).to(tl.float32)
            tl.store(Qo + b * s_qb + j * s_qh + t * s_qt + offs, yq.to(Qo.dtype.element_ty))
        elif j < HQ + HKV:
            hk = j - HQ
            xk = tl.load(Y + row * s_y + k_off + hk * D + offs).to(tl.float32)
            yk = xk * tl.rsqrt(tl.sum(xk * xk, 0) / D + eps) * tl.load(KN + offs).to(tl.float32)
            tl.store(Kc + b * s_cb + (pos + t) * s_cn + hk * s_ch + offs, yk.to(Kc.dtype.element_ty))
        else:
            hv = j - HQ - HKV
            xv = tl.load(Y + row * s_y + v_off + hv * D + offs)
            tl.store(Vc + b * s_cb + (pos + t) * s_cn + hv * s_ch + offs, xv)

    @triton.jit
    def _topk_kernel(L, s_l, Idx, Wt, E, K: tl.constexpr, BLOCK_E: tl.constexpr):
        """Router of one token: the top K of E logits by repeated max, softmax over the K chosen."""
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        x = tl.load(L + t * s_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
        m0 = tl.max(x, 0)
        den = tl.zeros([], tl.float32)
        for j in range(K):
            m = tl.max(x, 0)
            i = tl.min(tl.where(x == m, offs, BLOCK_E), 0)
            tl.store(Idx + t * K + j, i)
            tl.store(Wt + t * K + j, tl.exp(m - m0))
            den += tl.exp(m - m0)
            x = tl.where(offs == i, float("-inf"), x)
        for j in range(K):
            w = tl.load(Wt + t * K + j)
            tl.store(Wt + t * K + j, w / den)


def _triton_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ranges: Sequence[KeyRange],
    splits: int | None,
    sms: int,
    scale: float,
    gate: torch.Tensor | None,
    launch: AttnLaunch,
) -> torch.Tensor:
    """Split-KV attention (causal tail masked in-kernel) + one merge kernel.

    q [B, Hq, T, D], caches [B, Ncap, Hkv, D] (strided), gate [B, T, Hq, D] -> out [B, T, Hq, D].
    """
    nb, hq, t, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    r = g * t
    heads = nb * hkv  # one program column per (request, KV head)
    qf = q.reshape(heads, r, d)
    if not qf.is_contiguous():
        qf = qf.contiguous()
    plan = []
    for rng in ranges:
        length = rng.end - rng.start
        if length <= 0:
            continue
        n = splits or auto_splits(length, heads, sms)
        chunk = -(-length // n)
        plan.append((rng.start, rng.end, rng.end - rng.causal_tail, chunk, -(-length // chunk)))
    p_total = sum(p[-1] for p in plan)
    part = torch.empty((p_total, heads, r, d), device=q.device, dtype=torch.float32)
    lse = torch.empty((p_total, heads, r), device=q.device, dtype=torch.float32)
    block_m = max(16, triton.next_power_of_2(r))
    block_n, warps, stages = launch.choose(d, block_m)
    off = 0
    for start, end, cstart, chunk, n in plan:
        _split_kv_partial_kernel[(n, heads)](
            qf, k_cache, v_cache, part, lse, start, end, cstart, chunk, off, r, t, hkv,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * LOG2E,
            BLOCK_M=block_m, BLOCK_N=block_n, D=d, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        off += n
    out = torch.empty((nb, t, hq, d), device=q.device, dtype=q.dtype)
    gt = gate if gate is not None else out
    _merge_kernel[(heads * r,)](
        part, lse, out, gt, p_total, r, t, g, hkv, heads, out.stride(0), out.stride(1), out.stride(2),
        gt.stride(0), gt.stride(1), gt.stride(2), D=d, BLOCK_P=32, HAS_GATE=gate is not None, num_warps=4,
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
    """out = rmsnorm(x) * w (* silu(gate)); x, out, gate: [..., N] views of 2 to 4 dims, unit last stride."""
    result = out
    while x.dim() < 4:
        x, out = x.unsqueeze(0), out.unsqueeze(0)
        gate = gate.unsqueeze(0) if gate is not None else None
    n = x.shape[-1]
    if impl == "triton":
        gt = gate if gate is not None else x
        _rmsnorm_kernel[(x.shape[0] * x.shape[1] * x.shape[2],)](
            x, w, out, gt, x.shape[1], x.shape[2], x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out.stride(1), out.stride(2), gt.stride(0), gt.stride(1), gt.stride(2), n, eps,
            BLOCK=triton.next_power_of_2(n), HAS_GATE=gate is not None, num_warps=4 if n <= 1024 else 8,
        )  # fmt: skip
        return result
    y = F.rms_norm(x.float(), (n,), w.float(), eps)
    if gate is not None:
        y = y * F.silu(gate.float())
    out.copy_(y)
    return result


def rms(x: torch.Tensor, w: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """rmsnorm(x) * w into a new tensor."""
    return rms_norm_into(x, w, torch.empty_like(x), impl=impl)


def conv4_update(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor, out: torch.Tensor, impl: str = "torch") -> None:
    """Causal depthwise conv of width 4 with SiLU over x [B*T, C] (rows strided, request-major).

    state [3, C] (one request) or [B, 3, C] is updated; out [B*T, C] contiguous.
    """
    states = state if state.dim() == 3 else state[None]
    nb, c = states.shape[0], x.shape[1]
    t = x.shape[0] // nb
    if w.shape[1] != 4:
        raise ValueError(f"conv kernel width must be 4 (got {w.shape[1]})")
    if impl == "triton":
        grid = (triton.cdiv(c, 512), nb)
        _conv4_kernel[grid](x, x.stride(0), w, states, out, t, c, BLOCK_C=512, num_warps=4)
        return
    for b in range(nb):
        buf = torch.cat([states[b], x[b * t : (b + 1) * t]], 0)
        win = buf.unfold(0, 4, 1)  # [T, C, 4]
        out[b * t : (b + 1) * t].copy_(F.silu((win.float() * w.float()).sum(-1)))
        states[b].copy_(buf[t:])


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
    read, states_out[t] receives the state after token t; out: [T, HV, DV].  A batch: state
    [B, HV, DK, DV] and B*T rows everywhere else, request-major.
    """
    states = state if state.dim() == 4 else state[None]
    nb = states.shape[0]
    t, hk, dk = q.shape[0] // nb, q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    for name, ten, dim in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
        if ten.stride(2) != 1 or ten.stride(1) != dim:
            raise ValueError(f"fused_recurrence: {name} must be a [T, H, {dim}] view with packed heads")
    if impl == "triton":
        bv = min(32, dv)
        b = braw if braw is not None else graw
        _fused_recurrence_kernel[(dv // bv, hv, nb)](
            q, k, v, b, graw, a_log, dt_bias, d_skip if d_skip is not None else dt_bias, states, states_out, out,
            q.stride(0), k.stride(0), v.stride(0), b.stride(0), graw.stride(0), t, hv, hv // hk, scale,
            DK=dk, DV=dv, BV=bv, MAMBA=mamba, num_warps=4,
        )  # fmt: skip
        return out
    for r in range(nb):
        rows = slice(r * t, (r + 1) * t)
        _recurrence_torch(
            mamba, q[rows], k[rows], v[rows], None if braw is None else braw[rows], graw[rows], a_log, dt_bias,
            d_skip, states[r], states_out[rows], out[rows], scale,
        )  # fmt: skip
    return out


def _recurrence_torch(
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
) -> None:
    """One request's recurrence in float32 torch, token by token."""
    t, hk = q.shape[0], q.shape[1]
    ratio = v.shape[1] // hk
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


def expert_act(
    u: torch.Tensor,
    n_experts: int,
    inter: int,
    swiglu: bool,
    combine: torch.Tensor | None,
    out: torch.Tensor,
    impl: str = "torch",
    gate_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """u [T, E*(2I|I)] -> out [T, E*I] (rows may be strided): silu(gate)*up or relu^2, times
    combine[e, t] (routing weight) or sigmoid(gate_logit[t]) (a shared expert's gate)."""
    t = u.shape[0]
    if combine is not None and gate_logit is not None:
        raise ValueError("expert_act: a routing weight or a gate logit, not both")
    if impl == "triton":
        block = min(1024, triton.next_power_of_2(inter))
        if combine is not None:
            cw, s_ce, s_ct, mode = combine, combine.stride(0), combine.stride(1), 1
        elif gate_logit is not None:
            cw, s_ce, s_ct, mode = gate_logit, 0, gate_logit.stride(0), 2
        else:
            cw, s_ce, s_ct, mode = u, 0, 0, 0
        _act_kernel[(t * n_experts, triton.cdiv(inter, block))](
            u, cw, out, n_experts, inter, u.stride(0), s_ce, s_ct, out.stride(0),
            BLOCK=block, SWIGLU=swiglu, SCALE=mode, num_warps=4,
        )  # fmt: skip
        return out
    uu = u.reshape(t, n_experts, -1).float()
    y = F.silu(uu[..., :inter]) * uu[..., inter:] if swiglu else torch.square(F.relu(uu))
    if combine is not None:
        y = y * combine[:n_experts, :t].float().transpose(0, 1)[..., None]
    if gate_logit is not None:
        y = y * torch.sigmoid(gate_logit.float())[:, None, None]
    out.copy_(y.reshape(t, n_experts * inter))
    return out


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor | None = None,
    impl: str = "torch",
    gemm: GemmLaunch | None = None,
    sms: int = 132,
) -> torch.Tensor:
    """x [M, K] @ w [K, N] (+ residual [M, N]); rows of x and w may be strided, the last dims unit-stride.

    Decode GEMMs have a handful of rows and read each weight once: on CUDA a split-K kernel of ours
    streams the weights across every SM; the library GEMM is used for many rows and elsewhere.
    """
    g = gemm or GemmLaunch()
    m, k = x.shape
    n = w.shape[1]
    if impl != "triton" or not g.min_rows <= m <= g.max_rows or x.stride(1) != 1 or w.stride(1) != 1:
        return torch.addmm(residual, x, w) if residual is not None else x @ w
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    split, per = g.splits(n, k, sms)
    block_m = max(16, triton.next_power_of_2(m))
    res = residual if residual is not None else out
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    _skinny_mm_kernel[(triton.cdiv(n, g.block_n), split)](
        x, w, out, res, part, m, n, k, x.stride(0), w.stride(0), out.stride(0), res.stride(0), per,
        BLOCK_M=block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, SPLIT=split, HAS_RES=residual is not None,
        num_warps=g.num_warps, num_stages=g.num_stages,
    )  # fmt: skip
    if split > 1:
        _split_reduce_kernel[(m, triton.cdiv(n, 1024))](
            part, out, res, m, n, out.stride(0), res.stride(0), SPLIT=split, BLOCK=1024,
            HAS_RES=residual is not None, num_warps=4,
        )  # fmt: skip
    return out


def moe_act(
    pre: torch.Tensor,
    c_routed: int,
    n_experts: int,
    inter: int,
    s_inter: int,
    swiglu: bool,
    combine: torch.Tensor,
    gate_col: int | None,
    out: torch.Tensor,
    impl: str = "torch",
) -> torch.Tensor:
    """Both expert activations of a MoE from its first GEMM's output ``pre`` (shared up in the first
    columns, the gate logit at ``gate_col``, routed up from ``c_routed``) -> out [T, s_inter + n*inter]."""
    t = pre.shape[0]
    if impl == "triton":
        block = min(1024, triton.next_power_of_2(max(inter, s_inter)))
        _moe_act_kernel[(t * (n_experts + 1), triton.cdiv(max(inter, s_inter), block))](
            pre, pre.stride(0), c_routed, combine, combine.stride(0), combine.stride(1),
            gate_col if gate_col is not None else 0, out, out.stride(0), n_experts, inter, s_inter,
            BLOCK=block, SWIGLU=swiglu, SHARED_GATE=gate_col is not None, num_warps=4,
        )  # fmt: skip
        return out
    s_up = s_inter * (2 if swiglu else 1)
    gate = pre[:, gate_col] if gate_col is not None else None
    expert_act(pre[:, :s_up], 1, s_inter, swiglu, None, out[:, :s_inter], impl, gate_logit=gate)
    expert_act(pre[:, c_routed:], n_experts, inter, swiglu, combine, out[:, s_inter:], impl)
    return out


def attn_prep(
    y: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    heads: tuple[int, int, int],
    gated: bool,
    eps: float = 1e-6,
) -> None:
    """One launch: q heads of the QKV projection y [B*T, cols] normed into q_out [B, Hq, T, D], K normed and V
    copied into the caches [B, N, Hkv, D] at pos..pos+T (columns: q (with gate) | k | v)."""
    hq, hkv, d = heads
    nb, t = q_out.shape[0], q_out.shape[2]
    n_q = hq * d * (2 if gated else 1)
    _attn_prep_kernel[(nb * t, hq + 2 * hkv)](
        y, y.stride(0), q_norm, k_norm, q_out, k_cache, v_cache, t, hq, hkv, pos, d * (2 if gated else 1),
        n_q, n_q + hkv * d, q_out.stride(0), q_out.stride(1), q_out.stride(2), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps, D=d, num_warps=2 if d <= 256 else 4,
    )  # fmt: skip


def router_topk(logits: torch.Tensor, k: int, impl: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """The top k experts of each token's router logits [T, E] (rows may be strided) and their softmax weights.

    One kernel on CUDA: a library top-k launches several per call, and the router runs once per MoE layer.
    """
    t, e = logits.shape
    if impl == "triton":
        idx = torch.empty((t, k), device=logits.device, dtype=torch.int32)
        wt = torch.empty((t, k), device=logits.device, dtype=torch.float32)
        _topk_kernel[(t,)](logits, logits.stride(0), idx, wt, e, K=k, BLOCK_E=triton.next_power_of_2(e), num_warps=4)
        return idx, wt
    vals, idx = torch.topk(logits.float(), k, dim=-1)
    return idx.to(torch.int32), torch.softmax(vals, dim=-1)


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
    launch: AttnLaunch | None = None,
) -> torch.Tensor:
    """Attention of q [Hq, T, D] over the union of key ranges of a [Ncap, Hkv, D] cache -> [Hq, T, D].

    A range with ``causal_tail = T`` ends with the T query tokens themselves: query t sees the
    tail's first t + 1 keys.  Every other key is visible to every query.  ``gate`` ([T, Hq, D],
    any strides) multiplies the output by sigmoid(gate) (Qwen's gated attention).

    Batched: q [B, Hq, T, D], caches [B, Ncap, Hkv, D], gate [B, T, Hq, D] -> [B, Hq, T, D]; every
    request attends over the same ranges of its own cache.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    batched = q.dim() == 4
    if backend == "triton":
        qb, kb, vb = (q, k_cache, v_cache) if batched else (q[None], k_cache[None], v_cache[None])
        gb = gate if batched or gate is None else gate[None]
        out = _triton_attention(qb, kb, vb, ranges, splits, sms, scale, gb, launch or AttnLaunch())
        return out.transpose(1, 2) if batched else out[0].transpose(0, 1)
    if batched:
        kw = {"scale": scale, "backend": backend, "splits": splits, "sms": sms}
        return torch.stack(
            [
                decode_attention(q[b], k_cache[b], v_cache[b], ranges, gate=None if gate is None else gate[b], **kw)
                for b in range(q.shape[0])
            ]
        )
    hq, t, d = q.shape
    hkv = k_cache.shape[1]
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
