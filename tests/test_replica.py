"""The replica at tiny shapes on CPU: decode attention (full, windowed, split-KV merge), a whole step."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from wmtp.analyze import costmodel as cm  # noqa: E402
from wmtp.replica import replica as rp  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"
BF16_TOL = 2e-2  # relative error of bf16 operands


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def fresh(hq=8, hkv=2, d=32, n=300, t=3, dtype=torch.bfloat16):
    """Fresh random inputs every call (no fixed seed): the kernel must be right on any input."""
    kc = torch.randn(n + t, hkv, d, dtype=dtype)
    vc = torch.randn(n + t, hkv, d, dtype=dtype)
    q = torch.randn(hq, t, d, dtype=dtype)
    return q, kc, vc


def sdpa_plain(q, kc, vc, end):
    """Plain attention: SDPA over keys [0, end), causal aligned to the end (bottom-right)."""
    hq, t, _ = q.shape
    g = hq // kc.shape[1]
    k = kc[:end].transpose(0, 1).repeat_interleave(g, 0).float()
    v = vc[:end].transpose(0, 1).repeat_interleave(g, 0).float()
    mask = torch.arange(end)[None, :] <= (end - t + torch.arange(t))[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


@pytest.mark.parametrize("backend", ["math", "aten"])
@pytest.mark.parametrize("t", [1, 2, 4, 6])
def test_full_equals_plain_attention(backend, t):
    q, kc, vc = fresh(t=t, n=257)
    end = kc.shape[0]
    got = rp.decode_attention(q, kc, vc, [rp.KeyRange(0, end, causal_tail=t)], backend=backend, splits=5)
    assert rel_err(got, sdpa_plain(q, kc, vc, end)) < BF16_TOL


@pytest.mark.parametrize("backend", ["math", "aten"])
def test_windowed_equals_masked_sink_and_window(backend):
    q, kc, vc = fresh(t=1, n=999)
    end, sink, window = kc.shape[0], 4, 128
    plan = rp.StepPlan(context=end - 1, k=3, arm="wmtp", sink=sink, window=window)
    ranges = plan.draft_ranges(0)
    assert ranges[0] == rp.KeyRange(0, sink)
    assert ranges[1].end == end and ranges[1].end - ranges[1].start == window
    visible = torch.zeros(1, end, dtype=torch.bool)
    visible[:, :sink] = True
    visible[:, end - window :] = True
    ref = rp.reference_attention(q, kc, vc, visible)
    got = rp.decode_attention(q, kc, vc, ranges, backend=backend, splits=3)
    assert rel_err(got, ref) < BF16_TOL
    # and it differs from full attention (the window is really applied)
    full = rp.decode_attention(q, kc, vc, [rp.KeyRange(0, end, causal_tail=1)], backend=backend)
    assert rel_err(got, full) > 0.05


def test_native_draft_ranges_cover_everything():
    plan = rp.StepPlan(context=1000, k=3, arm="mtp", sink=4, window=128)
    assert plan.draft_ranges(2) == [rp.KeyRange(0, 1003, causal_tail=1)]
    short = rp.StepPlan(context=100, k=3, arm="wmtp", sink=4, window=128)
    assert short.draft_ranges(0) == [rp.KeyRange(0, 101, causal_tail=1)]


def test_split_kv_merge_equals_unsplit():
    q, kc, vc = fresh(hq=4, hkv=1, d=16, n=1000, t=4, dtype=torch.float32)
    qf = rp.fold_queries(q, 1)
    one_o, one_lse = rp._math_partial(qf, kc, vc, 0.25)
    parts = [rp._math_partial(qf, kc[s : s + 97], vc[s : s + 97], 0.25) for s in range(0, kc.shape[0], 97)]
    outs = torch.stack([torch.nn.functional.pad(o, (0, 0)) for o, _ in parts])
    lses = torch.stack([lse for _, lse in parts])
    merged, lse = rp.merge_partials(outs, lses)
    assert rel_err(merged, one_o) < 1e-5
    assert torch.allclose(lse, one_lse, atol=1e-4)


def test_split_counts_do_not_change_the_result():
    q, kc, vc = fresh(t=3, n=2000)
    end = kc.shape[0]
    rng = [rp.KeyRange(0, end, causal_tail=3)]
    a = rp.decode_attention(q, kc, vc, rng, backend="aten", splits=1)
    b = rp.decode_attention(q, kc, vc, rng, backend="aten", splits=13)
    c = rp.decode_attention(q, kc, vc, rng, backend="math", splits=7)
    assert rel_err(a, b) < BF16_TOL and rel_err(a, c) < BF16_TOL


def _gdn_inputs(t=3, hk=2, hv=4, dk=8, dv=4):
    return (
        torch.randn(t, hk, dk),
        torch.randn(t, hk, dk),
        torch.randn(t, hv, dv),
        torch.randn(t, hv),
        torch.randn(t, hv),
        torch.rand(hv),
        torch.rand(hv),
    )


def test_mamba2_first_token_is_outer_product():
    hk, hv, dk, dv = 2, 4, 8, 4
    c, b, x, _, dtraw, a_log, dt_bias = _gdn_inputs(1, hk, hv, dk, dv)
    s0 = torch.zeros(hv, dk, dv)
    so = torch.empty(1, hv, dk, dv)
    out = torch.empty(1, hv, dv)
    d_skip = torch.rand(hv)
    rp.fused_recurrence(True, c, b, x, None, dtraw, a_log, dt_bias, d_skip, s0, so, out, 1.0)
    dt = torch.nn.functional.softplus(dtraw[0] + dt_bias)
    bb, cc = b[0].repeat_interleave(2, 0), c[0].repeat_interleave(2, 0)
    expect_h = bb[:, :, None] * (x[0] * dt[:, None])[:, None, :]
    assert torch.allclose(so[0], expect_h, atol=1e-5)
    expect_o = torch.einsum("hkv,hk->hv", expect_h, cc) + d_skip[:, None] * x[0]
    assert torch.allclose(out[0], expect_o, atol=1e-5)


def test_gdn_delta_rule_on_zero_state():
    """From a zero state the delta rule writes beta * v along the normalised key."""
    hk, hv, dk, dv = 2, 4, 8, 4
    q, k, v, braw, graw, a_log, dt_bias = _gdn_inputs(1, hk, hv, dk, dv)
    s0 = torch.zeros(hv, dk, dv)
    so = torch.empty(1, hv, dk, dv)
    out = torch.empty(1, hv, dv)
    rp.fused_recurrence(False, q, k, v, braw, graw, a_log, dt_bias, None, s0, so, out, 0.5)
    kn = torch.nn.functional.normalize(k[0], dim=-1, eps=0).repeat_interleave(2, 0)
    beta = torch.sigmoid(braw[0])
    assert torch.allclose(so[0], kn[:, :, None] * (v[0] * beta[:, None])[:, None, :], atol=1e-4)


TINY_GDN = {
    "name": "tiny-gdn-moe",
    "hidden_size": 64,
    "vocab_size": 97,
    "layer_pattern": "LLLA",
    "pattern_legend": {"L": ["gdn", "moe"], "A": ["attn", "moe"]},
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, "output_gate": True},
    "gdn": {"num_k_heads": 2, "num_v_heads": 4, "k_head_dim": 16, "v_head_dim": 16, "conv_kernel": 4},
    "moe": {
        "num_experts": 16,
        "top_k": 2,
        "expert_intermediate_size": 32,
        "activation": "swiglu",
        "latent_size": None,
        "shared_experts": 1,
        "shared_intermediate_size": 32,
        "shared_expert_gate": True,
    },
    "mtp": {"num_layers": 1, "layer_pattern": "A"},
}
TINY_MAMBA = {
    "name": "tiny-mamba2-moe",
    "hidden_size": 64,
    "vocab_size": 97,
    "layer_pattern": "ME*E",
    "pattern_legend": {"M": ["mamba2"], "E": ["moe"], "*": ["attn"]},
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 16, "output_gate": False},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16, "conv_kernel": 4},
    "moe": {
        "num_experts": 32,
        "top_k": 4,
        "expert_intermediate_size": 24,
        "activation": "relu2",
        "latent_size": 32,
        "shared_experts": 1,
        "shared_intermediate_size": 48,
        "shared_expert_gate": False,
    },
    "mtp": {"num_layers": 1, "layer_pattern": "*E"},
}


@pytest.mark.parametrize("model", [TINY_GDN, TINY_MAMBA], ids=["gdn", "mamba2"])
@pytest.mark.parametrize("backend", ["math", "aten"])
def test_tiny_replica_step_runs_on_cpu(model, backend):
    spec = cm.model_from_dict(model)
    rep = rp.Replica(spec, capacity=600, max_k=3, device="cpu")
    # experts held = expected distinct experts for k + 1 tokens
    m = spec.moe
    moe = next(b for blocks in rep.layers for b in blocks if isinstance(b, rp.MoE))
    assert moe.n_alloc == round(cm.expected_distinct_experts(m.num_experts, m.top_k, 4))
    ctx = rp.AttnCtx(backend, splits=4)
    for arm in ("mtp", "wmtp", "none"):
        tok = rep.step(rp.StepPlan(context=512, k=3, arm=arm, sink=4, window=64), ctx)
        assert tok.shape == (1,) and 0 <= int(tok) < spec.vocab_size
    x = rep.target_body(rp.StepPlan(512, 3, "mtp", 4, 64), ctx)
    assert x.shape == (4, spec.hidden_size) and torch.isfinite(x.float()).all()
    skip = rep.target_body(rp.StepPlan(512, 3, "mtp", 4, 64), rp.AttnCtx(backend, skip_core=True))
    assert torch.isfinite(skip.float()).all()


def test_shipped_model_builds_at_tiny_context_budget():
    """The real 35B shapes parse and the replica's memory estimate is sane (no allocation)."""
    spec = cm.load_model(MODELS / "qwen3.6-35b-a3b.json")
    assert rp._fits(spec, 1 << 20, 5, 139 << 30)
    assert not rp._fits(spec, 1 << 20, 5, 20 << 30)


