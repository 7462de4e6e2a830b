"""Prompts of an exact token length, cut from real text (Python standard-library source).

The Spark study's workload is a coding agent with files pasted in; the standard library is real code that
ships with every Python, so the embedded default needs nothing downloaded. Lengths are converged on
or refused (after inference-perf's converge_to_exact_length_text), never approximate, and the cell
later checks them against the server's own ``usage.prompt_tokens``.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# The workloads, their code text and the copy task's shape are the protocol's: wmtp.config owns them (the generated
# models learn from the same text) and validates against them.
from wmtp.config import (
    COPY_CUE_TOKENS,
    COPY_LEAD_TOKENS,
    COPY_PASSAGE_TOKENS,
    Study,
    corpus_files,
)

_RARE_TOKEN = re.compile(r" ?[!-~]{3,}")


class PromptLengthError(RuntimeError):
    """No cut of the text re-tokenises to exactly the requested length."""


@dataclass(frozen=True)
class Corpus:
    text: str
    digest: str


@lru_cache(maxsize=2)
def load_corpus(max_chars: int = 16_000_000) -> Corpus:
    """The files joined with a header line each, as a coding agent pastes them."""
    parts: list[str] = []
    total = 0
    for path in corpus_files():
        chunk = f"# file: {path.name}\n{path.read_text(encoding='utf-8', errors='replace')}\n"
        parts.append(chunk)
        total += len(chunk)
        if total >= max_chars:
            break
    text = "".join(parts)
    return Corpus(text=text, digest=hashlib.sha256(text.encode()).hexdigest()[:16])


TokenCounter = Callable[[str], list[int]]


def exact_length_text(
    encode: TokenCounter,
    decode: Callable[[list[int]], str],
    source: str,
    n_tokens: int,
    max_tries: int = 64,
    measure: Callable[[str], int] | None = None,
    overhead: int = 0,
) -> str:
    """A prefix of ``source`` that encodes to exactly ``n_tokens`` tokens, or PromptLengthError.

    Cutting token ids and decoding can re-merge across the cut, so the candidate cut point moves
    around ``n_tokens`` until the re-encoded length matches. ``measure`` counts the whole prompt a
    candidate becomes (a chat template around it adds ``overhead`` tokens); by default, the candidate's own.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0 (got {n_tokens})")
    measure = measure or (lambda text: len(encode(text)))
    target = n_tokens - overhead
    if target <= 0:
        raise PromptLengthError(f"{n_tokens} tokens do not hold the chat template's {overhead} tokens and any text")
    ids = encode(source)
    if len(ids) < target + max_tries:
        raise PromptLengthError(f"source text holds only {len(ids)} tokens; {target} requested")
    offsets = [0]
    for step in range(1, max_tries):
        offsets += [step, -step]
    for offset in offsets[:max_tries]:
        cut = target + offset
        if cut <= 0:
            continue
        candidate = decode(ids[:cut])
        if measure(candidate) == n_tokens:
            return candidate
    raise PromptLengthError(
        f"no cut near {n_tokens} tokens re-encodes to exactly {n_tokens} tokens after {max_tries} tries"
    )


def chat_settings(study: Study, model: str) -> dict[str, Any] | None:
    """The chat-template arguments a model's prompts go through, or None for raw prompts.

    A model's own prompt_format and chat_template_kwargs take the place of the protocol's.
    """
    spec, protocol = study.model(model), study.protocol
    if (spec.prompt_format or protocol.prompt_format) != "chat":
        return None
    return dict(protocol.chat_template_kwargs if spec.chat_template_kwargs is None else spec.chat_template_kwargs)


def _special(value: Any) -> str:
    # tokenizer_config.json gives special tokens as a string or as {"content": ...}.
    if isinstance(value, Mapping):
        return str(value.get("content") or "")
    return str(value or "")


