"""The SGLang adapter on a CPU box: argv, version detection, response parsing, and one cell end to end
against a stand-in server (tests/fixtures/sglang/fake_site) that speaks sglang 0.5.21's response shape."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pandas as pd
import pytest

from wmtp.config import Cell, EngineSpec, study_from_dict
from wmtp.engines import ServeRequest, adapter, sglang
from wmtp.engines.build import EngineBuildError, spec_hash
from wmtp.engines.vllm import VLLMAdapter
from wmtp.layout import Draft
from wmtp.measure.client import complete

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
FAKE_SITE = FIXTURES / "fake_site"


def _argv(arm: str, k: int = 3, sink: int | None = None, window: int | None = None, engine_args=None, arm_args=()):
    return sglang.serve_argv(
        ServeRequest(
            "/env/bin/python",
            "/models/q",
            "q",
            8123,
            max_model_len=1_049_600,
            draft=Draft(arm=arm, k=k, sink=sink, window=window),
            engine_args=engine_args or ["--mem-fraction-static", "0.8"],
            model_args=["--trust-remote-code"],
            arm_args=arm_args,
        )
    )


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_registered():
    assert isinstance(adapter("sglang"), sglang.SGLangAdapter)
    assert isinstance(adapter("vllm"), VLLMAdapter)
    with pytest.raises(ValueError, match="known: sglang, vllm"):
        adapter("tensorrt")


def test_none_arm_has_no_speculative_flags():
    argv = _argv("none")
    assert argv[:3] == ["/env/bin/python", "-m", "sglang.launch_server"]
    assert _value(argv, "--model-path") == "/models/q" and _value(argv, "--context-length") == "1049600"
    assert _value(argv, "--port") == "8123" and _value(argv, "--host") == "127.0.0.1"
    assert not [a for a in argv if a.startswith("--speculative")]
    assert "--trust-remote-code" in argv and "--mem-fraction-static" in argv


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_arm_is_a_nextn_chain_of_k_steps(k):
    argv = _argv("mtp", k=k)
    assert _value(argv, "--speculative-algorithm") == "NEXTN"
    assert _value(argv, "--speculative-num-steps") == str(k)
    assert _value(argv, "--speculative-eagle-topk") == "1"
    assert _value(argv, "--speculative-num-draft-tokens") == str(k + 1)
    # The same draft backend as the windowed arm, so the arms differ only in the window.
    assert _value(argv, "--speculative-draft-attention-backend") == "flashinfer"
    assert "--speculative-draft-window-size" not in argv


def test_wmtp_arm_adds_window_sink_and_an_honouring_backend():
    argv = _argv("wmtp", k=3, sink=64, window=4032)
    assert _value(argv, "--speculative-draft-window-size") == "4032"
    assert _value(argv, "--speculative-draft-sink-size") == "64"
    assert _value(argv, "--speculative-draft-attention-backend") in sglang.WINDOW_BACKENDS
    mtp = _argv("mtp", k=3)
    assert [
        a for a in argv if a not in ("--speculative-draft-window-size", "4032", "--speculative-draft-sink-size", "64")
    ] == mtp


def test_wmtp_keeps_a_chosen_triton_backend_and_refuses_one_that_ignores_the_window():
    argv = _argv("wmtp", sink=0, window=128, engine_args=["--speculative-draft-attention-backend", "triton"])
    assert argv.count("--speculative-draft-attention-backend") == 1
    assert _value(argv, "--speculative-draft-attention-backend") == "triton"
    with pytest.raises(sglang.SGLangError, match="'trtllm_mha' ignores the draft window"):
        _argv("wmtp", sink=0, window=128, engine_args=["--speculative-draft-attention-backend=trtllm_mha"])


def _request(arm: str, engine_args=(), **draft) -> ServeRequest:
    return ServeRequest(
        "/env/bin/python",
        "/models/q",
        "q",
        8123,
        max_model_len=1_049_600,
        draft=Draft(arm=arm, k=3, **draft),
        engine_args=engine_args,
    )


def test_an_fa3_draft_is_windowed_by_the_plugin_through_the_environment_not_by_flags(tmp_path):
    fa3 = ["--speculative-draft-attention-backend", "fa3"]
    argv = _argv("wmtp", sink=64, window=4032, engine_args=fa3)
    assert "--speculative-draft-window-size" not in argv and "--speculative-draft-sink-size" not in argv
    assert argv == _argv("mtp", engine_args=fa3)  # the arms differ only in the server's environment
    env = sglang.server_env({}, tmp_path / "w", tmp_path / "t", _request("wmtp", fa3, sink=64, window=4032))
    assert json.loads(env["WMTP_SGLANG_WINDOW"]) == {"sink": 64, "window": 4032}
    assert env["WMTP_PLUGIN_STATS_DIR"] == str(tmp_path / "t" / "wmtp-stats")
    # Upstream's window (FlashInfer here) and the native arm leave the plugin off, also where the engine's env set it.
    stale = {"WMTP_SGLANG_WINDOW": '{"sink": 1, "window": 2}'}
    for request in (_request("wmtp", (), sink=64, window=4032), _request("mtp", fa3)):
        # Set empty, not left out: the server inherits the runner's own environment beneath this one.
        assert sglang.server_env(stale, tmp_path / "w", tmp_path / "t", request)["WMTP_SGLANG_WINDOW"] == ""


def test_check_cell_wants_the_plugins_hook_points_for_an_fa3_draft():
    spec = EngineSpec(name="sg", kind="sglang", device="cuda", packages=["sglang==0.5.17"])
    cell = Cell(study="s", model="m", engine="sg", arm="wmtp", k=3, sink=64, window=4032)
    fa3 = ["--speculative-draft-attention-backend", "fa3"]
    # 0.5.17 has no window flags: upstream's window is refused, the plugin's is taken where its hook points are.
    versions = {"sglang": "0.5.17", "draft_window_flags": False, "window_backends": []}
    with pytest.raises(sglang.SGLangError, match="lacks --speculative-draft-window-size"):
        sglang.check_cell(spec, {"versions": versions}, cell, [])
    missing = {**versions, "wmtp_hooks": {"ok": False, "missing": ["FlashAttentionMultiStepBackend.topk"]}}
    with pytest.raises(
        sglang.SGLangError, match=r"cannot window the 'fa3' draft .*FlashAttentionMultiStepBackend.topk"
    ):
        sglang.check_cell(spec, {"versions": missing}, cell, fa3)
    with pytest.raises(sglang.SGLangError, match="did not check them"):
        sglang.check_cell(spec, {"versions": versions}, cell, fa3)
    hooked = {**versions, "wmtp_hooks": {"ok": True}, "wmtp_plugin_registered": True}
    sglang.check_cell(spec, {"versions": hooked}, cell, fa3)
    with pytest.raises(sglang.SGLangError, match="not registered as an SGLang plugin"):
        sglang.check_cell(spec, {"versions": {**hooked, "wmtp_plugin_registered": False}}, cell, fa3)
    # One draft step: SGLang builds no multi-step draft backend, so there is nothing for the plugin to window.
    with pytest.raises(sglang.SGLangError, match="use k ≥ 2"):
        sglang.check_cell(spec, {"versions": hooked}, cell.model_copy(update={"k": 1}), fa3)


def test_a_cell_the_plugin_windowed_fails_when_its_counters_say_it_never_ran(tmp_path):
    from types import SimpleNamespace

    from wmtp.plugin.stats import WindowNotApplied

    cell = Cell(study="s", model="m", engine="sg", arm="wmtp", k=3, sink=64, window=4032)
    protocol = SimpleNamespace(rungs=[131072])
    fa3 = ["--speculative-draft-attention-backend", "fa3"]
    env = sglang.server_env({}, tmp_path / "w", tmp_path / "t", _request("wmtp", fa3, sink=64, window=4032))
    engine = sglang.SGLangAdapter()
    assert engine.verify_cell(tmp_path, {}, cell, protocol) == {}  # upstream's window: no counters of ours
    with pytest.raises(WindowNotApplied):
        engine.verify_cell(tmp_path, env, cell, protocol)


def test_an_arms_own_serve_args_come_last_and_choose_its_draft_backend():
    # The windowed arm on Triton, the native one on FlashInfer: each arm's own args, after the engine's and model's.
    triton = ["--speculative-draft-attention-backend", "triton"]
    wmtp = _argv("wmtp", k=6, sink=64, window=4032, arm_args=triton)
    assert wmtp[wmtp.index("--trust-remote-code") + 1 : wmtp.index("--speculative-algorithm")] == triton
    assert wmtp.count("--speculative-draft-attention-backend") == 1
    mtp = _argv("mtp", k=6, arm_args=["--speculative-draft-attention-backend", "flashinfer"])
    assert _value(mtp, "--speculative-draft-attention-backend") == "flashinfer"
    with pytest.raises(sglang.SGLangError, match="ignores the draft window"):
        _argv("wmtp", sink=64, window=4032, arm_args=["--speculative-draft-attention-backend", "trtllm_mha"])
    with pytest.raises(sglang.SGLangError, match="engine/model/arm serve_args set --speculative-num-steps"):
        _argv("mtp", arm_args=["--speculative-num-steps=2"])


def test_full_attention_interval_is_the_period_of_the_full_attention_layers():
    linear, full = "linear_attention", "full_attention"
    assert sglang.full_attention_interval([linear, linear, linear, full]) == 4
    assert sglang.full_attention_interval([linear, full] * 3) == 2
    assert sglang.full_attention_interval([full, full]) == 1
    # SGLang would place a full layer at 8 too, and none can say "the first four only"
    assert sglang.full_attention_interval([linear, linear, linear, full, linear, linear, linear, linear]) is None
    assert sglang.full_attention_interval([linear, full, linear, linear, full]) is None
    assert sglang.full_attention_interval([linear, linear]) is None


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _served(model_dir: Path, arm: str = "mtp", model_args=()) -> list[str]:
    return sglang.serve_argv(
        ServeRequest(
            "/env/bin/python", model_dir, "q", 8123, max_model_len=4096, draft=Draft(arm=arm, k=3),
            model_args=model_args,
        )
    )  # fmt: skip


def test_the_committed_tiny_checkpoint_and_the_dummies_get_the_interval_sglang_reads(tmp_path):
    from wmtp.layout import TRAINED_CHECKPOINT
    from wmtp.model.dummy import write_dummy

    argv = _served(TRAINED_CHECKPOINT)
    assert json.loads(_value(argv, sglang.OVERRIDE_FLAG)) == {"full_attention_interval": 4}
    write_dummy(REPO / "config" / "models" / "qwen3.6-35b-a3b.json", tmp_path / "dummy", 1049600)
    argv = _served(tmp_path / "dummy", arm="none")
    assert json.loads(_value(argv, sglang.OVERRIDE_FLAG)) == {"full_attention_interval": 4}


def test_a_studys_own_overrides_are_merged_and_a_clash_is_refused(tmp_path):
    layers = ["linear_attention", "full_attention"] * 2
    model = _checkpoint(tmp_path, {"model_type": "qwen3_next", "layer_types": layers})
    argv = _served(model, model_args=[sglang.OVERRIDE_FLAG, '{"rope_theta": 5e6}'])
    assert argv.count(sglang.OVERRIDE_FLAG) == 2  # the study's, then the merged one, which argparse keeps
    assert sglang.flag_value(argv, sglang.OVERRIDE_FLAG) == '{"full_attention_interval": 2, "rope_theta": 5000000.0}'
    with pytest.raises(sglang.SGLangError, match=re.escape("needs {'full_attention_interval': 2}")):
        _served(model, model_args=[sglang.OVERRIDE_FLAG, '{"full_attention_interval": 4}'])


def test_a_config_sglang_reads_as_it_stands_gets_no_override_and_an_odd_pattern_is_refused(tmp_path):
    layers = ["linear_attention", "full_attention"]
    given = {"model_type": "qwen3_next", "layer_types": layers, "full_attention_interval": 2}
    assert sglang.OVERRIDE_FLAG not in _served(_checkpoint(tmp_path, given))
    other = {"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]}
    assert sglang.config_overrides(other) == {}
    odd = {"model_type": "qwen3_next", "layer_types": ["full_attention", "linear_attention", "linear_attention"]}
    with pytest.raises(sglang.SGLangError, match="follow no such pattern"):
        sglang.config_overrides(odd)


def test_ring_arm_is_not_built_on_sglang():
    with pytest.raises(sglang.RingNotBuilt, match="wmtp-ring' on SGLang is not built yet"):
        _argv("wmtp-ring", sink=64, window=4032)


def test_serve_args_may_not_set_what_the_arm_decides():
    with pytest.raises(sglang.SGLangError, match="--speculative-num-steps"):
        _argv("mtp", engine_args=["--speculative-num-steps", "2"])


def test_server_env_keeps_caches_in_the_cell(tmp_path):
    env = sglang.server_env({"HF_HUB_OFFLINE": "1"}, tmp_path / "work", tmp_path / "t")
    assert env["TMPDIR"] == str(tmp_path / "t") and env["HF_HUB_OFFLINE"] == "1"
    for cache in ("TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[cache].startswith(str(tmp_path / "work")), cache


def test_every_server_exports_its_metrics_once():
    assert _argv("none").count("--enable-metrics") == 1
    assert _argv("mtp", engine_args=["--enable-metrics", "--mem-fraction-static", "0.8"]).count("--enable-metrics") == 1


# --- version detection ------------------------------------------------------------------------------


def _probe(site: Path, *more: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", sglang.VERSION_PROBE],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": ":".join(map(str, (site, *more))), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=True,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("WMTP-PROBE "))
    return json.loads(line[len("WMTP-PROBE ") :])


def test_probe_finds_the_window_flags_and_backends():
    info = _probe(FAKE_SITE, Path(sglang.__file__).parents[2])
    assert info["sglang"] == "0.5.21"
    assert info["draft_window_flags"] is True and info["draft_window_flags_cli"] is True
    assert info["prometheus_client"] is True and info["server_metrics"]["ok"]
    assert info["window_backends"] == ["flashinfer", "triton"]
    # The stand-in's attention backends are not SGLang's: the plugin's hook check runs and names what it misses.
    assert info["wmtp_hooks"]["ok"] is False and info["wmtp_hooks"]["missing"]
    # This interpreter's wmtp is installed, so SGLang's plugin loader finds its entry point.
    assert info["wmtp_plugin_registered"] is True


def _old_site(tmp_path: Path) -> Path:
    """The stand-in as sglang 0.5.20 was: a window option (EAGLE-3/DFLASH only) but no sink option."""
    site = tmp_path / "site"
    shutil.copytree(FAKE_SITE, site)
    (site / "sglang-0.5.21.dist-info").rename(site / "sglang-0.5.20.dist-info")
    meta = site / "sglang-0.5.20.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("0.5.21", "0.5.20"))
    args = site / "sglang" / "srt" / "server_args.py"
    args.write_text("\n".join(x for x in args.read_text().splitlines() if "sink" not in x))
    for backend in (site / "sglang" / "srt" / "layers" / "attention").glob("*_backend.py"):
        backend.write_text("# no draft window here\n")
    return site


def test_probe_and_check_cell_refuse_an_sglang_without_the_flags(tmp_path):
    info = _probe(_old_site(tmp_path))
    assert info["sglang"] == "0.5.20" and info["draft_window_flags"] is False
    spec = EngineSpec(name="sg", kind="sglang", device="cuda", packages=["sglang==0.5.20"])
    cell = Cell(study="s", model="m", engine="sg", arm="wmtp", k=3, sink=64, window=4032)
    with pytest.raises(sglang.SGLangError, match=r"sglang 0.5.20 lacks .*first released in sglang 0.5.21"):
        sglang.check_cell(spec, {"versions": info}, cell)
    sglang.check_cell(spec, {"versions": info}, cell.model_copy(update={"arm": "mtp", "sink": None, "window": None}))


def test_check_cell_refuses_cpu_and_ring():
    cpu = EngineSpec(name="sg", kind="sglang", device="cpu", packages=["sglang==0.5.21"])
    cell = Cell(study="s", model="m", engine="sg", arm="mtp", k=3)
    with pytest.raises(sglang.SGLangError, match="cannot run on a CPU box"):
        sglang.check_cell(cpu, {}, cell)
    gpu = cpu.model_copy(update={"device": "cuda"})
    with pytest.raises(sglang.RingNotBuilt):
        sglang.check_cell(gpu, {}, Cell(study="s", model="m", engine="sg", arm="wmtp-ring", k=3, sink=1, window=8))


def test_check_cell_refuses_an_sglang_that_does_not_export_the_request_clock():
    spec = EngineSpec(name="sg", kind="sglang", device="cuda", packages=["sglang==0.5.17"])
    none = Cell(study="s", model="m", engine="sg", arm="none")
    lacking = {"server_metrics": {"ok": False, "missing": ["metric sglang:spec_verify_calls_total"]}}
    with pytest.raises(sglang.SGLangError, match=r"does not export .*spec_verify_calls_total"):
        sglang.check_cell(spec, {"versions": lacking}, none)
    sglang.check_cell(spec, {"versions": {"server_metrics": {"ok": True}}}, none)
    with pytest.raises(sglang.SGLangError, match="prometheus_client is not installed"):
        sglang.check_cell(spec, {"versions": {"server_metrics": {"ok": True}, "prometheus_client": False}}, none)


# --- response parsing -------------------------------------------------------------------------------


def _stream_client(text: str) -> httpx.Client:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    client.seen = seen  # type: ignore[attr-defined]
    return client


def test_streamed_completion_carries_spec_details():
    client = _stream_client((FIXTURES / "completions_stream_mtp.sse").read_text())
    result = complete("http://sglang", "m", "p", 9, client=client, extra_body=sglang.REQUEST_EXTRA)
    assert client.seen["return_spec_tokens_details"] is True
    assert result.completion_tokens == 9 and result.prompt_tokens == 12
    fields = sglang.request_fields(result.extensions)
    assert fields == {"spec_verify_ct": 3, "spec_correct_drafts": 5, "spec_accept_histogram": [0, 2, 0, 1]}


def test_native_generate_meta_info_and_the_older_histogram_name():
    meta = json.loads((FIXTURES / "generate_meta_info.json").read_text())
    fields = sglang.request_fields({"meta_info": meta["meta_info"]})
    assert fields == {"spec_verify_ct": 3, "spec_correct_drafts": 5, "spec_accept_histogram": [0, 2, 0, 1]}
    assert sglang.request_fields({}) == {
        "spec_verify_ct": None,
        "spec_correct_drafts": None,
        "spec_accept_histogram": None,
    }


def test_an_answer_that_ends_at_its_first_token_has_no_verify_cycle_and_still_counts():
    # QA mode honours EOS: an answer can end with the prefill's token, before any verify cycle.
    details = {"spec_verify_ct": 0, "spec_num_correct_drafts": 0, "spec_correct_drafts_histogram": []}
    short = {"rung": 64, "completion_tokens": 1, **sglang.request_fields({"sglext": {"spec_tokens_details": details}})}
    assert short["spec_verify_ct"] == 0 and short["spec_correct_drafts"] == 0
    full = {
        "rung": 64,
        "completion_tokens": 9,
        "spec_verify_ct": 3,
        "spec_correct_drafts": 5,
        "spec_accept_histogram": [0, 2, 0, 1],
    }
    c = sglang.counters_from_requests([short, full], "mtp", 3)
    assert c["drafts"] == 3 and c["accepted"] == 10 - 3 and c["correct_drafts"] == 5
    assert [c[f"accepted_pos_{p}"] for p in range(3)] == [3, 1, 1]
    # A drafting response that carries no count at all is still refused.
    with pytest.raises(sglang.SGLangError, match="1 of 2 responses carry no spec_verify_ct"):
        sglang.counters_from_requests([full, {"rung": 64, "completion_tokens": 9}], "mtp", 3)


def test_rung_counters_give_design_tok_per_verify():
    rows = [
        {
            "rung": 64,
            "completion_tokens": 9,
            **sglang.request_fields(
                {
                    "sglext": {
                        "spec_tokens_details": {
                            "spec_verify_ct": 3,
                            "spec_num_correct_drafts": 5,
                            "spec_correct_drafts_histogram": [0, 2, 0, 1],
                        }
                    }
                }
            ),
        },
        {
            "rung": 64,
            "completion_tokens": 9,
            "spec_verify_ct": 4,
            "spec_correct_drafts": 4,
            "spec_accept_histogram": [1, 2, 1, 0],
        },
    ]
    c = sglang.counters_from_requests(rows, "mtp", 3)
    assert c["drafts"] == 7 and c["draft_tokens"] == 21
    # tidy's 1 + accepted/drafts is DESIGN's completion_tokens / spec_verify_ct, pooled over the rung.
    assert math.isclose(1 + c["accepted"] / c["drafts"], 18 / 7)
    assert c["correct_drafts"] == 9
    # Position p is accepted in every cycle that accepted more than p drafts.
    assert [c[f"accepted_pos_{p}"] for p in range(3)] == [3 + 3, 1 + 1, 1 + 0]
    assert sum(c[f"accepted_pos_{p}"] for p in range(3)) == c["correct_drafts"]
    assert sglang.counters_from_requests(rows, "none", 0) == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    with pytest.raises(sglang.SGLangError, match="no spec_verify_ct"):
        sglang.counters_from_requests([{"rung": 64, "completion_tokens": 9, "spec_verify_ct": None}], "mtp", 3)


def test_without_counts_in_the_responses_the_rung_takes_the_servers():
    # sglang 0.5.17's completions stream carries no spec details: its server's counters over the rung stand in.
    rows = [{"rung": 64, "completion_tokens": 9, **sglang.request_fields({})} for _ in range(2)]
    server = {"spec_verify_calls": 7.0, "clock_generation_tokens": 18.0, "clock_requests": 2.0}
    c = sglang.counters_from_requests(rows, "mtp", 3, server)
    assert (c["drafts"], c["draft_tokens"], c["accepted"]) == (7.0, 21.0, 11.0)
    assert math.isclose(1 + c["accepted"] / c["drafts"], 18 / 7)
    assert "correct_drafts" not in c and "accepted_pos_0" not in c
    # Tokens the rung's responses did not generate: another request shared the server, the count is not theirs.
    with pytest.raises(sglang.SGLangError, match=r"counted 19 generated tokens .*its 2 measured responses 18"):
        sglang.counters_from_requests(rows, "mtp", 3, {**server, "clock_generation_tokens": 19.0})
    with pytest.raises(sglang.SGLangError, match=r"server counted no verify cycles.*--enable-metrics"):
        sglang.counters_from_requests(rows, "mtp", 3, {"clock_generation_tokens": 18.0})
    assert sglang.counters_from_requests(rows, "none", 0, {}) == {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}


def test_server_counters_read_sglangs_metrics_summed_over_their_labels():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    registry = CollectorRegistry()
    tokens = Counter("sglang:generation_tokens_total", "", ["model_name", "is_streaming"], registry=registry)
    verify = Counter("sglang:spec_verify_calls_total", "", ["model_name"], registry=registry)
    ttft = Histogram("sglang:time_to_first_token_seconds", "", ["model_name", "is_streaming"], registry=registry)
    e2e = Histogram("sglang:e2e_request_latency_seconds", "", ["model_name", "is_streaming"], registry=registry)
    for streaming, first, last, n, cycles in (("true", 0.5, 2.0, 100, 40), ("false", 0.25, 1.0, 50, 20)):
        tokens.labels("m", streaming).inc(n)
        verify.labels("m").inc(cycles)
        ttft.labels("m", streaming).observe(first)
        e2e.labels("m", streaming).observe(last)
    got = sglang.server_counters(generate_latest(registry).decode())
    assert got["clock_requests"] == 2 and got["clock_generation_tokens"] == 150 and got["spec_verify_calls"] == 60
    assert math.isclose(got["clock_prefill_s"], 0.75)
    assert math.isclose(got["clock_decode_s"], (2.0 - 0.5) + (1.0 - 0.25))
    assert sglang.server_counters("") == {}


# --- one study end to end against the stand-in server ------------------------------------------------


@pytest.mark.parametrize("spec_details", ["1", "0"], ids=["sglang-0.5.21-responses", "sglang-0.5.17-responses"])
def test_cells_against_a_stand_in_server(tmp_path, tiny_tokenizer, spec_details):
    from wmtp.analyze.lossless import lossless_table
    from wmtp.analyze.steps import engine_release, step_table
    from wmtp.analyze.tidy import collect
    from wmtp.measure.cell import CellRun, run_cell

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(tiny_tokenizer, model_dir / "tokenizer.json")
    raw = {
        "study": "sg",
        "results_dir": str(tmp_path / "results"),
        "engines": [
            {
                "name": "sg",
                "kind": "sglang",
                "device": "cuda",
                "source": "python",
                "python": sys.executable,
                "env": {"PYTHONPATH": str(FAKE_SITE), "FAKE_SGLANG_SPEC_DETAILS": spec_details},
            }
        ],
        "models": [{"name": "m", "path": str(model_dir), "max_model_len": 4096}],
        "arms": [{"name": "none"}, {"name": "mtp", "k": [3]}, {"name": "wmtp", "k": [3], "sink": [4], "window": [64]}],
        "protocol": {
            "rungs": [64, 160],
            "repeats": 2,
            "output_tokens": 17,
            "warmup_requests": 1,
            "warmup_prompt_tokens": 16,
            "warmup_output_tokens": 4,
            "health_timeout_s": 60,
            "request_timeout_s": 60,
            "record_tokens": True,
        },
    }
    study = study_from_dict(raw, base_dir=tmp_path)
    manifest = {
        "python": sys.executable,
        "engine": "sg",
        "kind": "sglang",
        "source": "python",
        "versions": _probe(FAKE_SITE),
        "spec_hash": spec_hash(study.engine("sg")),  # a build of this study's engine
    }
    # A build left from another spec of the engine is refused before any server starts.
    stale = {**manifest, "spec_hash": "0" * 16}
    with pytest.raises(EngineBuildError, match="was built from spec 0000000000000000"):
        first = study.cells()[0]
        run_cell(
            CellRun(study=study, cell=first, out_dir=tmp_path / "stale", engine_manifest=stale, model_dir=model_dir)
        )
    assert not list((tmp_path / "stale").glob("**/server*.log"))
    dirs = []
    for cell in study.cells():
        out = tmp_path / "results" / "sg" / "raw" / cell.cell_id
        run_cell(CellRun(study=study, cell=cell, out_dir=out, engine_manifest=manifest, model_dir=model_dir))
        dirs.append(out)
        argv = json.loads((out / "manifest.json").read_text())["argv"]
        assert ("--speculative-draft-sink-size" in argv) == (cell.arm == "wmtp")
    tables = collect(dirs, tmp_path / "tidy")
    rungs = tables["rungs"].set_index(["arm", "rung"])
    requests = tables["requests"]
    # The stand-in's 17 tokens: the prefill's, then cycles of 2 accepted drafts and a bonus token (6 cycles, the
    # last accepting none) without a window, of 1 and a bonus (8 cycles) with it.
    for arm, cycles in (("mtp", 6), ("wmtp", 8)):
        for rung in (64, 160):
            measured = requests[(requests["arm"] == arm) & (requests["rung"] == rung)]
            assert math.isclose(rungs.loc[(arm, rung), "tok_per_verify"], 17 / cycles), (arm, rung)
            if spec_details == "1":
                assert (measured["spec_verify_ct"] == cycles).all()
            else:
                assert measured["spec_verify_ct"].isna().all()
    assert (rungs.loc["none", "tok_per_verify"] == 1.0).all()
    counters = pd.read_parquet(dirs[1] / "counters.parquet")
    assert {"drafts", "draft_tokens", "accepted", "clock_requests", "spec_verify_calls"} <= set(counters["counter"])
    # The histograms come with the responses' details only.
    assert ({"correct_drafts", "accepted_pos_0"} <= set(counters["counter"])) == (spec_details == "1")
    # Each request alone on the server is timed by the server's own clock, first output to last.
    measured = requests[~requests["warmup"]]
    assert (measured["clock"] == "engine").all()
    assert (measured["engine_decode_s"] > 0).all()
    assert (measured["engine_decode_s"] <= measured["client_decode_s"] + 0.05).all()
    # Every answer recorded token for token, with its candidates' gap, and judged against the no-draft arm's.
    assert (measured["token_ids"].map(len) == 17).all() and (measured["top2_gap"].map(min) > 2.9).all()
    lossless = lossless_table(requests)
    assert len(lossless) == len(measured[measured["arm"] != "none"]) and lossless["identical"].all()
    assert set(lossless["reference_arm"]) == {"none"}
    # The step file of the same cells: each arm's cycle on the server's clock, at the rung's tokens per verify.
    steps = step_table(
        requests, tables["rungs"], engine_release([json.loads((d / "manifest.json").read_text()) for d in dirs])
    )
    assert steps["engine_version"].unique().tolist() == ["0.5.21"] and (steps["clock"] == "engine").all()
    assert sorted(set(steps["arm"])) == ["mtp", "none", "wmtp"] and (steps["step_ms"] > 0).all()
