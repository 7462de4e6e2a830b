"""scripts/cell_acceptance.py: the closing table of a study's acceptance (arm × workload × rung)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("cell_acceptance", REPO / "scripts" / "cell_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _request(arm, window, acceptance, *, warmup=False, excluded=False, workload="copy", rung=1024):
    return {
        "arm": arm,
        "window": window,
        "workload": workload,
        "rung": rung,
        "req_acceptance": acceptance,
        "warmup": warmup,
        "excluded": excluded,
    }


def test_the_table_leaves_out_warmups_screened_requests_and_the_no_draft_arm():
    script = _script()
    requests = pd.DataFrame(
        [
            _request("mtp", math.nan, 0.9),
            _request("mtp", math.nan, 0.7),
            _request("mtp", math.nan, 0.8),
            _request("mtp", math.nan, 0.0, warmup=True),
            _request("mtp", math.nan, 2.5, excluded=True),
            _request("wmtp", 256.0, 0.1),
            _request("wmtp", 256.0, 0.1),
            _request("none", math.nan, math.nan),
        ]
    )
    table = script.table(requests)
    assert list(table.columns) == ["mtp", "wmtp W=256"]
    # Mean 80.0 over three requests, t(0.975, 2) = 4.303, sd 10: half width 24.8; the bound is clipped at 100.
    assert table.loc[("copy", 1024), "mtp"] == "80.0 [55.2, 100.0] n=3"
    # Two equal values: no spread, so no interval is claimed.
    assert table.loc[("copy", 1024), "wmtp W=256"] == "10.0 (no interval) n=2"
