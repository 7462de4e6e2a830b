"""The plugin's hook on a GPU, outside a server: right, never waiting for the device, and its host time per build.

Runs on an H200 with the carried vLLM on PYTHONPATH (scripts/device/engine_install.sh) and this checkout's src
before it. It builds vLLM's own CommonAttentionMetadata on the GPU at the 35B shape's attention block (560
tokens, a block table as wide as max_model_len 1,049,600 needs), for contexts of 131,072, 524,288 and
1,048,576 tokens and batches of 1 and 4, with the queries of a draft's first forward (k + 1 = 4 each) and of
the later ones (1 each), and for each:

- compares the windowed copy with wmtp.plugin.window's integer formulas (sequence lengths, kept blocks);
- runs the copy and the counters' record, writes included, under torch.cuda.set_sync_debug_mode("error"), so
  any operation that waits for the device raises;
- times the copy and the record on the host clock: the median over 7 rounds of 500 calls, never synchronised
  inside a round, beside the same for the plugin's previous copy (before it was cut to fewer kernels) and an
  empty call;
- times one decode cycle's hook work, k = 3 draft forwards (the first with 4 queries, the later ones with 1):
  as the plugin runs it on a GPU (wmtp.plugin.fused's Triton kernels, one launch a forward; `kernels` says which
  path ran) beside the same cycle with PyTorch operations (`torch_anchored_us`; the two must set the same window)
  and beside each forward windowed on its own, as the plugin did before.

Usage: PYTHONPATH=src:/tmp/wmtp-engine/site python3 scripts/device/hook_cost.py --out $OUT/hook_cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BLOCK = 560
MAX_MODEL_LEN = 1_049_600
SINK, WINDOW = 16, 4096
CONTEXTS = (131_072, 524_288, 1_048_576)
BATCHES = (1, 4)
QUERIES = (4, 1)
K = 3
ROUNDS, CALLS = int(os.environ.get("ROUNDS", 7)), int(os.environ.get("CALLS", 500))


def _metadata(context: int, batch: int, queries: int, device: torch.device):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    cols = -(-MAX_MODEL_LEN // BLOCK)
    generator = torch.Generator().manual_seed(context + batch + queries)
    # Rows a little apart, so each drops its own number of blocks.
    seq_lens = torch.tensor([context - 977 * r for r in range(batch)], dtype=torch.int32)
    query_start = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32)
    table = torch.randperm(cols * batch, generator=generator).to(torch.int32).reshape(batch, cols)
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    values = dict(
        query_start_loc=query_start.to(device),
        query_start_loc_cpu=query_start,
        seq_lens=seq_lens.to(device),
        num_reqs=batch,
        num_actual_tokens=batch * queries,
        max_query_len=queries,
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table.to(device),
        slot_mapping=torch.zeros(batch * queries, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        _seq_lens_cpu=seq_lens.clone(),
        _num_computed_tokens_cpu=seq_lens - queries,
    )
    # The host length copies exist up to vLLM 0.29 only.
    return CommonAttentionMetadata(**{name: value for name, value in values.items() if name in fields})


def _check(cm, windowed, config) -> list[str]:
    from wmtp.plugin import window as win

    problems = []
    lens = cm.seq_lens.tolist()
    queries = (cm.query_start_loc[1:] - cm.query_start_loc[:-1]).tolist()
    got_lens = windowed.seq_lens.tolist()
    full, table = cm.block_table_tensor.tolist(), windowed.block_table_tensor.tolist()
    for row, (length, query) in enumerate(zip(lens, queries, strict=True)):
        want = win.windowed_seq_len(length, query, config.sink, config.window, BLOCK)
        if got_lens[row] != want:
            problems.append(f"row {row}: windowed length {got_lens[row]}, the formula says {want}")
        kept = [full[row][j] for j in win.kept_blocks(length, query, config.sink, config.window, BLOCK)]
        if table[row][: len(kept)] != kept:
            problems.append(f"row {row}: the windowed table is not the kept blocks in order")
    if windowed.max_seq_len < max(got_lens):
        problems.append("max_seq_len is below a windowed length")
    return problems


def _previous_copy(cm, config, block_size: int):
    """The plugin's windowed copy as it was before it was cut to fewer kernels, for the timing beside it."""
    from wmtp.plugin import window as win

    sink, window = config.sink, config.window
    seq_lens = cm.seq_lens
    n = seq_lens.shape[0]
    query_start = cm.query_start_loc
    query_lens = query_start[1 : n + 1] - query_start[:n]
    n_sink = win.sink_blocks(sink, block_size)
    window_start = (seq_lens - query_lens - window).clamp(min=0)
    drop = (torch.div(window_start, block_size, rounding_mode="floor") - n_sink).clamp(min=0)
    new_seq_lens = seq_lens - drop * block_size
    table = cm.block_table_tensor
    rows, cols = table.shape
    width = min(cols, win.table_width_bound(cm.max_query_len, sink, window, block_size))
    row_drop = drop.to(torch.int64)[:rows, None]
    column = torch.arange(width, device=table.device, dtype=torch.int64)
    index = column + row_drop * (column >= n_sink)
    new_table = torch.gather(table, 1, index.clamp(max=cols - 1))
    bound = win.seq_len_bound(cm.max_query_len, sink, window, block_size)
    replaced = {
        "block_table_tensor": new_table,
        "seq_lens": new_seq_lens,
        "max_seq_len": min(cm.max_seq_len, bound),
        "seq_lens_cpu_upper_bound": cm.seq_lens_cpu_upper_bound.clamp(max=bound),
        "_num_computed_tokens_cache": None,
    }
    replaced.update({name: None for name in ("_seq_lens_cpu", "_num_computed_tokens_cpu") if hasattr(cm, name)})
    return dataclasses.replace(cm, **replaced), drop


