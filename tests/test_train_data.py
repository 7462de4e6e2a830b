"""The training data and schedule of wmtp.model.train, on their own (torch on CPU, no model)."""

from __future__ import annotations

import pytest

from wmtp.model.train import (
    COPIED_CODE,
    COPIED_RANDOM,
    TINY_BUDGET,
    Budget,
    _lr_at,
    make_far_copy_batch,
    phase_shape,
    stage_progress,
)

torch = pytest.importorskip("torch")


def _stream(n: int = 50_000):
    # Tokens 2048..: never drawn for random passages (1..vocab-1 with vocab 2048), so the two kinds tell apart.
    return torch.arange(n, dtype=torch.int64) + 2048


def test_far_copies_repeat_their_passage_at_the_drawn_distances():
    g = torch.Generator().manual_seed(3)
    seq_len, shortest = 4096, 32
    rows, copied = make_far_copy_batch(
        _stream(), g, 16, seq_len, 1.0, 0.5, 2048, passage=(shortest, 64), min_distance=512, copies=4
    )
    assert rows.shape == copied.shape == (16, seq_len)
    distances, kinds = [], set()
    for b in range(16):
        row, mask = rows[b], copied[b]
        # Each repeated token equals the token ``distance`` back, for one distance per run of marked tokens.
        marked = mask.nonzero().flatten().tolist()
        assert marked, "every row was asked to carry a copy"
        runs, start = [], marked[0]
        for prev, cur in zip(marked, [*marked[1:], None], strict=True):
            if cur != prev + 1:
                runs.append((start, prev + 1))
                start = cur
        for lo, hi in runs:
            found = [d for d in range(512, lo + 1) if torch.equal(row[lo:hi], row[lo - d : hi - d])]
            assert found, f"row {b}: tokens {lo}..{hi} repeat nothing from ≥ 512 back"
            distances.append(found[0])
            kind = int(mask[lo])
            kinds.add(kind)
            # Random passages are drawn from the vocabulary; code passages are the stream's own tokens.
            assert bool((row[lo:hi] < 2048).all()) == (kind == COPIED_RANDOM)
    assert kinds == {COPIED_CODE, COPIED_RANDOM}
    # Spread over the row: some near the minimum, some beyond half of it.
    assert min(distances) < seq_len // 4 and max(distances) > seq_len // 2


def test_far_copies_are_deterministic_and_respect_the_share():
    a = make_far_copy_batch(_stream(), torch.Generator().manual_seed(1), 8, 1024, 1.0, 0.0, 2048, (16, 32), 64, 2)
    b = make_far_copy_batch(_stream(), torch.Generator().manual_seed(1), 8, 1024, 1.0, 0.0, 2048, (16, 32), 64, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not bool((a[1] == COPIED_RANDOM).any())  # random_share 0: code passages only
    none = make_far_copy_batch(_stream(), torch.Generator().manual_seed(1), 8, 1024, 0.0, 1.0, 2048, (16, 32), 64, 2)
    assert not bool(none[1].any())


def test_a_row_too_short_for_the_distance_gets_no_copy():
    rows, copied = make_far_copy_batch(
        _stream(), torch.Generator().manual_seed(0), 4, 256, 1.0, 1.0, 2048, (32, 64), 512
    )
    assert not bool(copied.any())
    assert bool((rows >= 2048).all())


def test_phase_shape_follows_progress():
    phases = ((0.0, 32, 2048), (0.5, 8, 8192), (0.8, 4, 16384))
    assert phase_shape(0.1, phases, 1, 512) == (32, 2048)
    assert phase_shape(0.5, phases, 1, 512) == (8, 8192)
    assert phase_shape(0.99, phases, 1, 512) == (4, 16384)
    assert phase_shape(0.3, (), 8, 512) == (8, 512)
    assert phase_shape(0.1, ((0.2, 4, 64),), 8, 512) == (8, 512)


def test_a_time_limit_moves_the_schedule_on():
    assert stage_progress(10, 100, 999.0, 0.0) == 10  # no limit: the step itself (the CPU bytes depend on it)
    assert stage_progress(10, 100, 50.0, 100.0) == 50.0
    assert stage_progress(80, 100, 10.0, 100.0) == 80
    # Half-way in time is half-way down the cosine: the same rate as half-way in steps.
    assert _lr_at(stage_progress(10, 100, 50.0, 100.0), 100, 1.0, 0) == pytest.approx(_lr_at(50, 100, 1.0, 0))


def test_the_cpu_budgets_keep_the_near_layout_and_no_limits():
    for budget in (Budget(), TINY_BUDGET):
        assert budget.copy_layout == "near"
        assert budget.phases == () and budget.mtp_phases == ()
        assert budget.target_seconds == 0 and budget.mtp_seconds == 0


def test_the_cpu_budgets_keep_the_target_frozen_and_a_negative_weight_is_refused():
    assert Budget().mtp_target_weight == 0 and TINY_BUDGET.mtp_target_weight == 0
    with pytest.raises(ValueError, match="mtp_target_weight must be ≥ 0"):
        Budget(mtp_target_weight=-1.0)


def test_fusing_experts_inverts_the_checkpoint_layout():
    from wmtp.model.tiny import _split_fused_experts
    from wmtp.model.train import fuse_experts

    g = torch.Generator().manual_seed(0)
    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 2 * 8, 16, generator=g),
        "model.layers.0.mlp.experts.down_proj": torch.randn(4, 16, 8, generator=g),
        "model.layers.0.mlp.shared_expert.gate_proj.weight": torch.randn(8, 16, generator=g),
        "mtp.layers.0.mlp.experts.down_proj": torch.randn(4, 16, 8, generator=g),
        "mtp.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 2 * 8, 16, generator=g),
        "lm_head.weight": torch.randn(32, 16, generator=g),
    }
    split = _split_fused_experts(fused, 4)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in split
    back = fuse_experts(split, 4)
    assert back.keys() == fused.keys()
    assert all(torch.equal(back[k], fused[k]) for k in fused)
