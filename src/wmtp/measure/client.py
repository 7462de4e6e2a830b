"""Streaming OpenAI-compatible completions with TTFT, decode time and token counts.

A raw prompt goes to ``/v1/completions``; a chat prompt (``chat``: the chat-template arguments) goes to
``/v1/chat/completions`` as one user message with ``chat_template_kwargs``. The server applies the model's own
template, as it does for the chat clients of the Spark study, whose thinking-off runs went that way: the prompt
measured is the one such a client gets, and the server's ``usage.prompt_tokens`` counts the templated prompt, which
the cell checks against the rung (rendering locally and sending text or token ids to the completions endpoint
would measure a prompt that no chat client sends whenever our render and the server's differ).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx


class RequestError(RuntimeError):
    pass


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    e2e_s: float
    started_at: float  # time.monotonic() when the request was sent
    first_token_at: float
    finished_at: float
    token_ids: list[int] = field(default_factory=list)
    # Per generated token: {token_id: logprob} of the top candidates, when logprobs were requested (keyed by the
    # candidate's text where the server names candidates by text).
    top_logprobs: list[dict[int | str, float]] = field(default_factory=list)
    finish_reason: str | None = None
    # time.monotonic() at each streamed chunk that carried output. A chunk holds one engine step's tokens or, when
    # the server's output loop falls behind the engine, several steps' (seen on an H200: 1.2 to 1.8 tokens a chunk
    # at 6 ms a step), so a gap between chunks is a cycle only once divided by the cycles it holds.
    chunk_times: list[float] = field(default_factory=list)
    # The completion tokens so far at each of those chunks, where the server reports usage on every chunk
    # (``stream_options.continuous_usage_stats``); empty otherwise.
    chunk_tokens: list[int] = field(default_factory=list)
    # Response fields outside the OpenAI schema (e.g. SGLang's ``sglext``), by key; the last chunk wins.
    extensions: dict = field(default_factory=dict)

    @property
    def decode_s(self) -> float:
        return self.e2e_s - self.ttft_s

    @property
    def chunk_gaps_ms(self) -> list[float]:
        """Milliseconds between consecutive output chunks, from the first token on."""
        return [round(1e3 * (b - a), 3) for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def chunk_new_tokens(self) -> list[int]:
        """The tokens each chunk after the first added (one per gap of ``chunk_gaps_ms``); empty when unreported."""
        if len(self.chunk_tokens) != len(self.chunk_times):
            return []
        return [b - a for a, b in itertools.pairwise(self.chunk_tokens)]


def _token_id(token: str) -> int:
    # With return_tokens_as_token_ids, tokens arrive as "token_id:123".
    return int(token.rsplit(":", 1)[1])


def _token_key(token: str) -> int | str:
    """A candidate's id where the server names tokens by id (vLLM), else its text (SGLang, whose choices carry the
    generated ids themselves under ``return_token_ids``)."""
    return _token_id(token) if token.startswith("token_id:") else token


_OPENAI_KEYS = frozenset({"id", "object", "created", "model", "choices", "usage", "system_fingerprint"})


def _events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def _choice_text(choice: Mapping[str, Any]) -> str:
    # A completion chunk carries text; a chat chunk a delta, whose reasoning (thinking left on) is output too.
    if "delta" not in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")


def _add_logprobs(
    lp: Mapping[str, Any] | None, token_ids: list[int], tops: list[dict[int | str, float]], ids_given: bool
) -> None:
    """The chunk's generated ids (unless its choice gave them, ``ids_given``) and each token's top candidates."""
    if not lp:
        return
    if "content" in lp:  # chat: one entry per token, with its top candidates as a list
        for entry in lp.get("content") or []:
            if not ids_given:
                token_ids.append(_token_id(entry["token"]))
            tops.append({_token_key(t["token"]): t["logprob"] for t in entry.get("top_logprobs") or []})
        return
    if not ids_given:
        token_ids += [_token_id(t) for t in lp.get("tokens") or []]
    for top in lp.get("top_logprobs") or []:
        tops.append({_token_key(t): v for t, v in (top or {}).items()})


def _add_tokens(choice: Mapping[str, Any], token_ids: list[int], tops: list[dict[int | str, float]]) -> None:
    """A choice's generated ids, from its own ``token_ids`` (SGLang's ``return_token_ids``) or its log-probabilities'
    tokens, and each token's top candidates."""
    given = choice.get("token_ids")
    if given is not None:
        token_ids += [int(t) for t in given]
    _add_logprobs(choice.get("logprobs"), token_ids, tops, ids_given=given is not None)


