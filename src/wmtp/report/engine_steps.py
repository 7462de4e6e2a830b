"""A real engine's decode cycle next to the GPU replica's, the cost model's and the ceiling, and its break-even.

The step files (``measurements/<device>/vllm_<model>.csv``, written by ``wmtp step-table`` from a real engine's
cells; ``wmtp.analyze.steps`` owns their columns) give one cycle's time per arm, k, context and batch. From them:

- the cost-side ratio mtp / wmtp at matched k, context and batch: what windowing the draft saves per cycle in
  that engine, acceptance aside;
- beside it the replica's and the cost model's ratio at the same shape (the tidy replica table) and the ceiling
  1 + k/L_full, which holds when the draft's KV reads are all that windowing removes;
- the break-even acceptance: the tokens a cycle must yield for a drafting arm to decode as fast as no draft,
  its cycle over the no-draft step (1 + the accepted drafts per cycle; at most k + 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from wmtp.report.compare import canonical_model, model_file
from wmtp.report.labels import arm_order, context_label, fmt_interval, series_label
from wmtp.report.load import Section

# A step file's name says its engine and its model: ``<engine>_<model>.csv``.
STEP_FILE_ENGINES = {"vllm_": "vLLM", "sglang_": "SGLang"}


def step_file_engine(path: Path) -> tuple[str, str]:
    """The engine and the model a step file is of, from its name; refused where the name names no engine."""
    for prefix, engine in STEP_FILE_ENGINES.items():
        if path.stem.startswith(prefix):
            return engine, path.stem.removeprefix(prefix)
    raise ValueError(
        f"{path}: a step file is named <engine>_<model>.csv, the engine one of {sorted(STEP_FILE_ENGINES)}"
    )


def load_engine_steps(paths: Iterable[Path | str]) -> pd.DataFrame | None:
    """The step files, one frame with the engine and the model of each (from its name), or None."""
    frames = []
    for path in sorted(Path(p) for p in paths):
        frame = pd.read_csv(path)
        if frame.empty:
            continue
        engine, model = step_file_engine(path)
        frames.append(frame.assign(model=model, engine=engine))
    return pd.concat(frames, ignore_index=True) if frames else None


def break_even_tokens(step_ms: float, none_ms: float) -> float:
    """Tokens a cycle must yield for an arm whose cycle takes ``step_ms`` to decode as fast as no draft."""
    if not (step_ms > 0 and none_ms > 0):
        return math.nan
    return step_ms / none_ms


def _batches(replica: pd.DataFrame) -> pd.Series:
    """Requests per step of each replica row (one in tables from before the batch sweep)."""
    if "batch" not in replica.columns:
        return pd.Series(1, index=replica.index)
    return pd.to_numeric(replica["batch"], errors="coerce").fillna(1)


def _replica_ratio(replica: pd.DataFrame | None, model: str, context: int, k: int, batch: int) -> tuple[float, float]:
    """The replica's measured and the cost model's predicted ratio at that shape, or NaNs."""
    if replica is None or replica.empty or "measured_ratio" not in replica.columns:
        return math.nan, math.nan
    names = replica["model"].map(canonical_model)
    at = replica[
        (names == canonical_model(model))
        & (replica["context"] == context)
        & (replica["k"] == k)
        & (_batches(replica) == batch)
        & (replica["arm"] == "mtp")
    ]
    if at.empty:
        return math.nan, math.nan
    return float(at["measured_ratio"].iloc[0]), float(at["predicted_ratio"].iloc[0])


def _with_attention(steps: pd.DataFrame) -> pd.DataFrame:
    """The step rows with ``attention_config`` as text, empty for the engine's defaults (and in a step file from
    before the column)."""
    if "attention_config" not in steps.columns:
        return steps.assign(attention_config="")
    return steps.assign(attention_config=[v if isinstance(v, str) else "" for v in steps["attention_config"]])


def _engine_names(steps: pd.DataFrame) -> pd.Series:
    return steps["engine"] if "engine" in steps.columns else pd.Series("vLLM", index=steps.index)


def _engine_labels(steps: pd.DataFrame) -> list[str]:
    steps = _with_attention(steps)
    return [
        engine_label(v, a, name)
        for v, a, name in zip(steps["engine_version"], steps["attention_config"], _engine_names(steps), strict=True)
    ]


def engine_label(version: str, attention_config: str = "", engine: str = "vLLM") -> str:
    """'vLLM 0.24.0', or 'vLLM 0.24.0, attention flash_attn_max_num_splits_for_cuda_graph=128' where the servers
    ran with attention options of their own: the same release set otherwise is another engine."""
    return f"{engine} {version}" + (f", attention {attention_config}" if attention_config else "")


def ceiling_ratio(model: str, k: int) -> float:
    """1 + k/L_full for that model: the most windowing the draft can save per cycle when only KV reads count."""
    from wmtp.analyze.costmodel import limit_ratio

    # A study's checkpoint name ("…-nvfp4") finds its facts file; the replica's vendor spelling finds it by its name.
    path = model_file(str(model).lower()) or model_file(canonical_model(model))
    return limit_ratio(path, k) if path else math.nan


# A windowed row's plugin, as the report tells plugins apart: where it set the window ("cycle", "forward"), and
# ", Triton kernels" where the plugin's own kernels set it on the device.
TRITON_KERNELS = ", Triton kernels"


def _plugin_keys(rows: pd.DataFrame) -> pd.Series:
    """Each windowed row's plugin key (a step file from before the plugin kept a cycle's window: "forward")."""
    anchors = rows["window_anchor"].fillna("forward").astype(str) if "window_anchor" in rows.columns else None
    if anchors is None:
        return pd.Series("forward", index=rows.index)
    if "window_kernels" not in rows.columns:
        return anchors
    kernels = rows["window_kernels"].fillna("").astype(str)
    return anchors + kernels.map(lambda v: TRITON_KERNELS if v == "triton" else "")


def plugin_order(key: object) -> tuple[bool, bool, str]:
    """Sorts plugin keys newest first: the window set once a cycle by the plugin's Triton kernels, then once a cycle
    by PyTorch operations, then for each forward."""
    text = str(key)
    return (not text.startswith("cycle"), not text.endswith(TRITON_KERNELS), text)


def newest_plugin_first(rows: pd.DataFrame) -> pd.DataFrame:
    """Windowed rows ordered by their plugin, newest first (``plugin_order``); rows of one plugin keep their order.
    Rows without a plugin key (no ``window_anchor`` column) are returned as they are."""
    if "window_anchor" not in rows.columns or rows.empty:
        return rows
    keys = _plugin_keys(rows)
    return rows.loc[sorted(rows.index, key=lambda i: plugin_order(keys[i]))]


def _anchors(group: pd.DataFrame, k: int) -> list[str]:
    """The plugins that measured wmtp at that k: where each set a draft forward's window ("cycle", "forward"), and by
    which kernels (``_plugin_keys``), newest first."""
    rows = group[(group["arm"] == "wmtp") & (group["k"] == k)]
    return sorted(set(_plugin_keys(rows)), key=plugin_order)


def _windowed(
    group: pd.DataFrame, k: int, context: int, anchor: str = "forward"
) -> tuple[pd.Series | None, pd.Series | None]:
    """The windowed row at that k whose window acts at this context, and the control row whose S + W covers it, of
    the plugin ``anchor`` names (``_plugin_keys``)."""
    rows = group[(group["arm"] == "wmtp") & (group["k"] == k)]
    rows = rows[_plugin_keys(rows) == anchor]
    if "W" not in rows.columns:  # a step file from before windows were recorded: every row windowed
        return (rows.iloc[0] if len(rows) else None), None
    sink = pd.to_numeric(rows["S"], errors="coerce").fillna(0) if "S" in rows.columns else 0
    reach = sink + pd.to_numeric(rows["W"], errors="coerce").fillna(0)
    acting, control = rows[reach < context], rows[reach >= context]
    return (acting.iloc[0] if len(acting) else None), (control.iloc[0] if len(control) else None)


def cell_number(row: pd.Series | None, column: str) -> float:
    """A row's cell as a float: NaN where the row, the column or a number is missing."""
    if row is None or column not in row.index:
        return math.nan
    value = pd.to_numeric(pd.Series([row[column]]), errors="coerce").iloc[0]
    return float(value)


