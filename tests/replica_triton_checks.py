"""Every fused Triton kernel of the GPU replica against its torch twin, in Triton's interpreter on the CPU.

Run by tests/test_replica.py in the CPU engine's interpreter (it has Triton) with ``TRITON_INTERPRET=1``, which
must be set before Triton is imported. float32 throughout: the interpreter mishandles bf16. Exits 1 on the
first mismatch, with the failing check's traceback.
"""

from __future__ import annotations

import os

import torch
from replica_shapes import TINY_GDN, TINY_MAMBA, fresh, gdn_inputs, rel_err

from wmtp.analyze import costmodel as cm
from wmtp.replica import kernels as kn
from wmtp.replica import model as md
from wmtp.replica import sweep as sw


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" and kn.HAVE_TRITON, "needs Triton and TRITON_INTERPRET=1"
    f32 = torch.float32
    # attention with causal tail, a sink range and the output gate
    q, kc, vc = fresh(hq=8, hkv=2, d=32, n=300, t=4, dtype=f32)
    end = kc.shape[0]
    gate = torch.randn(4, 8, 32)
    for ranges in ([kn.KeyRange(0, end, causal_tail=4)], [kn.KeyRange(0, 4), kn.KeyRange(end - 64, end, 4)]):
        got = kn.decode_attention(q, kc, vc, ranges, backend="triton", splits=3, gate=gate)
        ref = kn.decode_attention(q, kc, vc, ranges, backend="math", splits=2, gate=gate)
        assert rel_err(got, ref) < 1e-4
    # rmsnorm on strided views, with a gate
    y = torch.randn(5, 3, 80)
    w = torch.rand(16)
    for gate in (None, y[..., 64:80]):
        a = kn.rms_norm_into(y[..., :16], w, torch.empty(5, 3, 16), gate=gate, impl="triton")
        b = kn.rms_norm_into(y[..., :16], w, torch.empty(5, 3, 16), gate=gate, impl="torch")
        assert rel_err(a, b) < 1e-5
    # conv with state
    x = torch.randn(4, 700)[:, :600]
    cw = torch.randn(600, 4)
    st1, st2 = torch.randn(3, 600), None
    st2 = st1.clone()
    o1, o2 = torch.empty(4, 600), torch.empty(4, 600)
    kn.conv4_update(x, cw, st1, o1, "triton")
    kn.conv4_update(x, cw, st2, o2, "torch")
    assert rel_err(o1, o2) < 1e-5 and rel_err(st1, st2) < 1e-6
    # recurrences
    for mamba in (False, True):
        t, hk, hv, dk, dv = 3, 2, 4, 16, 32
        qq, kk, vv, braw, graw, a_log, dt_bias = gdn_inputs(t, hk, hv, dk, dv)
        s0 = torch.randn(hv, dk, dv)
        outs = []
        for impl in ("triton", "torch"):
            so, o = torch.empty(t, hv, dk, dv), torch.empty(t, hv, dv)
            kn.fused_recurrence(mamba, qq, kk, vv, braw, graw, a_log, dt_bias, torch.rand(hv) * 0 + 1, s0, so, o,
                                0.3, impl)  # fmt: skip
            outs.append((o, so))
        assert rel_err(outs[0][0], outs[1][0]) < 1e-4 and rel_err(outs[0][1], outs[1][1]) < 1e-4
    # expert activation with routing weights
    for swiglu in (True, False):
        u = torch.randn(3, 5 * (2 if swiglu else 1) * 24)
        comb = torch.rand(7, 6)
        a = kn.expert_act(u, 5, 24, swiglu, comb, torch.empty(3, 5 * 24), "triton")
        b = kn.expert_act(u, 5, 24, swiglu, comb, torch.empty(3, 5 * 24), "torch")
        assert rel_err(a, b) < 1e-5
    # a whole tiny replica: fused vs torch
    # the skinny GEMM, split over K and not, on a strided column prefix, with a residual
    for m, k, n, g in ((3, 700, 90, kn.GemmLaunch(32, 64)), (20, 96, 40, kn.GemmLaunch(32, 32, waves=0))):
        xx, ww, res = torch.randn(m, k + 5)[:, :k], torch.randn(k, n + 7)[:, :n], torch.randn(m, n)
        assert rel_err(kn.linear(xx, ww, res, "triton", g, sms=4), res + xx @ ww) < 1e-5
        assert rel_err(kn.linear(xx, ww, None, "triton", g, sms=4), xx @ ww) < 1e-5
    logits = torch.randn(5, 40)[:, 3:36]
    idx, wt = kn.router_topk(logits, 4, "triton")
    ref_idx, ref_wt = kn.router_topk(logits, 4, "torch")
    assert torch.equal(idx, ref_idx) and rel_err(wt, ref_wt) < 1e-5
    # batched attention: each request over its own cache
    q2, k2, v2 = torch.randn(2, 8, 3, 32), torch.randn(2, 303, 2, 32), torch.randn(2, 303, 2, 32)
    rng = [kn.KeyRange(0, 303, causal_tail=3)]
    got = kn.decode_attention(q2, k2, v2, rng, backend="triton", splits=3, gate=torch.randn(2, 3, 8, 32))
    assert got.shape == (2, 8, 3, 32)
    for b in range(2):
        alone = kn.decode_attention(q2[b], k2[b], v2[b], rng, backend="math", splits=2)
        assert rel_err(kn.decode_attention(q2[b:b + 1], k2[b:b + 1], v2[b:b + 1], rng, backend="triton"),
                       alone[None]) < 1e-4  # fmt: skip
    # every block of a tiny replica over a batch of two, fused vs torch, on its delta
    for model in (TINY_GDN, TINY_MAMBA):
        rep = md.Replica(cm.model_from_dict(model), 600, 3, "cpu", dtype=f32, impl="triton", batch=2)
        plan = md.StepPlan(512, 3, "wmtp", 4, 64, batch=2)
        errs = sw.block_delta_errors(rep, plan, md.AttnCtx("triton", splits=3), md.AttnCtx("math", splits=2))
        assert len(errs) == len(rep.blocks()) and max(e for _, e in errs) < 1e-3, errs

    print("WMTP-TRITON-INTERPRETER ok")


if __name__ == "__main__":
    main()