def _carries_output(choice: Mapping[str, Any]) -> bool:
    """A choice with generated text or tokens: not a chat stream's opening role delta, not a bare finish."""
    if _choice_text(choice) or choice.get("logprobs"):
        return True
    delta = choice.get("delta")
    return (delta is None and not choice.get("finish_reason")) or bool(delta and delta.get("tool_calls"))


def _note_chunk(chunk: Mapping[str, Any], choices: list, times: list[float], tokens: list[int]) -> None:
    """When a chunk with output arrived and, where its usage says, the completion tokens so far."""
    so_far = (chunk.get("usage") or {}).get("completion_tokens") if choices else None
    if so_far is not None:
        # Usage on every chunk: a chunk is a step of output exactly when it added tokens.
        if int(so_far) > (tokens[-1] if tokens else 0):
            times.append(time.monotonic())
            tokens.append(int(so_far))
        return
    if any(_carries_output(c) for c in choices):
        times.append(time.monotonic())


def complete(
    base_url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    logprobs: int | None = None,
    ignore_eos: bool = True,
    timeout_s: float = 600.0,
    on_first_token: Callable[[], None] | None = None,
    client: httpx.Client | None = None,
    extra_body: Mapping | None = None,
    chat: Mapping[str, Any] | None = None,
) -> Completion:
    """One streamed completion; greedy by default, fixed length (ignore_eos).

    ``extra_body`` adds engine-specific request fields (SGLang: ``return_spec_tokens_details``). With ``chat``
    (the chat-template arguments, possibly empty) the prompt is one user message to the chat endpoint.
    """
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if chat is None:
        body["prompt"] = prompt
    else:
        if not isinstance(prompt, str):
            raise ValueError("a chat prompt is the user message's text, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
        body["chat_template_kwargs"] = dict(chat)
    if logprobs is not None:
        # The chat endpoint takes a flag and a count; the completions endpoint, the count.
        body.update({"logprobs": True, "top_logprobs": logprobs} if chat is not None else {"logprobs": logprobs})
        body["return_tokens_as_token_ids"] = True
    body.update(extra_body or {})
    path = "/v1/completions" if chat is None else "/v1/chat/completions"
    extensions: dict = {}
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
    texts: list[str] = []
    token_ids: list[int] = []
    tops: list[dict[int | str, float]] = []
    usage: dict | None = None
    finish: str | None = None
    first_at: float | None = None
    chunk_times: list[float] = []
    chunk_tokens: list[int] = []
    started = time.monotonic()
    try:
        with client.stream("POST", base_url + path, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise RequestError(f"server answered {response.status_code}: {response.text[:500]}")
            for chunk in _events(response.iter_lines()):
                if chunk.get("error"):
                    raise RequestError(f"the server broke off the stream: {str(chunk['error'])[:500]}")
                # The closing usage chunk has no choices; usage on every chunk (vLLM's continuous usage) would
                # otherwise let a stream cut short pass for a complete one.
                if chunk.get("usage") and not chunk.get("choices"):
                    usage = chunk["usage"]
                extensions.update({k: v for k, v in chunk.items() if k not in _OPENAI_KEYS and v is not None})
                choices = chunk.get("choices") or []
                _note_chunk(chunk, choices, chunk_times, chunk_tokens)
                for choice in choices:
                    if first_at is None:
                        first_at = chunk_times[-1] if chunk_times else time.monotonic()
                        if on_first_token:
                            on_first_token()
                    texts.append(_choice_text(choice))
                    finish = choice.get("finish_reason") or finish
                    _add_tokens(choice, token_ids, tops)
    except httpx.HTTPError as err:
        raise RequestError(f"request to {base_url} failed: {err!r}") from err
    finally:
        if own:
            client.close()
    finished = time.monotonic()
    if usage is None:
        raise RequestError("stream ended without a usage chunk (stream_options.include_usage)")
    if first_at is None:
        raise RequestError("stream ended without any generated token")
    return Completion(
        text="".join(texts),
        prompt_tokens=int(usage["prompt_tokens"]),
        completion_tokens=int(usage["completion_tokens"]),
        ttft_s=first_at - started,
        e2e_s=finished - started,
        started_at=started,
        first_token_at=first_at,
        finished_at=finished,
        token_ids=token_ids,
        top_logprobs=tops,
        finish_reason=finish,
        chunk_times=chunk_times,
        chunk_tokens=chunk_tokens,
        extensions=extensions,
    )
