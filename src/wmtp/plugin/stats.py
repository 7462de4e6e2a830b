"""What the windowed draft actually did, counted in the worker and read back by the cell.

A wmtp cell must never pass with the window silently off: a vLLM whose runner bypasses the hooked
proposer, a plugin that never loaded in the worker, or a hook that hands the metadata through would all
give plain MTP numbers under a wmtp label. So each configured proposer counts its draft metadata builds
and what it windowed, and writes them as JSON to ``$WMTP_PLUGIN_STATS_DIR/wmtp-stats-<pid>-<n>.json``
(the vLLM adapter points the variable into the cell's temporary directory). The cell reads the files
after its sweep (``check``) and fails when the longest context outgrew S + W but nothing was windowed.

The file is written when the proposer starts, at the first windowed forward, then every 32 draft forwards
or once a second, whichever comes first, and at exit (which a killed worker skips); the counts are
therefore lower bounds, and the check compares only numbers from one and the same write. The number of
dropped blocks is summed on the device and never waited for while the server runs: on a GPU each write
starts a copy of the sum into pinned host memory and reports the last copy that has landed, with the
longest decode context as of when it was started (``skipped_as_of_decode_context``, which the check
compares it with); on the CPU the sum is read directly. A blocking read there would drain the device's
queue and cost a cycle's host lead each time.

Where the host holds no lengths without waiting for the device (SGLang's draft under CUDA graphs), the plugin hands
``record`` the longest context as a device tensor too; it is folded on the device and read back in the same copy as
the dropped-block sum, so the two numbers of a write are always of one moment.

Each configured proposer also times its own hook on the host (``hook_host_us_per_build``): the windowed
copy is launched from the host before every draft forward, so that is what the window adds to a cycle
wherever the host, not the device, sets the pace.

This module imports neither torch nor vLLM: the pipeline's side (``summarize``, ``check``) runs anywhere.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "WMTP_PLUGIN_STATS_DIR"
# Where a draft forward's window starts: set by a decode cycle's first forward and kept by its later ones
# (wmtp.plugin.window). Counters written before the plugin kept it say nothing, which reads as "forward".
WINDOW_ANCHOR = "cycle"
PREFIX = "wmtp-stats-"
WRITE_EVERY_S = 1.0
WRITE_EVERY_BUILDS = 32
NEVER_RAN = "the windowed draft never ran"

_instances = 0
_live: list[DraftStats] = []


class WindowNotApplied(RuntimeError):
    """A wmtp cell's context outgrew S + W, but the plugin reports no windowed draft forward."""


