"""Chat prompts (protocol.prompt_format: chat): exact templated lengths, the request, and one real cell.

The prompt's content is cut so that the model's chat template around it makes exactly the rung, counted as the
chat endpoint counts it; the request goes to /v1/chat/completions with chat_template_kwargs. The engine test runs
one cell of the trained tiny model (its installed copy given the tiny models' minimal template) on the real vLLM
CPU server: the cell fails unless the server's usage.prompt_tokens equals the rung for every request, and the
template adds an empty thinking block only when enable_thinking is false, so a server that ignored the argument
would count fewer tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import REPO, engines_dir

from wmtp.config import load_study, study_from_dict
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.measure.client import complete
from wmtp.measure.tasks import workload_prompt
from wmtp.measure.workload import PromptFactory, chat_settings, copy_task_prompt
from wmtp.model.tiny import CHAT_TEMPLATE

FIXTURE = TRAINED_CHECKPOINT
NO_THINKING = {"enable_thinking": False}


def _with_template(model_dir: Path) -> Path:
    """The tokenizer files of the trained fixture, copied and given the tiny models' chat template."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(FIXTURE / name, model_dir / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def test_fixture_is_unchanged_and_has_no_template():
    assert "chat_template" not in json.loads((FIXTURE / "tokenizer_config.json").read_text())


def test_chat_settings_protocol_and_model_override():
    study = load_study(REPO / "config" / "studies" / "spark-128k.yaml")
    assert chat_settings(study, study.models[0].name) == NO_THINKING
    embedded = load_study(REPO / "config" / "config.yaml")
    assert chat_settings(embedded, "tiny") is None
    raw = json.loads(json.dumps(embedded.model_dump(mode="json", exclude_none=True)))
    raw["models"][0].update(prompt_format="chat", chat_template_kwargs={"enable_thinking": True})
    study = study_from_dict(raw, base_dir=REPO)
    assert chat_settings(study, "tiny") == {"enable_thinking": True}
    # Unused, the new keys leave the embedded study's hash (and so its cells' identities) as they were.
    assert "prompt_format" not in embedded.model_dump(mode="json")["protocol"]


@pytest.mark.parametrize("n_tokens", [48, 1024, 4096])
def test_templated_prompt_has_the_exact_length(tmp_path, n_tokens):
    factory = PromptFactory(_with_template(tmp_path) / "tokenizer.json", chat=NO_THINKING)
    assert factory.overhead > 0
    for workload in ("code", "copy") if n_tokens >= 1024 else ("code",):
        content = workload_prompt(factory, workload, n_tokens, 0, salt="t")
        rendered = factory.chat.render(content)
        assert rendered.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
        assert len(factory.tokenizer.encode(rendered, add_special_tokens=False).ids) == n_tokens


def test_copy_task_counts_the_template_before_the_passage(tmp_path):
    factory = PromptFactory(_with_template(tmp_path) / "tokenizer.json", chat=NO_THINKING)
    raw = PromptFactory(FIXTURE / "tokenizer.json")
    chat_task, raw_task = copy_task_prompt(factory, 2048, 0), copy_task_prompt(raw, 2048, 0)
    assert chat_task.passage_start == raw_task.passage_start + factory.prefix_tokens


def test_a_model_without_template_is_refused_with_what_to_do(tmp_path):
    from wmtp.measure.workload import PromptLengthError

    shutil.copyfile(FIXTURE / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(PromptLengthError, match=r"no chat template.*prompt_format: raw"):
        PromptFactory(tmp_path / "tokenizer.json", chat={})


def test_chat_request_goes_to_the_chat_endpoint_with_template_arguments():
    seen: list[dict] = []

    def reply(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, **json.loads(request.content)})
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "def"}}]},
            {"choices": [{"index": 0, "delta": {"content": " f"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2}},
        ]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(reply)) as client:
        done = complete("http://server", "m", "hello", 2, chat=NO_THINKING, client=client)
    assert seen[0]["path"] == "/v1/chat/completions"
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen[0]["chat_template_kwargs"] == NO_THINKING and "prompt" not in seen[0]
    assert seen[0]["ignore_eos"] is True and seen[0]["temperature"] == 0.0
    assert (done.text, done.prompt_tokens, done.completion_tokens) == ("def f", 40, 2)


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_chat_cell_on_the_real_server(engine_python, tmp_path):
    """One cell, one server: every chat prompt's templated length is the rung as the server counts it."""
    import pandas as pd

    from wmtp.measure.cell import CellRun, run_cell
    from wmtp.model.train import install_fixture

    model_dir = tmp_path / "model"
    install_fixture(model_dir, FIXTURE, seed=0)
    _with_template(model_dir)
    embedded = load_study(REPO / "config" / "config.yaml")
    raw = embedded.model_dump(mode="json", exclude_none=True)
    raw.update(
        study="chat",
        results_dir=str(tmp_path / "results"),
        engines_dir=str(engines_dir()),
        models=[{"name": "tiny", "path": str(model_dir), "max_model_len": 4096}],
        arms=[{"name": "mtp", "k": [3]}],
    )
    raw["protocol"].update(
        rungs=[1024],
        repeats=[2],
        workloads=["code", "copy"],
        output_tokens=16,
        warmup_requests=1,
        prompt_format="chat",
        chat_template_kwargs=NO_THINKING,
    )
    raw.pop("replica", None)
    study = study_from_dict(raw, base_dir=tmp_path)
    (cell,) = study.cells()
    engine = study.engine(cell.engine)
    manifest = json.loads((engines_dir() / engine.name / "manifest.json").read_text())
    assert Path(manifest["python"]) == Path(engine_python) or manifest["python"]
    out = tmp_path / "results" / "chat" / "raw" / cell.cell_id
    # The engine's vLLM cache, as the pipeline gives every cell (wmtp.cli).
    cache_dir = engines_dir() / engine.name / "cache"
    run_cell(
        CellRun(study=study, cell=cell, out_dir=out, engine_manifest=manifest, model_dir=model_dir, cache_dir=cache_dir)
    )
    requests = pd.read_parquet(out / "requests.parquet")
    measured = requests[~requests["warmup"]]
    assert len(measured) == 4 and set(measured["workload"]) == {"code", "copy"}
    assert (measured["prompt_tokens"] == 1024).all()
    assert (measured["completion_tokens"] == 16).all()
    # the chat stream's opening role delta is no step: the chunks after the first add every token but the first's
    for added, tokens in zip(measured["chunk_new_tokens"], measured["completion_tokens"], strict=True):
        assert min(added) >= 1 and tokens - 4 <= sum(added) <= tokens - 1
    counters = pd.read_parquet(out / "counters.parquet")
    assert counters[counters["counter"] == "drafts"]["delta"].sum() > 0
