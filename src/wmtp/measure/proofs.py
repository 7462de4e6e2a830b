"""What a run of an engine's plugin proofs found (scripts/device/*_gpu_proofs.py), written once and said per proof,
and the judgements of the instrument's records that the proofs and the engine tests share."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: What the proofs print of their findings beside each proof's verdict.
SUMMARY_KEYS = ("engine", "arms", "plugin_counters", "read_set", "poison_writes")


def finish(found: dict[str, Any], outputs: dict[str, Any], path: Path) -> int:
    """Add which code the proofs are of (the commit, and the plugin's source as this process imported it) and the
    verdict to ``found``, write it with the outputs to ``path``, print each proof; 0 when every one passed."""
    from wmtp.measure.cell import git_revision
    from wmtp.plugin import source_sha256

    proofs = found["proofs"]
    found["wmtp_revision"] = git_revision()
    found["wmtp_plugin_sha256"] = source_sha256()
    found["passed"] = all(proofs.values())
    found["outputs"] = outputs
    path.write_text(json.dumps(found, indent=1))
    for name, ok in proofs.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(json.dumps({key: found[key] for key in SUMMARY_KEYS if key in found}))
    return 0 if found["passed"] else 1


def ring_frees(lines: Sequence[Mapping[str, Any]], sink: int, window: int) -> dict[str, int]:
    """The ring's frees judged against the draft's reads, from the instrument's records in the order written, one
    request at a time: the engine core's ``free`` records (what the ring's KV cache manager gave back to the pool;
    the worker's block table keeps the freed ids, so only the manager can show it) and the worker's ``build`` records
    (each draft forward's lengths). Counts the blocks given back, the frees that did not start right after the sink,
    and the frees that reached a block the next draft forward reads: at or past the first block of the window of
    its cycle's first query (``wmtp.plugin.ring_math.freed_blocks`` there)."""
    from wmtp.plugin import window as win
    from wmtp.plugin.ring_math import freed_blocks

    found = {"frees": 0, "blocks_given_back": 0, "not_after_the_sink": 0, "into_a_read_window": 0}
    waiting: list[Mapping[str, Any]] = []
    for line in lines:
        if line.get("kind") == "free":
            found["frees"] += 1
            found["blocks_given_back"] += line["taken"]
            found["not_after_the_sink"] += line["first"] != win.sink_blocks(sink, line["block_size"])
            waiting.append(line)
        elif line.get("kind") == "build" and waiting:
            p0 = min(s - q for s, q in zip(line["cycle_seq_lens"], line["cycle_query_lens"], strict=True))
            _, window_start = freed_blocks(p0, sink, window, line["block_size"])
            found["into_a_read_window"] += sum(free["last"] > window_start for free in waiting)
            waiting = []
    return found