class ChatTemplate:
    """A checkpoint's chat template, rendered as transformers' apply_chat_template renders it.

    Only to cut a prompt to length: the server applies the template itself, and the cell compares the
    server's count of the templated prompt with the rung, so a difference here fails the rung instead of
    skewing it.
    """

    def __init__(self, model_dir: Path, kwargs: Mapping[str, Any]):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source is None and (model_dir / "chat_template.jinja").is_file():
            source = (model_dir / "chat_template.jinja").read_text()
        if not source:
            raise PromptLengthError(
                f"{model_dir} has no chat template (tokenizer_config.json or chat_template.jinja); "
                "set prompt_format: raw for this model"
            )

        def raise_exception(message: str) -> None:
            raise PromptLengthError(f"the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.kwargs = dict(kwargs)
        self.specials = {key: _special(config.get(key)) for key in ("bos_token", "eos_token", "pad_token")}

    def render(self, content: str) -> str:
        """One user message, followed by the assistant's turn, as the server's chat endpoint renders it."""
        messages = [{"role": "user", "content": content}]
        return self.template.render(messages=messages, add_generation_prompt=True, **self.specials, **self.kwargs)


class PromptFactory:
    """Exact-length prompts that share no prefix with each other: each starts at its own offset.

    With ``chat`` (the chat-template arguments) a prompt is the user message's content, cut so that the
    model's chat template around it makes exactly the requested number of tokens.
    """

    def __init__(
        self,
        tokenizer_json: Path,
        corpus: Corpus | None = None,
        chars_per_token: float = 4.0,
        chat: Mapping[str, Any] | None = None,
    ):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.corpus = corpus or load_corpus()
        self.chars_per_token = chars_per_token
        self.chat = None if chat is None else ChatTemplate(Path(tokenizer_json).parent, chat)
        # Template tokens around the content, and those before it (where the content starts in the prompt).
        self.overhead = 0 if self.chat is None else self.length("")
        self.prefix_tokens = 0
        self._rare_tokens: tuple[str, ...] | None = None
        if self.chat is not None:
            marker = "\x00wmtp-content\x00"
            before = self.chat.render(marker).split(marker)[0]
            self.prefix_tokens = len(self.tokenizer.encode(before, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        # Count as the server does for a completion: with the tokenizer's own special tokens.
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def token_count(self, text: str) -> int:
        """Tokens of ``text`` on its own, without special tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else 0

    def length(self, content: str) -> int:
        """The prompt's length as the server counts it: the chat endpoint tokenizes the rendered template
        without adding special tokens (the template writes its own), the completions endpoint adds them."""
        if self.chat is None:
            return len(self.encode(content))
        return len(self.tokenizer.encode(self.chat.render(content), add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def rare_tokens(self) -> tuple[str, ...]:
        """The vocabulary's tokens of three or more printable characters after an optional leading space, in id
        order: pieces of words and identifiers, each rare in any one stretch of text."""
        if self._rare_tokens is None:
            decoded = (self.tokenizer.decode([i]) for i in range(self.tokenizer.get_vocab_size()))
            self._rare_tokens = tuple(t for t in decoded if _RARE_TOKEN.fullmatch(t))
            if len(self._rare_tokens) < 256:
                found = len(self._rare_tokens)
                raise PromptLengthError(f"the tokenizer has {found} tokens to draw from; 256 are needed")
        return self._rare_tokens

    def random_tokens(self, n_tokens: int, index: int, salt: str) -> str:
        """Exactly ``n_tokens`` tokens of text made of tokens drawn at random from :attr:`rare_tokens`: text that
        nothing but an earlier copy of it predicts. Distinct (index, salt) → distinct text."""
        rng = random.Random(hashlib.sha256(f"{salt}:{index}".encode()).digest())
        text = "".join(rng.choice(self.rare_tokens) for _ in range(n_tokens + 128))
        return exact_length_text(self.encode, self.decode, text, n_tokens)

    def _slice(self, start: int, n_chars: int) -> str:
        text = self.corpus.text
        start %= len(text)
        piece = text[start : start + n_chars]
        while len(piece) < n_chars:  # wrap around a short corpus
            piece += text[: n_chars - len(piece)]
        return piece

    def prompt(self, n_tokens: int, index: int, salt: str = "measure") -> str:
        """Prompt number ``index`` of exactly ``n_tokens`` tokens as the server counts it (with a chat
        template: the content that the template makes ``n_tokens`` long); distinct (index, salt) → distinct start."""
        if self.chat is None:
            return self.text(n_tokens, index, salt)
        return self.text(n_tokens, index, salt, measure=self.length, overhead=self.overhead)

    def text(
        self,
        n_tokens: int,
        index: int,
        salt: str = "measure",
        measure: Callable[[str], int] | None = None,
        overhead: int = 0,
    ) -> str:
        """Text of exactly ``n_tokens`` tokens on its own (``measure``: as part of a longer prompt)."""
        start = int(hashlib.sha256(f"{salt}:{index}".encode()).hexdigest()[:12], 16)
        n_chars = int((n_tokens + 256) * self.chars_per_token)
        for _ in range(8):
            source = self._slice(start, n_chars)
            try:
                return exact_length_text(self.encode, self.decode, source, n_tokens, measure=measure, overhead=overhead)
            except PromptLengthError as err:
                if "holds only" in str(err):
                    n_chars *= 2
                else:  # no cut of this text re-encodes to n_tokens: cut from elsewhere (deterministically)
                    start += 7919
        raise PromptLengthError(f"could not gather exactly {n_tokens} tokens of text")


@dataclass(frozen=True)
class CopyTask:
    """A prompt whose continuation is a passage from far back, and where that passage sits."""

    text: str
    passage_start: int  # tokens before the passage (the lead-in)
    passage_tokens: int
    cue_tokens: int
    continuation: str  # the rest of the passage after the cue: what a faithful copy generates next

    def distance(self, n_tokens: int) -> int:
        """Tokens between the end of the prompt and the start of the passage it repeats."""
        return n_tokens - self.passage_start


def copy_task_prompt(
    factory: PromptFactory,
    n_tokens: int,
    index: int,
    passage_tokens: int = COPY_PASSAGE_TOKENS,
    cue_tokens: int = COPY_CUE_TOKENS,
    lead_tokens: int = COPY_LEAD_TOKENS,
    salt: str = "copy",
    max_tries: int = 64,
) -> CopyTask:
    """The hard / low-acceptance workload: exactly ``n_tokens`` tokens that end by starting to repeat a
    passage from far back, so that the right continuation is a copy of text the window cannot see.

    Layout: ``[lead-in][passage][filler][the passage's first cue_tokens]``, lead-in and filler cut from the
    corpus, the passage tokens drawn at random from the vocabulary (:meth:`PromptFactory.random_tokens`). Only
    the passage's earlier occurrence predicts how it goes on, so a draft that guesses from the code it sees
    cannot pass for one that copies: a model that copies goes on with the passage; a draft that attends only
    to a sink and a recent window shorter than the distance back to the passage cannot see it. The lead-in
    (at least one KV block of a hybrid model) keeps the passage out of the attention sink. The filler's
    length is converged on until the whole prompt
    re-tokenises to exactly ``n_tokens``, or PromptLengthError — never approximate.
    """
    if passage_tokens < cue_tokens + max_tries:
        raise ValueError(f"passage_tokens ({passage_tokens}) must exceed cue_tokens ({cue_tokens}) by {max_tries}")
    # The pieces are text on their own; only the whole prompt is measured as the server counts it (with a chat
    # template around it, when there is one).
    lead = factory.text(lead_tokens, index, salt=f"{salt}/lead")
    passage = factory.random_tokens(passage_tokens, index, salt=f"{salt}/passage")
    cue = exact_length_text(factory.encode, factory.decode, passage, cue_tokens, max_tries)
    head = f"{lead}\n\n{passage}\n\n"
    head_tokens = len(factory.encode(head))
    tail = f"\n\n{cue}"
    filler_tokens = n_tokens - head_tokens - len(factory.encode(tail)) - factory.overhead
    if filler_tokens < 16:
        raise PromptLengthError(
            f"{n_tokens} tokens cannot hold a {lead_tokens}-token lead-in, a "
            f"{passage_tokens}-token passage and its {cue_tokens}-token cue"
        )
    offsets = [0]
    for step in range(1, max_tries):
        offsets += [-step, step]
    # A filler that ends in a newline merges with the tail's, so one text can step over n_tokens at
    # every length; another filler text (a few variants, deterministic) has other boundaries.
    for variant in range(4):
        filler_salt = f"{salt}/filler" + (f"/{variant}" if variant else "")
        for offset in offsets[:max_tries]:
            if filler_tokens + offset < 1:
                continue
            filler = factory.text(filler_tokens + offset, index, salt=filler_salt)
            text = head + filler + tail
            if factory.length(text) == n_tokens:
                start = factory.prefix_tokens + len(factory.encode(f"{lead}\n\n"))
                return CopyTask(text, start, passage_tokens, cue_tokens, passage[len(cue) :])
    raise PromptLengthError(f"no filler length near {filler_tokens} makes the copy task exactly {n_tokens} tokens")


def copied_tokens(count_tokens: Callable[[str], int], output: str, continuation: str | None) -> int | None:
    """How many tokens of ``continuation`` the generated ``output`` reproduces before it leaves it: the tokens
    of their common prefix (compared as text, so that it needs no token ids and a token that spans the end of
    the cue and the start of the continuation still counts). None for a prompt without a passage."""
    if continuation is None:
        return None
    shared = next(
        (i for i, (a, b) in enumerate(zip(output, continuation, strict=False)) if a != b),
        min(len(output), len(continuation)),
    )
    return count_tokens(continuation[:shared])
