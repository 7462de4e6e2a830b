"""The streaming client's reading of a server-sent stream: which chunks are output, and a stream cut short.

The real vLLM CPU server's streams are read in tests/test_pipeline_vllm.py and tests/test_chat.py; these are the
shapes a server sends around them (a chat role delta, usage on every chunk, an error event), as parsing cases.
"""

from __future__ import annotations

import json

import httpx
import pytest

from wmtp.measure.client import RequestError, complete


def _serve(chunks: list[dict]) -> httpx.Client:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Client(
        transport=httpx.MockTransport(
            lambda request: httpx.Response(200, text=body, headers={"Content-Type": "text/event-stream"})
        )
    )


def _delta(text: str, so_far: int | None = None, finish: str | None = None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": text} if role else {"content": text}
    chunk: dict = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if so_far is not None:
        chunk["usage"] = {"prompt_tokens": 9, "completion_tokens": so_far}
    return chunk


FINAL = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}


def test_usage_on_every_chunk_counts_the_tokens_each_chunk_added_and_skips_the_role_delta():
    chunks = [_delta("", 0, role=True), _delta("a", 1), _delta("bc", 3), _delta("", 4), _delta("", 4, "length")]
    with _serve([*chunks, FINAL]) as client:
        done = complete("http://s", "m", "hi", 4, chat={}, client=client)
    # the role delta and the closing chunk add no token; an empty-text chunk that did add one is a step
    assert done.chunk_tokens == [1, 3, 4] and done.chunk_new_tokens == [2, 1]
    assert len(done.chunk_gaps_ms) == 2 and done.completion_tokens == 4


def test_without_usage_per_chunk_the_chunks_with_output_are_timed():
    chunks = [_delta("", role=True), _delta("a"), _delta("b"), _delta("", finish="length")]
    with _serve([*chunks, FINAL]) as client:
        done = complete("http://s", "m", "hi", 4, chat={}, client=client)
    assert len(done.chunk_times) == 2 and done.chunk_new_tokens == []


def test_a_stream_cut_short_is_refused_even_when_its_chunks_carried_usage():
    with _serve([_delta("a", 1), _delta("b", 2)]) as client, pytest.raises(RequestError, match="without a usage"):
        complete("http://s", "m", "hi", 4, chat={}, client=client)
    broken = [_delta("a", 1), {"error": {"message": "engine died", "code": 500}}]
    with _serve(broken) as client, pytest.raises(RequestError, match=r"broke off the stream: .*engine died"):
        complete("http://s", "m", "hi", 4, chat={}, client=client)
