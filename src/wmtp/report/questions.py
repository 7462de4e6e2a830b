"""One sentence per figure: what the figure shows, with its number and that number's interval.

After the answer, the report asks one question per section and answers it with a figure and the sentence made
here; the tables behind each figure go to the appendix. Every number goes through
:func:`wmtp.report.labels.fmt_interval`, so it is rounded to what its interval supports and reads 'not resolved'
where the interval holds no effect. A number without an interval (one pooled count, one run) says so.

A sentence is one sentence: clauses are joined by commas and semicolons, never by a full stop, so that a reader
(and the page's test) finds exactly one next to each figure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from wmtp.report.labels import context_label, fmt_interval, fmt_value
from wmtp.report.load import Section


def _longest(frame: pd.DataFrame, column: str = "rung") -> pd.DataFrame:
    """The rows at the frame's longest context."""
    values = pd.to_numeric(frame[column], errors="coerce")
    return frame[values == values.max()]


def _num(row: Any, column: str) -> float:
    try:
        value = row[column]
    except (KeyError, IndexError):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _listing(rows: Iterable[Any], text: Callable[[Any], str]) -> str:
    """'a: x, b: y and c: z', each part from ``text`` (empty parts left out)."""
    parts = [t for t in (text(r) for r in rows) if t]
    if len(parts) <= 1:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return frame.to_dict("records")


def _label(row: dict[str, Any]) -> str:
    return str(row.get("label") or row.get("series") or row.get("arm"))


def _intervals(at: pd.DataFrame, value: str, lo: str, hi: str, *, null: float | None = None, unit: str = "") -> str:
    """Each series' ``value`` with its interval [``lo``, ``hi``], listed: 'a 1.2 [1.1, 1.3] s and b …'."""
    return _listing(
        _records(at), lambda r: f"{_label(r)} {fmt_interval(_num(r, value), _num(r, lo), _num(r, hi), null=null)}{unit}"
    )


def decode_sentence(section: Section) -> str:
    """Decode rate of each series at the longest context, with its bootstrap interval over repeats."""
    if not section.available:
        return ""
    at = _longest(section.frame)
    where = context_label(at["rung"].iloc[0])
    listed = _intervals(at, "value", "lo", "hi")
    return f"At {where} each arm decoded, in tokens a second (median over repeats, bootstrap interval): {listed}."


def speedup_sentence(section: Section) -> str:
    """Each drafting series' speedup over no draft at the longest context, paired over prompts."""
    if not section.available:
        return ""
    at = _longest(section.frame)
    where = context_label(at["rung"].iloc[0])
    listed = _intervals(at, "speedup", "lo", "hi", null=1.0, unit="×")
    return (
        f"At {where} each draft decoded this many times as fast as no draft on the same prompts (95 % interval over "
        f"the prompts): {listed}."
    )


def cycle_sentence(cycle: Section, draft_tax: Section) -> str:
    """The draft's own growth as a share of the plain step's, over the widest span of contexts, with its interval;
    without a no-draft arm, each series' cycle at the longest context."""
    if draft_tax.available:
        f = draft_tax.frame
        widest = f[(f["rung_to"] == f["rung_to"].max()) & (f["rung_from"] == f["rung_from"].min())]
        first = widest.iloc[0]
        span = f"{context_label(first['rung_from'])} to {context_label(first['rung_to'])}"
        listed = _listing(
            _records(widest),
            lambda r: (
                f"{_label(r)} {fmt_interval(100 * _num(r, 'share'), 100 * _num(r, 'share_lo'), 100 * _num(r, 'share_hi'), null=0.0)} %"  # noqa: E501
            ),
        )
        return (
            f"From {span} each draft's cycle grew beyond the plain step by this share of the plain step's own "
            f"growth (the draft tax, bootstrap interval): {listed}."
        )
    if not cycle.available:
        return ""
    at = _longest(cycle.frame)
    listed = _listing(_records(at), lambda r: f"{_label(r)} {fmt_value(_num(r, 'cycle_ms'), 3)} ms")
    return (
        f"At {context_label(at['rung'].iloc[0])} one cycle took {listed} (the median over repeats; a cycle has no "
        "interval of its own)."
    )


def acceptance_sentence(answer_rows: pd.DataFrame, section: Section) -> str:
    """Accepted share of drafted tokens at the longest context: from the answer's per-prompt rows with their
    interval where there are some, else the pooled count, which has none."""
    if not section.available:
        return ""
    rows = answer_rows[answer_rows["quantity"] == "acceptance"] if not answer_rows.empty else answer_rows
    if not rows.empty:
        at = _longest(rows)
        labels = _labels_of(at, section.frame)
        listed = _listing(
            _records(at.assign(label=labels)),
            lambda r: f"{_label(r)} {fmt_interval(100 * _num(r, 'value'), 100 * _num(r, 'lo'), 100 * _num(r, 'hi'))} %",
        )
        return (
            f"At {context_label(at['rung'].iloc[0])} each draft's accepted share of its drafted tokens was (95 % "
            f"interval over the prompts) {listed}."
        )
    at = _longest(section.frame)
    listed = _listing(_records(at), lambda r: f"{_label(r)} {fmt_value(100 * _num(r, 'acceptance_rate'), 3)} %")
    return (
        f"At {context_label(at['rung'].iloc[0])} each draft accepted {listed} of its drafted tokens, one count "
        "pooled over the rung's requests with no interval."
    )