def effective(sink: int, window: int, block_size: int) -> dict[str, int]:
    """What the draft reads after block rounding: the sink rounds up to whole blocks, the window starts at
    a block boundary, so it covers W to W + B - 1 tokens before the forward's first query."""
    n_sink = -(-sink // block_size)
    return {
        "block_size": block_size,
        "sink_blocks": n_sink,
        "sink_tokens": n_sink * block_size,
        "window_tokens_min": window,
        "window_tokens_max": window + block_size - 1,
    }


class DraftStats:
    """Counters of one configured proposer; ``record`` is called once per draft metadata build."""

    def __init__(
        self, sink: int, window: int, engine_version: str, engine: str = "vLLM", window_anchor: str = WINDOW_ANCHOR
    ) -> None:
        global _instances
        directory = os.environ.get(ENV)
        self.path = Path(directory) / f"{PREFIX}{os.getpid()}-{_instances}.json" if directory else None
        _instances += 1
        self.sink, self.window, self.engine, self.engine_version = sink, window, engine, engine_version
        self.window_anchor = window_anchor
        self.block_size: int | None = None
        self.builds = 0
        self.windowed_forwards = 0
        self.longest_context = 0
        self.longest_decode_context = 0  # over forwards of one query token a request: p0 = seq_len - 1
        self.anchored_forwards = 0  # later forwards of a cycle that kept its first forward's window
        self._skipped = None  # a device tensor: the sum of dropped blocks, read back only when written
        self._cycle_total = None  # the dropped blocks of the current cycle's first forward (a device tensor)
        self._reuses = 0  # later forwards of that cycle not yet added to _skipped
        self._on_device = False  # the window's kernels keep _skipped themselves (count_on_device)
        self._skipped_host = 0
        self._skipped_as_of = 0  # the longest decode context when the sum in _skipped_host was taken
        self._longest = None  # a device tensor: the longest decode context, where the host does not know it
        self._pending: tuple[Any, Any, int] | None = None  # (pinned host copy, its CUDA event, decode context)
        self._pinned = None
        self.host_ns = 0
        self._written_at = 0.0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _live.append(self)
            if len(_live) == 1:
                atexit.register(_write_all)
            self.write()

    def record(
        self,
        sink: int,
        window: int,
        block_size: int,
        max_seq_len: int,
        max_query_len: int,
        dropped: Any | None,
        reused: bool = False,
        device_max_seq_len: Any | None = None,
    ) -> None:
        """One draft forward's metadata build; ``dropped`` is the per-row count of dropped blocks, or None
        when the metadata was handed through (no context longer than S + W); ``reused`` when it is the
        cycle's first forward's, kept by a later forward (its sum is added once a cycle, not once a forward).
        ``device_max_seq_len``, a decode forward's longest context on the device, stands in for ``max_seq_len``
        where the host does not know it (pass 0 there)."""
        self.sink, self.window, self.block_size = sink, window, block_size
        self.builds += 1
        self.longest_context = max(self.longest_context, int(max_seq_len))
        if max_query_len == 1:
            self.longest_decode_context = max(self.longest_decode_context, int(max_seq_len))
            if device_max_seq_len is not None:
                longest = device_max_seq_len.long()  # the dtype of a sum of dropped blocks
                self._longest = longest if self._longest is None else self._longest.maximum(longest)
        first = False
        if dropped is not None:
            first = self.windowed_forwards == 0
            self.windowed_forwards += 1
            if self._on_device:
                self.anchored_forwards += int(reused)
            elif reused and self._cycle_total is not None:
                self.anchored_forwards += 1
                self._reuses += 1
            else:
                self._fold_reuses()
                total = dropped.sum()
                self._cycle_total = total
                self._skipped = total if self._skipped is None else self._skipped + total
        due = self.builds % WRITE_EVERY_BUILDS == 0 or time.monotonic() - self._written_at >= WRITE_EVERY_S
        if self.path is not None and (first or due):
            self.write()

    def count_on_device(self, total: Any) -> None:
        """From now on the window's kernels add every windowed forward's dropped blocks to ``total`` themselves (one
        int64 on the device, ``fused.CycleBuffers.total``); ``record`` only counts forwards."""
        self._fold_reuses()
        if self._skipped is not None:
            total.add_(self._skipped)
        self._skipped, self._cycle_total, self._on_device = total, None, True

    def _fold_reuses(self) -> None:
        if self._reuses:
            self._skipped = self._skipped + self._cycle_total * self._reuses
            self._reuses = 0

    def add_host_ns(self, ns: int) -> None:
        """Host time of one hooked metadata build (the window's copy and this record)."""
        self.host_ns += ns

    def _note_longest(self, longest: int) -> int:
        self.longest_context = max(self.longest_context, longest)
        self.longest_decode_context = max(self.longest_decode_context, longest)
        return longest

    def _read_skipped(self, wait: bool) -> None:
        """The dropped-block sum on the host; on a GPU without waiting for it unless ``wait``."""
        self._fold_reuses()
        total = self._skipped
        if total is None:
            return
        if wait or not getattr(total, "is_cuda", False):
            as_of = self.longest_decode_context if self._longest is None else self._note_longest(int(self._longest))
            self._skipped_host, self._skipped_as_of, self._pending = int(total), as_of, None
            return
        if self._pending is not None and self._pending[1].query():
            landed = self._pending[0]
            if landed.dim():  # the sum and the longest context, taken together
                self._skipped_host, self._skipped_as_of = int(landed[0]), self._note_longest(int(landed[1]))
            else:
                self._skipped_host, self._skipped_as_of = int(landed), self._pending[2]
            self._pending = None
        if self._pending is None:
            import torch  # only in a worker that sums on a GPU, where torch is loaded

            both = total if self._longest is None else torch.stack([total, self._longest.to(total.dtype)])
            if self._pinned is None or self._pinned.shape != both.shape:
                self._pinned = torch.zeros(both.shape, dtype=total.dtype, pin_memory=True)
            self._pinned.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (self._pinned, event, self.longest_decode_context)

    def snapshot(self, wait: bool = False) -> dict[str, Any]:
        self._read_skipped(wait)
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "engine": self.engine,
            "engine_version": self.engine_version,
            "sink": self.sink,
            "window": self.window,
            "builds": self.builds,
            "windowed_forwards": self.windowed_forwards,
            "anchored_forwards": self.anchored_forwards,
            "window_anchor": self.window_anchor,
            # What set the window on the device: the plugin's Triton kernels, or PyTorch operations.
            "window_kernels": "triton" if self._on_device else "torch",
            "blocks_skipped": self._skipped_host,
            "skipped_as_of_decode_context": self._skipped_as_of,
            "longest_context": self.longest_context,
            "longest_decode_context": self.longest_decode_context,
            "hook_host_us_per_build": round(self.host_ns / 1e3 / self.builds, 2) if self.builds else None,
        }
        if self.block_size is not None:
            out.update(effective(self.sink, self.window, self.block_size))
            out["tokens_skipped"] = self._skipped_host * self.block_size
        if self.engine == "vLLM":
            out["vllm_version"] = self.engine_version  # the name earlier counters and their readers use
        out["message"] = describe(out)
        return out

    def write(self, wait: bool = False) -> None:
        if self.path is None:
            return
        self._written_at = time.monotonic()
        try:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.snapshot(wait)))
            os.replace(tmp, self.path)
        except (OSError, RuntimeError):
            pass  # the counters are a proof for the cell, never a reason to stop drafting