@pytest.mark.skipif(
    not (rp.HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels run on CPU only under TRITON_INTERPRET=1",
)
def test_triton_kernels_in_interpreter():
    """Every fused kernel against its torch twin (float32: the interpreter mishandles bf16)."""
    f32 = torch.float32
    # attention with causal tail, a sink range and the output gate
    q, kc, vc = fresh(hq=8, hkv=2, d=32, n=300, t=4, dtype=f32)
    end = kc.shape[0]
    gate = torch.randn(4, 8, 32)
    for ranges in ([rp.KeyRange(0, end, causal_tail=4)], [rp.KeyRange(0, 4), rp.KeyRange(end - 64, end, 4)]):
        got = rp.decode_attention(q, kc, vc, ranges, backend="triton", splits=3, gate=gate)
        ref = rp.decode_attention(q, kc, vc, ranges, backend="math", splits=2, gate=gate)
        assert rel_err(got, ref) < 1e-4
    # rmsnorm on strided views, with a gate
    y = torch.randn(5, 3, 80)
    w = torch.rand(16)
    for gate in (None, y[..., 64:80]):
        a = rp.rms_norm_into(y[..., :16], w, torch.empty(5, 3, 16), gate=gate, impl="triton")
        b = rp.rms_norm_into(y[..., :16], w, torch.empty(5, 3, 16), gate=gate, impl="torch")
        assert rel_err(a, b) < 1e-5
    # conv with state
    x = torch.randn(4, 700)[:, :600]
    cw = torch.randn(600, 4)
    st1, st2 = torch.randn(3, 600), None
    st2 = st1.clone()
    o1, o2 = torch.empty(4, 600), torch.empty(4, 600)
    rp.conv4_update(x, cw, st1, o1, "triton")
    rp.conv4_update(x, cw, st2, o2, "torch")
    assert rel_err(o1, o2) < 1e-5 and rel_err(st1, st2) < 1e-6
    # recurrences
    for mamba in (False, True):
        t, hk, hv, dk, dv = 3, 2, 4, 16, 32
        qq, kk, vv, braw, graw, a_log, dt_bias = _gdn_inputs(t, hk, hv, dk, dv)
        s0 = torch.randn(hv, dk, dv)
        outs = []
        for impl in ("triton", "torch"):
            so, o = torch.empty(t, hv, dk, dv), torch.empty(t, hv, dv)
            rp.fused_recurrence(mamba, qq, kk, vv, braw, graw, a_log, dt_bias, torch.rand(hv) * 0 + 1, s0, so, o,
                                0.3, impl)  # fmt: skip
            outs.append((o, so))
        assert rel_err(outs[0][0], outs[1][0]) < 1e-4 and rel_err(outs[0][1], outs[1][1]) < 1e-4
    # expert activation with routing weights
    for swiglu in (True, False):
        u = torch.randn(3, 5 * (2 if swiglu else 1) * 24)
        comb = torch.rand(7, 6)
        a = rp.expert_act(u, 5, 24, swiglu, comb, torch.empty(3, 5 * 24), "triton")
        b = rp.expert_act(u, 5, 24, swiglu, comb, torch.empty(3, 5 * 24), "torch")
        assert rel_err(a, b) < 1e-5
    # a whole tiny replica: fused vs torch
    for model in (TINY_GDN, TINY_MAMBA):
        rep = rp.Replica(cm.model_from_dict(model), 600, 3, "cpu", dtype=f32, impl="triton")
        plan = rp.StepPlan(512, 3, "wmtp", 4, 64)
        res = {}
        saved = rep.save_conv_states()
        for impl, backend in (("triton", "triton"), ("torch", "math")):
            rep.set_impl(impl)
            rep.load_conv_states(saved)
            xx = rep.target_body(plan, rp.AttnCtx(backend, splits=3))
            dd = rep.draft_body(plan, 1, rep.tokens[:1], xx[-1:], rp.AttnCtx(backend, splits=3))
            res[impl] = (xx, dd)
        assert rel_err(res["triton"][0], res["torch"][0]) < 1e-3
        assert rel_err(res["triton"][1], res["torch"][1]) < 1e-3


def test_tidy_joins_prediction(tmp_path):
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "replica_bandwidth.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["bytes", "median_ms", "bandwidth", "reps"])
        w.writerow([8e9, 2.0, 4.0e12, 20])
    fields = ["model", "context", "k", "sink", "window", "backend", "arm", "median_ms", "p10_ms", "p90_ms"]
    with open(raw / "replica_steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        for arm, ms in (("mtp", 10.0), ("wmtp", 8.0), ("none", 5.0)):
            w.writerow(
                {
                    "model": "Qwen3.6-35B-A3B",
                    "context": 1 << 20,
                    "k": 0 if arm == "none" else 3,
                    "sink": 4,
                    "window": 2048,
                    "backend": "triton",
                    "arm": arm,
                    "median_ms": ms,
                    "p10_ms": ms,
                    "p90_ms": ms,
                }
            )
    out = tmp_path / "tidy" / "replica.parquet"
    assert rp.main(["tidy", "--raw", str(raw), "--models-dir", str(MODELS), "--out", str(out)]) == 0
    import pandas as pd

    df = pd.read_parquet(out)
    nat = df[df.arm == "mtp"].iloc[0]
    assert nat.measured_ratio == pytest.approx(1.25)
    p = cm.predict(MODELS / "qwen3.6-35b-a3b.json", 1 << 20, 3, 4, 2048, 4.0e12)
    assert nat.predicted_ratio == pytest.approx(p.ratio)


def test_sweep_dry_run_on_cpu(tmp_path):
    """The whole sweep path (bench, checks, steps, components, CSVs, summary) at tiny shapes on CPU."""
    import json

    models = []
    for m in (TINY_GDN, TINY_MAMBA):
        path = tmp_path / f"{m['name']}.json"
        path.write_text(json.dumps(m))
        models.append(str(path))
    out = tmp_path / "out"
    argv = ["sweep", "--device", "cpu", "--models", *models, "--contexts", "600,1000", "--ks", "1,3"]
    argv += ["--reps", "2", "--sink", "16", "--window", "64", "--out", str(out), "--attn-bench", "800"]
    assert rp.main(argv) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"{t}.csv" for t in rp.TABLES] + ["replica_manifest.json"]), names
    with open(out / "replica_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2  # models x contexts x ks
    assert all(float(r["ratio"]) > 0 and float(r["predicted_ratio"]) >= 1.0 for r in rows)
    with open(out / "replica_checks.csv") as f:
        checks = list(csv.DictReader(f))
    assert checks and all(c["ok"] == "True" for c in checks), checks
    with open(out / "replica_components.csv") as f:
        comps = {r["component"] for r in csv.DictReader(f)}
    assert comps == {
        "target_attn",
        "target_other",
        "lm_head",
        "draft_attn_nat",
        "draft_attn_win",
        "draft_other",
        "draft_lm_head",
    }