def _later(cm):
    """The same metadata as propose() hands a cycle's later forwards: one query a request, the same tensors."""
    batch = cm.seq_lens.shape[0]
    query_start = torch.arange(batch + 1, dtype=torch.int32)
    return dataclasses.replace(
        cm,
        query_start_loc=query_start.to(cm.seq_lens.device),
        query_start_loc_cpu=query_start,
        num_actual_tokens=batch,
        max_query_len=1,
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_debug(mode: str) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def _host_us(call, *args) -> dict[str, float]:
    rounds = []
    for _ in range(ROUNDS):
        _sync()
        started = time.perf_counter()
        for _ in range(CALLS):
            call(*args)
        rounds.append(1e6 * (time.perf_counter() - started) / CALLS)
    _sync()
    return {"median": round(statistics.median(rounds), 2), "min": round(min(rounds), 2), "max": round(max(rounds), 2)}


def _cycle_row(context: int, batch: int, device: torch.device, config, problems: list[str]) -> dict:
    """One decode cycle's hook work, anchored as the plugin runs it and each forward on its own, checked and timed."""
    import vllm

    from wmtp.plugin import hook
    from wmtp.plugin import stats as wstats
    from wmtp.plugin import window as win

    counters = wstats.DraftStats(SINK, WINDOW, vllm.__version__)
    state = hook._State(config, counters, K)
    # The same cycle windowed with PyTorch operations (the plugin's path off a GPU, or with WMTP_WINDOW_KERNELS=torch).
    torch_counters = wstats.DraftStats(SINK, WINDOW, vllm.__version__)
    torch_state = hook._State(config, torch_counters, K, buffers=False)

    def anchored_cycle(first, later, state=state, counters=counters):
        for step in range(K):
            cm = first if step == 0 else later
            windowed, dropped, reused = hook.window_forward(state, cm, config, BLOCK, step)
            counters.record(SINK, WINDOW, BLOCK, cm.max_seq_len, cm.max_query_len, dropped, reused=reused)
        return windowed

    def torch_cycle(first, later):
        return anchored_cycle(first, later, torch_state, torch_counters)

    def per_forward_cycle(first, later):
        for step in range(K):
            cm = first if step == 0 else later
            windowed, dropped = hook.windowed_with_drops(cm, config, BLOCK)
            counters.record(SINK, WINDOW, BLOCK, cm.max_seq_len, cm.max_query_len, dropped)
        return windowed

    first = _metadata(context, batch, K + 1, device)
    later = _later(first)
    last = anchored_cycle(first, later)
    by_torch = torch_cycle(first, later)
    if not (
        torch.equal(last.seq_lens, by_torch.seq_lens)
        and torch.equal(last.block_table_tensor, by_torch.block_table_tensor)
    ):
        problems.append(f"context {context}, batch {batch}: the window kernels and the PyTorch path differ")
    lens = first.seq_lens.tolist()
    drops = [win.dropped_blocks(length, K + 1, SINK, WINDOW, BLOCK) for length in lens]
    full, table = first.block_table_tensor.tolist(), last.block_table_tensor.tolist()
    for row, (length, drop) in enumerate(zip(lens, drops, strict=True)):
        kept = [full[row][j] for j in win.kept_blocks_after(length, drop, SINK, BLOCK)]
        if int(last.seq_lens[row]) != length - BLOCK * drop or table[row][: len(kept)] != kept:
            problems.append(f"context {context}, batch {batch}: a later forward lost its cycle's window")
    _sync_debug("error")
    try:
        for _ in range(wstats.WRITE_EVERY_BUILDS):
            anchored_cycle(first, later)
    except RuntimeError as err:
        problems.append(f"context {context}, batch {batch}: a cycle waited for the GPU: {err}")
    finally:
        _sync_debug("default")
    return {
        "context": context,
        "batch": batch,
        "draft_forwards": K,
        "anchored_us": _host_us(anchored_cycle, first, later),
        "kernels": "triton" if state.buffers else "torch",
        "torch_anchored_us": _host_us(torch_cycle, first, later),
        "per_forward_us": _host_us(per_forward_cycle, first, later),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cpu: the same checks and timings on the host alone")
    args = parser.parse_args()

    import vllm

    from wmtp.plugin import hook
    from wmtp.plugin import stats as wstats
    from wmtp.plugin import window as win

    device = torch.device(args.device)
    # The plugin's Triton kernels for the cycles it times as the plugin runs them (on a GPU; the PyTorch path beside).
    os.environ.setdefault(hook.KERNELS_ENV, "triton")
    config = win.WindowConfig(SINK, WINDOW)
    stats_dir = Path(tempfile.mkdtemp())
    os.environ[wstats.ENV] = str(stats_dir)
    counters = wstats.DraftStats(SINK, WINDOW, vllm.__version__)

    def hooked(cm):
        windowed, dropped = hook.windowed_with_drops(cm, config, BLOCK)
        counters.record(SINK, WINDOW, BLOCK, cm.max_seq_len, cm.max_query_len, dropped)
        return windowed

    def previous(cm):
        windowed, dropped = _previous_copy(cm, config, BLOCK)
        total = dropped.sum()
        return windowed, total

    def empty(cm):
        return cm

    rows, cycles, problems, expected_skipped = [], [], [], 0
    for context in CONTEXTS:
        for batch in BATCHES:
            for queries in QUERIES:
                cm = _metadata(context, batch, queries, device)
                windowed = hooked(cm)
                found = _check(cm, windowed, config)
                problems += [f"context {context}, batch {batch}, queries {queries}: {p}" for p in found]
                expected_skipped += sum(
                    win.dropped_blocks(length, queries, SINK, WINDOW, BLOCK) for length in cm.seq_lens.tolist()
                )
                _sync_debug("error")
                try:
                    for _ in range(2 * wstats.WRITE_EVERY_BUILDS):  # through two writes of the counters
                        hooked(cm)
                    synced = None
                except RuntimeError as err:
                    synced = str(err).splitlines()[0]
                finally:
                    _sync_debug("default")
                expected_skipped += (
                    2
                    * wstats.WRITE_EVERY_BUILDS
                    * sum(win.dropped_blocks(length, queries, SINK, WINDOW, BLOCK) for length in cm.seq_lens.tolist())
                )
                if synced:
                    where = f"context {context}, batch {batch}, queries {queries}"
                    problems.append(f"{where}: waited for the GPU: {synced}")
                row = {
                    "context": context,
                    "batch": batch,
                    "queries": queries,
                    "hook_us": _host_us(hooked, cm),
                    "previous_us": _host_us(previous, cm),
                    "empty_us": _host_us(empty, cm),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            cycle = _cycle_row(context, batch, device, config, problems)
            cycles.append(cycle)
            print(json.dumps(cycle), flush=True)
    timed_builds = len(rows) * ROUNDS * CALLS
    counters.write(wait=True)
    written = json.loads(counters.path.read_text())
    per_build = sum(
        win.dropped_blocks(length, r["queries"], SINK, WINDOW, BLOCK)
        for r in rows
        for length in _metadata(r["context"], r["batch"], r["queries"], torch.device("cpu")).seq_lens.tolist()
    )
    expected_skipped += ROUNDS * CALLS * per_build
    if written["blocks_skipped"] != expected_skipped:
        problems.append(f"counters: {written['blocks_skipped']} blocks skipped, expected {expected_skipped}")
    result = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
        "load_average": os.getloadavg(),
        "block": BLOCK,
        "sink": SINK,
        "window": WINDOW,
        "rounds": ROUNDS,
        "calls_per_round": CALLS,
        "timed_builds": timed_builds,
        "rows": rows,
        "cycles": cycles,
        "counters": {k: written[k] for k in ("builds", "windowed_forwards", "blocks_skipped")},
        "problems": problems,
        "passed": not problems,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("hook_cost:", "PASS" if not problems else "FAIL", *problems[:10], sep="\n  ")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
