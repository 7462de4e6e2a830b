"""The engine's own clock against the client's, under the real vLLM CPU server.

A client that reads its stream late sees the first chunk late and the rest in a burst: its decode window
(first chunk to last) shrinks and a cycle computed from it comes out too short. vLLM's per-request histograms
on /metrics time the same decode from EngineCore's first and last token and do not move.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from wmtp.analyze.tidy import apply_engine_clock
from wmtp.engines.vllm import REQUEST_EXTRA, VLLMAdapter
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.measure.cell import settled_counters
from wmtp.measure.client import complete
from wmtp.measure.workload import PromptFactory

pytestmark = [pytest.mark.engine]

PROMPT_TOKENS = 512
OUTPUT_TOKENS = 64
# Long enough that the whole decode is over before the client reads its first chunk.
READ_LATE_S = 6.0


def _late_reader(delay_s: float) -> httpx.Client:
    """A client that waits ``delay_s`` after the response's headers before it reads the body."""

    def wait(_response: httpx.Response) -> None:
        time.sleep(delay_s)

    return httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), event_hooks={"response": [wait]})


def _request_row(engine: VLLMAdapter, base: str, prompt: str, client: httpx.Client) -> dict:
    before = engine.read_counters(base)
    done = complete(base, "tiny", prompt, OUTPUT_TOKENS, client=client, extra_body=REQUEST_EXTRA)
    after = settled_counters(engine, base, before, 1)
    return {
        "ttft_s": done.ttft_s,
        "decode_s": done.decode_s,
        "completion_tokens": done.completion_tokens,
        "first_chunk_tokens": done.chunk_tokens[0] if done.chunk_tokens else None,
        **{f"d_{k}": after.get(k, 0.0) - before.get(k, 0.0) for k in after},
    }


def read_clock(base: str, _control_dir: Path) -> list[dict]:
    """A warm-up, then prompt and late readers in turn, each request alone on the server."""
    engine = VLLMAdapter()
    factory = PromptFactory(TRAINED_CHECKPOINT / "tokenizer.json")
    rows = []
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as prompt_reader:
        complete(base, "tiny", factory.prompt(64, 0, salt="clock/warmup"), 8, client=prompt_reader)
        for i, late in enumerate([False, True, False, True]):
            prompt = factory.prompt(PROMPT_TOKENS, i, salt="clock")
            if late:
                with _late_reader(READ_LATE_S) as client:
                    rows.append({"late": True, **_request_row(engine, base, prompt, client)})
            else:
                rows.append({"late": False, **_request_row(engine, base, prompt, prompt_reader)})
    return rows


@pytest.fixture(scope="module")
def timed(trained_none):
    # The server of arm none on the trained checkpoint that tests/test_train.py reads too (tests/conftest.py).
    frame = pd.DataFrame(trained_none["clock"])
    apply_engine_clock(frame)
    return frame


def test_every_request_is_timed_by_the_engine(timed):
    assert (timed["clock"] == "engine").all()
    assert (timed["d_clock_requests"] == 1).all()
    assert (timed["d_clock_generation_tokens"] == OUTPUT_TOKENS).all()
    assert (timed["engine_decode_s"] > 0).all() and (timed["engine_ttft_s"] > 0).all()


def test_a_late_reader_undercounts_decode_and_the_engine_clock_does_not(timed):
    prompt, late = timed[~timed["late"]], timed[timed["late"]]
    # The late reader saw its first chunk after the engine had decoded everything and the rest in a burst: its
    # first token is late by the delay, its decode window a small part of the engine's.
    assert (late["client_ttft_s"] >= READ_LATE_S).all()
    assert (late["client_decode_s"] < 0.5 * late["engine_decode_s"]).all()
    # The engine's TTFT (queue and prefill) knows nothing of the delay.
    assert (late["engine_ttft_s"] < READ_LATE_S / 2).all() and (late["ttft_s"] == late["engine_ttft_s"]).all()
    assert (late["clock_disagreement"] < -0.5).all()
    # A prompt reader's two views agree far better than that.
    assert (prompt["clock_disagreement"].abs() < 0.5).all(), prompt["clock_disagreement"].tolist()
    # The engine's decode time does not depend on when the client read: the late requests' is that of the
    # prompt ones within the machine's noise, and the decode_s the tidy table keeps is the engine's.
    ratio = late["engine_decode_s"].median() / prompt["engine_decode_s"].median()
    assert 0.6 < ratio < 1.6, ratio
    assert (timed["decode_s"] == timed["engine_decode_s"]).all()
