"""The ring's admission proof: sizing, the engine's counters read back, the tidy table and the report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import ENGINE_NAME, engines_dir

from wmtp.analyze import costmodel
from wmtp.analyze.tidy import admission_table
from wmtp.config import ConfigError, study_from_dict
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.measure import admission as adm
from wmtp.report.load import Tidy
from wmtp.report.sections import admission_section, reclaim_measured_section

REPO = Path(__file__).resolve().parents[1]


def test_the_kv_budget_admits_n_under_wmtp_and_one_more_under_the_ring():
    plain, ring = 3_145_728, 2_359_296  # bytes per request, as the CPU build counts them at 4,096 tokens
    budget = adm.kv_bytes_for(2, plain, ring)
    assert budget // plain == 2 and budget // ring == 3
    # the middle of [max(2 · plain, 3 · ring), 3 · plain)
    assert budget == (3 * 2_359_296 + 3 * 3_145_728) // 2
    for n in (1, 3, 4):
        size = adm.kv_bytes_for(n, plain, ring)
        assert size // plain == n and size // ring >= n + 1


def test_a_ring_that_saves_nothing_cannot_be_sized():
    with pytest.raises(adm.AdmissionUnsized, match="to admit 3 where wmtp admits 2"):
        adm.kv_bytes_for(2, 1000.0, 1000.0)


def test_the_steps_say_what_ran_at_once():
    queued = [
        {"running": 1, "waiting": 2, "preemptions": 0},
        {"running": 2, "waiting": 1, "preemptions": 0},
        {"running": 2, "waiting": 1, "preemptions": 0},
        {"running": 1, "waiting": 0, "preemptions": 0},
    ]
    got = adm.summarize_steps(queued, 3)
    assert got == {
        "requests": 3,
        "steps": 4,
        "max_running": 2,
        "steps_with_waiting": 3,
        "preemptions": 0,
        "all_at_once": False,
    }
    everyone = [{"running": 3, "waiting": 0, "preemptions": 0}]
    preempted = [{"running": 3, "waiting": 0, "preemptions": 0}, {"running": 2, "waiting": 1, "preemptions": 1}]
    assert adm.summarize_steps(everyone, 3)["all_at_once"]
    assert not adm.summarize_steps(preempted, 3)["all_at_once"]
    assert adm.verdict(got, adm.summarize_steps(everyone, 3)) == "ring admits one more"
    assert adm.verdict(got, got) == "the ring did not run all at once"
    assert adm.verdict(adm.summarize_steps(everyone, 3), adm.summarize_steps(everyone, 3)).startswith("both ran")


def test_the_embedded_study_asks_for_one_proof_at_its_ring_cell():
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    proofs = study_from_dict(raw).admission_proofs()
    assert [(c.model, c.engine, c.arm, c.k, c.sink, c.window) for c in proofs] == [
        ("tiny", "vllm-cpu", "wmtp-ring", 3, 16, 256)
    ]
    study = study_from_dict(raw)
    # the proof's length: the cells' 16,640 is capped at the 4,096 the CPU build serves this batch at
    assert study.admission_settings("tiny", "vllm-cpu") == {"sink": 16, "window": 256, "k": 3, "max_model_len": 4096}
    assert study.runs_windowed("vllm-cpu")
    with pytest.raises(ConfigError, match="asks for no admission proof of 'other'"):
        study.admission_settings("other", "vllm-cpu")
    raw["arms"] = [a for a in raw["arms"] if a["name"] != "wmtp-ring"]
    assert study_from_dict(raw).admission_proofs() == []
    raw["arms"] = [a for a in raw["arms"] if a["name"] not in ("wmtp",)]
    assert not study_from_dict(raw).runs_windowed("vllm-cpu")


def test_the_cost_model_reads_the_tiny_checkpoints_config():
    config = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    spec = costmodel.model_from_hf_config(config, "tiny")
    full = sum(t == "full_attention" for t in config["layer_types"])
    assert (spec.n_attn, spec.n_draft_attn) == (full, 1)
    per_token = 2 * config["num_key_value_heads"] * config["head_dim"] * 2  # K and V in bf16
    plain = costmodel.kv_memory(spec, 4096, sink=16, window=256, ring=False)
    ring = costmodel.kv_memory(spec, 4096, sink=16, window=256, ring=True)
    assert plain.target_kv == full * 4096 * per_token and plain.draft_kv == 4096 * per_token
    assert ring.draft_kv == (16 + 256) * per_token and ring.state == plain.state > 0


def _proof_file(tmp_path: Path) -> Path:
    def arm(blocks: int, concurrency: float, running: int, waiting: int, all_at_once: bool) -> dict:
        return {
            "kv_cache_memory_bytes": 8_257_536,
            "num_blocks": blocks,
            "capacity_tokens": blocks * 256,
            "max_concurrency": concurrency,
            "bytes_per_request": 8_257_536 / concurrency,
            "pages_by_group": "FullAttentionSpec ×1 layers: 16",
            "requests": 3,
            "steps": 20,
            "max_running": running,
            "steps_with_waiting": waiting,
            "preemptions": 0,
            "all_at_once": all_at_once,
            "seconds": 3.0,
        }

    found = {
        "n": 2,
        "sink": 16,
        "window": 256,
        "k": 3,
        "max_model_len": 4096,
        "prompt_tokens": 4080,
        "output_tokens": 16,
        "kv_cache_memory_bytes": 8_257_536,
        "arms": {"wmtp": arm(63, 2.625, 2, 11, False), "wmtp-ring": arm(126, 3.5, 3, 7, True)},
        "same_output": True,
        "verdict": "ring admits one more",
        "predicted": {
            "bytes_per_request_wmtp": 2_202_368,
            "bytes_per_request_ring": 1_223_424,
            "reclaimed_fraction": 0.446,
        },
    }
    path = tmp_path / "tiny~vllm-cpu.json"
    path.write_text(json.dumps(found))
    return path


def test_the_proof_becomes_one_row_per_arm_and_a_report_table(tmp_path):
    table = admission_table([_proof_file(tmp_path)])
    assert list(table["arm"]) == ["wmtp", "wmtp-ring"]
    assert table.set_index("arm").loc["wmtp-ring", "predicted_bytes_per_request"] == 1_223_424
    tidy = Tidy(requests=pd.DataFrame(), rungs=pd.DataFrame(), positions=pd.DataFrame(), admission=table)
    section = admission_section(tidy)
    assert list(section.frame["most running at once"]) == [2, 3]
    assert section.notes[0].startswith("tiny on vllm-cpu: ring admits one more. 3 requests of 4,080 prompt tokens")
    assert set(section.frame["engine"]) == {"vllm-cpu"}
    reclaim = reclaim_measured_section(tidy).frame.iloc[0]
    # engine: 1 − (8,257,536 / 3.5) / (8,257,536 / 2.625) = 1 − 2.625 / 3.5 = 25 %
    assert reclaim["reclaimed, engine (%)"] == 25.0 and reclaim["reclaimed, cost model (%)"] == 44.6


def test_a_proof_that_could_not_be_sized_is_reported_not_dropped(tmp_path):
    path = _proof_file(tmp_path)
    found = json.loads(path.read_text())
    found.update(arms={}, same_output=None, verdict="not sizeable: the ring saves nothing per request")
    found.pop("predicted")
    path.write_text(json.dumps(found))
    table = admission_table([path])
    assert len(table) == 1 and table["arm"].isna().all()
    tidy = Tidy(requests=pd.DataFrame(), rungs=pd.DataFrame(), positions=pd.DataFrame(), admission=table)
    section = admission_section(tidy)
    assert not section.available
    assert section.notes == ("tiny on vllm-cpu: not sizeable: the ring saves nothing per request",)
    assert not reclaim_measured_section(tidy).available


def _drafts_cut_short(prompt: int, tokens: int, k: int, max_model_len: int) -> list[int]:
    """Generated counts at which vLLM's scheduler (v1, 0.32) would cut a decode step's 1 + k tokens short: it schedules
    at most max_model_len - computed - 1, and a request that still needs a token has computed prompt + generated - 1."""
    return [g for g in range(1, tokens) if 1 + k > max_model_len - (prompt + g - 1) - 1]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_proofs_prompt_leaves_every_step_its_whole_draft(k):
    prompt = adm.prompt_length(4096, 16, k)
    assert _drafts_cut_short(prompt, 16, k, 4096) == []
    # A prompt of max_model_len - tokens, the proof's length before, had its last steps' drafts cut.
    assert _drafts_cut_short(4096 - 16, 16, k, 4096) != []
    with pytest.raises(ValueError, match="leaves no prompt"):
        adm.prompt_length(16 + k + 1, 16, k)


def test_no_proof_says_why():
    tidy = Tidy(requests=pd.DataFrame(), rungs=pd.DataFrame(), positions=pd.DataFrame())
    assert admission_section(tidy).notes[0].startswith("no admission proof")
    assert not reclaim_measured_section(tidy).available


@pytest.mark.engine
def test_the_ring_serves_one_more_request_where_wmtp_queues(engine_python, tmp_path):
    """In the real CPU build: wmtp's KV holds 2 requests of 4,076 prompt tokens, the ring's 3; 3 arrive at once.
    The committed model accepts whole drafts often enough that a draft cut at max_model_len would stop vLLM here."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # The engine's vLLM cache, which the cells share (wmtp.cli): a fresh one costs a subprocess importing vLLM.
    env["VLLM_CACHE_ROOT"] = str(engines_dir() / ENGINE_NAME / "cache" / "vllm")
    out = tmp_path / "proof.json"
    found = adm.run_in_engine(engine_python, env, TRAINED_CHECKPOINT, out, sink=16, window=256, k=3, max_model_len=4096)
    assert (tmp_path / "proof.json.log").read_text().count("wmtp: ring:") >= 1  # the engine's own output, kept
    plain, ring = found["arms"]["wmtp"], found["arms"]["wmtp-ring"]
    assert plain["kv_cache_memory_bytes"] == ring["kv_cache_memory_bytes"] == found["kv_cache_memory_bytes"]
    assert 2 <= plain["max_concurrency"] < 3 <= ring["max_concurrency"], (plain, ring)
    assert ring["max_running"] == 3 and ring["preemptions"] == 0
    assert plain["max_running"] == 2 and (
        plain["steps_with_waiting"] > ring["steps_with_waiting"] or plain["preemptions"]
    )
    assert "SinkWindowSpec" in ring["pages_by_group"] and "SinkWindowSpec" not in plain["pages_by_group"]
    # The engine's own attention layers: the checkpoint's full-attention layers and its one MTP layer.
    layer_types = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())["layer_types"]
    full = layer_types.count("full_attention")
    assert (plain["attention_layers"], plain["draft_attention_layers"]) == (full + 1, 1)
    assert found["draft_kv_share"] == pytest.approx(1 / (full + 1))
    assert 0 < found["reclaimed_fraction"] < found["draft_kv_share"]
    assert found["same_output"], found["output_check"]
    assert found["output_check"]["ring_vs_same_batches"] == "token-identical"
    assert found["verdict"] == "ring admits one more"
    assert os.path.exists(out)


