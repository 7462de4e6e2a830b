"""The question-answering workloads: exact lengths, seeded prompts, answers that the prompt really holds, recall."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from wmtp.config import (
    CWE_COMMON,
    CWE_COMMON_REPEATS,
    CWE_UNCOMMON_REPEATS,
    FWE_TOP,
    NIAH_KEYS,
    NIAH_QUERIES,
    RULER_MIN_TOKENS,
    RULER_WORKLOADS,
    ConfigError,
    study_from_dict,
)
from wmtp.measure.ruler import answer_recall, cwe_task, fwe_counts, fwe_task, niah_multiquery_task, ruler_task, score
from wmtp.measure.tasks import workload_task
from wmtp.measure.workload import PromptFactory, PromptLengthError


@pytest.fixture(scope="module")
def factory(tiny_tokenizer) -> PromptFactory:
    return PromptFactory(tiny_tokenizer)


LENGTHS = [RULER_MIN_TOKENS, 5000, 8191, 12288]


@pytest.mark.parametrize("workload", RULER_WORKLOADS)
@pytest.mark.parametrize("n", LENGTHS)
def test_exact_length_as_the_server_counts_it(factory, workload, n):
    task = ruler_task(factory, workload, n, 0, salt="measure")
    assert len(factory.encode(task.text)) == n
    assert task.answer


@pytest.mark.parametrize("workload", RULER_WORKLOADS)
def test_seeded_per_salt_index_and_length(factory, workload):
    one = ruler_task(factory, workload, 4500, 1, salt="s")
    assert ruler_task(factory, workload, 4500, 1, salt="s") == one
    others = [
        ruler_task(factory, workload, 4500, 2, salt="s"),
        ruler_task(factory, workload, 4500, 1, salt="t"),
        ruler_task(factory, workload, 4501, 1, salt="s"),
    ]
    for other in others:
        assert other.text != one.text
        assert other.answer != one.answer


def test_workload_task_carries_the_answer_and_code_and_copy_none(factory):
    n = RULER_MIN_TOKENS
    for workload in RULER_WORKLOADS:
        task = workload_task(factory, workload, n, 0, salt=f"measure/{n}")
        assert len(factory.encode(task.text)) == n and task.answer
        assert task.continuation is None and task.distance is None
    assert workload_task(factory, "code", n, 0, salt="measure").answer is None
    assert workload_task(factory, "copy", n, 0, salt="measure").answer is None


def test_the_chat_template_counts_too(tiny_tokenizer, tmp_path):
    # A checkpoint with a chat template of its own: the prompt is the content that the template makes n tokens long.
    import json
    import shutil

    shutil.copy(tiny_tokenizer, tmp_path / "tokenizer.json")
    template = "<|user|>\n{{ messages[0]['content'] }}\n<|assistant|>\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    chat = PromptFactory(tmp_path / "tokenizer.json", chat={})
    for workload in RULER_WORKLOADS:
        task = ruler_task(chat, workload, 6000, 0, salt="chat")
        assert chat.length(task.text) == 6000
        assert len(chat.encode(task.text)) < 6000  # the template's tokens are part of the count


# --- needle in a haystack ------------------------------------------------------------------------------------------

NEEDLE = re.compile(r"^One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.$", re.MULTILINE)


@pytest.mark.parametrize("n", [RULER_MIN_TOKENS, 9000])
def test_niah_needles_are_in_the_haystack_and_the_answer_is_theirs(factory, n):
    task = niah_multiquery_task(factory, n, 3, salt="t")
    needles = dict(NEEDLE.findall(task.text))
    assert len(needles) == NIAH_KEYS == len(set(needles.values()))
    assert len(task.answer) == NIAH_QUERIES
    # The question names the keys in the answer's order; each expected number is that key's needle.
    question = task.text[task.text.rindex("What are the special magic numbers for ") :]
    asked = re.findall(r"[a-z]+-[a-z]+", question)
    assert len(asked) == NIAH_QUERIES and set(asked) <= set(needles)
    assert [needles[key] for key in asked] == list(task.answer)
    # Spread through the haystack, not bunched at one end: needles in each third of the prompt.
    where = [task.text.index(f"for {key} is:") / len(task.text) for key in needles]
    assert min(where) < 1 / 3 and max(where) > 2 / 3 and any(1 / 3 < w < 2 / 3 for w in where)


def test_niah_fewer_queries_ask_for_a_subset(factory):
    task = niah_multiquery_task(factory, 4200, 0, salt="t", queries=4)
    needles = dict(NEEDLE.findall(task.text))
    assert len(task.answer) == 4 and set(task.answer) < set(needles.values())


def test_niah_refuses_a_prompt_too_short_for_its_needles(factory):
    with pytest.raises(PromptLengthError, match="cannot hold 48 needles"):
        niah_multiquery_task(factory, 1024, 0)


# --- frequent words ------------------------------------------------------------------------------------------------


def _coded_words(text: str) -> Counter:
    """The coded text's words, counted here on their own: between the instructions and the question, dots aside."""
    body = text.split("\n\n", 1)[1].rsplit("\n\nQuestion:", 1)[0]
    return Counter(word for word in body.split() if word.strip("."))


