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


def _records(path: Path, drafts: dict[str, list]) -> Path:
    lines = [{"kind": "propose", "tag": tag, "draft": d} for tag, each in drafts.items() for d in each]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _outputs(ring_ids: list[int]) -> dict:
    answer = {"ids": [1, 2, 3], "gaps": [1.0, 1.0, 1.0]}
    return {"mtp code 4096": answer, "wmtp-ring code 4096": {**answer, "ids": ring_ids}}


def test_the_ring_passes_where_it_drafts_as_wmtp_and_its_freed_blocks_are_unread(tmp_path):
    script = _script()
    drafts = {
        "clean": [[[4, 5, 6]]],
        "clean, read all": [[[4, 5, 7]]],
        "ring clean": [[[4, 5, 6]]],
        "ring poison outside": [[[4, 5, 6]]],
        "ring clean, read all": [[[9, 9, 9]]],
    }
    proofs, found = {}, {}
    script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3]), _records(tmp_path / "r.jsonl", drafts), proofs, found)
    assert proofs and all(proofs.values()), proofs
    assert found["ring_read_set"]["ring clean"] == 1


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
        "ring read set: what it gave back is gone": {"ring clean, read all": [[[4, 5, 7]]]},
    }
    for failing, change in cases.items():
        proofs: dict = {}
        records = _records(tmp_path / f"{len(failing)}.jsonl", {**base, **change})
        script._ring_proofs({"code 4096": []}, _outputs([1, 2, 3]), records, proofs, {})
        assert [name for name, ok in proofs.items() if not ok] == [failing]
    proofs = {}
    script._ring_proofs({"code 4096": []}, _outputs([1, 9, 3]), _records(tmp_path / "l.jsonl", base), proofs, {})
    assert not proofs["ring lossless code 4096"]
