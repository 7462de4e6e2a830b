"""Where a study's run stands, from the files its cells leave: which cells are done, which one is running and on
which rung, how long each phase of a cell took, and about how long the rest will take.

Read-only: the cells' logs (each line stamped by the ``wmtp`` command's logging) and their manifests. Nothing here
is a rule's input or output, so looking never changes what Snakemake plans.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from wmtp import layout

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ wmtp\.measure\.cell: (.*)$")
# The cell's own phase markers (wmtp.measure.cell logs them as it goes).
_STARTING = re.compile(r"^cell \S+: starting ")
_HEALTHY = re.compile(r"^server healthy after ")
_WARMUP = re.compile(r"^warm-up (\d+)/(\d+)")
_BUILDING = re.compile(r"^rung (\d+)(?: \((\S+)\))?: building")
_REPEAT = re.compile(r"^rung (\d+)(?: \((\S+)\))? repeat (\d+)/(\d+)")


@dataclass
class Phase:
    """One stretch of a cell's time: ``server start``, ``warm-up`` or ``rung R`` (``rung R (workload)``)."""

    name: str
    start: datetime
    end: datetime
    # Requests done of the phase's requests (a rung's repeats × concurrency, the warm-up's requests).
    done: int = 0
    of: int = 0

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


@dataclass
class CellTimeline:
    phases: list[Phase] = field(default_factory=list)

    @property
    def started(self) -> datetime | None:
        return self.phases[0].start if self.phases else None

    @property
    def last_seen(self) -> datetime | None:
        return self.phases[-1].end if self.phases else None

    @property
    def current(self) -> Phase | None:
        return self.phases[-1] if self.phases else None


def parse_cell_log(lines: Iterable[str]) -> CellTimeline:
    """A cell's phases from its log: each begins at its marker and ends at the next phase's start, or at the last
    line seen of it. Lines of other loggers (the server's, vLLM's) only move nothing; a log written twice (a cell
    run again) keeps the last run."""
    timeline = CellTimeline()

    def begin(name: str, at: datetime, of: int = 0) -> None:
        if timeline.phases:
            timeline.phases[-1].end = at
        timeline.phases.append(Phase(name, at, at, 0, of))

    for line in lines:
        match = _STAMP.match(line.rstrip("\n"))
        if not match:
            continue
        at = datetime.strptime(f"{match[1]}.{match[2]}", "%Y-%m-%d %H:%M:%S.%f")
        message = match[3]
        if _STARTING.match(message):
            timeline.phases.clear()
            begin("server start", at)
        elif _HEALTHY.match(message):
            begin("warm-up", at)
        elif warm := _WARMUP.match(message):
            if timeline.current is None or timeline.current.name != "warm-up":
                begin("warm-up", at)
            timeline.current.done, timeline.current.of = int(warm[1]) - 1, int(warm[2])
            timeline.current.end = at
        elif build := _BUILDING.match(message):
            begin(_rung_name(build[1], build[2]), at)
        elif repeat := _REPEAT.match(message):
            name = _rung_name(repeat[1], repeat[2])
            if timeline.current is None or timeline.current.name != name:
                begin(name, at)
            timeline.current.done, timeline.current.of = int(repeat[3]), int(repeat[4])
            timeline.current.end = at
        elif timeline.current is not None:
            timeline.current.end = at
    return timeline


def _rung_name(rung: str, workload: str | None) -> str:
    return f"rung {rung}" + (f" ({workload})" if workload else "")


@dataclass
class StudyProgress:
    cells: int
    done: list[str]
    running: dict[str, CellTimeline]
    waiting: list[str]
    # Seconds each done cell took (its manifest's duration), by cell id.
    durations: dict[str, float]
    # Every cell's phases as its log tells them (done and running cells), by cell id.
    timelines: dict[str, CellTimeline] = field(default_factory=dict)

    def eta_s(self, now: datetime) -> float | None:
        """About how long the rest takes one cell after another: the median done cell's time for each cell not
        started, and for a running one what is left of it (never below zero); None before any cell is done."""
        if not self.durations:
            return None
        typical = statistics.median(self.durations.values())
        running_left = sum(
            max(typical - (now - t.started).total_seconds(), 0.0) for t in self.running.values() if t.started
        )
        return typical * len(self.waiting) + running_left


def study_progress(cell_ids: list[str], results: Path, running_within_s: float = 600.0) -> StudyProgress:
    """Each of the study's cells as done (its manifest is there), running (its log grew in the last
    ``running_within_s`` seconds and no manifest yet) or waiting."""
    done, running, waiting, durations, timelines = [], {}, [], {}, {}
    for cell_id in cell_ids:
        manifest = layout.cell_dir(results, cell_id) / layout.MANIFEST_FILE
        log = layout.cell_log(results, cell_id)
        if log.is_file():
            timelines[cell_id] = parse_cell_log(log.read_text(errors="replace").splitlines())
        if manifest.is_file():
            done.append(cell_id)
            try:
                duration = json.loads(manifest.read_text()).get("duration_s")
            except (OSError, ValueError):
                duration = None
            if isinstance(duration, int | float):
                durations[cell_id] = float(duration)
        elif cell_id in timelines and time.time() - log.stat().st_mtime < running_within_s:
            running[cell_id] = timelines[cell_id]
        else:
            waiting.append(cell_id)
    return StudyProgress(len(cell_ids), done, running, waiting, durations, timelines)
