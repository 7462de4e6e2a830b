"""The replica at tiny shapes on CPU: decode attention (full, windowed, split-KV merge), a whole step."""

from __future__ import annotations

import csv
import itertools
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from replica_shapes import TINY_GDN, TINY_MAMBA, fresh, gdn_inputs, rel_err  # noqa: E402

from wmtp.analyze import costmodel as cm  # noqa: E402
from wmtp.analyze import floor as fl  # noqa: E402
from wmtp.replica import cli  # noqa: E402
from wmtp.replica import kernels as kn  # noqa: E402
from wmtp.replica import model as md  # noqa: E402
from wmtp.replica import sweep as sw  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"
BF16_TOL = 2e-2  # relative error of bf16 operands


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
    got = kn.decode_attention(q, kc, vc, [kn.KeyRange(0, end, causal_tail=t)], backend=backend, splits=5)
    assert rel_err(got, sdpa_plain(q, kc, vc, end)) < BF16_TOL


@pytest.mark.parametrize("backend", ["math", "aten"])
def test_windowed_equals_masked_sink_and_window(backend):
    q, kc, vc = fresh(t=1, n=999)
    end, sink, window = kc.shape[0], 4, 128
    plan = md.StepPlan(context=end - 1, k=3, arm="wmtp", sink=sink, window=window)
    ranges = plan.draft_ranges(0)
    assert ranges[0] == kn.KeyRange(0, sink)
    assert ranges[1].end == end and ranges[1].end - ranges[1].start == window
    visible = torch.zeros(1, end, dtype=torch.bool)
    visible[:, :sink] = True
    visible[:, end - window :] = True
    ref = kn.reference_attention(q, kc, vc, visible)
    got = kn.decode_attention(q, kc, vc, ranges, backend=backend, splits=3)
    assert rel_err(got, ref) < BF16_TOL
    # and it differs from full attention (the window is really applied)
    full = kn.decode_attention(q, kc, vc, [kn.KeyRange(0, end, causal_tail=1)], backend=backend)
    assert rel_err(got, full) > 0.05


def test_native_draft_ranges_cover_everything():
    plan = md.StepPlan(context=1000, k=3, arm="mtp", sink=4, window=128)
    assert plan.draft_ranges(2) == [kn.KeyRange(0, 1003, causal_tail=1)]
    short = md.StepPlan(context=100, k=3, arm="wmtp", sink=4, window=128)
    assert short.draft_ranges(0) == [kn.KeyRange(0, 101, causal_tail=1)]


def test_split_kv_merge_equals_unsplit():
    q, kc, vc = fresh(hq=4, hkv=1, d=16, n=1000, t=4, dtype=torch.float32)
    qf = kn.fold_queries(q, 1)
    one_o, one_lse = kn._math_partial(qf, kc, vc, 0.25)
    parts = [kn._math_partial(qf, kc[s : s + 97], vc[s : s + 97], 0.25) for s in range(0, kc.shape[0], 97)]
    outs = torch.stack([torch.nn.functional.pad(o, (0, 0)) for o, _ in parts])
    lses = torch.stack([lse for _, lse in parts])
    merged, lse = kn.merge_partials(outs, lses)
    assert rel_err(merged, one_o) < 1e-5
    assert torch.allclose(lse, one_lse, atol=1e-4)


def test_split_counts_do_not_change_the_result():
    q, kc, vc = fresh(t=3, n=2000)
    end = kc.shape[0]
    rng = [kn.KeyRange(0, end, causal_tail=3)]
    a = kn.decode_attention(q, kc, vc, rng, backend="aten", splits=1)
    b = kn.decode_attention(q, kc, vc, rng, backend="aten", splits=13)
    c = kn.decode_attention(q, kc, vc, rng, backend="math", splits=7)
    assert rel_err(a, b) < BF16_TOL and rel_err(a, c) < BF16_TOL