def test_a_build_of_another_engine_spec_is_refused_before_the_proof_runs(tmp_path):
    from wmtp.cli import main
    from wmtp.engines.build import EngineBuildError

    # The interpreter does not exist: the refusal must come before anything tries to run it.
    manifest = {"engine": "vllm-cpu", "python": str(tmp_path / "no-python"), "build_hash": "a" * 16}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    argv = ["admission", "--model", "tiny", "--model-dir", str(tmp_path), "--engine-manifest"]
    argv += [str(tmp_path / "manifest.json"), "--proof", json.dumps({"sink": 16, "window": 256, "k": 3})]
    argv += ["--out", str(tmp_path / "proof.json")]
    with pytest.raises(EngineBuildError, match=f"was built from spec {'a' * 16}, but the study describes spec b"):
        main([*argv, "--engine-hash", "b" * 16])
    assert not (tmp_path / "proof.json").exists()


def _outputs(same_batches: list[list[int]], proof: list[list[int]], ring: list[list[int]], gap: float = 1.0) -> dict:
    def wrap(rows):
        return [adm.Output(ids, [gap] * len(ids)) for ids in rows]

    return {adm.SAME_BATCHES: wrap(same_batches), "wmtp": wrap(proof), "wmtp-ring": wrap(ring)}


