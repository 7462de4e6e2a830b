"""The GPU sweep: correctness checks, attention bandwidth, and step times per (model, context, k, batch, arm).

Each step is captured whole in one CUDA graph and replayed; components are timed as their own
graphs behind an L2 scrub, minus the scrub alone.  Every step and component is written next to its
bytes/bandwidth floor (:mod:`wmtp.analyze.floor`) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from wmtp.analyze import costmodel as cm
from wmtp.analyze import floor as fl
from wmtp.analyze.analysis import cost_side_ratio
from wmtp.config import PAPER_SINK, PAPER_WINDOW
from wmtp.replica.kernels import (
    HAVE_TRITON,
    AttnLaunch,
    GemmLaunch,
    KeyRange,
    auto_splits,
    decode_attention,
    fit_smem,
    linear,
    reference_attention,
    torch,
    triton,
)
from wmtp.replica.model import Attention, AttnCtx, MoE, Recurrent, Replica, StepPlan, default_impl
from wmtp.replica.timing import (
    GraphTimer,
    Timings,
    copy_bandwidth,
    empty_cache,
    free_bytes,
    is_cuda,
    noop,
    sm_count,
    stats,
    sync,
)

log = logging.getLogger("wmtp.replica")

_KEYS = ["model", "context", "k", "batch", "sink", "window", "backend"]

#: Columns of each table the sweep writes (fixed, so rows written in any order share a header).
TABLES: dict[str, list[str]] = {
    "replica_bandwidth": ["bytes", "median_ms", "bandwidth", "reps"],
    "replica_checks": ["check", "backend", "hq", "hkv", "d", "n", "t", "rel_err", "ok", "note"],
    "replica_attention": [
        "model", "backend", "variant", "context", "t", "splits", "kv_bytes", "median_ms", "p10_ms", "p90_ms",
        "scrub_ms", "bandwidth", "copy_bandwidth", "fraction_of_copy",
    ],
    "replica_steps": [
        *_KEYS, "arm", "median_ms", "p10_ms", "p90_ms", "reps", "predicted_ms", "predicted_bytes", "floor_ms",
        "step_over_floor",
    ],
    "replica_summary": [
        *_KEYS, "step_nat_ms", "step_win_ms", "ratio", "predicted_ratio", "predicted_nat_ms", "predicted_win_ms",
        "copy_bandwidth",
    ],
    "replica_gemm": [
        "model", "m", "k", "n", "variant", "median_ms", "weight_bytes", "bandwidth", "copy_bandwidth",
        "fraction_of_copy", "chosen",
    ],
    "replica_components": [
        *_KEYS, "component", "median_ms", "p10_ms", "p90_ms", "reps", "scrub_ms", "floor_ms", "over_floor",
    ],
}  # fmt: skip


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
    sink: int = PAPER_SINK
    window: int = PAPER_WINDOW
    reps: int = 30
    batches: list[int] = field(default_factory=lambda: [1])
    backend: str = "auto"
    splits: int | None = None
    use_graphs: bool = True
    components: bool = True
    deadline_s: float = 1e9
    checks: bool = True
    device: str = "cuda"
    out: Path = field(default_factory=lambda: Path("."))
    launch: AttnLaunch = field(default_factory=AttnLaunch)


def check_attention(backend: str, sink: CsvSink, device: str = "cuda") -> bool:
    """Correctness of decode attention against float32 with an explicit mask, on fresh random inputs."""
    all_ok = True
    shapes = ((16, 2, 256, 70_000, 4), (32, 2, 256, 30_000, 6), (32, 2, 128, 50_000, 6), (16, 2, 256, 9_000, 1))
    for hq, hkv, d, n, t in shapes:
        n = n if is_cuda(device) else n // 20
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
    all_ok &= _check_batched_attention(backend, sink, device)
    return all_ok


def _check_batched_attention(backend: str, sink: CsvSink, device: str) -> bool:
    """A batch of requests, each over its own cache, against each request alone in float32."""
    nb, hq, hkv, d, n, t = 3, 16, 2, 128, (20_000 if is_cuda(device) else 900), 4
    kc = torch.randn(nb, n + t, hkv, d, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(nb, hq, t, d, device=device, dtype=torch.bfloat16)
    gate = torch.randn(nb, t, hq, d, device=device, dtype=torch.bfloat16)
    end = n + t
    vis = torch.arange(end, device=device)[None, :] <= (n + torch.arange(t, device=device))[:, None]
    ref = torch.stack(
        [reference_attention(q[b], kc[b], vc[b], vis).float() * torch.sigmoid(gate[b].float()).transpose(0, 1)
         for b in range(nb)]
    )  # fmt: skip
    got = decode_attention(q, kc, vc, [KeyRange(0, end, causal_tail=t)], backend=backend, gate=gate)
    err = rel_error(got, ref)
    sink.write(
        "replica_checks",
        {"check": "attention_batch", "backend": backend, "hq": hq, "hkv": hkv, "d": d, "n": n, "t": t,
         "rel_err": err, "ok": err < 2e-2, "note": f"batch {nb}"},
    )  # fmt: skip
    return err < 2e-2


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """|got - ref| / |ref| in float32."""
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def delta_error(out: torch.Tensor, ref_out: torch.Tensor, x_in: torch.Tensor) -> float:
    """Relative error of a residual block's *delta* (out - x_in) against the reference's.

    A block's output is x_in plus a delta that can be orders of magnitude smaller than x_in, so
    comparing outputs hides any error in the delta; comparing deltas does not.
    """
    return rel_error(out.float() - x_in.float(), ref_out.float() - x_in.float())


def _small_spec(spec: cm.ModelSpec) -> cm.ModelSpec:
    """The same shapes with one layer of each kind (for a fused-vs-torch check)."""
    kinds = []
    for layer in spec.layers:
        if layer not in kinds:
            kinds.append(layer)
    return dataclasses.replace(spec, layers=tuple(kinds))


def block_delta_errors(rep: Replica, plan: StepPlan, ctx: AttnCtx, ref_ctx: AttnCtx) -> list[tuple[str, float]]:
    """Every block of the replica (verify blocks, then draft blocks) run fused and in torch on the same
    input: the relative error of each block's delta, named ``verify_<kind>`` or ``draft_<kind>``."""
    out: list[tuple[str, float]] = []
    saved = rep.save_conv_states()
    h = rep.spec.hidden_size
    sets = [("verify", [b for blocks in rep.layers for b in blocks], plan.t_verify * plan.batch, plan.context),
            ("draft", rep.mtp_blocks, plan.batch, plan.context)]  # fmt: skip
    for what, blocks, rows, pos in sets:
        ranges = plan.verify_ranges() if what == "verify" else plan.draft_ranges(0)
        for b in blocks:
            x = torch.randn(rows, h, device=rep.device, dtype=rep.dtype)
            res = {}
            for impl, c in (("triton", ctx), ("torch", ref_ctx)):
                rep.set_impl(impl)
                rep.load_conv_states(saved)
                res[impl] = rep.block_forward(b, x, pos, ranges, c, plan.batch)
            kind = "attn" if isinstance(b, Attention) else b.kind if isinstance(b, Recurrent) else "moe"
            out.append((f"{what}_{kind}", delta_error(res["triton"], res["torch"], x)))
    rep.set_impl("triton")
    rep.load_conv_states(saved)
    return out