def test_mamba2_first_token_is_outer_product():
    hk, hv, dk, dv = 2, 4, 8, 4
    c, b, x, _, dtraw, a_log, dt_bias = gdn_inputs(1, hk, hv, dk, dv)
    s0 = torch.zeros(hv, dk, dv)
    so = torch.empty(1, hv, dk, dv)
    out = torch.empty(1, hv, dv)
    d_skip = torch.rand(hv)
    kn.fused_recurrence(True, c, b, x, None, dtraw, a_log, dt_bias, d_skip, s0, so, out, 1.0)
    dt = torch.nn.functional.softplus(dtraw[0] + dt_bias)
    bb, cc = b[0].repeat_interleave(2, 0), c[0].repeat_interleave(2, 0)
    expect_h = bb[:, :, None] * (x[0] * dt[:, None])[:, None, :]
    assert torch.allclose(so[0], expect_h, atol=1e-5)
    expect_o = torch.einsum("hkv,hk->hv", expect_h, cc) + d_skip[:, None] * x[0]
    assert torch.allclose(out[0], expect_o, atol=1e-5)


def test_gdn_delta_rule_on_zero_state():
    """From a zero state the delta rule writes beta * v along the normalised key."""
    hk, hv, dk, dv = 2, 4, 8, 4
    q, k, v, braw, graw, a_log, dt_bias = gdn_inputs(1, hk, hv, dk, dv)
    s0 = torch.zeros(hv, dk, dv)
    so = torch.empty(1, hv, dk, dv)
    out = torch.empty(1, hv, dv)
    kn.fused_recurrence(False, q, k, v, braw, graw, a_log, dt_bias, None, s0, so, out, 0.5)
    k_unit = torch.nn.functional.normalize(k[0], dim=-1, eps=0).repeat_interleave(2, 0)
    beta = torch.sigmoid(braw[0])
    assert torch.allclose(so[0], k_unit[:, :, None] * (v[0] * beta[:, None])[:, None, :], atol=1e-4)


@pytest.mark.parametrize("model", [TINY_GDN, TINY_MAMBA], ids=["gdn", "mamba2"])
@pytest.mark.parametrize("backend", ["math", "aten"])
def test_tiny_replica_step_runs_on_cpu(model, backend):
    spec = cm.model_from_dict(model)
    rep = md.Replica(spec, capacity=600, max_k=3, device="cpu")
    # experts held = expected distinct experts for k + 1 tokens
    m = spec.moe
    moe = next(b for blocks in rep.layers for b in blocks if isinstance(b, md.MoE))
    assert moe.n_alloc == round(cm.expected_distinct_experts(m.num_experts, m.top_k, 4))
    ctx = md.AttnCtx(backend, splits=4)
    for arm in ("mtp", "wmtp", "none"):
        tok = rep.step(md.StepPlan(context=512, k=3, arm=arm, sink=4, window=64), ctx)
        assert tok.shape == (1,) and 0 <= int(tok) < spec.vocab_size
    two = md.Replica(spec, capacity=600, max_k=3, device="cpu", batch=2)
    assert two.step(md.StepPlan(512, 3, "wmtp", 4, 64, batch=2), ctx).shape == (2,)
    x = rep.target_body(md.StepPlan(512, 3, "mtp", 4, 64), ctx)
    assert x.shape == (4, spec.hidden_size) and torch.isfinite(x.float()).all()
    skip = rep.target_body(md.StepPlan(512, 3, "mtp", 4, 64), md.AttnCtx(backend, skip_core=True))
    assert torch.isfinite(skip.float()).all()