def test_the_ring_must_repeat_wmtp_in_the_same_batches_token_for_token():
    check = adm.output_check(_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]), eps=0.25)
    assert check["equal"] and check["ring_vs_same_batches"] == "token-identical"
    assert check["summary"].endswith("against wmtp in the proof's KV 2 of 2 requests are identical")
    # Even a near tie may not excuse a difference where the batches were the same.
    wrong = adm.output_check(_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]], gap=0.01), 0.25)
    assert not wrong["equal"] and wrong["ring_vs_same_batches"] == "differs"
    assert wrong["summary"].startswith("NOT equal")


def test_against_wmtp_in_other_batches_a_near_tie_may_flip_but_a_confident_token_may_not():
    tie = adm.output_check(_outputs([[1, 2, 9]], [[1, 2, 3]], [[1, 2, 9]], gap=0.1), eps=0.25)
    assert tie["equal"]
    assert tie["ring_vs_proof_wmtp"][0]["first_divergence"] == 2
    assert "request 0 at token 2 (gap 0.100)" in tie["summary"]
    confident = adm.output_check(_outputs([[1, 2, 9]], [[1, 2, 3]], [[1, 2, 9]], gap=2.0), eps=0.25)
    assert not confident["equal"] and not confident["ring_vs_proof_wmtp"][0]["equal"]