def check_fused(sink: CsvSink, spec: cm.ModelSpec, device: str = "cuda", backend: str = "triton") -> bool:
    """Fused Triton kernels vs the same math in torch, block by block on a batch of two requests, bf16."""
    rep = Replica(_small_spec(spec), 5000, 5, device, impl="triton", batch=2)
    plan = StepPlan(4000, 5, "wmtp", 4, 2048, batch=2)
    all_ok = True
    for name, err in block_delta_errors(
        rep, plan, AttnCtx(backend), AttnCtx("aten" if backend == "triton" else backend)
    ):
        ok = err < 5e-2
        all_ok &= ok
        sink.write(
            "replica_checks",
            {"check": f"fused_{name}", "backend": backend, "n": 4000, "t": 6 if name.startswith("verify") else 1,
             "rel_err": err, "ok": ok, "note": f"{spec.name}; layer delta, batch 2"},
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
    launch: AttnLaunch | None = None,
) -> None:
    """Achieved bandwidth of one layer's decode attention: KV bytes (read once) / time, vs copy."""
    a = spec.attention
    cap = max(contexts) + 8
    device = timer.device
    kc = torch.empty(cap, a.num_kv_heads, a.head_dim, device=device, dtype=torch.bfloat16).normal_()
    vc = torch.empty_like(kc).normal_()
    sms = sm_count(device)
    base = statistics.median(timer.time(noop, reps, scrub=True))
    base_launch = launch or AttnLaunch()
    for backend in backends:
        for variant in variants if backend == "triton" else ((None, None, None),):
            lc = base_launch.with_override(variant)
            for n in contexts:
                for t in ts:
                    for f in split_factors:
                        splits = max(1, round(auto_splits(n, a.num_kv_heads, sms) * f))
                        q = torch.randn(a.num_q_heads, t, a.head_dim, device=device, dtype=torch.bfloat16)
                        rng = [KeyRange(0, n + t, causal_tail=t)]
                        fn = partial(decode_attention, q, kc, vc, rng, backend=backend, splits=splits, sms=sms,
                                     launch=lc)  # fmt: skip
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
                            {"model": spec.name, "backend": backend, "variant": "-".join(str(v) for v in variant),
                             "context": n, "t": t, "splits": splits, "kv_bytes": kv_bytes, "median_ms": net,
                             "p10_ms": Timings("", ms).q(0.1) - base, "p90_ms": Timings("", ms).q(0.9) - base,
                             "scrub_ms": base, "bandwidth": bw, "copy_bandwidth": copy_bw,
                             "fraction_of_copy": bw / copy_bw},
                        )  # fmt: skip
                        log.info("attn %s %s %s N=%d T=%d P=%d: %.3f ms %.2f TB/s (%.0f%% of copy)", spec.name,
                                 backend, variant, n, t, splits, net, bw / 1e12, 100 * bw / copy_bw)  # fmt: skip