def test_shipped_model_builds_at_tiny_context_budget():
    """The real 35B shapes parse and the replica's memory estimate is sane (no allocation): one 1M request
    fits an H200, eight do not (each holds about 23 GB of KV), and 20 GiB holds none."""
    spec = cm.load_model(MODELS / "qwen3.6-35b-a3b.json")
    h200, slack = 139 << 30, 6 << 30
    top = fl.largest_batch(spec, 1 << 20, 5, [1, 2, 4, 8], h200, slack)
    assert 1 <= top < 8
    assert fl.largest_batch(spec, 1 << 20, 5, [1, 2, 4, 8], 20 << 30, slack) == 0
    assert fl.largest_batch(spec, 128 << 10, 5, [1, 2, 4, 8], h200, slack) == 8
    per_request = fl.replica_bytes(spec, 1 << 20, 5, 2) - fl.replica_bytes(spec, 1 << 20, 5, 1)
    # a second request adds its KV and state, and the experts its tokens touch
    assert per_request > cm.kv_memory(spec, 1 << 20).total


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.json")), ids=lambda p: p.stem)
def test_floor_at_batch_one_is_the_cost_models_step(path):
    spec = cm.load_model(path)
    for arm, k in (("none", 0), ("mtp", 3), ("wmtp", 5)):
        parts = fl.step_bytes(spec, 300_000, k, arm, sink=64, window=4032)
        sc = cm.step_cost(spec, 300_000, k, arm, sink=64, window=4032)
        assert sum(parts.values()) == pytest.approx(sc.bytes.total)
        assert parts["target_attn"] + parts["draft_attn"] == pytest.approx(sc.bytes.kv)
        ms = fl.step_floor_ms(spec, 300_000, k, arm, 4e12, sink=64, window=4032)
        assert ms["step"] == pytest.approx(sc.bytes.total / 4e12 * 1e3)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_floor_ratio_climbs_with_batch_towards_the_kv_ceiling(k):
    """More requests share the weights and add KV: the cost-side ratio rises towards 1 + k/L_full, never past it."""
    path = MODELS / "qwen3.6-35b-a3b.json"
    spec, ceiling = cm.load_model(path), cm.limit_ratio(path, k)
    ratios = [fl.predicted_ratio(spec, 1 << 20, k, 4e12, batch=b, sink=64, window=4032) for b in (1, 2, 4, 8, 64)]
    assert all(a < b for a, b in itertools.pairwise(ratios))
    # at 64 requests the weights are a small part: within a tenth of the wedge below the ceiling
    assert ratios[-1] < ceiling and (ceiling - ratios[-1]) / (ceiling - 1) < 0.1
    assert ratios[0] == pytest.approx(cm.predict(path, 1 << 20, k, 64, 4032, 4e12).ratio)
    with pytest.raises(ValueError):
        fl.step_bytes(spec, 1000, k, "mtp", batch=0)


def test_layer_delta_error_sees_what_the_output_error_hides():
    """A 1 % error in a block's delta is invisible in its output when the residual is 1,000 times larger."""
    x = torch.randn(6, 256) * 1000
    delta = torch.randn(6, 256)
    ref = x + delta
    got = x + delta * 1.01
    assert sw.rel_error(got, ref) < 1e-4
    assert sw.delta_error(got, ref, x) == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("n,k", [(2048, 16384), (106_000, 2048), (64, 100), (4096, 129)])
def test_gemm_splits_cover_the_keys_once(n, k):
    g = kn.GemmLaunch()
    split, per = g.splits(n, k, 132)
    assert per % g.block_k == 0 and (split - 1) * per < k <= split * per
    if n <= 4096 and k >= 16384:  # few columns, many keys: split so that every SM streams weights
        assert split * kn.cdiv(n, g.block_n) >= 132


def test_gemm_choice_takes_ours_only_from_the_rows_where_it_wins():
    times = {(2, "library"): 1.0, (6, "library"): 2.0, (48, "library"): 9.0}
    times |= {(2, "a"): 1.5, (6, "a"): 1.8, (48, "a"): 5.0, (2, "b"): 0.9, (6, "b"): 2.5, (48, "b"): 6.0}
    assert sw.choose_gemm(times, [2, 6, 48]) == ("a", 6)  # b wins at 2 rows only, and loses at 6
    slow = {key: (t * 10 if key[1] != "library" else t) for key, t in times.items()}
    assert sw.choose_gemm(slow, [2, 6, 48]) == ("library", 49)
    fast = {key: (t / 10 if key[1] != "library" else t) for key, t in times.items()}
    assert sw.choose_gemm(fast, [48, 2, 6]) == ("a", 2)


def test_tuned_launch_is_a_new_value_and_the_defaults_stay():
    base = kn.AttnLaunch()
    tuned = base.with_tuned(128, 32, (32, 8, 3))
    assert tuned.choose(128, 32) == (32, 8, 3)
    assert not base.has(128, 32) and (128, 32) not in kn.ATTN_TUNED_H200
    assert base.choose(256, 16) == kn.ATTN_TUNED_H200[(256, 16)]
    assert base.with_override((32, None, None)).choose(256, 16)[0] == 32
    # a launch too large for shared memory is shrunk until it fits
    bn, _, st = base.with_override((256, 4, 4)).choose(256, 64)
    assert kn.attn_smem_bytes(64, bn, st, 256) <= kn.SMEM_LIMIT
    with pytest.raises(TypeError):
        kn.ATTN_TUNED_H200[(1, 1)] = (1, 1, 1)  # type: ignore[index]


