"""One colour and one marker per arm in every figure of the report, read off the matplotlib artists the report's
notebook draws (its code run in this process, with every figure kept instead of saved)."""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pandas as pd
import pytest

from wmtp.report import labels, render, window_cost

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "report.ipynb"
STEPS = ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"
ARMS = ("none", "mtp", "wmtp", "wmtp-ring")


def _make_tidy():
    path = ROOT / "tests" / "fixtures" / "tidy_synthetic" / "make_tidy.py"
    spec = importlib.util.spec_from_file_location("make_tidy", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def arm_artists(fig) -> list[tuple[str, str, str, str]]:
    """(arm, colour, marker, what) for every line or marker of ``fig`` that belongs to an arm: one whose label names
    an arm first ('wmtp k=3 S=16 W=128'), an errorbar whose container does, or one marked ``gid='arm:<arm>'``."""
    found = []
    for ax in fig.axes:
        in_containers = set()
        for container in ax.containers:
            arm = labels.arm_of(container.get_label() or "")
            lines = getattr(container, "lines", None)
            if arm in ARMS and lines and lines[0] is not None:
                data_line = lines[0]
                in_containers.add(id(data_line))
                found.append((arm, data_line.get_color(), data_line.get_marker(), container.get_label()))
        for line in ax.get_lines():
            if id(line) in in_containers:
                continue
            gid = line.get_gid() or ""
            arm = gid.removeprefix("arm:") if gid.startswith("arm:") else labels.arm_of(line.get_label())
            if arm in ARMS:
                found.append((arm, line.get_color(), line.get_marker(), line.get_label() or gid))
    return [(arm, mcolors.to_hex(colour), str(marker), what) for arm, colour, marker, what in found]


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict[str, object]:
    """Every figure the notebook draws for the full synthetic study with the GPU replica and the committed step
    file: its code cells run here, in order, with ``render.save_figure`` keeping each figure by name."""
    root = tmp_path_factory.mktemp("palette")
    make = _make_tidy()
    make.write_replica(root / "results" / "replica" / "tidy" / "replica.parquet")
    tidy = make.write_tidy(root / "results" / "spark-128k" / "tidy", "spark-128k")
    kept: dict[str, object] = {}

    def keep(fig, figures_dir, name, **_):
        kept[name] = fig
        path = Path(figures_dir) / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=40)
        return path

    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict[str, object] = {}
    mp = pytest.MonkeyPatch()
    mp.setattr(render, "save_figure", keep)
    mp.setattr(plt, "close", lambda *a, **k: None)  # the notebook closes each figure once shown: keep them
    # The notebook sets its theme and warning filters for its kernel: here they end with it.
    with matplotlib.rc_context(), warnings.catch_warnings():
        try:
            exec("".join(cells[0]["source"]), namespace)
            namespace.update(
                study="spark-128k",
                tidy_dir=str(tidy),
                published_dir=str(ROOT / "config" / "published"),
                figures_dir=str(root / "figures"),
                replica_path="",
                engine_step_paths=[str(STEPS)],
            )
            for cell in cells[1:]:
                exec("".join(cell["source"]), namespace)
        finally:
            mp.undo()
    yield kept
    for fig in kept.values():
        plt.close(fig)


def test_each_arm_has_one_colour_and_one_marker_in_every_figure(figures):
    seen: dict[str, set[tuple[str, str]]] = defaultdict(set)
    where: dict[str, set[str]] = defaultdict(set)
    for name, fig in figures.items():
        for arm, colour, marker, what in arm_artists(fig):
            seen[arm].add((colour, marker))
            where[arm].add(name)
            expected = labels.arm_style(arm)
            assert (colour, marker) == (mcolors.to_hex(expected["color"]), expected["marker"]), (name, what)
    # the check has something to check: every arm in several figures, each arm's style its own
    assert set(seen) == set(ARMS), dict(where)
    assert all(len(where[arm]) >= 3 for arm in ARMS), dict(where)
    assert {"speedup", "cycle_ms", "tok_per_j", "ttft_s", "costmodel", "cost_side_wedge", "engine_cycles"} <= set(
        figures
    )
    assert len({style for styles in seen.values() for style in styles}) == len(ARMS)


def test_the_real_engines_figure_shows_each_arm_by_both_clocks_in_its_style(figures):
    artists = arm_artists(figures["engine_cycles"])
    steps = pd.read_csv(STEPS)
    assert {arm for arm, *_ in artists} == set(steps["arm"])
    # per arm: the engine's line and the client's open marks, one style
    for arm in set(steps["arm"]):
        styles = {(c, m) for a, c, m, _ in artists if a == arm}
        assert len(styles) == 1 and len([a for a, *_ in artists if a == arm]) >= 2


def test_the_window_cost_figure_keeps_the_arms_styles():
    rows = [
        {"workload": "copy", "arm": arm, "k": 3, "sink": sink, "window": window, "rung": rung, "repeat": r,
         "distance": rung - 200, "accepted": acc, "draft_tokens": 300, "copied": 40, "excluded": False}
        for rung in (1024, 4096)
        for r in range(3)
        for arm, sink, window, acc in (("mtp", None, None, 240 + r), ("wmtp", 16, 256, 90 + r),
                                       ("wmtp-ring", 16, 256, 90 + r))
    ]  # fmt: skip
    fig = window_cost.window_cost_figure(window_cost.window_cost_section(pd.DataFrame(rows)))
    artists = arm_artists(fig)
    plt.close(fig)
    assert {arm for arm, *_ in artists} == {"mtp", "wmtp", "wmtp-ring"}
    for arm, colour, marker, what in artists:
        assert (colour, marker) == (mcolors.to_hex(labels.arm_style(arm)["color"]), labels.arm_style(arm)["marker"]), (
            what
        )


def test_the_headline_ratio_takes_no_arms_colour(figures):
    """The ratio mtp / wmtp is neither arm: a line of it in mtp's blue would read as mtp's."""
    arm_colours = {mcolors.to_hex(labels.arm_style(arm)["color"]) for arm in ARMS}
    drawn = {mcolors.to_hex(line.get_color()) for ax in figures["engine_steps"].axes for line in ax.get_lines()}
    assert mcolors.to_hex(labels.RATIO_SOURCE_COLORS["engine mtp / wmtp"]) in drawn
    assert not drawn & arm_colours, drawn & arm_colours