def test_top2_gaps_read_vllms_logprobs():
    class Logprob:
        def __init__(self, value: float) -> None:
            self.logprob = value

    gaps = adm.top2_gaps([{7: Logprob(-0.1), 3: Logprob(-2.6)}, {5: Logprob(-0.0)}])
    assert gaps[0] == pytest.approx(2.5) and gaps[1] == float("inf")
    assert adm.top2_gaps(None) == []


def _record(arm: str, kv: int, concurrency: float, running: int, ids: list[list[int]], **settings) -> dict:
    base = {"n": 2, "sink": 16, "window": 4096, "k": 3, "max_model_len": 1_041_021, "prompt_tokens": 1_040_000}
    base |= {"output_tokens": 1017, "chunk": 8192, **settings}
    return {
        "arm": arm,
        "engine": {"vllm": "0.24.0"},
        **base,
        "kv_cache_memory_bytes": kv,
        "max_concurrency": concurrency,
        "bytes_per_request": kv / concurrency,
        "requests": 3,
        "steps": 1200,
        "max_running": running,
        "steps_with_waiting": 254 if running == 3 else 500,
        "preemptions": 0,
        "all_at_once": running == 3,
        "decode_step_ms": {"3": {"median": 15.0, "p10": 14.0, "p90": 16.0, "n": 900}},
        "outputs": [{"ids": i, "gaps": [1.0] * len(i)} for i in ids],
    }


