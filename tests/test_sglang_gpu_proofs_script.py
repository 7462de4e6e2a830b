"""The SGLang proofs script's readers, on answers shaped as SGLang's offline engine gives them (it needs a GPU)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "sglang_gpu_proofs", REPO / "scripts" / "device" / "sglang_gpu_proofs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Engine:
    """SGLang's Engine.generate answer for one request: output ids, and per token its top candidates as
    (logprob, token id, text) in meta_info, with the request's verify cycles."""

    def __init__(self):
        self.asked = {}

    def generate(self, **kwargs):
        self.asked = kwargs
        top = [[(-0.1, 5, None), (-2.1, 6, None)], [(-0.5, 7, None), (-0.6, 8, None)], [(-0.2, 9, None)]]
        meta = {"output_top_logprobs": top, "completion_tokens": 3, "spec_verify_ct": 2}
        return {"output_ids": [5, 7, 9], "meta_info": meta}


def test_an_answer_gives_its_ids_its_top2_gaps_and_its_tokens_per_verify():
    script, engine = _script(), Engine()
    got = script._generate(engine, [1, 2, 3], penalty=1.15)
    assert got["ids"] == [5, 7, 9] and got["tokens_per_verify"] == 1.5
    assert math.isclose(got["gaps"][0], 2.0) and math.isclose(got["gaps"][1], 0.1) and got["gaps"][2] == math.inf
    assert engine.asked["return_logprob"] and engine.asked["top_logprobs_num"] == 2
    assert engine.asked["sampling_params"]["repetition_penalty"] == 1.15
    assert engine.asked["sampling_params"]["ignore_eos"] and engine.asked["input_ids"] == [1, 2, 3]


def test_the_read_set_compares_the_windowed_steps_tokens_of_one_tag(tmp_path):
    script = _script()
    records = tmp_path / "records.jsonl"
    lines = [
        {"kind": "propose", "tag": "clean", "draft": [[1, 2, 3, 4], [5, 6, 7, 8]]},
        {"kind": "poison", "tag": "clean", "region": "outside", "slots": 3},
        {"kind": "propose", "tag": "other", "draft": [[9, 9, 9, 9]]},
    ]
    records.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # The bonus token and the draft-extend's are left out: only the windowed steps' tokens.
    assert script._drafts(records, "clean") == [[[3, 4], [7, 8]]]
    assert script._drafts(tmp_path / "none.jsonl", "clean") == []