def _interval_text(ratio: float, lo: float, hi: float, single: str = "one server each") -> str:
    """The ratio with its range over pairings of servers; 'not resolved' where the range holds 1, no verdict where
    there is a single pairing (``single`` says so)."""
    if math.isnan(ratio):
        return ""
    if lo == hi:
        return f"{ratio:.2f} ({single})"
    verdict = "" if lo > 1 or hi < 1 else ", not resolved"
    return f"{ratio:.2f} [{lo:.2f}, {hi:.2f}]{verdict}"


def _same_gpu_text(interval: pd.Series) -> str:
    """The ratio over the pairings of servers that ran on one GPU, and how many pairings; '–' where none did."""
    pairs = int(interval["same_gpu_pairs"])
    if pairs == 0:
        return "–"
    text = _interval_text(interval["same_gpu"], interval["same_gpu_lo"], interval["same_gpu_hi"], "one pairing")
    return f"{text}, {_count(pairs, 'pairing')} of {interval['same_gpu_servers']} servers"


def engine_step_section(steps: pd.DataFrame | None, replica: pd.DataFrame | None) -> Section:
    """One row per (model, engine version and attention options, context, k, batch, window anchor) where the
    engine measured mtp and wmtp at that k.

    The ratio mtp / wmtp is of the medians of each arm's servers, with its range over every pairing of one server
    of each, and over the pairings whose two servers ran on one GPU; each arm's cycle is also shown as a multiple
    of its byte floor, and the clock that timed it.
    """
    need = {"arm", "k", "context", "batch", "step_ms", "n", "engine_version", "model"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return Section()
    from wmtp.analyze.steps import server_ratio

    steps = _with_attention(steps).assign(engine=_engine_names(steps))
    keys = ["model", "engine", "engine_version", "attention_config", "context", "batch"]
    rows = []
    for (model, name, version, attention, context, batch), group in steps.groupby(keys, sort=True):
        none = group[group["arm"] == "none"]
        none_row = none.iloc[0] if len(none) else None
        none_ms = cell_number(none_row, "step_ms")
        ks = sorted(set(group.loc[group["arm"] == "mtp", "k"]) & set(group.loc[group["arm"] == "wmtp", "k"]))
        for k, anchor in ((each, anchor) for each in ks for anchor in _anchors(group, int(each))):
            mtp = group[(group["arm"] == "mtp") & (group["k"] == k)].iloc[0]
            wmtp, control = _windowed(group, int(k), int(context), anchor)
            if wmtp is None:
                continue
            pair = pd.DataFrame([mtp, wmtp])
            interval = server_ratio(pair, "mtp", "wmtp").iloc[0]
            window_off = _control_ratios(control, mtp, wmtp)
            replica_ratio, model_ratio = _replica_ratio(replica, model, int(context), int(k), int(batch))
            servers = [cell_number(r, "servers") for r in (none_row, mtp, wmtp)]
            clocks = {str(r["clock"]) for r in (none_row, mtp, wmtp) if r is not None and "clock" in r.index}
            rows.append(
                {
                    "model": model,
                    "engine": engine_label(version, attention, name),
                    "context": context_label(context),
                    "tokens": int(context),
                    "k": int(k),
                    "batch": int(batch),
                    "wmtp window set per": anchor,
                    "clock": "/".join(sorted(clocks)) or "client",
                    "none (ms)": round(none_ms, 2),
                    "mtp (ms)": round(float(mtp["step_ms"]), 2),
                    "wmtp (ms)": round(float(wmtp["step_ms"]), 2),
                    "wmtp, window off (ms)": round(cell_number(control, "step_ms"), 2),
                    "servers none/mtp/wmtp": "/".join("–" if math.isnan(v) else str(int(v)) for v in servers),
                    "n none/mtp/wmtp": "/".join(
                        str(int(cell_number(r, "n") or 0)) if r is not None else "0" for r in (none_row, mtp, wmtp)
                    ),
                    "engine mtp / wmtp": float(interval["ratio"]),
                    "ratio_lo": float(interval["ratio_lo"]),
                    "ratio_hi": float(interval["ratio_hi"]),
                    "mtp / wmtp [range over servers]": _interval_text(
                        float(interval["ratio"]), float(interval["ratio_lo"]), float(interval["ratio_hi"])
                    ),
                    "mtp / wmtp, servers on one GPU": _same_gpu_text(interval),
                    "gpus": int(interval["gpus"]),
                    "same_gpu": float(interval["same_gpu"]),
                    "same_gpu_lo": float(interval["same_gpu_lo"]),
                    "same_gpu_hi": float(interval["same_gpu_hi"]),
                    "same_gpu_pairs": int(interval["same_gpu_pairs"]),
                    **_leading_ratio(interval),
                    **window_off,
                    "replica": round(replica_ratio, 3),
                    "cost model": round(model_ratio, 3),
                    "ceiling 1 + k/L_full": round(ceiling_ratio(model, int(k)), 3),
                    "× floor none/mtp/wmtp": "/".join(
                        "–" if math.isnan(cell_number(r, "over_floor")) else f"{cell_number(r, 'over_floor'):.1f}"
                        for r in (none_row, mtp, wmtp)
                    ),
                    "break-even tokens/cycle, mtp": round(break_even_tokens(float(mtp["step_ms"]), none_ms), 2),
                    "break-even tokens/cycle, wmtp": round(break_even_tokens(float(wmtp["step_ms"]), none_ms), 2),
                    # The plugin's count over the wmtp cell's whole server, all of its rungs.
                    "windowed draft forwards (server)": cell_number(wmtp, "windowed_forwards"),
                }
            )
    return Section(pd.DataFrame(rows))


#: The engine section's numeric columns behind its text ones (figures read them, a table shows the text).
NUMERIC_COLUMNS = [
    "tokens",
    "engine mtp / wmtp",
    "ratio_lo",
    "ratio_hi",
    "same_gpu",
    "same_gpu_lo",
    "same_gpu_hi",
    "same_gpu_pairs",
    "lead",
    "lead_lo",
    "lead_hi",
    "lead_pairs",
    "lead_on_one_gpu",
    "control servers",
    "window off / wmtp",
    "off_lo",
    "off_hi",
    "off_same_gpu",
    "mtp / window off",
    "mtp_off_lo",
    "mtp_off_hi",
]

# The control is its own arm in these ratios: the plugin loaded, its window covering every context.
_OFF = "off"


# A ratio of no pairing at all: where a shape has no window-off control.
_NO_RATIO = pd.Series(
    {"ratio": math.nan, "ratio_lo": math.nan, "ratio_hi": math.nan, "same_gpu": math.nan, "same_gpu_pairs": 0}
)


def _control_ratios(control: pd.Series | None, mtp: pd.Series, wmtp: pd.Series) -> dict[str, object]:
    """The window-off control against the windowed row (what the window alone saves, free of native MTP's spread
    between servers) and native MTP against the control (what loading the plugin costs or saves by itself), each
    with its range over pairings of servers and over the pairings on one GPU; NaN and '' without a control."""
    from wmtp.analyze.steps import server_ratio

    saved = cost = _NO_RATIO
    if control is not None:
        off = control.copy()
        off["arm"] = _OFF
        saved = server_ratio(pd.DataFrame([off, wmtp]), _OFF, "wmtp").iloc[0]
        cost = server_ratio(pd.DataFrame([mtp, off]), "mtp", _OFF).iloc[0]
    ratio = {
        name: [float(r[key]) for key in ("ratio", "ratio_lo", "ratio_hi")]
        for name, r in (("saved", saved), ("cost", cost))
    }
    return {
        "control servers": cell_number(control, "servers"),
        "window off / wmtp": ratio["saved"][0],
        "off_lo": ratio["saved"][1],
        "off_hi": ratio["saved"][2],
        "off_same_gpu": float(saved["same_gpu"]),
        "window off / wmtp [range over servers]": fmt_interval(*ratio["saved"], null=1.0),
        "window off / wmtp, servers on one GPU": _same_gpu_text(saved) if control is not None else "",
        "mtp / window off": ratio["cost"][0],
        "mtp_off_lo": ratio["cost"][1],
        "mtp_off_hi": ratio["cost"][2],
        "mtp / window off [range over servers]": fmt_interval(*ratio["cost"], null=1.0),
        "mtp / window off, servers on one GPU": _same_gpu_text(cost) if control is not None else "",
    }


def _leading_ratio(interval: pd.Series) -> dict[str, float]:
    """The ratio the answer and its figure lead with: where the two arms' servers ran on several GPUs and some
    pairs of them on one, the ratio over those pairings (GPUs have differed by more than the arms), else over every
    pairing; ``lead_pairs`` how many pairings it rests on, ``lead_on_one_gpu`` 1 where it is the one-GPU ratio."""
    on_one = int(interval["gpus"]) > 1 and int(interval["same_gpu_pairs"]) > 0
    key = "same_gpu" if on_one else "ratio"
    each = [int(n) for n in str(interval["servers"]).split("/")]
    pairs = int(interval["same_gpu_pairs"]) if on_one else each[0] * each[1]
    return {
        "lead": float(interval[key]),
        "lead_lo": float(interval[f"{key}_lo"]),
        "lead_hi": float(interval[f"{key}_hi"]),
        "lead_pairs": pairs,
        "lead_on_one_gpu": int(on_one),
    }


def _windows(pairs: Iterable[tuple[float, float]]) -> str:
    return " and ".join(f"S {int(sink)}, W {int(window)}" for sink, window in dict.fromkeys(pairs))


def _engine_window(sink: float, window: float, read_sink: float) -> str:
    text = f"S {int(sink)}, W {int(window)}"
    if math.isnan(read_sink) or read_sink <= sink:
        return text
    # The engine rounds the sink up to whole KV blocks: a sink of at most half what it read took one block.
    blocks = f"one {int(read_sink)}-token block" if 2 * sink <= read_sink else f"{int(read_sink)} tokens"
    return f"{text}, which it reads as a sink of {blocks}"


def windows_sentence(steps: pd.DataFrame | None, replica: pd.DataFrame | None) -> str:
    """The sink and window the replica ran (from its table) and the engine's windowed arm (from its step file, with
    the sink it really read), e.g. 'The replica ran S 16, W 128; the engine S 16, W 4096, which it reads as a sink
    of one 560-token block.' Only the windows that act at some context: a window-off control is said apart."""
    parts = []
    if replica is not None and not replica.empty and {"sink", "window"} <= set(replica.columns):
        parts.append(f"The replica ran {_windows(zip(replica['sink'], replica['window'], strict=True))}")
    if steps is not None and not steps.empty and {"S", "W"} <= set(steps.columns):
        rows = steps[(steps["arm"] == "wmtp") & (_numeric(steps, "S") + _numeric(steps, "W") < steps["context"])]
        engine = [
            _engine_window(float(s), float(w), cell_number(r, "read_sink_tokens"))
            for (s, w), r in rows.groupby(["S", "W"], sort=True).first().iterrows()
        ]
        if engine:
            parts.append(("the engine " if parts else "The engine ran ") + " and ".join(engine))
    return "; ".join(parts) + "." if parts else ""


# --------------------------------------------------------------------------------------------------
# Each arm's cycle, and the step file's own checks: the two clocks and the growth between contexts
# --------------------------------------------------------------------------------------------------

#: A shape whose request's two decode windows (engine's and client's) differ by more than this is listed.
CLOCK_DISAGREEMENT_LIMIT = 0.03


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _series(row: pd.Series) -> str:
    """'none', 'mtp k=3', 'wmtp k=3 S=16 W=4096': the step file's arm and draft settings, as the figures name them;
    a windowed row whose plugin recorded where it set the window adds it ('…, window per cycle'), since two plugins
    that differ there are never pooled."""
    label = series_label({"arm": row.get("arm"), "k": row.get("k"), "sink": row.get("S"), "window": row.get("W")})
    anchor = row.get("window_anchor")
    if not (isinstance(anchor, str) and anchor):
        return label
    kernels = TRITON_KERNELS if row.get("window_kernels") == "triton" else ""
    return f"{label}, window per {anchor}{kernels}"


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    if column not in frame.columns:
        return pd.Series(math.nan, index=frame.index, dtype=float)
    return pd.to_numeric(frame[column], errors="coerce").astype(float)


def engine_cycles(steps: pd.DataFrame | None) -> pd.DataFrame:
    """One row per (model, engine version, batch, series, context): the cycle by the engine's clock with its lowest
    and highest request, and by the client's clock; sorted by arm, then context."""
    need = {"arm", "k", "context", "batch", "step_ms", "engine_version", "model"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return pd.DataFrame()
    out = pd.DataFrame(
        {
            "model": steps["model"],
            "engine": _engine_labels(steps),
            "batch": steps["batch"].astype(int),
            "arm": steps["arm"].astype(str),
            "series": [_series(r) for _, r in steps.iterrows()],
            "tokens": steps["context"].astype(int),
            "context": [context_label(c) for c in steps["context"]],
            "step_ms": _numeric(steps, "step_ms"),
            "step_ms_min": _numeric(steps, "step_ms_min"),
            "step_ms_max": _numeric(steps, "step_ms_max"),
            "client_step_ms": _numeric(steps, "client_step_ms"),
            "clock_disagreement_max": _numeric(steps, "clock_disagreement_max"),
            "clock": steps["clock"].astype(str) if "clock" in steps.columns else "client",
        }
    )
    return arm_order(out).sort_values(["model", "engine", "batch"], kind="stable").reset_index(drop=True)


def clock_check_section(steps: pd.DataFrame | None, limit: float = CLOCK_DISAGREEMENT_LIMIT) -> Section:
    """Every shape whose largest disagreement between one request's two decode windows exceeds ``limit``: both
    cycles, the client's relative to the engine's, and that largest disagreement. The note says which clock the
    report uses; an empty table (the clocks agree within ``limit``) still gets it."""
    cycles = engine_cycles(steps)
    if cycles.empty:
        return Section()
    over = cycles[cycles["clock_disagreement_max"] > limit]
    table = pd.DataFrame(
        {
            "model": over["model"],
            "engine": over["engine"],
            "series": over["series"],
            "context": over["context"],
            "engine's cycle (ms)": over["step_ms"].round(2),
            "client's cycle (ms)": over["client_step_ms"].round(2),
            "client vs engine, median (%)": (100 * (over["client_step_ms"] / over["step_ms"] - 1)).round(1),
            "largest disagreement of one request (%)": (100 * over["clock_disagreement_max"]).round(1),
        }
    ).reset_index(drop=True)
    return Section(table, (clock_sentence(steps, limit),))


def clock_sentence(steps: pd.DataFrame | None, limit: float = CLOCK_DISAGREEMENT_LIMIT) -> str:
    """One sentence: the engine's clock times every cycle, and how far the client's strayed from it."""
    cycles = engine_cycles(steps)
    if cycles.empty:
        return ""
    over = cycles[cycles["clock_disagreement_max"] > limit]
    used = (
        "Every cycle in this report is timed by the engine's own clock (vLLM's per-request first-to-last-token "
        "time), not by the client's"
    )
    if over.empty:
        return f"{used}; no shape's two clocks differed by more than {100 * limit:.0f} % in any request."
    shorter = over["client_step_ms"] < over["step_ms"]
    side = "shorter" if shorter.all() else "longer" if not shorter.any() else "apart"
    return (
        f"{used}; in {_count(len(over), 'shape')} one request's two decode windows differed by more than "
        f"{100 * limit:.0f} % "
        f"(at most {100 * over['clock_disagreement_max'].max():.1f} %, the client's reading {side}), listed here."
    )


def growth_check_section(steps: pd.DataFrame | None) -> Section:
    """The step file's growth check: each shape's growth from the same configuration's next shorter context beside
    the least its extra bytes allow, flagged where it is below that floor, and whether the growth was taken within
    servers that measured both contexts or between the medians of different servers (which can differ by more
    than the growth itself)."""
    if steps is None or steps.empty or "growth_ms" not in steps.columns:
        return Section()
    rows = []
    has_servers = "growth_servers" in steps.columns
    for (model, engine, batch, series), group in steps.assign(
        series=[_series(r) for _, r in steps.iterrows()], engine=_engine_labels(steps)
    ).groupby(["model", "engine", "batch", "series"], sort=False):
        ordered = group.sort_values("context")
        for (_, shorter), (_, longer) in zip(ordered.iterrows(), ordered.iloc[1:].iterrows(), strict=False):
            growth, floor = cell_number(longer, "growth_ms"), cell_number(longer, "growth_floor_ms")
            if math.isnan(growth):
                continue
            servers = int(cell_number(longer, "growth_servers")) if has_servers else None
            where = (
                "not recorded"
                if servers is None
                else f"within {_count(servers, 'server')}"
                if servers > 0
                else "across servers (medians of different servers)"
            )
            below = not math.isnan(floor) and growth < floor
            rows.append(
                {
                    "model": model,
                    "engine": engine,
                    "batch": int(batch),
                    "series": series,
                    "from → to": f"{context_label(shorter['context'])} → {context_label(longer['context'])}",
                    "growth (ms)": round(growth, 2),
                    "floor of the growth (ms)": round(floor, 2),
                    "check": f"{'below' if below else 'at or above'} its floor, {where}",
                }
            )
    frame = pd.DataFrame(rows)
    if frame.empty:
        return Section()
    return Section(frame, (growth_sentence(frame),))


def growth_sentence(frame: pd.DataFrame) -> str:
    """One sentence over :func:`growth_check_section`'s table: how many growths fall below their floor, and where."""
    below = frame[frame["check"].str.startswith("below")]
    if below.empty:
        return (
            f"Each of the {_count(len(frame), 'growth')} from one context to the next is at least the least its "
            "extra bytes allow at the GPU's peak bandwidth."
        )
    across = int(below["check"].str.contains("across servers").sum())
    return (
        f"{len(below)} of {_count(len(frame), 'growth')} fall below the least their extra bytes allow, "
        f"{across} of them taken across servers (which differ by more than a context's extra bytes take) and "
        f"{len(below) - across} within a server, where the floor is a real test."
    )


def window_gain_split(steps: pd.DataFrame | None) -> Section:
    """What the window saves a cycle (native MTP's cycle less the windowed draft's, ms) in the engine as it ships and
    in each tuned build of it (other attention options), beside what the window's bytes allow (the difference of the
    two cycles' byte floors): per (model, context, k, batch, window anchor) where both engines measured both arms.
    The default engine's saving less a tuned one's is what those options took away (in vLLM 0.24 on an H200,
    FlashAttention's split cap); a tuned saving away from the bytes is what the kernels and the host add or take."""
    need = {"arm", "k", "context", "batch", "step_ms", "floor_ms", "engine_version", "model"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return Section()
    steps = _with_attention(steps)
    rows = []
    for (model, version, context, batch), group in steps.groupby(["model", "engine_version", "context", "batch"]):
        options = sorted(set(group["attention_config"]))
        if "" not in options or len(options) < 2:
            continue
        for k in sorted(set(group.loc[group["arm"] == "mtp", "k"])):
            saved = {}
            for attention in options:
                engine = group[group["attention_config"] == attention]
                mtp = engine[(engine["arm"] == "mtp") & (engine["k"] == k)]
                wmtp, _ = _windowed(engine, int(k), int(context), "cycle")
                if len(mtp) and wmtp is not None:
                    saved[attention] = (mtp.iloc[0], wmtp)
            if "" not in saved:
                continue
            default_mtp, default_wmtp = saved[""]
            by_bytes = float(default_mtp["floor_ms"]) - float(default_wmtp["floor_ms"])
            default_saved = float(default_mtp["step_ms"]) - float(default_wmtp["step_ms"])
            for attention, (mtp, wmtp) in saved.items():
                if not attention:
                    continue
                tuned_saved = float(mtp["step_ms"]) - float(wmtp["step_ms"])
                spread = _server_range(default_mtp) + _server_range(default_wmtp)
                tuned_servers = (int(mtp["servers"]), int(wmtp["servers"]))
                rows.append(
                    {
                        "model": model,
                        "context": context_label(context),
                        "k": int(k),
                        "batch": int(batch),
                        "tuned engine": engine_label(version, attention),
                        "saved, default (ms)": round(default_saved, 3),
                        "saved, tuned (ms)": round(tuned_saved, 3),
                        "by bytes (ms)": round(by_bytes, 3),
                        "taken by the tuned options (ms)": round(default_saved - tuned_saved, 3),
                        "tuned less bytes (ms)": round(tuned_saved - by_bytes, 3),
                        "default servers' range, mtp + wmtp (ms)": round(spread, 3),
                        "servers default mtp/wmtp": f"{int(default_mtp['servers'])}/{int(default_wmtp['servers'])}",
                        "servers tuned mtp/wmtp": "/".join(map(str, tuned_servers)),
                        "split": _split_verdict(default_saved - tuned_saved, spread, tuned_servers),
                    }
                )
    return Section(pd.DataFrame(rows))


def _split_verdict(taken: float, spread: float, tuned_servers: tuple[int, int]) -> str:
    """Whether what the tuned options took is told apart from the servers' own spread: not where the default
    engine's servers of the two arms range more than it; where the tuned arms ran one server each, their own spread
    is not known, and the verdict says so."""
    if not abs(taken) > spread:
        return "not resolved: the default engine's servers range more"
    if min(tuned_servers) < 2:
        return "above the default's server range; one tuned server an arm, its own range not measured"
    return "resolved"


def _server_range(row: pd.Series) -> float:
    """The highest server's median cycle less the lowest's (0 for one server)."""
    from wmtp.analyze.steps import server_steps

    medians = server_steps(row)
    return max(medians) - min(medians)


CROSS_ENGINE_ARMS = ("none", "mtp", "wmtp")


def cross_engine_section(steps: pd.DataFrame | None) -> Section:
    """The same shape in each engine: per (model, context, k), at one request, each engine's none, mtp and wmtp
    cycle (the median over its servers, its engine's default attention, the plugin's window set once a cycle where it
    ran both anchors), how many servers each came from, and its mtp / wmtp with that ratio's range over every pairing
    of one server of each arm; only where at least two engines measured mtp and wmtp there."""
    need = {"arm", "k", "context", "batch", "step_ms", "engine_version", "model"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return Section()
    from wmtp.analyze.steps import server_ratio, server_steps

    steps = _with_attention(steps).assign(engine=_engine_names(steps))
    steps = steps[(steps["attention_config"] == "") & (steps["batch"] == 1) & steps["arm"].isin(CROSS_ENGINE_ARMS)]
    if "W" in steps.columns:  # a window-off control is not the windowed arm
        steps = steps[(steps["arm"] != "wmtp") | (_numeric(steps, "W") < steps["context"])]
    rows = []
    for (model, context), group in steps.groupby(["model", "context"], sort=True):
        ks = sorted({int(k) for k in group.loc[group["arm"] == "mtp", "k"]})
        for k in ks:
            row: dict[str, object] = {"model": model, "context": context_label(context), "tokens": int(context), "k": k}
            engines = 0
            for (name, version), at in group.groupby(["engine", "engine_version"], sort=True):
                chosen = {}
                for arm in CROSS_ENGINE_ARMS:
                    # The newest plugin that measured it.
                    rows_of = newest_plugin_first(at[(at["arm"] == arm) & ((at["k"] == k) | (arm == "none"))])
                    chosen[arm] = rows_of.iloc[0] if len(rows_of) else None
                if chosen["mtp"] is None or chosen["wmtp"] is None:
                    continue
                engines += 1
                label = f"{name} {version}"
                row.update({f"{label}: {arm} (ms)": round(cell_number(chosen[arm], "step_ms"), 2) for arm in chosen})
                row[f"{label}: servers none/mtp/wmtp"] = "/".join(
                    "–" if r is None else str(len(server_steps(r))) for r in chosen.values()
                )
                # The ratio of the servers' medians, and its range over every pairing of one server of each arm.
                interval = server_ratio(pd.DataFrame([chosen["mtp"], chosen["wmtp"]]), "mtp", "wmtp").iloc[0]
                row[f"{label}: mtp / wmtp"] = round(float(interval["ratio"]), 3)
                row[f"{label}: range over servers"] = _interval_text(
                    interval["ratio"], interval["ratio_lo"], interval["ratio_hi"]
                )
            if engines >= 2:
                rows.append(row)
    if not rows:
        return Section(notes=("one engine only: no shape was measured in two engines",))
    return Section(pd.DataFrame(rows))