def _labels_of(rows: pd.DataFrame, labelled: pd.DataFrame) -> list[str]:
    """The labels the figures give ``rows``' series, looked up in a labelled section's frame."""
    keys = [c for c in ("model", "engine", "concurrency", "workload", "arm", "k", "sink", "window") if c in rows]
    keys = [c for c in keys if c in labelled.columns]

    def part(value: Any) -> str:
        # 16, 16.0 and Int64's 16 name the same window; a missing one is missing whatever its type
        if value is None or pd.isna(value):
            return ""
        number = pd.to_numeric(pd.Series([value]), errors="coerce").iloc[0]
        return str(value) if pd.isna(number) else f"{float(number):g}"

    def key(r: dict[str, Any]) -> tuple:
        return tuple(part(r[c]) for c in keys)

    names = {key(r): _label(r) for r in _records(labelled)}
    return [names.get(key(r), str(r.get("arm"))) for r in _records(rows)]


def positions_sentence(section: Section) -> str:
    """The first and the last draft position's acceptance at the longest context, per series (pooled counts)."""
    if not section.available:
        return ""
    at = _longest(section.frame)
    parts = []
    for label, g in at.groupby("label", sort=False):
        g = g.sort_values("position")
        first, last = 100 * float(g["rate"].iloc[0]), 100 * float(g["rate"].iloc[-1])
        parts.append(f"{label} from {fmt_value(first, 2)} % at position 1 to {fmt_value(last, 2)} % at {len(g)}")
    return (
        f"At {context_label(at['rung'].iloc[0])} the share of verify cycles that accepted a draft position fell "
        f"from the first to the last: {_listing(parts, str)} (one count pooled over the rung's requests, with no "
        "interval)."
    )


def window_cost_sentence(section: Section) -> str:
    """Each windowed draft's acceptance against the full draft's on the same prompts, where the copied passage
    sat farthest beyond its window, with the paired interval."""
    if not section.available:
        return ""
    f = section.frame
    windowed = f[f["window"].notna() & f["vs_full"].notna()]
    if windowed.empty:
        return ""
    farthest = windowed.loc[windowed.groupby(["arm", "sink", "window"], dropna=False)["distance_over_window"].idxmax()]
    listed = _listing(
        _records(farthest),
        lambda r: (
            f"{r['arm']} W={int(r['window']):,} at {fmt_value(_num(r, 'distance_over_window'), 2)} windows back "
            f"{fmt_interval(100 * _num(r, 'vs_full'), 100 * _num(r, 'vs_full_lo'), 100 * _num(r, 'vs_full_hi'), null=0.0)} "  # noqa: E501
            "points"
        ),
    )
    return (
        "Where the copied passage sat farthest beyond each window, the windowed draft's acceptance differed from "
        f"the full draft's on the same prompts by (95 % interval over the prompts) {listed}."
    )


def energy_sentence(section: Section) -> str:
    """Decode tokens per joule of each series at the longest context, with its bootstrap interval."""
    if not section.available:
        return ""
    at = _longest(section.frame)
    listed = _intervals(at, "tok_per_j", "tok_per_j_lo", "tok_per_j_hi")
    return (
        f"At {context_label(at['rung'].iloc[0])} a joule decoded, in tokens (bootstrap interval over repeats; the "
        f"right panel is the board's power): {listed}."
    )


def prefill_sentence(section: Section) -> str:
    """Time to first token of each series at the longest context, with its bootstrap interval."""
    if not section.available:
        return ""
    at = _longest(section.frame)
    listed = _intervals(at, "ttft_s", "ttft_s_lo", "ttft_s_hi", unit=" s")
    return (
        f"At {context_label(at['rung'].iloc[0])} the first token came after (bootstrap interval over repeats; the "
        f"right panel is the prefill's rate): {listed}."
    )


def wedge_sentence(section: Section) -> str:
    """What windowing saved per cycle at the longest context: this study's with its interval, the GPU replica's
    (one run each, no interval)."""
    if not section.available:
        return ""
    f = section.frame
    parts = []
    measured = f[f["source"] == "measured"]
    if not measured.empty:
        at = _longest(measured)
        parts.append(
            f"in this study at {context_label(at['rung'].iloc[0])}, "
            + _listing(
                _records(at),
                lambda r: (
                    f"{r['variant']} k={int(r['k'])} "
                    f"{fmt_interval(100 * _num(r, 'wedge'), 100 * _num(r, 'wedge_lo'), 100 * _num(r, 'wedge_hi'), null=0.0)} %"  # noqa: E501
                ),
            )
            + " (bootstrap interval over repeats)"
        )
    replica = f[f["source"] == "replica"]
    if not replica.empty:
        at = _longest(replica)
        parts.append(
            f"in the GPU replica at {context_label(at['rung'].iloc[0])}, "
            + _listing(
                _records(at),
                lambda r: f"{r['model']} k={int(r['k'])} {fmt_value(100 * _num(r, 'wedge'), 3)} %",
            )
            + " (one run each, no interval)"
        )
    return f"Native MTP's cycle exceeded the windowed draft's by: {'; '.join(parts)}."


