#!/usr/bin/env python
"""Per-request acceptance of a finished study, as a table (arm × workload × rung) and optionally a CSV.

Reads the study's tidy requests table (``make run`` writes it); measured requests only, screened ones counted
and left out. Each point is the mean of per-request acceptance with its 95 % t interval (wmtp.analyze.intervals)
and n; for the copy task it also prints how many tokens of the passage the output reproduced, on average.

    .venv/bin/python scripts/cell_acceptance.py results/embedded
    .venv/bin/python scripts/cell_acceptance.py results/embedded --csv measurements/cpu/embedded_NAME_requests.csv
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from wmtp.analyze.intervals import mean_interval

COLUMNS = [
    "arm",
    "k",
    "sink",
    "window",
    "workload",
    "rung",
    "repeat",
    "distance",
    "copied_tokens",
    "d_drafts",
    "d_draft_tokens",
    "d_accepted",
    "d_accepted_pos_0",
    "d_accepted_pos_1",
    "d_accepted_pos_2",
    "req_acceptance",
    "excluded",
    "exclusion",
]


def arm_label(arm: str, window: float) -> str:
    return arm if pd.isna(window) else f"{arm} W={int(window)}"


def point(values: pd.Series) -> str:
    found = mean_interval(values.to_numpy() * 100)
    if not math.isfinite(found.lo):
        return f"{found.value:.1f} (no interval) n={found.n}"
    return f"{found.value:.1f} [{max(0.0, found.lo):.1f}, {min(100.0, found.hi):.1f}] n={found.n}"


def table(requests: pd.DataFrame) -> pd.DataFrame:
    measured = requests[~requests.warmup & ~requests.excluded & (requests.arm != "none")]
    rows = []
    for (workload, rung, arm, window), group in measured.groupby(["workload", "rung", "arm", "window"], dropna=False):
        rows.append(
            {
                "workload": workload,
                "rung": rung,
                "arm": arm_label(arm, window),
                "acceptance %": point(group.req_acceptance.dropna()),
            }
        )
    return pd.DataFrame(rows).pivot(index=["workload", "rung"], columns="arm", values="acceptance %")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study_dir", type=Path, help="a study's results folder, e.g. results/embedded")
    parser.add_argument("--csv", type=Path, help="write the measured requests' counters here")
    args = parser.parse_args()
    requests = pd.read_parquet(args.study_dir / "tidy" / "requests.parquet")
    print(table(requests).to_string())
    copies = requests[~requests.warmup & ~requests.excluded & (requests.workload == "copy") & (requests.arm != "none")]
    if not copies.empty:
        print("passage tokens reproduced (mean):", copies.groupby("rung").copied_tokens.mean().round(1).to_dict())
    print("screened requests:", int(requests.excluded.sum()))
    if args.csv:
        measured = requests[~requests.warmup & (requests.arm != "none")]
        measured[COLUMNS].sort_values(["workload", "rung", "arm", "window", "repeat"]).to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