@pytest.mark.parametrize("n", [RULER_MIN_TOKENS, 8192, 16384])
def test_fwe_answer_is_the_most_frequent_words_of_the_text(factory, n):
    task = fwe_task(factory, n, 0, salt="t")
    counts = _coded_words(task.text)
    assert len(task.answer) == FWE_TOP
    ranked = counts.most_common()
    # The answer is the top words, most frequent first, and the next word is strictly less frequent.
    assert [word for word, _ in ranked[:FWE_TOP]] == list(task.answer)
    assert ranked[FWE_TOP - 1][1] > ranked[FWE_TOP][1]
    assert len({c for _, c in ranked[:FWE_TOP]}) == FWE_TOP
    # Many other words: a long tail to search through, not the answer alone.
    assert len(counts) > 3 * FWE_TOP


def test_fwe_counts_follow_the_zipf_law_with_a_ladder():
    counts = fwe_counts(100_000, 500)
    # Where the law gives distinct counts, they are the law's: rank r ≈ N r^-2 / zeta(2).
    assert counts[1] == int(100_000 / 4 / (3.141592653589793**2 / 6))
    assert counts[9] == int(100_000 / 100 / (3.141592653589793**2 / 6))
    # With few words, the ladder keeps the answer's ranks (2 … 31) distinct and above the rest.
    small = fwe_counts(200, 100)
    assert all(small[r] > small[r + 1] for r in range(1, FWE_TOP + 1))
    assert small[FWE_TOP + 1] < small[FWE_TOP]


# --- common words --------------------------------------------------------------------------------------------------


def _listed(text: str) -> Counter:
    return Counter(re.findall(r"^\d+\. ([a-z]+)$", text, re.MULTILINE))