def replica_batch_sentence(section: Section) -> str:
    """The replica's ratio at each model's largest batch beside the ceiling (one run each, no interval)."""
    if not section.available:
        return ""
    f = section.frame
    top = f.loc[f.groupby(["model", "k"])["batch"].idxmax()]
    listed = _listing(
        _records(top),
        lambda r: (
            f"{r['model']} k={int(r['k'])} {fmt_value(_num(r, 'replica (H200)'), 3)} at {int(r['batch'])} requests "
            f"(ceiling {fmt_value(_num(r, 'ceiling 1 + k/L_full'), 3)})"
        ),
    )
    return f"As requests were added the replica's cost-side ratio rose to {listed}, one run each with no interval."


def costmodel_sentence(section: Section) -> str:
    """Measured against the cost model at the longest context, per series and quantity (no interval)."""
    if not section.available:
        return ""
    at = _longest(section.frame)
    units = {"draft_share_pct": " %", "cost_side_ratio": "×"}
    names = {"draft_share_pct": "draft's share of the target's growth", "cost_side_ratio": "cost-side ratio"}
    listed = _listing(
        _records(at),
        lambda r: (
            f"{_label(r)} {names.get(r['quantity'], r['quantity'])} {fmt_value(_num(r, 'measured'), 3)}"
            f"{units.get(r['quantity'], '')} against {fmt_value(_num(r, 'predicted'), 3)}"
            f"{units.get(r['quantity'], '')}"
        ),
    )
    return (
        f"At {context_label(at['rung'].iloc[0])} the measurement set against the cost model reads {listed} "
        "(medians over repeats, no interval)."
    )


def engine_cycle_sentence(cycles: pd.DataFrame) -> str:
    """Each arm's cycle on the real engine at its longest context, with its lowest and highest request, and which
    clock timed it."""
    if cycles.empty:
        return ""
    at = _longest(cycles, "tokens")
    listed = _listing(
        _records(at),
        lambda r: (
            f"{r['series']} {fmt_interval(_num(r, 'step_ms'), _num(r, 'step_ms_min'), _num(r, 'step_ms_max'))} ms"
        ),
    )
    clocks = set(at["clock"]) if "clock" in at.columns else {"client"}
    # A step file from before the engine's clock was read times its cycles by the client's: say which it is.
    by = (
        "By the engine's own clock (filled marks; the client's are open)"
        if clocks == {"engine"}
        else f"By the {'/'.join(sorted(clocks))} clock"
    )
    return (
        f"{by}, one cycle of {at['engine'].iloc[0]} at {at['context'].iloc[0]} took, with the lowest and highest "
        f"request in brackets: {listed}."
    )


def cycle_profile_sentence(table: pd.DataFrame, gain: pd.DataFrame) -> str:
    """What the window saved on the device at the longest traced context, against what its bytes allow, and how far
    above their floors the target's attention and its dense kernels ran there."""
    if table.empty:
        return ""
    context = int(table["context"].max())
    at = table[table["context"] == context]
    parts = []
    saved = gain[(gain["context"] == context) & (gain["component"] == "draft_attn")] if not gain.empty else gain
    traced = at.drop_duplicates(["arm"])
    counted = ", ".join(
        f"{r['arm']} {int(r['cycles'])} cycles of {int(r['traces'])} request(s)" for _, r in traced.iterrows()
    )
    single = "; one request an arm, so no interval" if traced["traces"].max() == 1 else ""
    if not saved.empty:
        row = saved.iloc[0]
        parts.append(
            f"At {context_label(context)} tokens, traced ({counted}{single}), "
            f"the window took {row['saved_us'] / 1e3:.2f} ms a cycle off the "
            f"draft's attention on the device, where its bytes allow {row['saved_by_bytes_us'] / 1e3:.2f} ms: the "
            "rest is the native draft's attention kernel running above its floor"
        )
    native = at[at["arm"] == ("mtp" if "mtp" in set(at["arm"]) else at["arm"].iloc[0])].set_index("component")
    over = [
        f"{label} {native.at[name, 'over_floor']:.2f}×"
        for name, label in (("target_attn", "the target's attention"), ("target_other", "its dense kernels"))
        if name in native.index and math.isfinite(native.at[name, "over_floor"])
    ]
    if over:
        parts.append("there the native arm ran " + " and ".join(over) + " their floors")
    return ("; ".join(parts) + ".") if parts else ""
