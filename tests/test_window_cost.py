"""wmtp.report.window_cost: acceptance against the copied passage's distance, relative to the window."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from wmtp.report import labels
from wmtp.report.window_cost import COLUMNS, passage_distance, window_cost


def _requests() -> pd.DataFrame:
    """Copy prompts at two rungs, three prompts each: the full draft copies, W=256 does not, W=4096 at 4K does."""
    rows = []
    for rung in (1024, 4096):
        for index in range(3):
            full = 0.9 + 0.01 * index
            for arm, sink, window, acc in (
                ("mtp", None, None, full),
                ("wmtp", 16, 256, full - 0.5),
                ("wmtp", 16, 4096, full),
            ):
                rows.append(
                    {
                        "arm": arm,
                        "sink": sink,
                        "window": window,
                        "workload": "copy",
                        "rung": rung,
                        "index": index,
                        "distance": rung - 520,
                        "accepted": acc * 100,
                        "draft_tokens": 100,
                    }
                )
            rows.append({**rows[-1], "workload": "plain", "accepted": 10})  # not the copy workload: ignored
    return pd.DataFrame(rows)


def test_the_windowed_draft_loses_what_its_window_cannot_see():
    out = window_cost(_requests())
    assert list(out.columns) == list(COLUMNS)
    assert len(out) == 6 and set(out["n"]) == {3}
    narrow = out[(out["arm"] == "wmtp") & (out["window"] == 256)]
    assert list(narrow["distance"]) == [504, 3576]
    assert list(narrow["distance_over_window"]) == pytest.approx([504 / 256, 3576 / 256])
    assert not narrow["covered"].any()
    assert narrow["vs_full"].tolist() == pytest.approx([-0.5, -0.5])
    # Every prompt loses exactly 0.5: the paired interval collapses onto it, the unpaired one does not.
    assert narrow["vs_full_lo"].tolist() == pytest.approx([-0.5, -0.5])
    assert (narrow["hi"] > narrow["acceptance"]).all() and (narrow["lo"] < narrow["acceptance"]).all()
    wide = out[(out["arm"] == "wmtp") & (out["window"] == 4096)]
    assert wide["covered"].all() and wide["vs_full"].tolist() == pytest.approx([0.0, 0.0])
    full = out[out["arm"] == "mtp"]
    assert full["distance_over_window"].tolist() == [0.0, 0.0] and full["covered"].all()
    assert full["vs_full"].isna().all()
    assert full["acceptance"].tolist() == pytest.approx([0.91, 0.91])


def test_distance_from_the_lead_in_when_the_table_has_none():
    frame = _requests().drop(columns="distance").rename(columns={"index": "repeat"})
    with pytest.raises(ValueError, match="lead_tokens"):
        window_cost(frame)
    out = window_cost(frame, lead_tokens=512)
    assert sorted(set(out["distance"])) == [512, 3584]
    assert list(passage_distance(pd.DataFrame({"rung": [16384]}), 512)) == [15872]


def test_excluded_requests_and_no_copy_rows():
    frame = _requests()
    frame["excluded"] = (frame["index"] == 2) & (frame["arm"] == "wmtp")
    out = window_cost(frame)
    assert set(out.loc[out["arm"] == "wmtp", "n"]) == {2}
    assert window_cost(frame[frame["workload"] == "plain"]).empty


def test_tidy_per_request_acceptance_is_used_when_present():
    frame = _requests()
    frame["req_acceptance"] = math.nan
    frame.loc[frame["arm"] == "mtp", "req_acceptance"] = 0.5
    out = window_cost(frame)
    assert out.loc[out["arm"] == "mtp", "acceptance"].tolist() == pytest.approx([0.5, 0.5])
    assert out.loc[out["arm"] == "wmtp", "n"].eq(0).all()  # NaN acceptances are not counted


def test_the_section_says_why_it_is_empty():
    from wmtp.report.window_cost import window_cost_section

    frame = _requests()
    assert window_cost_section(frame).available
    assert "no copy-task" in window_cost_section(frame[frame["workload"] == "plain"]).notes[0]
    assert "no windowed draft" in window_cost_section(frame[frame["arm"] == "mtp"]).notes[0]


def test_intervals_stay_within_what_a_rate_can_be():
    frame = _requests()
    frame.loc[(frame["arm"] == "mtp") & (frame["index"] == 0), "accepted"] = 0  # 0, 0.91, 0.92: a wide interval
    out = window_cost(frame)
    full = out[out["arm"] == "mtp"]
    assert (full["lo"] == 0.0).all() and (full["hi"] <= 1.0).all()
    assert (out["vs_full_hi"].dropna() <= 1.0).all() and (out["vs_full_lo"].dropna() >= -1.0).all()


def test_display_and_figure_draw_every_windowed_draft():
    from wmtp.report.window_cost import window_cost_display, window_cost_figure, window_cost_section

    section = window_cost_section(_requests())
    table = window_cost_display(section)
    assert len(table) == 6 and table["n"].eq(3).all()
    assert (
        table.loc[table["draft"] == "wmtp S=16 W=256", "vs full draft, points [95 % t]"].str.startswith("-50.0").all()
    )
    assert (
        table.loc[table["draft"] != "mtp", "pairs"].eq(3).all()
        and table.loc[table["draft"] == "mtp", "pairs"].isna().all()
    )
    fig = window_cost_figure(section)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and len(ax.get_legend().get_texts()) == 2
    # Two drafts that accept the same must not hide one another: the arm's marker and colour, but another line
    # style, a smaller marker and a thinner line.
    first, second = (container.lines[0] for container in ax.get_legend_handles_labels()[0])
    assert first.get_marker() == second.get_marker() == labels.arm_style("wmtp")["marker"]
    assert first.get_color() == second.get_color() == labels.arm_style("wmtp")["color"]
    assert first.get_linestyle() != second.get_linestyle()
    assert second.get_markersize() < first.get_markersize() and second.get_linewidth() < first.get_linewidth()


def test_cells_without_per_request_counters_get_a_note_not_an_error():
    from wmtp.report.window_cost import window_cost_section

    old = _requests().drop(columns=["accepted", "draft_tokens"])
    section = window_cost_section(old)
    assert not section.available and "no per-request acceptance" in section.notes[0]


def test_the_section_says_where_the_model_does_not_copy():
    from wmtp.report.window_cost import MIN_COPIED_TOKENS, NOTE_APPROXIMATE, window_cost_display, window_cost_section

    frame = _requests()
    frame["copied_tokens"] = [None if w == "plain" else 30 for w in frame["workload"]]
    section = window_cost_section(frame)
    assert section.notes == (NOTE_APPROXIMATE,) and set(section.frame["copied"]) == {30.0}
    # every prompt copied 30 tokens: no spread, so no interval (not a zero-width one)
    assert set(window_cost_display(section)["passage copied, tokens [95 % t]"]) == {"30.0"}
    # At 4K the outputs leave the passage at once: the curve cannot show a window's cost there.
    frame.loc[(frame["rung"] == 4096) & (frame["workload"] == "copy"), "copied_tokens"] = MIN_COPIED_TOKENS - 1
    note, _ = window_cost_section(frame).notes
    assert note.startswith("at 4,096 tokens the model reproduced 7.0 tokens") and "cannot show" in note
    frame["copied_tokens"] = [
        None if w == "plain" else 20 + 10 * i for w, i in zip(frame["workload"], frame["index"], strict=True)
    ]
    spread = window_cost_section(frame).frame
    assert (spread["copied"] == 30.0).all() and (spread["copied_lo"] < 30).all() and (spread["copied_hi"] > 30).all()
    unknown, _ = window_cost_section(_requests()).notes  # cells that did not record it
    assert "not known" in unknown


def test_each_setting_is_its_own_row_and_pairs_only_with_its_own_full_draft():
    """Two models, and a windowed draft at k = 1 next to k = 3: nothing pools across them, and a draft with no
    full draft of its own depth has no paired difference rather than one against another depth's."""
    frames = []
    for model, full_acc in (("a", 0.9), ("b", 0.5)):
        frame = _requests().assign(model=model, k=3)
        frame.loc[frame["arm"] == "mtp", "accepted"] = 100 * full_acc
        shallow = frame[(frame["arm"] == "wmtp") & (frame["window"] == 256)].assign(k=1, accepted=65.0)
        frames += [frame, shallow]
    out = window_cost(pd.concat(frames, ignore_index=True))
    assert list(out.columns[:2]) == ["model", "k"]
    assert set(out["n"]) == {3}
    narrow = out[(out["window"] == 256) & (out["rung"] == 1024)].set_index(["model", "k"])
    assert narrow.loc[("a", 1), "acceptance"] == pytest.approx(0.65) and math.isnan(narrow.loc[("a", 1), "vs_full"])
    # wmtp W=256 accepts 0.4-0.42 in both models' frames: against its own model's full draft, not the other's.
    assert narrow.loc[("a", 3), "vs_full"] == pytest.approx(0.41 - 0.9)
    assert narrow.loc[("b", 3), "vs_full"] == pytest.approx(0.41 - 0.5)


def test_two_full_drafts_for_one_prompt_are_refused():
    frame = _requests()
    with pytest.raises(ValueError, match="share one prompt"):
        window_cost(pd.concat([frame, frame[frame["arm"] == "mtp"]], ignore_index=True))


def test_a_recorded_distance_wins_over_the_lead_in_and_fills_row_by_row():
    frame = pd.DataFrame({"rung": [1024, 1024, 4096], "distance": [511, None, 3583]})
    assert passage_distance(frame, 512).tolist() == [511, 512, 3583]
    with pytest.raises(ValueError, match="lead_tokens"):
        passage_distance(frame)