@pytest.mark.parametrize("n", [RULER_MIN_TOKENS, 8192, 16384])
def test_cwe_answer_is_the_words_the_list_repeats_most(factory, n):
    task = cwe_task(factory, n, 0, salt="t")
    counts = _listed(task.text)
    assert len(task.answer) == CWE_COMMON == len(set(task.answer))
    assert all(counts[word] >= CWE_COMMON_REPEATS for word in task.answer)
    others = [c for word, c in counts.items() if word not in task.answer]
    assert max(others) <= CWE_UNCOMMON_REPEATS + 1 < CWE_COMMON_REPEATS
    assert sum(1 for c in others if c == CWE_UNCOMMON_REPEATS) >= CWE_COMMON
    # The list is numbered 1, 2, 3 … in order.
    numbers = [int(m) for m in re.findall(r"^(\d+)\. ", task.text, re.MULTILINE)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_cwe_refuses_a_prompt_too_short_for_its_common_words(factory):
    with pytest.raises(PromptLengthError, match="cannot hold the cwe task"):
        cwe_task(factory, 1500, 0)


# --- scoring -------------------------------------------------------------------------------------------------------


def test_recall_is_the_fraction_of_items_named():
    answer = ("4821937", "1022334", "9988776", "5550001")
    assert answer_recall("4821937\n1022334\n9988776\n5550001", answer) == 1.0
    assert answer_recall("amber-anchor: 4821937, brave-badge: 9988776", answer) == 0.5
    assert answer_recall("I do not know.", answer) == 0.0
    assert answer_recall("Tomaro, PIKEL and zunda", ("tomaro", "pikel", "brisk")) == pytest.approx(2 / 3)
    assert score("cwe", "tomaro pikel", ("tomaro", "pikel")) == 1.0
    with pytest.raises(ValueError):
        score("copy", "x", ("x",))
    with pytest.raises(ValueError):
        answer_recall("x", ())


def test_a_right_answer_to_a_generated_task_scores_one_and_a_wrong_one_zero(factory):
    task = niah_multiquery_task(factory, RULER_MIN_TOKENS, 0, salt="t")
    needles = dict(NEEDLE.findall(task.text))
    reply = "\n".join(f"{key}: {value}" for key, value in needles.items())
    assert score("niah_multiquery", reply, task.answer) == 1.0
    half = reply.splitlines()
    kept = [line for line in half if line.split(": ")[1] in task.answer[: NIAH_QUERIES // 2]]
    assert score("niah_multiquery", "\n".join(kept), task.answer) == 0.5
    assert score("niah_multiquery", "1234567", task.answer) == 0.0


# --- the study's protocol ------------------------------------------------------------------------------------------


def test_the_protocol_accepts_the_qa_workloads_and_a_repetition_penalty(embedded_raw):
    embedded_raw["protocol"].update(rungs=[RULER_MIN_TOKENS, 16384], repeats=[2, 2])
    embedded_raw["protocol"]["workloads"] = ["code", *RULER_WORKLOADS]
    embedded_raw["protocol"]["repetition_penalty"] = 1.15
    study = study_from_dict(embedded_raw)
    assert study.protocol.workloads == ["code", "niah_multiquery", "fwe", "cwe"]
    assert study.protocol.repetition_penalty == 1.15


@pytest.mark.parametrize("workload", RULER_WORKLOADS)
def test_a_rung_too_short_for_a_qa_task_is_refused(embedded_raw, workload):
    embedded_raw["protocol"]["rungs"] = [1024, 4096, 16384]
    embedded_raw["protocol"]["workloads"] = ["code", workload]
    with pytest.raises(ConfigError) as info:
        study_from_dict(embedded_raw)
    message = str(info.value)
    assert "protocol.rungs[0] = 1024" in message and f"too short for the {workload} workload" in message
    assert f"≥ {RULER_MIN_TOKENS}" in message
    embedded_raw["protocol"]["workloads"] = ["code"]
    assert study_from_dict(embedded_raw).protocol.rungs[0] == 1024


@pytest.mark.parametrize("bad", [0, -1.0, "high"])
def test_a_repetition_penalty_must_be_a_positive_number(embedded_raw, bad):
    embedded_raw["protocol"]["repetition_penalty"] = bad
    with pytest.raises(ConfigError, match="repetition_penalty"):
        study_from_dict(embedded_raw)


def test_the_question_answering_workloads_are_workloads_a_study_may_name():
    from wmtp.config import WORKLOADS

    assert set(RULER_WORKLOADS) < set(WORKLOADS)


def test_a_protocol_without_a_penalty_keeps_its_identity(embedded_raw):
    from wmtp.measure.identity import protocol_identity

    study = study_from_dict(embedded_raw)
    assert "repetition_penalty" not in study.protocol.model_dump(mode="json")
    assert "ruler_tasks" not in protocol_identity(study)
    embedded_raw["protocol"]["repetition_penalty"] = 1.15
    embedded_raw["protocol"].update(rungs=[RULER_MIN_TOKENS], repeats=[2], workloads=["fwe"])
    penalised = protocol_identity(study_from_dict(embedded_raw))
    assert penalised["repetition_penalty"] == 1.15 and penalised["ruler_tasks"]["fwe_top"] == FWE_TOP


def test_engines_send_the_penalty_only_when_the_protocol_sets_one(embedded_raw):
    from wmtp.engines import adapter

    plain = study_from_dict(embedded_raw).protocol
    embedded_raw["protocol"]["repetition_penalty"] = 1.15
    penalised = study_from_dict(embedded_raw).protocol
    for kind in ("vllm", "sglang"):
        assert adapter(kind).sampling_fields(plain) == {}
        assert adapter(kind).sampling_fields(penalised) == {"repetition_penalty": 1.15}


# --- one cell on the real server -----------------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_niah_cell_on_the_real_server(engine_python, tmp_path):
    """One mtp cell answering one needle-in-a-haystack prompt with a repetition penalty: the request stops at EOS
    or the cap, the record holds the expected answer (the prompt's own needles) and a recall in [0, 1], and the
    draft still drafts."""
    import json
    from pathlib import Path

    import pandas as pd
    from conftest import REPO, engines_dir

    from wmtp.config import load_study
    from wmtp.layout import TRAINED_CHECKPOINT
    from wmtp.measure.cell import CellRun, run_cell
    from wmtp.model.train import install_fixture

    fixture = TRAINED_CHECKPOINT
    model_dir = tmp_path / "model"
    install_fixture(model_dir, fixture, seed=0)
    raw = load_study(REPO / "config" / "config.yaml").model_dump(mode="json", exclude_none=True)
    raw.update(
        study="niah",
        results_dir=str(tmp_path / "results"),
        engines_dir=str(engines_dir()),
        models=[{"name": "tiny", "path": str(model_dir), "max_model_len": 8192}],
        arms=[{"name": "mtp", "k": [3]}],
    )
    rung, cap = RULER_MIN_TOKENS, 48
    raw["protocol"].update(
        rungs=[rung],
        repeats=[1],
        workloads=["niah_multiquery"],
        output_tokens=cap,
        warmup_requests=1,
        repetition_penalty=1.15,
    )
    raw.pop("replica", None)
    study = study_from_dict(raw, base_dir=tmp_path)
    (cell,) = study.cells()
    manifest = json.loads((engines_dir() / study.engine(cell.engine).name / "manifest.json").read_text())
    assert Path(manifest["python"]).exists() or engine_python
    out = tmp_path / "results" / "niah" / "raw" / cell.cell_id
    # The engine's own cache, as the pipeline's cells share it: vLLM inspects the model's classes once.
    cache_dir = engines_dir() / study.engine(cell.engine).name / "cache"
    run_cell(
        CellRun(study=study, cell=cell, out_dir=out, engine_manifest=manifest, model_dir=model_dir, cache_dir=cache_dir)
    )

    requests = pd.read_parquet(out / "requests.parquet")
    (row,) = requests[~requests["warmup"]].to_dict("records")
    assert row["workload"] == "niah_multiquery" and row["prompt_tokens"] == rung
    assert 1 <= row["completion_tokens"] <= cap and row["finish_reason"] in ("stop", "length")
    # The answer recorded is the one the prompt's needles give, rebuilt here from the same seed.
    factory = PromptFactory(model_dir / "tokenizer.json")
    prompt = workload_task(factory, "niah_multiquery", rung, 0, salt=f"measure/{rung}")
    needles = dict(NEEDLE.findall(prompt.text))
    assert list(row["expected_answer"]) == list(prompt.answer) and set(prompt.answer) <= set(needles.values())
    assert 0.0 <= row["answer_recall"] <= 1.0
    warm = requests[requests["warmup"]]
    assert warm["expected_answer"].isna().all() and warm["answer_recall"].isna().all()
    counters = pd.read_parquet(out / "counters.parquet")
    assert counters[counters["counter"] == "drafts"]["delta"].sum() > 0


# --- the cell's requests -------------------------------------------------------------------------------------------


def test_the_cell_answers_questions_until_eos_and_records_the_recall(embedded_raw, tmp_path, monkeypatch):
    """QA requests honour EOS and carry the penalty; code requests keep their fixed length; the rows say what the
    answer should have been and how much of it the output named."""
    from wmtp.engines.vllm import VLLMAdapter
    from wmtp.measure import cell as cell_mod
    from wmtp.measure.client import Completion
    from wmtp.measure.tasks import PromptTask

    embedded_raw["protocol"].update(rungs=[RULER_MIN_TOKENS], repeats=[1], workloads=["code", "niah_multiquery"])
    embedded_raw["protocol"]["repetition_penalty"] = 1.15
    study = study_from_dict(embedded_raw)
    run = cell_mod.CellRun(study, study.cells()[0], tmp_path, {}, tmp_path)
    sent: list[dict] = []

    def fake_complete(base_url, model, prompt, max_tokens, **kwargs):
        sent.append({"max_tokens": max_tokens, **kwargs})
        return Completion("brave-anchor: 1111111\ncalm-badge: 2222222", RULER_MIN_TOKENS, 9, 0.1, 0.5, 0, 0.1, 0.5)

    class Engine(VLLMAdapter):
        def read_counters(self, base_url):
            return {}

    class Meter:
        available = False

    monkeypatch.setattr(cell_mod, "complete", fake_complete)
    answer = ("1111111", "2222222", "3333333", "4444444")
    rows = {}
    for workload, task in (("code", PromptTask("x")), ("niah_multiquery", PromptTask("x", answer=answer))):
        (rows[workload],) = cell_mod._measure(
            run, Meter(), "http://s", "tiny", [task], workload, RULER_MIN_TOKENS, 0, 512, False, None, Engine()
        )
    code, qa = sent
    assert code["ignore_eos"] is True and qa["ignore_eos"] is False and qa["max_tokens"] == 512
    assert code["extra_body"]["repetition_penalty"] == qa["extra_body"]["repetition_penalty"] == 1.15
    assert qa["extra_body"]["stream_options"]["continuous_usage_stats"] is True  # the engine's own fields stay
    assert rows["niah_multiquery"]["expected_answer"] == list(answer)
    assert rows["niah_multiquery"]["answer_recall"] == 0.5
    assert rows["code"]["expected_answer"] is None and rows["code"]["answer_recall"] is None
