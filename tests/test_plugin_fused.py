"""The window kernels (wmtp.plugin.fused) against the plugin's PyTorch path and the integer formulas.

On a GPU the plugin windows a cycle with these Triton kernels; here Triton's interpreter runs the same kernels on
CPU tensors (TRITON_INTERPRET must be set before the kernels are defined, so each case runs in a fresh interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"

CASES = textwrap.dedent(
    """
    import dataclasses, random
    import torch
    from attention_metadata import Metadata
    from wmtp.plugin import fused, hook, stats as wstats, window as win

    def metadata(lens, queries, table):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        starts = torch.tensor([0] + list(torch.tensor(queries).cumsum(0)), dtype=torch.int32)
        return Metadata(starts, starts.clone(), seq_lens, max(queries), max(lens), table, seq_lens.clone())

    rng = random.Random(7)
    checked = 0
    for case in range(60):
        block = rng.choice([16, 96, 560])
        sink, window, k = rng.choice([0, 16, 64]), rng.choice([256, 1000, 4096]), rng.choice([1, 3, 6])
        n = rng.choice([1, 2, 3, 4, 70])  # 70: more rows than one chunk of the later kernel
        rows = n + rng.randint(0, 2)  # vLLM's table can hold more rows than the batch
        lens = [rng.randint(1, 60 * block) for _ in range(n)]
        cols = -(-max(lens) // block) + k + 2
        table = torch.randperm(rows * cols).to(torch.int32).reshape(rows, cols)
        config = win.WindowConfig(sink, window)
        states = []
        for on_gpu_path in (False, True):
            counters = wstats.DraftStats(sink, window, "test")
            state = hook._State(config, counters, k)
            if on_gpu_path:
                state.buffers = fused.CycleBuffers(torch.device("cpu"))
                counters.count_on_device(state.buffers.total)
            else:
                state.buffers = False
            states.append(state)
        # A decode cycle; one whose later forwards get another block table (each windows on its own); a prefill's
        # chunk of more queries (its forwards never keep a window).
        mode = rng.choice(["decode", "new table", "chunk"])
        queries = rng.randint(k + 2, 40) if mode == "chunk" else k + 1
        first = metadata(lens, [queries] * n, table)
        outs = []
        for state in states:
            cm = dataclasses.replace(first, seq_lens=first.seq_lens.clone())
            cycle = []
            for step in range(k):
                if step:
                    cm = dataclasses.replace(cm, query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                                             max_query_len=1, seq_lens=cm.seq_lens + 1, max_seq_len=cm.max_seq_len + 1)
                    if mode == "new table":
                        cm = dataclasses.replace(cm, block_table_tensor=cm.block_table_tensor.clone())
                windowed, dropped, reused = hook.window_forward(state, cm, config, block, step)
                state.stats.record(sink, window, block, cm.max_seq_len, cm.max_query_len, dropped, reused=reused)
                cycle.append((windowed.seq_lens.tolist(), windowed.block_table_tensor[:n].tolist(),
                              windowed.max_seq_len, reused))
            outs.append(cycle)
        assert outs[0] == outs[1], (case, outs)
        torch_stats, kernel_stats = (s.stats.snapshot(wait=True) for s in states)
        assert (torch_stats["window_kernels"], kernel_stats["window_kernels"]) == ("torch", "triton")
        # On a GPU the counters read the total without waiting, by a copy into a 0-d pinned host tensor.
        host = torch.zeros((), dtype=torch.int64)
        host.copy_(states[1].buffers.total)
        assert int(host) == kernel_stats["blocks_skipped"]
        for key in ("windowed_forwards", "anchored_forwards", "blocks_skipped"):
            assert torch_stats[key] == kernel_stats[key], (case, key, torch_stats[key], kernel_stats[key])
        # The first forward against the integer formulas, row by row.
        lens_out, table_out, _, _ = outs[1][0]
        if win.needs_window(max(lens), sink, window):
            for row, length in enumerate(lens):
                assert lens_out[row] == win.windowed_seq_len(length, queries, sink, window, block)
                kept = [int(table[row][j]) for j in win.kept_blocks(length, queries, sink, window, block)]
                assert table_out[row][: len(kept)] == kept
                checked += 1
    assert checked > 20, checked
    print("checked", checked)
    """
)


def test_the_window_kernels_set_the_same_window_and_count_the_same_blocks_as_the_pytorch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    done = subprocess.run([sys.executable, "-c", CASES], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked" in done.stdout