TUNE_VARIANTS: tuple[tuple[int, int, int], ...] = ((64, 4, 3), (128, 4, 3), (32, 8, 3), (64, 8, 2))


def tune_attention(
    rep: Replica,
    n: int,
    ts: Sequence[int],
    timer: GraphTimer,
    sink: CsvSink,
    copy_bw: float,
    reps: int,
    launch: AttnLaunch,
) -> AttnLaunch:
    """The split-KV launch variant per row block on this model's first KV cache at n tokens.

    Returns ``launch`` with the row classes it did not know added; ``launch`` itself is unchanged.
    """
    layer = next(b for blocks in rep.layers for b in blocks if isinstance(b, Attention))
    a = rep.spec.attention
    sms = sm_count(str(rep.device))
    base = statistics.median(timer.time(noop, reps, scrub=True))
    for t in ts:
        r = (a.num_q_heads // a.num_kv_heads) * t
        block_m = max(16, triton.next_power_of_2(r))
        if launch.has(a.head_dim, block_m):
            continue
        q = torch.randn(1, a.num_q_heads, t, a.head_dim, device=rep.device, dtype=rep.dtype)
        rng = [KeyRange(0, n + t, causal_tail=t)]
        best: tuple[float, tuple[int, int, int]] | None = None
        for variant in sorted({fit_smem(block_m, a.head_dim, v) for v in TUNE_VARIANTS}):
            trial = launch.with_tuned(a.head_dim, block_m, variant)
            try:
                ms = timer.time(
                    partial(layer.core, q, rng, AttnCtx("triton", None, sms, launch=trial)), reps, scrub=True
                )
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
        if best is not None:
            launch = launch.with_tuned(a.head_dim, block_m, best[1])
            log.info("tuned %s d=%d rows=%d: %s", rep.spec.name, a.head_dim, block_m, best[1])
    return launch


#: Skinny-GEMM tiles the tuner tries: (block_n, block_k, num_warps, num_stages).
GEMM_VARIANTS: tuple[tuple[int, int, int, int], ...] = (
    (64, 128, 4, 4),
    (128, 128, 4, 3),
    (64, 256, 4, 3),
    (32, 256, 4, 4),
    (128, 64, 4, 4),
    (64, 128, 8, 4),
)


def choose_gemm(times: dict[tuple[int, str], float], rows: Sequence[int]) -> tuple[str, int]:
    """From per-(rows, variant) times, 'library' among them: for each tile variant the fewest rows from which
    it beats the library at every larger row count, and the variant whose step (ours from there, the library
    below) is fastest.  Returns (variant, min_rows); ('library', max rows + 1) when none wins anywhere."""
    rows = sorted(rows)
    lib = {m: times.get((m, "library"), math.inf) for m in rows}
    best: tuple[float, str, int] = (sum(lib.values()), "library", rows[-1] + 1)
    for v in sorted({v for _, v in times if v != "library"}):
        min_rows = rows[-1] + 1
        for m in reversed(rows):
            if times.get((m, v), math.inf) >= lib[m]:
                break
            min_rows = m
        score = sum(times[(m, v)] if m >= min_rows else lib[m] for m in rows)
        if min_rows <= rows[-1] and score < best[0]:
            best = (score, v, min_rows)
    return best[1], best[2]


def tune_gemm(rep: Replica, rows: Sequence[int], timer: GraphTimer, sink: CsvSink, copy_bw: float, reps: int) -> None:
    """The skinny-GEMM tiles (or the library GEMM) that read the first MoE layer's weights fastest, over its two
    GEMMs at each row count, timed behind an L2 scrub less the scrub; set on the replica (``rep.set_gemm``)."""
    moe = next(b for blocks in rep.layers for b in blocks if isinstance(b, MoE))
    ws = (moe.w_pre, moe.w_down_cat if hasattr(moe, "w_down_cat") else moe.w_down)
    sms = sm_count(str(rep.device))
    base = statistics.median(timer.time(noop, reps, scrub=True))
    variants = {"-".join(map(str, v)): GemmLaunch(*v) for v in GEMM_VARIANTS} | {"library": GemmLaunch(max_rows=0)}
    times: dict[tuple[int, str], float] = {}
    for name, g in variants.items():
        for m in rows:
            total = 0.0
            for w in ws:
                x = torch.randn(m, w.shape[0], device=rep.device, dtype=rep.dtype)
                try:
                    ms = statistics.median(timer.time(partial(linear, x, w, None, "triton", g, sms), reps, scrub=True))
                except Exception as e:  # a variant that does not compile is skipped
                    log.warning("gemm %s: %s", name, e)
                    total = math.inf
                    break
                net = max(1e-6, ms - base)
                total += net
                nbytes = w.numel() * w.element_size()
                sink.write("replica_gemm", {"model": rep.spec.name, "m": m, "k": w.shape[0], "n": w.shape[1],
                                            "variant": name, "median_ms": net, "weight_bytes": nbytes,
                                            "bandwidth": nbytes / (net * 1e-3), "copy_bandwidth": copy_bw,
                                            "fraction_of_copy": nbytes / (net * 1e-3) / copy_bw})  # fmt: skip
            times[(m, name)] = total
    chosen, min_rows = choose_gemm(times, rows)
    gemm = GemmLaunch(max_rows=0) if chosen == "library" else dataclasses.replace(variants[chosen], min_rows=min_rows)
    sink.write("replica_gemm", {"model": rep.spec.name, "variant": chosen, "m": min_rows, "chosen": True})
    log.info("%s: GEMM %s from %d rows", rep.spec.name, chosen, min_rows)
    rep.set_gemm(gemm)


def fits_note(spec: cm.ModelSpec, context: int, max_k: int, batch: int, free: float) -> str:
    """Why a (context, batch) point is left out: what it needs against what the device has free."""
    need = fl.replica_bytes(spec, context, max_k, batch)
    return (
        f"{spec.name} batch {batch}: needs {need / 2**30:.1f} GiB (+6 GiB working space) of {free / 2**30:.1f} GiB free"
    )


def _components(rep: Replica, plan_nat: StepPlan, ctx: AttnCtx, draft: bool) -> dict[str, Callable[[], Any]]:
    """The pieces of a step timed on their own, with inputs of the step's shapes."""
    spec, dev = rep.spec, rep.device
    a, nb, k = spec.attention, plan_nat.batch, plan_nat.k
    ctx_skip = dataclasses.replace(ctx, skip_core=True)
    qv = torch.randn(nb, a.num_q_heads, k + 1, a.head_dim, device=dev, dtype=rep.dtype)
    q1 = torch.randn(nb, a.num_q_heads, 1, a.head_dim, device=dev, dtype=rep.dtype)
    xv = torch.randn(nb * (k + 1), spec.hidden_size, device=dev, dtype=rep.dtype)
    x1 = xv[:nb]
    tok = rep.tokens[:nb]
    pieces: dict[str, Callable[[], Any]] = {
        "target_attn": partial(rep.target_attn_cores, plan_nat, ctx, qv),
        "target_other": partial(rep.target_body, plan_nat, ctx_skip),
        "lm_head": partial(rep.logits_argmax, xv, rep.final_norm),
    }
    if draft:
        plan_win = dataclasses.replace(plan_nat, arm="wmtp")
        pieces |= {
            "draft_attn_nat": partial(rep.draft_attn_cores, plan_nat, ctx, q1),
            "draft_attn_win": partial(rep.draft_attn_cores, plan_win, ctx, q1),
            "draft_other": partial(rep.draft_body, plan_nat, 0, tok, x1, ctx_skip),
            "draft_lm_head": partial(rep.logits_argmax, x1, rep.mtp_final_norm),
        }
    return pieces


def component_floors(spec: cm.ModelSpec, plan: StepPlan, bandwidth: float) -> dict[str, float]:
    """Floor (ms) of each timed component: target pieces once, draft pieces for one draft forward."""
    kw = {"batch": plan.batch, "sink": plan.sink, "window": plan.window}
    nat = fl.step_floor_ms(spec, plan.context, plan.k, "mtp", bandwidth, **kw)
    win = fl.step_floor_ms(spec, plan.context, plan.k, "wmtp", bandwidth, **kw)
    k = plan.k
    return {
        "target_attn": nat["target_attn"],
        "target_other": nat["target_other"],
        "lm_head": nat["lm_head"],
        "draft_attn_nat": nat["draft_attn"] / k,
        "draft_attn_win": win["draft_attn"] / k,
        "draft_other": nat["draft_other"] / k,
        "draft_lm_head": nat["draft_lm_head"] / k,
    }


def measure_point(
    rep: Replica, cfg: SweepConfig, sink: CsvSink, timer: GraphTimer, row: dict[str, Any], ctx: AttnCtx,
    copy_bw: float, components: bool,
) -> None:  # fmt: skip
    """Every arm's whole step at one (context, k, batch), its floor, the summary and the components."""
    spec = rep.spec
    n, k, nb = row["context"], row["k"], row["batch"]
    step_ms: dict[str, float] = {}
    floors: dict[str, float] = {}
    for arm in ("mtp", "wmtp", "none"):
        if arm == "none" and k != cfg.ks[0]:
            continue
        plan = StepPlan(n, k, arm, cfg.sink, cfg.window, batch=nb)
        st = stats(arm, timer.time(partial(rep.step, plan, ctx), cfg.reps))
        step_ms[arm] = st["median_ms"]
        floors[arm] = fl.step_floor_ms(spec, n, k, arm, copy_bw, batch=nb, sink=cfg.sink, window=cfg.window)["step"]
        nbytes = sum(fl.step_bytes(spec, n, k, arm, batch=nb, sink=cfg.sink, window=cfg.window).values())
        sink.write(
            "replica_steps",
            {**row, "k": 0 if arm == "none" else k, "arm": arm, **st, "predicted_ms": floors[arm],
             "predicted_bytes": nbytes, "floor_ms": floors[arm], "step_over_floor": st["median_ms"] / floors[arm]},
        )  # fmt: skip
    sink.write(
        "replica_summary",
        {**row, "step_nat_ms": step_ms["mtp"], "step_win_ms": step_ms["wmtp"],
         "ratio": cost_side_ratio(step_ms["mtp"], step_ms["wmtp"]),
         "predicted_ratio": cost_side_ratio(floors["mtp"], floors["wmtp"]), "predicted_nat_ms": floors["mtp"],
         "predicted_win_ms": floors["wmtp"], "copy_bandwidth": copy_bw},
    )  # fmt: skip
    log.info("%s N=%d k=%d B=%d: nat %.3f ms (floor %.3f), win %.3f ms (floor %.3f), ratio %.3f (floor %.3f)",
             spec.name, n, k, nb, step_ms["mtp"], floors["mtp"], step_ms["wmtp"], floors["wmtp"],
             cost_side_ratio(step_ms["mtp"], step_ms["wmtp"]),
             cost_side_ratio(floors["mtp"], floors["wmtp"]))  # fmt: skip
    if not components:
        return
    plan_nat = StepPlan(n, k, "mtp", cfg.sink, cfg.window, batch=nb)
    want = component_floors(spec, plan_nat, copy_bw)
    base = statistics.median(timer.time(noop, cfg.reps, scrub=True))
    for name, fn in _components(rep, plan_nat, ctx, draft=True).items():
        st = stats(name, [max(0.0, x - base) for x in timer.time(fn, cfg.reps, scrub=True)])
        sink.write(
            "replica_components",
            {**row, "component": name, **st, "scrub_ms": base, "floor_ms": want[name],
             "over_floor": st["median_ms"] / want[name] if want[name] > 0 else None},
        )  # fmt: skip


def _build(
    spec: cm.ModelSpec, n: int, max_k: int, dev: str, impl: str | None, top: int, batches: list[int], sink: CsvSink
) -> tuple[Replica | None, int]:
    """The replica for ``top`` requests at n tokens; where the estimate was short, the next smaller batch."""
    while top:
        try:
            rep = Replica(spec, n, max_k, dev, impl=impl, batch=top)
            sync(dev)
            return rep, top
        except torch.OutOfMemoryError as e:
            note = f"{spec.name} batch {top}: out of memory ({str(e)[:80]})"
        empty_cache(dev)  # after the handler: its traceback held the half-built replica
        sink.write("replica_checks", {"check": "fits_memory", "n": n, "t": top, "ok": False, "note": note})
        top = max((b for b in batches if b < top), default=0)
    return None, 0


def sweep_model(
    cfg: SweepConfig, path: Path, sink: CsvSink, copy_bw: float, backend: str, t0: float, impl: str | None = None
) -> None:
    """Every (context, batch, k) of one model that fits, a replica built per context at its largest batch."""
    spec = cm.load_model(path)
    max_k = max(cfg.ks)
    dev = cfg.device
    launch = cfg.launch
    comp_k = 3 if 3 in cfg.ks else cfg.ks[0]
    gemm: GemmLaunch | None = None
    for n in cfg.contexts:
        empty_cache(dev)
        free = free_bytes(dev)
        top = fl.largest_batch(spec, n, max_k, cfg.batches, free, slack=6 << 30)
        for b in (b for b in cfg.batches if b > top):
            log.warning("%s N=%d batch %d does not fit; skipped", spec.name, n, b)
            sink.write("replica_checks", {"check": "fits_memory", "n": n, "t": b, "ok": False,
                                          "note": fits_note(spec, n, max_k, b, free)})  # fmt: skip
        if top == 0:
            continue
        tb = time.time()
        rep, top = _build(spec, n, max_k, dev, impl, top, cfg.batches, sink)
        if rep is None:
            continue
        log.info("%s N=%d: replica for %d requests built in %.1f s, %.1f GiB allocated", spec.name, n, top,
                 time.time() - tb, torch.cuda.memory_allocated() / 2**30 if is_cuda(dev) else 0.0)  # fmt: skip
        timer = GraphTimer(cfg.use_graphs, device=dev)
        if backend == "triton" and is_cuda(dev):  # row classes the probe did not measure
            launch = tune_attention(rep, n, sorted({1, max_k + 1}), timer, sink, copy_bw, cfg.reps, launch)
        if gemm is None and rep.impl == "triton" and is_cuda(dev):
            tune_gemm(rep, sorted({2, max_k + 1, top * (max_k + 1)}), timer, sink, copy_bw, cfg.reps)
            gemm = rep.gemm
        elif gemm is not None:
            rep.set_gemm(gemm)
        ctx = AttnCtx(backend, cfg.splits, sm_count(dev), launch=launch)
        for nb in (b for b in cfg.batches if b <= top):
            for k in cfg.ks:
                if time.time() - t0 > cfg.deadline_s:
                    log.warning("deadline reached; stopping before %s N=%d k=%d B=%d", spec.name, n, k, nb)
                    return
                row = {"model": spec.name, "context": n, "k": k, "batch": nb, "sink": cfg.sink,
                       "window": cfg.window, "backend": backend}  # fmt: skip
                comps = cfg.components and k == comp_k and nb in (1, top)
                measure_point(rep, cfg, sink, timer, row, ctx, copy_bw, comps)
        del rep, timer
        empty_cache(dev)


def choose_backend(requested: str, device: str = "cuda") -> str:
    if requested != "auto":
        return requested
    return "triton" if HAVE_TRITON and is_cuda(device) else "aten"


def _run_checks(cfg: SweepConfig, sink: CsvSink, backend: str, impl: str) -> tuple[str, str]:
    """The correctness checks; a failing fused path falls back to torch ops and aten attention."""
    dev = cfg.device
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
            ok = all([check_fused(sink, cm.load_model(path), dev, backend) for path in cfg.models])
        except Exception as e:
            log.exception("fused-kernel check failed")
            sink.write("replica_checks", {"check": "fused", "backend": "triton", "ok": False, "note": str(e)[:200]})
            ok = False
        if not ok:
            log.error("fused kernels failed their check: the sweep uses plain torch ops and aten attention")
            impl, backend = "torch", "aten"
    empty_cache(dev)
    return backend, impl


def run_sweep(cfg: SweepConfig) -> int:
    dev = cfg.device
    if torch is None or (is_cuda(dev) and not torch.cuda.is_available()):
        log.error("replica sweep: --device %s needs a CUDA GPU (torch.cuda.is_available() is False)", dev)
        return 2
    t0 = time.time()
    sink = CsvSink(cfg.out)
    props = torch.cuda.get_device_properties(0) if is_cuda(dev) else None
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
        backend, impl = _run_checks(cfg, sink, backend, impl)
    manifest["backend"], manifest["impl"] = backend, impl
    (cfg.out / "replica_manifest.json").write_text(json.dumps(manifest, indent=2))
    for path in cfg.models:
        try:
            sweep_model(cfg, path, sink, copy_bw, backend, t0, impl)
        except Exception as e:  # one model's failure must not lose the others
            log.exception("%s failed", path)
            sink.write("replica_checks", {"check": "sweep_model", "ok": False, "note": f"{path.name}: {e}"[:200]})
        empty_cache(dev)
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
    lines = [f"{'model':36s} {'N':>8s} {'k':>2s} {'B':>2s} {'nat ms':>8s} {'win ms':>8s} {'ratio':>6s} {'floor':>6s}"]
    for r in rows:
        lines.append(
            f"{r['model']:36s} {int(r['context']):8d} {int(r['k']):2d} {int(r.get('batch') or 1):2d} "
            f"{float(r['step_nat_ms']):8.3f} {float(r['step_win_ms']):8.3f} {float(r['ratio']):6.3f} "
            f"{float(r['predicted_ratio']):6.3f}"
        )
    sys.stdout.write("\n".join(lines) + "\n")
