"""The vLLM GPU proofs' judgement of the ring, on records shaped as the plugin's instrument writes them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("vllm_gpu_proofs", REPO / "scripts" / "device" / "vllm_gpu_proofs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BLOCK = 96


def _build(tag: str, committed: int, query: int = 4) -> dict:
    return {
        "kind": "build",
        "tag": tag,
        "block_size": BLOCK,
        "cycle_seq_lens": [committed + query],
        "cycle_query_lens": [query],
    }


def _free(tag: str, first: int, last: int) -> dict:
    return {"kind": "free", "tag": tag, "first": first, "last": last, "taken": last - first, "block_size": BLOCK}


def _frees(first: int = 1, last: int = 30) -> list[dict]:
    """Under each ring tag, a free of blocks [first, last) before a draft forward with 3,840 tokens committed: S 16
    and W 256 at 96-token blocks read the sink (block 0) and from block (3840 - 256) // 96 = 37 on."""
    return [
        line for tag in ("ring clean", "ring poison outside", "ring clean, read all")
        for line in (_free(tag, first, last), _build(tag, 3840))
    ]  # fmt: skip


def _poison(free: int = 96, spared: int = 192) -> dict:
    """The instrument's record of one poisoning under the ring: slots written, of them in free blocks, and spared."""
    return {"kind": "poison", "tag": "ring poison outside", "region": "outside", "slots": free, "free": free,
            "spared": spared}  # fmt: skip


def _records(path: Path, drafts: dict[str, list], lines: list[dict] | None = None, poison: dict | None = None) -> Path:
    written = [{"kind": "propose", "tag": tag, "draft": d} for tag, each in drafts.items() for d in each]
    written += _frees() if lines is None else lines
    written.append(poison or _poison())
    path.write_text("".join(json.dumps(line) + "\n" for line in written))
    return path


def _outputs(ring_ids: list[int], poisoned_ids: list[int] | None = None) -> dict:
    answer = {"ids": [1, 2, 3], "gaps": [1.0, 1.0, 1.0]}
    return {
        "mtp code 4096": answer,
        "wmtp-ring code 4096": {**answer, "ids": ring_ids},
        "read set ring clean": {**answer, "ids": [7, 8]},
        "read set ring poison outside": {**answer, "ids": poisoned_ids or [7, 8]},
    }


def test_the_ring_passes_where_it_drafts_as_wmtp_and_its_freed_blocks_are_unread(tmp_path):
    script = _script()
    drafts = {
        "clean": [[[4, 5, 6]]],
        "clean, read all": [[[4, 5, 7]]],
        "ring clean": [[[4, 5, 6]]],
        "ring poison outside": [[[4, 5, 6]]],
        "ring clean, read all": [[[4, 5, 7]]],
    }
    proofs, found = {}, {}
    script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3]), _records(tmp_path / "r.jsonl", drafts), proofs, found)
    assert proofs and all(proofs.values()), proofs
    assert found["ring_read_set"]["ring clean"] == 1
    assert found["ring_poison"] == {"slots": 96, "free": 96, "spared": 192}
    assert found["ring_frees"] == {
        "frees": 3, "blocks_given_back": 3 * 29, "not_after_the_sink": 0, "into_a_read_window": 0,
    }  # fmt: skip
    # Told to read all, the ring proposed as wmtp told the same: recorded, not a proof.
    assert found["ring_read_all_differs_from_wmtp_read_all"] is False


def test_each_ring_proof_fails_on_its_own_evidence(tmp_path):
    script = _script()
    base = {
        "clean": [[[4, 5, 6]]],
        "clean, read all": [[[4, 5, 7]]],
        "ring clean": [[[4, 5, 6]]],
        "ring poison outside": [[[4, 5, 6]]],
        "ring clean, read all": [[[9, 9, 9]]],
    }
    cases = {
        "ring read set: drafts as wmtp's": {"ring clean": [[[4, 5, 8]]], "ring poison outside": [[[4, 5, 8]]]},
        "ring read set: freed blocks unread": {"ring poison outside": [[[4, 0, 6]]]},
    }
    for failing, change in cases.items():
        proofs: dict = {}
        records = _records(tmp_path / f"{len(failing)}.jsonl", {**base, **change})
        script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3]), records, proofs, {})
        assert [name for name, ok in proofs.items() if not ok] == [failing]
    # Unchanged drafts prove nothing where no poison reached a block the ring gave back and the pool holds free.
    proofs = {}
    records = _records(tmp_path / "spared.jsonl", base, poison=_poison(free=0))
    script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3]), records, proofs, {})
    assert [name for name, ok in proofs.items() if not ok] == ["ring read set: freed blocks unread"]
    # Poison that reached the target's KV (a reused block written through the draft's stale table) moves the output.
    proofs = {}
    records = _records(tmp_path / "target.jsonl", base)
    script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3], poisoned_ids=[7, 9]), records, proofs, {})
    assert [name for name, ok in proofs.items() if not ok] == ["ring read set: the poison left the target alone"]
    gone = "ring read set: what it gave back is gone"
    for name, lines in {
        "nothing freed": [_build("ring clean", 3840)],
        "the window's first block freed": _frees(1, 38),
        "the sink freed": _frees(0, 30),
        "freed before a forward that still reads it": [_free("ring clean", 1, 30), _build("ring clean", 2000)],
    }.items():
        proofs = {}
        records = _records(tmp_path / "g.jsonl", base, lines)
        script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3]), records, proofs, {})
        assert [n for n, ok in proofs.items() if not ok] == [gone], name
    proofs = {}
    script._ring_proofs({"code 4096": []}, _outputs([1, 9, 3]), _records(tmp_path / "l.jsonl", base), proofs, {})
    assert not proofs["ring lossless code 4096"]
