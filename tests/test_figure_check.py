"""wmtp.report.figure_check: a figure whose text collides is found, and is not saved."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from wmtp.report import figure_check, render


def _two_panels(*, readable: bool):
    layout = "constrained" if readable else None
    fig, (a, b) = plt.subplots(1, 2, figsize=(6, 3), layout=layout)
    for ax, title in ((a, "code prompts"), (b, "copy task")):
        ax.plot([1, 2, 3], [1, 2, 3], label="mtp k=3")
        ax.plot([1, 2, 3], [3, 2, 1], label="wmtp k=3 S=64 W=4032")
        ax.set_title(title if readable else f"{title}, acceptance by position")
        ax.set_xlabel("context (prompt tokens)")
    fig.suptitle("Acceptance vs context")
    if readable:
        fig.legend(*a.get_legend_handles_labels(), loc="outside lower center", ncol=2)
    else:
        fig.legend(*a.get_legend_handles_labels(), loc="upper center")
    return fig


def test_a_clean_figure_has_no_overlap():
    fig = _two_panels(readable=True)
    assert figure_check.overlaps(fig) == []
    plt.close(fig)


def test_overlapping_titles_and_a_legend_on_the_suptitle_are_found():
    fig = _two_panels(readable=False)
    found = figure_check.overlaps(fig)
    plt.close(fig)
    assert any("title 'code prompts" in f and "title 'copy task" in f for f in found), found
    assert any("suptitle" in f and "legend" in f for f in found), found
    assert any("figure legend covers the axes" in f for f in found), found


def test_crowded_tick_labels_of_one_axis_are_found():
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.set_xticks(range(10), [f"{1000 * i:,} tokens" for i in range(10)])
    found = figure_check.overlaps(fig)
    plt.close(fig)
    assert any("x tick" in f for f in found), found


def test_an_unreadable_figure_is_not_saved(tmp_path):
    fig = _two_panels(readable=False)
    with pytest.raises(figure_check.UnreadableFigure, match="'wedge'"):
        render.save_figure(fig, tmp_path, "wedge")
    plt.close(fig)
    assert not (tmp_path / "wedge.png").exists()
    fig = _two_panels(readable=True)
    assert render.save_figure(fig, tmp_path, "wedge").exists()
    plt.close(fig)