@pytest.mark.parametrize("backend", ["math", "aten"])
def test_a_batched_request_sees_only_its_own_cache_and_state(backend):
    """Request 0 of a batch of two gives what it gives alone: attention and recurrent blocks, block by block."""
    spec = cm.model_from_dict(TINY_GDN)
    rep = md.Replica(spec, capacity=600, max_k=3, device="cpu", batch=2)
    plan = md.StepPlan(512, 3, "mtp", 4, 64, batch=2)
    ctx = md.AttnCtx(backend, splits=4)
    blocks = [b for b in rep.blocks() if not isinstance(b, md.MoE)]
    assert {type(b) for b in blocks} == {md.Attention, md.Recurrent}
    saved = rep.save_conv_states()
    for b in blocks:
        x = torch.randn(8, spec.hidden_size, dtype=rep.dtype)
        rep.load_conv_states(saved)
        both = rep.block_forward(b, x, 512, plan.verify_ranges(), ctx, 2)
        rep.load_conv_states(saved)
        alone = rep.block_forward(b, x[:4], 512, plan.verify_ranges(), ctx, 1)
        assert rel_err(both[:4], alone) < 1e-2
        assert rel_err(both[4:], alone) > 0.05  # the other request has its own cache and state


def test_triton_kernels_in_interpreter():
    """Every fused kernel against its torch twin, in Triton's CPU interpreter: a process of its own, because
    TRITON_INTERPRET must be set before Triton is first imported."""
    import subprocess
    import sys

    script = Path(__file__).with_name("replica_triton_checks.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "WMTP-TRITON-INTERPRETER ok" in out.stdout, out.stderr[-3000:]


def test_tidy_joins_prediction(tmp_path):
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "replica_bandwidth.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["bytes", "median_ms", "bandwidth", "reps"])
        w.writerow([8e9, 2.0, 4.0e12, 20])
    fields = ["model", "context", "k", "batch", "sink", "window", "backend", "arm", "median_ms", "p10_ms", "p90_ms"]
    with open(raw / "replica_steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        for (arm, ms), nb in itertools.product((("mtp", 10.0), ("wmtp", 8.0), ("none", 5.0)), (2, 1)):
            w.writerow(
                {
                    "model": "Qwen3.6-35B-A3B",
                    "context": 1 << 20,
                    "k": 0 if arm == "none" else 3,
                    "batch": nb,
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
    assert cli.main(["tidy", "--raw", str(raw), "--models-dir", str(MODELS), "--out", str(out)]) == 0
    import pandas as pd

    df = pd.read_parquet(out)
    assert list(df["batch"]) == sorted(df["batch"])  # batch 1 first: readers that ignore batch see it
    nat = df[df.arm == "mtp"].iloc[0]
    assert nat.batch == 1 and nat.measured_ratio == pytest.approx(1.25)
    p = cm.predict(MODELS / "qwen3.6-35b-a3b.json", 1 << 20, 3, 4, 2048, 4.0e12)
    assert nat.predicted_ratio == pytest.approx(p.ratio)
    two = df[(df.arm == "mtp") & (df.batch == 2)].iloc[0]
    spec = cm.load_model(MODELS / "qwen3.6-35b-a3b.json")
    assert two.predicted_ratio == pytest.approx(
        fl.predicted_ratio(spec, 1 << 20, 3, 4.0e12, batch=2, sink=4, window=2048)
    )
    assert two.predicted_ratio > nat.predicted_ratio
    assert two.step_over_floor == pytest.approx(10.0 / two.predicted_ms)


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
    assert cli.main([*argv, "--batches", "1,2"]) == 0
    names = sorted(p.name for p in out.iterdir())
    # the skinny-GEMM tuner runs only on CUDA
    assert names == sorted([f"{t}.csv" for t in sw.TABLES if t != "replica_gemm"] + ["replica_manifest.json"]), names
    with open(out / "replica_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * 2  # models x contexts x ks x batches
    assert {r["batch"] for r in rows} == {"1", "2"}
    assert all(float(r["ratio"]) > 0 and float(r["predicted_ratio"]) >= 1.0 for r in rows)
    with open(out / "replica_checks.csv") as f:
        checks = list(csv.DictReader(f))
    assert checks and all(c["ok"] == "True" for c in checks), checks
    assert "attention_batch" in {c["check"] for c in checks}
    with open(out / "replica_steps.csv") as f:
        steps = list(csv.DictReader(f))
    assert all(float(r["floor_ms"]) > 0 and float(r["step_over_floor"]) > 0 for r in steps)
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
