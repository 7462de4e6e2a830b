"""`wmtp progress` on a terminal: the study's cells as a rich table, once or redrawn until the run ends."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from wmtp.measure.progress import StudyProgress, study_progress


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _view(progress: StudyProgress, now: datetime, phases: bool) -> Group:
    eta = progress.eta_s(now)
    if not progress.running and not progress.waiting:
        left = "finished"
    elif eta is None:
        left = "time left: known once a cell is done"
    else:
        left = f"about {_minutes(eta)} left"
    head = Text(
        f"{len(progress.done)} of {progress.cells} cells done, {len(progress.running)} running, "
        f"{len(progress.waiting)} waiting; {left}",
        style="bold",
    )
    table = Table(show_header=True, header_style="bold", expand=False)
    for column in ("cell", "state", "now", "time"):
        table.add_column(column, overflow="fold")
    for cell_id, timeline in progress.running.items():
        phase = timeline.current
        step = "starting" if phase is None else phase.name + (f" {phase.done}/{phase.of}" if phase.of else "")
        since = _minutes((now - timeline.started).total_seconds()) if timeline.started else ""
        table.add_row(cell_id, Text("running", style="yellow"), step, since)
    for cell_id in progress.done:
        seconds = progress.durations.get(cell_id)
        table.add_row(cell_id, Text("done", style="green"), "", _minutes(seconds) if seconds is not None else "")
    for cell_id in progress.waiting:
        table.add_row(cell_id, Text("waiting", style="dim"), "", "")
    parts: list = [head, table]
    if phases:
        parts.append(_phase_table(progress))
    return Group(*parts)


def _phase_table(progress: StudyProgress) -> Table:
    """Each cell's phases as its log tells them, in seconds: where its time goes (from the first line of its
    server's start to the last request of its last rung)."""
    table = Table(title="time per phase", show_header=True, header_style="bold")
    table.add_column("cell", overflow="fold")
    table.add_column("phase")
    table.add_column("s", justify="right")
    for cell_id, timeline in progress.timelines.items():
        # The cell named once, on its first phase: the rows below it are its own.
        for i, phase in enumerate(timeline.phases):
            table.add_row(cell_id if i == 0 else "", phase.name, f"{phase.seconds:.1f}", end_section=False)
        if timeline.phases:
            table.add_section()
    return table


def show_progress(cell_ids: list[str], results: Path, follow: bool = False, phases: bool = False) -> int:
    """Print where the study stands; with ``follow``, redraw every 2 s until no cell is running or waiting."""
    console = Console()
    progress = study_progress(cell_ids, results)
    if not follow:
        console.print(_view(progress, datetime.now(), phases))
        return 0
    with Live(_view(progress, datetime.now(), phases), console=console, refresh_per_second=1) as live:
        try:
            while progress.running or progress.waiting:
                time.sleep(2)
                progress = study_progress(cell_ids, results)
                live.update(_view(progress, datetime.now(), phases))
        except KeyboardInterrupt:
            pass
    return 0