def test_three_arm_records_of_separate_runs_make_one_proof():
    ids = [[1, 2], [3, 4], [5, 6]]
    records = [
        _record("wmtp, all at once", 80, 3.4, 3, ids),
        _record("wmtp", 60, 2.55, 2, ids),
        _record("wmtp-ring", 60, 2.8, 3, ids),
    ]
    proof = adm.combine(records)
    assert proof["verdict"] == "ring admits one more" and proof["same_output"] is True
    assert proof["reclaimed_fraction"] == pytest.approx(1 - 2.55 / 2.8)
    assert set(proof["arms"]) == {"wmtp", "wmtp-ring"} and proof["same_batches"]["max_running"] == 3
    assert "outputs" not in proof["arms"]["wmtp-ring"] and proof["arms"]["wmtp-ring"]["decode_step_ms"]["3"]["n"] == 900
    # a ring whose tokens differ from wmtp's in the same batches is no proof of the same output
    assert all("engine" not in arm and "arm" not in arm for arm in proof["arms"].values())
    differs = adm.combine([*records[:2], _record("wmtp-ring", 60, 2.8, 3, [[1, 2], [3, 4], [5, 7]])])
    assert differs["same_output"] is False and differs["verdict"] == "ring admits one more"


def test_records_of_different_proofs_are_not_combined():
    ids = [[1, 2], [3, 4], [5, 6]]
    same = _record("wmtp, all at once", 80, 3.4, 3, ids)
    with pytest.raises(ValueError, match=r"other \['window'\]"):
        adm.combine([same, _record("wmtp", 60, 2.55, 2, ids), _record("wmtp-ring", 60, 2.8, 3, ids, window=256)])
    with pytest.raises(ValueError, match="same KV cache memory"):
        adm.combine([same, _record("wmtp", 60, 2.55, 2, ids), _record("wmtp-ring", 61, 2.8, 3, ids)])
    with pytest.raises(ValueError, match=r"missing \['wmtp, all at once'\]"):
        adm.combine([_record("wmtp", 60, 2.55, 2, ids), _record("wmtp-ring", 60, 2.8, 3, ids)])
    # arms run in separate leases must have run one plugin
    plugins = [_record("wmtp, all at once", 80, 3.4, 3, ids), _record("wmtp", 60, 2.55, 2, ids)]
    plugins.append(_record("wmtp-ring", 60, 2.8, 3, ids))
    for record, plugin in zip(plugins, ("c1ec7d015478044c", "c1ec7d015478044c", "7df2f84be143a431"), strict=True):
        record["wmtp_plugin_sha256"] = plugin
    with pytest.raises(ValueError, match="other wmtp_plugin_sha256"):
        adm.combine(plugins)
    plugins[-1]["wmtp_plugin_sha256"] = "c1ec7d015478044c"
    assert adm.combine(plugins)["wmtp_plugin_sha256"] == "c1ec7d015478044c"


def test_decode_steps_are_timed_per_batch_size_and_prefill_steps_left_out():
    samples = [(0, 900.0), (1, 10.0), (1, 12.0), (1, 11.0), (3, 20.0), (0, 1200.0)]
    times = adm.step_times(samples)
    assert set(times) == {"1", "3"}
    assert times["1"]["median"] == 11.0 and times["1"]["n"] == 3 and times["3"]["n"] == 1
    assert times["1"]["p10"] <= times["1"]["median"] <= times["1"]["p90"]


def test_a_combined_proof_becomes_the_report_table_under_its_files_engine_name(tmp_path):
    ids = [[1, 2], [3, 4], [5, 6]]
    records = [
        _record("wmtp, all at once", 80, 3.4, 3, ids),
        _record("wmtp", 60, 2.55, 2, ids),
        _record("wmtp-ring", 60, 2.8, 3, ids),
    ]
    path = tmp_path / "qwen3.6-35b-a3b~vllm.json"
    path.write_text(json.dumps(adm.combine(records)))
    table = admission_table([path])
    assert list(table["arm"]) == ["wmtp", "wmtp-ring"] and set(table["engine"]) == {"vllm"}
    tidy = Tidy(requests=pd.DataFrame(), rungs=pd.DataFrame(), positions=pd.DataFrame(), admission=table)
    section = admission_section(tidy)
    assert list(section.frame["most running at once"]) == [2, 3]
    assert section.notes[0].startswith("qwen3.6-35b-a3b on vllm: ring admits one more")
