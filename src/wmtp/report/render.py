"""Saving figures and rendering ``notebooks/report.ipynb`` (papermill, then nbconvert) into one
self-contained HTML page; the ``wmtp report`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from wmtp.layout import REPO_ROOT
from wmtp.report.load import PUBLISHED_DIR, load_tidy

log = logging.getLogger(__name__)

NOTEBOOK = REPO_ROOT / "notebooks" / "report.ipynb"


def save_figure(fig: Any, figures_dir: Path | str, name: str, *, dpi: int = 120) -> Path:
    """Saves a matplotlib figure as ``<name>.png`` and ``<name>.svg``; returns the PNG path.

    A figure whose text boxes collide is refused (:class:`wmtp.report.figure_check.UnreadableFigure`)."""
    from wmtp.report.figure_check import check_readable

    check_readable(fig, name)
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    png = figures_dir / f"{name}.png"
    fig.savefig(png, dpi=dpi, bbox_inches="tight")
    fig.savefig(figures_dir / f"{name}.svg", bbox_inches="tight")
    return png


def img_tag(png_path: Path | str, alt: str) -> str:
    """An ``<img>`` with the PNG embedded as a data URI and its alternative text (for the notebook)."""
    import base64
    import html

    data = base64.b64encode(Path(png_path).read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt, quote=True)}"/>'


_HTML_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


@contextlib.contextmanager
def _venv_kernel() -> Iterator[None]:
    """Makes kernel 'python3' this interpreter, for this process only.

    A kernelspec named python3 pointing at ``sys.executable`` goes into a temporary directory that is
    put first on JUPYTER_PATH, so a user-level or system 'python3' kernel cannot win. Nothing is
    registered outside the temporary directory.
    """
    with tempfile.TemporaryDirectory(prefix="wmtp-kernel-") as tmp:
        spec_dir = Path(tmp) / "kernels" / "python3"
        spec_dir.mkdir(parents=True)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (wmtp)",
            "language": "python",
            "env": {"MPLBACKEND": "Agg"},
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (tmp, old) if p)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old


def notebook_to_html(notebook_path: Path | str, html_path: Path | str) -> Path:
    """Converts an executed notebook into one self-contained HTML page without code cells.

    Images are embedded as data URIs; the CDN scripts (require.js, MathJax, Mermaid) are left out.
    """
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook_path), as_version=4)
    with tempfile.TemporaryDirectory(prefix="wmtp-nbconvert-") as tmp:
        template = Path(tmp) / "wmtp_report.html.j2"
        template.write_text(_HTML_TEMPLATE)
        exporter = HTMLExporter(
            template_file=str(template),
            exclude_input=True,
            exclude_input_prompt=True,
            exclude_output_prompt=True,
            embed_images=True,
        )
        body, _ = exporter.from_notebook_node(nb)
    html_path = Path(html_path)
    html_path.write_text(body, encoding="utf-8")
    return html_path


def render_report(
    study: str,
    tidy_dir: Path | str,
    out_dir: Path | str,
    *,
    published_dir: Path | str | None = None,
    replica_path: Path | str | None = None,
    engine_step_paths: Sequence[Path | str] = (),
    trace_paths: Sequence[Path | str] = (),
    notebook: Path | str | None = None,
    timeout_s: int = 900,
) -> Path:
    """Runs the report notebook for one study with papermill and writes ``out_dir/index.html``.

    Figures land in ``out_dir/figures`` (PNG + SVG each), the executed notebook in
    ``out_dir/report.ipynb``. Returns the HTML path. The kernel is this interpreter (see
    :func:`_venv_kernel`), so the pipeline venv that runs this function also runs the notebook.
    """
    import papermill as pm

    out_dir = Path(out_dir).resolve()
    figures_dir = out_dir / "figures"
    # Only this rendering's figures: one a study no longer draws (its windowed arms gone, say) must not stay.
    if figures_dir.exists():
        shutil.rmtree(figures_dir)
    figures_dir.mkdir(parents=True)
    tidy_dir = Path(tidy_dir).resolve()
    load_tidy(tidy_dir)  # fail here, with the path in the message, rather than inside the kernel
    parameters = {
        "study": study,
        "tidy_dir": str(tidy_dir),
        "published_dir": str(Path(published_dir).resolve() if published_dir else PUBLISHED_DIR),
        "figures_dir": str(figures_dir),
        "replica_path": str(Path(replica_path).resolve()) if replica_path else "",
        "engine_step_paths": [str(Path(p).resolve()) for p in engine_step_paths],
        "trace_paths": [str(Path(p).resolve()) for p in trace_paths],
    }
    executed = out_dir / "report.ipynb"
    with _venv_kernel():
        pm.execute_notebook(
            str(notebook or NOTEBOOK),
            str(executed),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(out_dir),
            progress_bar=False,
            log_output=False,
            execution_timeout=timeout_s,
        )
    return notebook_to_html(executed, out_dir / "index.html")


def main_report(argv: Sequence[str] | None = None) -> int:
    """``python -m wmtp report --study S --tidy DIR --out DIR [--published DIR] [--replica FILE]``."""
    parser = argparse.ArgumentParser(prog="wmtp report", description="Render a study's report as one HTML page.")
    parser.add_argument("--study", required=True, help="study name (as in the study config)")
    parser.add_argument("--tidy", required=True, type=Path, help="results/<study>/tidy")
    parser.add_argument("--out", required=True, type=Path, help="output directory (index.html, figures/)")
    parser.add_argument("--published", type=Path, default=None, help=f"published CSVs (default {PUBLISHED_DIR})")
    parser.add_argument(
        "--replica",
        type=Path,
        default=None,
        help="replica.parquet (default results/replica/tidy/replica.parquet next to --tidy)",
    )
    parser.add_argument(
        "--engine-steps",
        type=Path,
        nargs="*",
        default=[],
        help="a real engine's step files (vllm_<model>.csv from wmtp step-table), set beside the replica",
    )
    parser.add_argument(
        "--traces",
        type=Path,
        nargs="*",
        default=[],
        help="a profiling study's trace tables (traces.csv from wmtp trace-table): where a traced cycle's time goes",
    )
    parser.add_argument("--notebook", type=Path, default=None, help=f"report notebook (default {NOTEBOOK})")
    parser.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    args = parser.parse_args(list(argv) if argv is not None else None)
    html = render_report(
        args.study,
        args.tidy,
        args.out,
        published_dir=args.published,
        replica_path=args.replica,
        engine_step_paths=args.engine_steps,
        trace_paths=args.traces,
        notebook=args.notebook,
        timeout_s=args.timeout,
    )
    log.info("report written to %s", html)
    return 0
