"""Does a draft change what the model says? Each request's greedy output against the same prompt's without a draft.

The target verifies every drafted token with the full context, so a draft, windowed or not, may change how fast the
model answers and never what it answers, up to numerics (``wmtp.analyze.equality``). A study that records its
tokens (``protocol.record_tokens``: token ids and the top-2 log-probabilities of each generated token) can show it
from its own cells: a cell's prompts depend only on the workload, the rung, the repeat and the slot, so every arm of
one model, engine and concurrency answers the same prompts. The reference for a prompt is the ``none`` arm's answer
(the first server's, where several served it); without a ``none`` arm, native MTP's at the same k. Every other
answer to that prompt, other servers of the reference's arm included, is judged against it, and a windowed draft's
answer also against native MTP's at its k (``equal_to_mtp``): a difference native MTP shares comes from the engine
configured for drafting (its rounding), not from the window (docs/design.md, "Lossless up to numerics").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from wmtp.analyze.equality import equal_up_to_numerics

#: A first difference where the reference's two best tokens lay closer than this (log-probability) is a near tie that
#: bf16 numerics may flip: the trained tiny model's first bf16 divergence of a full draft from none was at a gap of
#: 0.094 (tests/test_train.py); the bound its vLLM proofs use too.
NEAR_TIE = 0.25
#: What makes two requests the same prompt in the same engine.
PROMPT_KEYS = ["model", "engine", "concurrency", "workload", "rung", "repeat", "slot"]
SERIES_KEYS = ["arm", "k", "sink", "window"]
COLUMNS = [
    *PROMPT_KEYS,
    "cell_id",
    *SERIES_KEYS,
    "reference_cell_id",
    "reference_arm",
    "tokens",
    "reference_tokens",
    "identical",
    "equal",
    "first_divergence",
    "reference_gap",
    "reason",
    "equal_to_mtp",
]
SUMMARY_COLUMNS = [
    "model",
    "engine",
    *SERIES_KEYS,
    "reference_arm",
    "requests",
    "identical",
    "equal",
    "diverged",
    "equal_to_mtp",
    "tokens",
]


def _ids(value: Any) -> list[int] | None:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    return [int(x) for x in value]


def _gaps(value: Any, length: int) -> list[float]:
    """The reference's top-2 gaps, as many as its tokens; where none were recorded only identity can be judged."""
    gaps = [] if value is None or (isinstance(value, float) and pd.isna(value)) else [float(g) for g in value]
    return gaps + [float("inf")] * (length - len(gaps))


def _reference_rows(recorded: pd.DataFrame) -> pd.DataFrame:
    """Per prompt, the row every other answer is judged against: the ``none`` arm's, else MTP's at each k."""
    ordered = recorded.sort_values("cell_id", kind="stable")
    none = ordered[ordered["arm"] == "none"].drop_duplicates(PROMPT_KEYS)
    mtp = ordered[ordered["arm"] == "mtp"].drop_duplicates([*PROMPT_KEYS, "k"])
    return pd.concat([none, mtp], ignore_index=True)


def _pick_reference(row: pd.Series, references: dict[tuple, pd.Series], mtp: dict[tuple, pd.Series]) -> Any:
    key = tuple(row[c] for c in PROMPT_KEYS)
    if key in references:
        return references[key]
    return mtp.get((*key, row["k"]))


def lossless_table(requests: pd.DataFrame, eps: float = NEAR_TIE) -> pd.DataFrame:
    """One row per measured request that has a reference answer to the same prompt (see the module docstring):
    whether its tokens are the reference's (``identical``), or first differ where the reference's top-2 gap is
    below ``eps`` (``equal``, a near tie numerics may flip), and where. Empty where no tokens were recorded."""
    needed = {*PROMPT_KEYS, *SERIES_KEYS, "cell_id", "warmup", "token_ids", "top2_gap"}
    if requests.empty or not needed <= set(requests.columns):
        return pd.DataFrame(columns=COLUMNS)
    recorded = requests[~requests["warmup"].astype(bool) & requests["token_ids"].map(lambda v: _ids(v) is not None)]
    if recorded.empty:
        return pd.DataFrame(columns=COLUMNS)
    reference_rows = _reference_rows(recorded)
    by_prompt = {
        tuple(r[c] for c in PROMPT_KEYS): r for _, r in reference_rows[reference_rows["arm"] == "none"].iterrows()
    }
    by_prompt_k = {
        (*(r[c] for c in PROMPT_KEYS), r["k"]): r for _, r in reference_rows[reference_rows["arm"] == "mtp"].iterrows()
    }
    rows = []
    for _, row in recorded.iterrows():
        reference = _pick_reference(row, by_prompt, by_prompt_k)
        if reference is None or reference["cell_id"] == row["cell_id"]:
            continue
        want, have = _ids(reference["token_ids"]), _ids(row["token_ids"])
        verdict = equal_up_to_numerics(want, _gaps(reference["top2_gap"], len(want)), have, eps)
        # A windowed draft's answer against native MTP's at its k: what the window alone could have changed.
        native = by_prompt_k.get((*(row[c] for c in PROMPT_KEYS), row["k"])) if row["arm"] != "mtp" else None
        if native is not None and native["cell_id"] != row["cell_id"]:
            native_ids = _ids(native["token_ids"])
            to_mtp = equal_up_to_numerics(native_ids, _gaps(native["top2_gap"], len(native_ids)), have, eps).equal
        else:
            to_mtp = None
        rows.append(
            {
                **{c: row[c] for c in (*PROMPT_KEYS, "cell_id", *SERIES_KEYS)},
                "reference_cell_id": reference["cell_id"],
                "reference_arm": reference["arm"],
                "tokens": len(have),
                "reference_tokens": len(want),
                "identical": verdict.identical,
                "equal": verdict.equal,
                "first_divergence": verdict.first_divergence,
                "reference_gap": verdict.reference_gap,
                "reason": verdict.reason,
                "equal_to_mtp": to_mtp,
            }
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def lossless_summary(table: pd.DataFrame, keys: Sequence[str] = ("model", "engine", *SERIES_KEYS)) -> pd.DataFrame:
    """Per series: requests judged, token-identical, equal up to near ties, diverged, equal to native MTP's answer at
    the same k (a windowed draft's), and tokens compared."""
    if table.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    judged_to_mtp = table.assign(_to_mtp=table["equal_to_mtp"].map(lambda v: v is True or v == 1.0))
    grouped = judged_to_mtp.groupby([*keys, "reference_arm"], dropna=False, sort=True)
    summary = grouped.agg(
        requests=("cell_id", "size"),
        identical=("identical", "sum"),
        equal=("equal", "sum"),
        equal_to_mtp=("_to_mtp", "sum"),
        judged_to_mtp=("equal_to_mtp", "count"),
        tokens=("tokens", "sum"),
    ).reset_index()
    # "equal to mtp" counts where there was a native answer to judge against; blank for mtp itself.
    summary["equal_to_mtp"] = [
        f"{int(equal)} of {int(judged)}" if judged else ""
        for equal, judged in zip(summary["equal_to_mtp"], summary["judged_to_mtp"], strict=True)
    ]
    summary["diverged"] = summary["requests"] - summary["equal"]
    return summary[[c for c in SUMMARY_COLUMNS if c in summary.columns]]
