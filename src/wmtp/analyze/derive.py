"""Tidy tables → the derived tables the report shows, written once (results/<study>/derived/)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from wmtp.analyze.answer import answer_table
from wmtp.analyze.lossless import lossless_table
from wmtp.layout import DERIVED_TABLES, TIDY_TABLES

EXCLUDED_COLUMNS = ["cell_id", "workload", "rung", "repeat", "slot", "completion_tokens", "decode_s", "exclusion"]


def derive(tidy_dir: Path, out_dir: Path) -> dict[str, pd.DataFrame]:
    """The paired answer table, the list of excluded requests and each recorded answer judged against the same
    prompt's without a draft, from the tidy tables."""
    tidy = {name: pd.read_parquet(tidy_dir / f"{name}.parquet") for name in TIDY_TABLES}
    requests = tidy["requests"]
    screened = "excluded" in requests.columns
    tables = {
        "answer": answer_table(requests, tidy["rungs"])
        if screened
        else answer_table(requests.iloc[0:0], tidy["rungs"]),
        "excluded": (
            requests.loc[requests["excluded"], [c for c in EXCLUDED_COLUMNS if c in requests.columns]]
            if screened
            else pd.DataFrame(columns=EXCLUDED_COLUMNS)
        ).reset_index(drop=True),
        "lossless": lossless_table(requests),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in DERIVED_TABLES:
        tables[name].to_parquet(out_dir / f"{name}.parquet", index=False)
    return tables
