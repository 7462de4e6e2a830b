"""wmtp.report: published CSVs, figure-ready sections, and the real papermill + nbconvert rendering."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from wmtp.report import compare, labels, load, render, sections

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "tidy_synthetic" / "make_tidy.py"
PUBLISHED = ROOT / "config" / "published"
COLUMNS = [
    "study", "quantity", "arm", "k", "rung", "rung_from", "position", "value", "pm", "lo", "hi", "unit",
    "primary", "source", "source_quote", "model", "workload",
]  # fmt: skip

FULL_FIGURES = {
    "decode_tok_s", "speedup", "cycle_ms", "tok_per_verify", "position_acceptance", "tok_per_j", "ttft_s",
    "cost_side_wedge", "costmodel",
}  # fmt: skip
BARE_FIGURES = FULL_FIGURES - {"tok_per_j", "cost_side_wedge", "costmodel"}


def _make_tidy():
    spec = importlib.util.spec_from_file_location("make_tidy", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_tidy():
    return _make_tidy()


@pytest.fixture(scope="module")
def full_tidy_dir(tmp_path_factory, make_tidy) -> Path:
    """Energy measured, windowed arms, and a GPU replica table at its default place."""
    root = tmp_path_factory.mktemp("full")
    make_tidy.write_replica(root / "results" / "replica" / "tidy" / "replica.parquet")
    return make_tidy.write_tidy(root / "results" / "spark-128k" / "tidy", "spark-128k")


@pytest.fixture(scope="module")
def bare_tidy_dir(tmp_path_factory, make_tidy) -> Path:
    """No power (no NVML), no windowed arm, no replica."""
    root = tmp_path_factory.mktemp("bare")
    return make_tidy.write_tidy(root / "results" / "spark-128k" / "tidy", "spark-128k", energy=False, windowed=False)


# ------------------------------------------------------------------------------------------------
# Published CSVs
# ------------------------------------------------------------------------------------------------


def _number_forms(value: float) -> set[str]:
    forms = {f"{value:g}", f"{value:.1f}", f"{value:.2f}", f"{value:.3f}"}
    if float(value).is_integer():
        forms |= {f"{int(value):,}", str(int(value))}
    return forms


@pytest.mark.parametrize("name", ["spark-128k.csv", "windowed-mtp-paper.csv", "paper-1m.csv"])
def test_published_csv_shape_and_quotes(name: str):
    frame = pd.read_csv(PUBLISHED / name, dtype=str, keep_default_na=False)
    assert list(frame.columns) == COLUMNS
    assert len(frame) > 0
    for row in frame.to_dict("records"):
        numbers = [float(row[c]) for c in ("value", "lo", "hi") if row[c] != ""]
        assert numbers, f"{name}: row {row['quantity']} states no number"
        assert not (row["value"] and (row["lo"] or row["hi"])), "one number per row: a value or a range"
        quote = row["source_quote"]
        for number in numbers + ([float(row["pm"])] if row["pm"] else []):
            assert any(form in quote for form in _number_forms(number)), (row["quantity"], number, quote)


def test_load_published_types_and_the_headline_numbers():
    pub = load.load_published(PUBLISHED, "spark-128k", primary_only=True)
    sel = pub[(pub["quantity"] == "cycle_ms")].set_index(["arm", "rung"])["value"]
    assert sel["none", 2040] == 14.14
    assert sel["mtp", 131290] == 38.35
    change = pub[pub["quantity"] == "speedup_change"].iloc[0]
    assert (change["value"], change["pm"], change["rung_from"], change["rung"]) == (0.08, 0.032, 2040, 131290)
    rng = pub[pub["quantity"] == "decode_tok_s_range"].iloc[0]
    assert (rng["lo"], rng["hi"], rng["rung"]) == (90.2, 102.2, 32779)
    claim = compare.paper_claim(load.load_published(PUBLISHED))
    assert claim == {"rung": 1_048_576.0, "lo": pytest.approx(0.28), "hi": pytest.approx(0.44)}
    ring = load.load_published(PUBLISHED, "windowed-mtp-paper", primary_only=True)
    kv = ring[ring["quantity"] == "kv_reclaimed_pct"].iloc[0]
    assert (kv["lo"], kv["hi"]) == (7.7, 11.1)


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "label"),
    [(2040, "2K"), (32779, "32K"), (131290, "131K"), (1536, "1.5K"), (512, "512"), (1_000_000, "1M"),
     (1_048_576, "1M"), (262144, "262K")],
)  # fmt: skip
def test_context_label(tokens: int, label: str):
    assert labels.context_label(tokens) == label


def test_context_ticks_collapse_near_duplicates():
    assert labels.context_ticks([131290, 131072, 2040, 1_000_000, 1_048_576]) == [2040, 131072, 1_000_000]


def test_series_label():
    assert labels.series_label({"arm": "none", "k": 0, "sink": None, "window": None}) == "none"
    assert labels.series_label({"arm": "wmtp", "k": 3, "sink": 16, "window": 128}) == "wmtp k=3 S=16 W=128"


def test_a_label_says_what_the_windowed_draft_read():
    reads = {"kv_block_size": 256, "read_sink_tokens": 256, "read_window_min": 128, "read_window_max": 383}
    row = {"arm": "wmtp", "k": 3, "sink": 16, "window": 128, **reads}
    assert labels.series_label(row) == "wmtp k=3 S=16 W=128 (block 256: reads S=256 W=128–383)"
    unreported = {"arm": "wmtp", "k": 3, "sink": 16, "window": 128}
    assert labels.series_label(unreported) == "wmtp k=3 S=16 W=128"


def test_labels_take_the_read_window_from_the_rung_table():
    rungs = pd.DataFrame(
        [
            {"model": "m", "engine": "e", "arm": "mtp", "k": 3, "sink": None, "window": None, "kv_block_size": None},
            {"model": "m", "engine": "e", "arm": "wmtp", "k": 3, "sink": 16, "window": 256, "kv_block_size": 128},
        ]
    ).assign(read_sink_tokens=[None, 128], read_window_min=[None, 256], read_window_max=[None, 383])
    derived = pd.DataFrame(
        [
            {"model": "m", "engine": "e", "arm": a, "k": 3, "sink": s, "window": w}
            for a, s, w in (("mtp", None, None), ("wmtp", 16.0, 256.0))
        ]
    )
    labelled = labels.add_labels(derived, rungs).set_index("arm")
    # without the engine the series is not known for sure: no read window rather than another engine's
    assert "block" not in labels.add_labels(derived.drop(columns="engine"), rungs).set_index("arm").loc["wmtp", "label"]
    assert labelled.loc["mtp", "label"] == "mtp k=3"
    assert labelled.loc["wmtp", "label"] == "wmtp k=3 S=16 W=256 (block 128: reads S=128 W=256–383)"


def test_context_tick_labels_never_collide():
    ticks = [2048, 32768, 131072, 262144, 524288, 1_048_576]
    # a narrow panel keeps 2K … 131K … 1M and leaves 262K and 524K as bare ticks
    assert labels.context_tick_labels(ticks, 3.0) == ["2K", "32K", "131K", "", "", "1M"]
    assert labels.context_tick_labels(ticks, 8.0) == ["2K", "32K", "131K", "262K", "524K", "1M"]
    assert labels.context_tick_labels([256, 1024], 3.0) == ["256", "1K"]
    assert labels.context_tick_labels([2040], 3.0) == ["2K"]


def test_add_labels_facets_by_model_where_it_varies():
    frame = pd.DataFrame(
        {"model": ["a", "a", "b"], "engine": ["vllm"] * 3, "arm": ["none", "mtp", "mtp"], "k": [0, 3, 3],
         "sink": [None] * 3, "window": [None] * 3, "concurrency": [1, 2, 1], "rung": [2040] * 3}
    )  # fmt: skip
    out = labels.add_labels(frame)
    assert list(out["facet"]) == ["a", "a", "b"]
    assert list(out["series"]) == ["none (c=1)", "mtp k=3 (c=2)", "mtp k=3 (c=1)"]
    assert out["label"].iloc[2] == "mtp k=3 (b, c=1)"
    one = labels.add_labels(frame[frame["model"] == "a"].assign(concurrency=1))
    assert set(one["facet"]) == {""} and list(one["series"]) == list(one["label"]) == ["none", "mtp k=3"]


def test_series_styles_one_colour_and_marker_per_arm_and_a_line_style_per_series_within_it():
    frame = pd.DataFrame(
        {"arm": ["none", "mtp", "mtp", "wmtp", "wmtp-ring"], "k": [0, 1, 3, 3, 3],
         "label": ["none", "mtp k=1", "mtp k=3", "wmtp k=3 S=16 W=128", "wmtp-ring k=3 S=16 W=128"]}
    )  # fmt: skip
    styles = labels.series_styles(frame, key="label")
    assert set(styles) == set(frame["label"])
    for label, style in styles.items():
        assert {k: style[k] for k in ("color", "marker")} == labels.arm_style(labels.arm_of(label)), label
    arms = ["none", "mtp", "wmtp", "wmtp-ring"]
    assert len({labels.arm_style(a)["color"] for a in arms}) == len({labels.arm_style(a)["marker"] for a in arms}) == 4
    # two series of one arm: its colour and marker, told apart by the line, the smaller k first
    assert styles["mtp k=1"]["ls"] == "-" and styles["mtp k=3"]["ls"] == "--"
    assert labels.series_styles(pd.DataFrame()) == {}


def test_k_color_is_fixed_per_k_and_dodge_is_centred():
    assert labels.k_color(3) == labels.k_color(3.0) != labels.k_color(5)
    assert len({labels.k_color(k) for k in range(1, 7)}) == 6
    shifts = labels.dodge(3, [2040, 131290])
    assert shifts[1] == 1.0 and shifts[0] < 1.0 < shifts[2]
    assert shifts[0] * shifts[2] == pytest.approx(1.0)
    assert labels.dodge(1, [2040]) == [1.0]


def test_paper_models_from_the_paper_study():
    if not (ROOT / "config" / "studies" / "paper-1m.yaml").exists():
        pytest.skip("config/studies/paper-1m.yaml not present")
    paper = compare.paper_models()
    # the study names checkpoints, the replica names architectures: both meet on the config/models name
    for name in ("Qwen3.6-35B-A3B", "Qwen3.5-122B-A10B", "NVIDIA-Nemotron-3-Super-120B-A12B", "qwen3.5-122b-a10b-fp8"):
        assert compare.canonical_model(name) in paper, name
    assert compare.canonical_model("Qwen3-Next-80B-A3B") not in paper
    assert compare.canonical_model("tiny") == "tiny"
    assert compare.paper_models(ROOT / "nope.yaml") == frozenset()


def _plotted_columns_are_finite(section: load.Section, columns: list[str]) -> None:
    for col in columns:
        if col in section.frame.columns:
            values = pd.to_numeric(section.frame[col], errors="coerce").to_numpy(float)
            assert np.isfinite(values).all(), col


def test_report_data_full(full_tidy_dir):
    data = sections.load_report_data("spark-128k", full_tidy_dir, PUBLISHED, n_boot=300)
    for name in ("decode", "speedup", "speedup_change", "cycle", "draft_tax", "acceptance", "positions", "energy",
                 "prefill", "wedge", "published_vs_measured"):  # fmt: skip
        assert getattr(data, name).available, name
    assert data.replica is not None
    assert set(data.wedge.frame["source"]) == {"measured", "replica", "replica model"}
    # small multiples: one panel per replica model, then the study's own measured panel
    panels = list(dict.fromkeys(data.wedge.frame["panel"]))
    assert panels[-1] == "qwen3.6-35b-a3b-nvfp4 · this study"
    assert set(panels[:-1]) == {"qwen3.6-35b-a3b · GPU replica", "qwen3.5-122b-a10b · GPU replica"}
    assert set(data.wedge.frame["variant"]) == {"wmtp S=16 W=128", "wmtp-ring S=16 W=128"}
    assert data.wedge.frame["paper_model"].all()  # both replica models and the 35B checkpoint are the paper's
    assert set(data.styles) >= set(data.decode.frame["series"])
    assert set(data.decode.frame["facet"]) == {""}  # one model, one engine: one panel per figure
    _plotted_columns_are_finite(data.wedge, ["wedge", "rung"])
    _plotted_columns_are_finite(data.energy, ["tok_per_j", "power_w"])
    cmp = data.published_vs_measured.frame.set_index(["quantity", "arm"])
    change = cmp.loc[("speedup_change", "mtp")]
    assert change["verdict"] == "within ±"
    cyc = data.published_vs_measured.frame
    cyc = cyc[cyc["quantity"] == "cycle_ms"]
    assert (cyc["relative_difference"].abs() < 0.01).all()
    share = data.published_vs_measured.frame.query("quantity == 'draft_share_pct'").iloc[0]
    assert share["measured"] == pytest.approx(8.8, abs=1.0)
    # what the notebook shows beside the sections comes ready too
    assert data.rungs == [2040, 32779, 131290]
    assert set(data.answer_rows["quantity"]) >= {"speedup", "cost_side_ratio"}
    assert set(data.published_sources.columns) == {"source", "source_quote"} and len(data.published_sources)
    assert data.published_sources.duplicated().sum() == 0
    assert data.engine_windows == "The replica ran S 16, W 128."  # no engine step file given
    assert data.engine_cycles.empty and not data.engine_clock.available and data.paper_marks.empty


def test_report_data_bare_says_what_is_missing(bare_tidy_dir):
    data = sections.load_report_data("spark-128k", bare_tidy_dir, PUBLISHED, n_boot=300)
    assert not data.energy.available
    assert sections.NOTE_NO_POWER in data.energy.notes
    assert not data.wedge.available
    assert compare.NOTE_NO_WINDOWED in data.wedge.notes
    assert compare.NOTE_NO_REPLICA in data.wedge.notes
    assert data.replica is None
    missing = " ".join(data.published_vs_measured.notes)
    assert "tok_per_j" in missing and "power_w" in missing


def test_report_data_for_a_cpu_shaped_study(tmp_path, make_tidy):
    tidy = make_tidy.write_tidy(tmp_path / "results" / "embedded" / "tidy", "embedded", shape="cpu")
    data = sections.load_report_data("embedded", tidy, PUBLISHED, n_boot=200)
    assert data.decode.available and data.speedup.available and data.acceptance.available
    assert "no published numbers for study 'embedded'" in data.published_vs_measured.notes
    assert sections.NOTE_NO_POWER in data.energy.notes
    _plotted_columns_are_finite(data.speedup, ["speedup", "lo", "hi"])


def test_costmodel_missing_is_a_note(monkeypatch, full_tidy_dir):
    monkeypatch.setitem(sys.modules, "wmtp.analyze.costmodel", None)  # import raises ImportError
    section = compare.costmodel_section(load.load_tidy(full_tidy_dir))
    assert not section.available
    assert section.notes == (compare.NOTE_COSTMODEL_MISSING,)


def test_costmodel_section_when_available(full_tidy_dir):
    pytest.importorskip("wmtp.analyze.costmodel")
    section = compare.costmodel_section(load.load_tidy(full_tidy_dir))
    assert section.available
    share = section.frame.query("quantity == 'draft_share_pct' and arm == 'mtp' and rung == 131290").iloc[0]
    # one draft attention layer against ten full-attention target layers: the roofline says 10 %
    assert share["predicted"] == pytest.approx(10.0, abs=1.0)
    assert set(section.frame["quantity"]) == {"draft_share_pct", "cost_side_ratio"}


def test_model_file_prefix_match():
    path = compare.model_file("qwen3.6-35b-a3b-nvfp4")
    if not (ROOT / "config" / "models" / "qwen3.6-35b-a3b.json").exists():
        pytest.skip("config/models not present")
    assert path is not None and path.name == "qwen3.6-35b-a3b.json"
    assert compare.model_file("tiny") is None


def test_replica_long_shape_is_normalised():
    long = pd.DataFrame(
        [
            {"model": "m", "context": c, "k": 3, "arm": arm, "sink": 16, "window": 128, "measured_ms": ms,
             "predicted_ms": ms, "measured_ratio": r, "predicted_ratio": r}
            for c, r in ((131072, 1.1), (1048576, 1.4))
            for arm, ms in (("none", 1.0), ("mtp", 2.0 * r), ("wmtp", 2.0))
        ]
    )  # fmt: skip
    rep = load.normalise_replica(long)
    assert list(rep["ratio"]) == [1.1, 1.4]
    assert list(rep["context"]) == [131072, 1048576]
    summary = pd.DataFrame({"model": ["m"], "context": [1], "k": [3], "sink": [16], "window": [128],
                            "step_nat_ms": [3.0], "step_win_ms": [2.0]})  # fmt: skip
    assert load.normalise_replica(summary)["ratio"].iloc[0] == 1.5
    assert load.normalise_replica(pd.DataFrame({"x": [1]})).empty


def test_load_tidy_names_the_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load.load_tidy(tmp_path / "nope")


# ------------------------------------------------------------------------------------------------
# Rendering: real papermill, real kernel (this interpreter), real nbconvert
# ------------------------------------------------------------------------------------------------


def _html_checks(html_path: Path, figures: set[str]) -> str:
    html = html_path.read_text(encoding="utf-8")
    fig_dir = html_path.parent / "figures"
    pngs = {p.stem for p in fig_dir.glob("*.png")}
    svgs = {p.stem for p in fig_dir.glob("*.svg")}
    assert figures <= pngs, figures - pngs
    assert pngs == svgs
    assert html.count("<img") == len(pngs)
    for tag in re.findall(r"<img[^>]*>", html):  # embedded (self-contained), with alternative text
        assert 'src="data:image/png;base64,' in tag
        assert re.search(r'alt="[^"]+"', tag) and "No description" not in tag
    assert not re.search(r'<script[^>]+src="https?://', html)  # no CDN scripts
    assert "import matplotlib" not in html and "load_report_data" not in html  # code cells hidden
    assert "Traceback" not in html and "Error" not in re.sub(r"<style.*?</style>", "", html, flags=re.S)
    assert "nan" not in re.sub(r"<[^>]+>", " ", re.sub(r"<(style|script).*?</\1>", "", html, flags=re.S)).split()
    return html


@pytest.fixture(scope="module")
def full_report(tmp_path_factory, full_tidy_dir) -> Path:
    out = tmp_path_factory.mktemp("full") / "report"
    steps = ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"
    argv = ["--study", "spark-128k", "--tidy", str(full_tidy_dir), "--out", str(out), "--engine-steps", str(steps)]
    assert render.main_report(argv) == 0
    return out


@pytest.mark.timeout(600)
def test_render_full_report(full_report):
    out = full_report
    html = _html_checks(out / "index.html", FULL_FIGURES | {"engine_steps", "engine_cycles"})
    assert "Study report" in html
    assert "A real engine on a GPU" in html and "vLLM 0.24.0" in html
    assert sections.NOTE_NO_POWER not in html
    assert compare.NOTE_NO_WINDOWED not in html
    assert "paper: 1.28–1.44× at 1M" not in html  # legend text lives in the image, not the page
    assert (out / "report.ipynb").exists()


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "Debian's chromium is not installed (apt-get install chromium); .ci/run installs it"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def _sentences(html: str) -> list[str]:
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("¶", "").strip()
    return [t for t in re.split(r"(?<=[.])\s+", text) if t]


@pytest.mark.timeout(300)
def test_a_reader_sees_the_answer_first_in_a_browser(full_report, tmp_path):
    """The rendered page in headless Chromium at 1,400 × 900: the answer first and short, its figure right after it,
    then one question per section with one figure and exactly one sentence, every table in the appendix at the end,
    every figure drawn, no traceback, NaN or empty table, and a first screen that is not blank."""
    browser = _chromium()
    page = (full_report / "index.html").resolve().as_uri()
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1400,900",
              f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run([*common, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    assert "<h1" in dom, dom[:2000]
    body = re.sub(r"<(style|script)[^>]*>.*?</\1>", "", dom, flags=re.S)
    headings = re.findall(r"<h[12][^>]*>(.*?)</h[12]>", body, flags=re.S)
    texts = [re.sub(r"<[^>]+>", "", h).replace("¶", "").strip() for h in headings]
    assert texts[1] == "The answer", texts[:4]
    answer = body.split(headings[1], 1)[1].split("<h2", 1)[0]
    sentences = _sentences(answer.split("<img", 1)[0])
    assert 1 <= len(sentences) <= 6, sentences
    assert "<img" in answer, "the headline figure comes with the answer"
    assert body.count("<img") == len(list((full_report / "figures").glob("*.png")))
    words = re.sub(r"<[^>]+>", " ", body).split()
    assert "Traceback" not in words and "nan" not in words and "NaN" not in words
    for table in re.findall(r"<table.*?</table>", body, flags=re.S):
        assert "<td" in table, "an empty table"

    # Every table after the appendix's heading, none before it; the appendix is the page's last part.
    appendix = [i for i, t in enumerate(texts) if t.startswith("Appendix")]
    assert appendix == [len(texts) - 1] and texts[-1] == "Appendix: tables", texts
    start = body.index(headings[-1])
    assert body.count("<table") >= 5 and "<table" not in body[:start], "a table before the appendix"
    assert "<img" not in body[start:], "a figure in the appendix"
    # Each figure after the headline: exactly one sentence beside it, up to the next figure or heading.
    figures = [m.start() for m in re.finditer(r"<img", body)]
    assert len(figures) >= len(FULL_FIGURES) + 1
    for at in figures[1:]:
        beside = re.split(r"<img|<h[1-6]", body[at + 4 :], maxsplit=1)[0]
        found = _sentences(beside.split(">", 1)[1])
        assert len(found) == 1, found
        assert re.search(r"\d", found[0]), f"a sentence without its number: {found[0]}"
    shot = tmp_path / "first-screen.png"
    subprocess.run([*common, f"--screenshot={shot}", page], capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (900, 1400) and pixels.std() > 0.05, "the first screen is blank"


@pytest.mark.timeout(600)
def test_render_report_without_power_or_windowed_arm(tmp_path, bare_tidy_dir):
    out = tmp_path / "report"
    # A figure an earlier rendering drew (when the study still had windowed arms) does not survive this one.
    (out / "figures").mkdir(parents=True)
    (out / "figures" / "cost_side_wedge.png").write_bytes(b"stale")
    html_path = render.render_report("spark-128k", bare_tidy_dir, out, published_dir=PUBLISHED)
    html = _html_checks(html_path, BARE_FIGURES)
    assert "not measured: no NVML on this machine" in html
    assert "no windowed arm in this study" in html
    assert "no GPU replica data" in html
    for absent in ("tok_per_j", "power_w", "cost_side_wedge"):
        assert not (out / "figures" / f"{absent}.png").exists()


def test_venv_kernel_is_this_interpreter():
    from jupyter_client.kernelspec import KernelSpecManager

    with render._venv_kernel():
        spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable


def _raw_fixture_studies() -> list[Path]:
    """Fixture folders of real raw cell files (any tests/fixtures/*/ holding a cell's manifest.json)."""
    fixtures = Path(__file__).parent / "fixtures"
    return sorted(d for d in fixtures.iterdir() if d.is_dir() and next(d.rglob("manifest.json"), None) is not None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("raw_dir", _raw_fixture_studies() or [None], ids=lambda p: p.name if p else "none")
def test_render_from_real_raw_cells(tmp_path, raw_dir: Path | None):
    """Real raw files → wmtp.analyze.tidy.collect → the report, whatever arms and power the run had."""
    if raw_dir is None:
        pytest.skip("no fixture of real raw cell files under tests/fixtures yet")
    from wmtp.analyze.tidy import collect

    cells = [m.parent for m in raw_dir.rglob("manifest.json")]
    tidy = tmp_path / "results" / "real" / "tidy"
    tables = collect(cells, tidy)
    study = str(tables["rungs"]["study"].iloc[0])
    html = render.render_report(study, tidy, tmp_path / "report", published_dir=PUBLISHED).read_text()
    pngs = list((tmp_path / "report" / "figures").glob("*.png"))
    assert {"decode_tok_s", "cycle_ms", "ttft_s"} <= {p.stem for p in pngs}
    assert html.count("<img") == len(pngs)
    assert "Traceback" not in html


@pytest.fixture(scope="module")
def two_workload_tidy_dir(tmp_path_factory, make_tidy) -> Path:
    """The Spark-shaped tables measured twice: on code prompts, and on the copy task where every decode is
    10 % slower and the windowed drafts accept half as much."""
    frames = make_tidy.build("spark-128k")
    copy = {name: frame.assign(workload="copy") for name, frame in frames.items()}
    copy["requests"]["decode_tok_s"] *= 0.9
    windowed = copy["rungs"]["arm"].isin(["wmtp", "wmtp-ring"])
    for col in ("d_accepted",):
        copy["rungs"].loc[windowed, col] = (copy["rungs"].loc[windowed, col] * 0.5).round()
    out = tmp_path_factory.mktemp("workloads") / "results" / "spark-128k" / "tidy"
    out.mkdir(parents=True)
    for name, frame in frames.items():
        pd.concat([frame.assign(workload="code"), copy[name]], ignore_index=True).to_parquet(
            out / f"{name}.parquet", index=False
        )
    return out


def test_workloads_are_separate_series_matched_to_their_own_baseline(two_workload_tidy_dir):
    data = sections.load_report_data("spark-128k", two_workload_tidy_dir, PUBLISHED, n_boot=300)
    speedup = data.speedup.frame
    assert set(speedup["workload"]) == {"code", "copy"}
    both = speedup.pivot_table(index=["arm", "rung"], columns="workload", values="speedup")
    # copy's requests are uniformly 10 % slower, its none arm too: the speedups are the same
    assert both["copy"].to_numpy() == pytest.approx(both["code"].to_numpy(), rel=1e-9)
    assert set(data.acceptance.frame["facet"]) == {"code prompts", "copy task (repeats a far-back passage)"}
    acc = data.acceptance.frame.pivot_table(index=["arm", "rung"], columns="workload", values="acceptance_rate")
    assert (acc.loc["wmtp", "copy"] < 0.6 * acc.loc["wmtp", "code"]).all()
    assert (acc.loc["mtp", "copy"] == acc.loc["mtp", "code"]).all()
    shown = sections.acceptance_display(data.acceptance)
    assert list(shown.columns[:2]) == ["workload", "series"] and len(shown) == 2 * 3
    assert shown.iloc[0]["workload"] == "code prompts"
    assert list(shown["series"][:3]) == ["mtp k=3", "wmtp k=3 S=16 W=128", "wmtp-ring k=3 S=16 W=128"]
    # the measured wedge gets a panel per workload; published numbers are matched on code prompts only
    assert {p for p in data.wedge.frame["panel"] if "this study" in p} == {
        "qwen3.6-35b-a3b-nvfp4 · this study · code prompts",
        "qwen3.6-35b-a3b-nvfp4 · this study · copy task (repeats a far-back passage)",
    }
    cmp = data.published_vs_measured.frame
    cyc = cmp[cmp["quantity"] == "cycle_ms"]
    assert (cyc["relative_difference"].abs() < 0.01).all()


def test_acceptance_display_without_workloads(full_tidy_dir):
    data = sections.load_report_data("spark-128k", full_tidy_dir, PUBLISHED, n_boot=200)
    shown = sections.acceptance_display(data.acceptance)
    assert list(shown.columns) == ["series", "2K", "32K", "131K"], list(shown.columns)
    mtp = shown[shown["series"] == "mtp k=3"].iloc[0]
    assert mtp["2K"].endswith("(3.36)") and mtp["2K"].startswith("78.")
    # a pooled count per rung: the section says over how many requests, and that it carries no interval
    (note,) = data.acceptance.notes
    counts = data.tidy.requests.groupby(["cell_id", "workload", "rung"]).size()
    assert f"over a rung's {counts.min()}" in note and "no interval" in note


def test_the_papers_claim_is_set_against_the_ceiling_with_the_committed_h200_replica(tmp_path):
    """The committed H200 measurements, tidied as the workflow does: the 35B's replica ratio at 1M and k = 3
    sits below the KV-bound ceiling 1 + 3/10; the paper's range is set against the ceiling at its own depth."""
    from wmtp.replica import replica as rp

    out = tmp_path / "replica.parquet"
    assert rp.main(["tidy", "--raw", str(ROOT / "measurements" / "h200"), "--models-dir",
                    str(ROOT / "config" / "models"), "--out", str(out)]) == 0  # fmt: skip
    frame = compare.paper_claim_section(pd.read_parquet(out), load.load_published(PUBLISHED)).frame
    row = frame.set_index("model").loc["Qwen3.6-35B-A3B"]
    assert row["context"] == "1M" and row["paper"] == "1.28–1.44"
    assert row["ceiling 1 + 3/L_full"] == pytest.approx(1.30)
    assert 1.0 < row["replica (H200)"] < row["cost model"] < row["ceiling 1 + 3/L_full"] < 1.44
    # at the paper's own depth (d 7: six draft forwards) its range sits within the ceiling 1 + 6/10
    assert row["ceiling at the paper's d 7"] == pytest.approx(1.60)
    assert row["the paper's range, at its own d"] == "within the ceiling"


def test_the_report_shows_the_claim_the_floor_and_the_batch_sweep_from_the_replica_table(tmp_path, full_tidy_dir):
    """Through load_report_data, as the notebook gets them: every arm and batch reaches the replica's sections."""
    from wmtp.replica import replica as rp

    out = tmp_path / "replica.parquet"
    assert rp.main(["tidy", "--raw", str(ROOT / "measurements" / "h200"), "--models-dir",
                    str(ROOT / "config" / "models"), "--out", str(out)]) == 0  # fmt: skip
    steps = ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"
    data = sections.load_report_data("spark-128k", full_tidy_dir, PUBLISHED, out, [steps], n_boot=100)
    assert data.paper.available and set(data.paper.frame["context"]) == {"1M"}
    # the real engine beside it: its cycles, the clocks' check, the paper's mark and which windows each ran
    assert set(data.engine_cycles["arm"]) == {"none", "mtp", "wmtp"} and data.engine_clock.notes
    assert list(data.paper_marks["model"]) == ["qwen3.6-35b-a3b"]
    assert data.engine_windows.startswith("The replica ran S 64, W 4032; the engine S 16, W 4096")
    floor = data.replica_floor.frame
    assert {"none", "mtp", "wmtp"} <= set(floor["arm"]) and (floor["step / floor"] > 0.9).all()
    batch = data.replica_batch.frame
    assert batch.groupby("model")["batch"].max().max() >= 2  # more than one request per step where it fits
    # the ratio climbs with concurrency towards, and stays under, the ceiling
    for _, rows in batch.groupby(["model", "k"]):
        assert rows.sort_values("batch")["replica (H200)"].is_monotonic_increasing, rows
        assert (rows["replica (H200)"] < rows["ceiling 1 + k/L_full"]).all()


def test_robust_limits_ignore_one_far_point_and_keep_real_spread():
    speedups = [0.97, 0.9, 0.8, 0.72, 0.86, 0.68, 1.26, 1.07, 0.97]
    assert labels.robust_limits(speedups) is None  # a real spread sets the axis itself
    lo, hi = labels.robust_limits([*speedups, 284.7])  # one impossible point, had it not been screened
    assert lo < 0.68 and 1.26 < hi < 2.0
    assert labels.robust_limits([1.0, 2.0, float("nan")]) is None


def test_ring_reclaim_is_the_draft_layers_share_of_attention_kv():
    """1/(L_full + 1): 10 full-attention layers + the draft (35B) → 9.1 %; the paper's 7.7–11.1 % spans the models."""
    ladder = compare.ring_reclaim_section().frame
    assert set(ladder["context"]) == {"131K", "262K", "524K", "1M"}
    # the kept sink + window and the recurrent states weigh less as context grows: the reclaim rises with it
    for _, rows in ladder.groupby("model"):
        assert rows["KV reclaimed by the ring (%)"].is_monotonic_increasing, rows
    frame = ladder[ladder["context"] == "1M"].set_index("model")
    assert frame.loc["Qwen3.6-35B-A3B", "draft KV share (%)"] == pytest.approx(100 / 11, abs=0.05)
    assert frame["draft KV share (%)"].min() == pytest.approx(100 / 13, abs=0.05)
    assert frame["draft KV share (%)"].max() == pytest.approx(100 / 9, abs=0.05)
    # The ring gives back the share, less the sink + window it keeps (a few thousand of 1M tokens).
    assert ((frame["KV reclaimed by the ring (%)"] < frame["draft KV share (%)"])
            & (frame["KV reclaimed by the ring (%)"] > frame["draft KV share (%)"] - 0.5)).all()  # fmt: skip


def test_copy_task_numbers_are_never_set_against_published_code_prompt_numbers(full_tidy_dir):
    """The published studies measured code prompts: a study whose rows are all on the copy task has nothing of
    theirs to compare with, however close its quantities' names."""
    import dataclasses

    tidy = load.load_tidy(full_tidy_dir)
    published = load.load_published(PUBLISHED)
    on_code = compare.published_comparison(tidy, published, "spark-128k").frame
    assert "acceptance_rate_pct" in set(on_code["quantity"])
    on_copy = dataclasses.replace(
        tidy,
        requests=tidy.requests.assign(workload="copy"),
        rungs=tidy.rungs.assign(workload="copy"),
        positions=tidy.positions.assign(workload="copy"),
    )
    measured = compare.measured_quantities(on_copy)
    assert set(measured["workload"]) == {"copy"}
    section = compare.published_comparison(on_copy, published, "spark-128k")
    assert section.frame is None or section.frame.empty


def test_the_speedup_change_table_says_how_its_speedups_differ_from_the_answer_tables(full_tidy_dir):
    section = sections.speedup_change_section(load.load_tidy(full_tidy_dir), n_boot=200)
    assert section.available and section.notes == (sections.NOTE_SPEEDUP_CHANGE_METHOD,)
    assert "ratio of the two arms' median" in section.notes[0] and "ignoring" in section.notes[0]
    assert "change [bootstrap interval, unpaired]" in sections.speedup_change_display(section).columns


def test_a_published_number_of_a_model_and_a_workload_meets_only_that_series(full_tidy_dir):
    """The paper's artifact gives numbers per model and task: each is set beside that model's series on that task
    alone, and the end-to-end ratio (windowed over native decode rate) is measured to meet it."""
    import dataclasses

    tidy = load.load_tidy(full_tidy_dir)
    tidy = dataclasses.replace(
        tidy,
        requests=tidy.requests.assign(workload="niah_multiquery"),
        rungs=tidy.rungs.assign(workload="niah_multiquery"),
        positions=tidy.positions.assign(workload="niah_multiquery"),
    )
    model = tidy.rungs["model"].iloc[0]
    rung = int(tidy.rungs["rung"].max())
    windowed = tidy.rungs[(tidy.rungs["arm"] == "wmtp") & (tidy.rungs["rung"] == rung)].iloc[0]
    native = tidy.rungs[
        (tidy.rungs["arm"] == "mtp") & (tidy.rungs["rung"] == rung) & (tidy.rungs["k"] == windowed["k"])
    ].iloc[0]
    measured = compare.measured_quantities(tidy)
    speedup = measured[(measured["quantity"] == "windowed_decode_speedup") & (measured["rung"] == rung)]
    assert speedup["value"].iloc[0] == pytest.approx(windowed["decode_tok_s"] / native["decode_tok_s"])

    def row(**over):
        base = {c: "" for c in COLUMNS}
        base.update(study="s", quantity="windowed_decode_speedup", arm="wmtp", k=int(windowed["k"]), rung=rung)
        base.update(value=1.5, unit="x", primary="true", source="t", source_quote="1.5", **over)
        return base

    rows = [row(model=model, workload="niah_multiquery"), row(model="another", workload="niah_multiquery")]
    rows.append(row(model=model, workload="cwe"))
    folder = full_tidy_dir.parent / "published-per-model"
    folder.mkdir(exist_ok=True)
    pd.DataFrame(rows, columns=COLUMNS).to_csv(folder / "s.csv", index=False)
    section = compare.published_comparison(tidy, load.load_published(folder), "s")
    assert set(section.frame["model"]) == {model} and set(section.frame["workload"]) == {"niah_multiquery"}
    assert len(section.frame) == len(speedup[(speedup["k"] == windowed["k"]) & (speedup["arm"] == "wmtp")]) == 1
    assert "published but not measured here: windowed_decode_speedup" in section.notes