def _write_all() -> None:
    for stats in _live:
        stats.write(wait=True)  # at exit nothing waits on the device any more


def describe(stats: Mapping[str, Any]) -> str:
    """One line of what a proposer windowed, in the plugin's words."""
    where = f"sink S={stats['sink']}, window W={stats['window']}"
    if "block_size" in stats:
        where += (
            f", KV block size {stats['block_size']}: reads sink {stats['sink_tokens']} tokens and window "
            f"{stats['window_tokens_min']}-{stats['window_tokens_max']} tokens"
        )
    return (
        f"wmtp plugin (pid {stats['pid']}, {stats.get('engine', 'vLLM')} "
        f"{stats.get('engine_version', stats.get('vllm_version'))}; {where}): "
        f"{stats['windowed_forwards']} of {stats['builds']} draft forwards windowed, "
        f"{stats['blocks_skipped']} KV blocks skipped, longest context {stats['longest_context']} tokens"
    )


def read(directory: Path | str | None) -> list[dict[str, Any]]:
    """Every proposer's last written counters in ``directory`` (none when it is unset or missing)."""
    if not directory or not Path(directory).is_dir():
        return []
    out = []
    for path in sorted(Path(directory).glob(PREFIX + "*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # a file replaced while read; the others still prove or disprove the window
    return out


def summarize(found: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The counters of every proposer of a server, summed, with the effective S and W they report."""
    total: dict[str, Any] = {
        "proposers": len(found),
        "builds": sum(s["builds"] for s in found),
        "windowed_forwards": sum(s["windowed_forwards"] for s in found),
        "anchored_forwards": sum(s.get("anchored_forwards", 0) for s in found),
        "window_anchor": next((s["window_anchor"] for s in found if s.get("window_anchor")), None),
        "window_kernels": ",".join(sorted({s["window_kernels"] for s in found if s.get("window_kernels")})) or None,
        "blocks_skipped": sum(s["blocks_skipped"] for s in found),
        "longest_context": max((s["longest_context"] for s in found), default=0),
        "longest_decode_context": max((s.get("longest_decode_context", 0) for s in found), default=0),
        # How far the reported skipped blocks had got: a read lagging far behind shows here.
        "skipped_as_of_decode_context": max((s.get("skipped_as_of_decode_context", 0) for s in found), default=0),
    }
    timed = [s for s in found if s.get("hook_host_us_per_build") is not None and s["builds"]]
    total["hook_host_us_per_build"] = (
        round(sum(s["hook_host_us_per_build"] * s["builds"] for s in timed) / sum(s["builds"] for s in timed), 2)
        if timed
        else None
    )
    sized = [s for s in found if "block_size" in s]
    if sized:
        for key in ("block_size", "sink_blocks", "sink_tokens", "window_tokens_min", "window_tokens_max"):
            total[key] = sized[0][key]
        total["tokens_skipped"] = sum(s.get("tokens_skipped", 0) for s in sized)
    total["messages"] = [s["message"] for s in found]
    return total


def check(
    found: Sequence[Mapping[str, Any]], longest_prompt: int, sink: int, window: int, k: int, directory: str | None
) -> dict[str, Any]:
    """The summary of a windowed cell's counters; raises WindowNotApplied when the window never ran.

    It never ran when the longest prompt exceeded S + W and no draft forward was windowed, or when the
    plugin saw a decode step long enough that it must drop a block (beyond the rounded sink, one block and
    W + 3k + 1 tokens: k for a ``max_seq_len`` that runs ahead under asynchronous drafting, 2k for a
    cycle's later forwards, which keep its first forward's window) and reports none dropped. The second
    compares numbers of one write, so a report cut short cannot fail it.
    """
    total = summarize(found)
    if longest_prompt <= sink + window:
        return total
    said = "; ".join(total["messages"]) or (
        f"no wmtp counters in {directory}: no worker ran a proposer configured for wmtp "
        "(the plugin did not load there, or this vLLM drafts without the hooked proposer)"
        if directory
        else f"${ENV} was not set for the server, so the plugin could not report"
    )
    if total["windowed_forwards"] == 0:
        raise WindowNotApplied(
            f"{NEVER_RAN}: prompts of up to {longest_prompt} tokens exceed S + W = {sink + window}, "
            f"but no draft forward was windowed; {said}"
        )
    for one in found:
        block = one.get("block_size")
        # The decode context as of the sum of dropped blocks reported beside it (older files: the longest one).
        decoded = one.get("skipped_as_of_decode_context", one["longest_decode_context"])
        must_drop = block and decoded - window - (3 * k + 1) >= (-(-sink // block) + 1) * block
        if must_drop and one["blocks_skipped"] == 0:
            raise WindowNotApplied(
                f"{NEVER_RAN}: decode steps at up to {decoded} tokens must drop KV blocks "
                f"between the sink and the window, but none was dropped; {one['message']}"
            )
    return total


def cell_record(directory: str | None, cell: Any, longest_prompt: int) -> dict[str, Any]:
    """What a windowed cell's manifest records of the plugin: the requested S and W beside ``check``'s summary of
    the counters in ``directory`` (the effective sink and window, windowed forwards, skipped blocks); raises
    ``WindowNotApplied`` when the window never ran."""
    summary = check(read(directory), longest_prompt, cell.sink, cell.window, cell.k, directory)
    return {"wmtp_plugin": {"requested_sink": cell.sink, "requested_window": cell.window, **summary}}
