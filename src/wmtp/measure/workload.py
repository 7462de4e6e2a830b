"""Prompts of an exact token length, cut from real text (Python standard-library source).

The Spark study's workload is a coding agent with files pasted in; the standard library is real code that
ships with every Python, so the embedded default needs nothing downloaded. Lengths are converged on
or refused (after inference-perf's converge_to_exact_length_text), never approximate, and the cell
later checks them against the server's own ``usage.prompt_tokens``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# The workloads and the copy task's shape are the protocol's: wmtp.config owns them and validates against them.
from wmtp.config import (
    COPY_CUE_TOKENS,
    COPY_LEAD_TOKENS,
    COPY_PASSAGE_TOKENS,
    WORKLOADS,
)

_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


class PromptLengthError(RuntimeError):
    """No cut of the text re-tokenises to exactly the requested length."""


def corpus_files(stdlib: Path | None = None) -> Iterator[Path]:
    """Standard-library ``.py`` files in a stable order."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if not _SKIP_PARTS.intersection(path.relative_to(root).parts):
            yield path


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
    encode: TokenCounter, decode: Callable[[list[int]], str], source: str, n_tokens: int, max_tries: int = 64
) -> str:
    """A prefix of ``source`` that encodes to exactly ``n_tokens`` tokens, or PromptLengthError.

    Cutting token ids and decoding can re-merge across the cut, so the candidate cut point moves
    around ``n_tokens`` until the re-encoded length matches.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be > 0 (got {n_tokens})")
    ids = encode(source)
    if len(ids) < n_tokens + max_tries:
        raise PromptLengthError(f"source text holds only {len(ids)} tokens; {n_tokens} requested")
    offsets = [0]
    for step in range(1, max_tries):
        offsets += [step, -step]
    for offset in offsets[:max_tries]:
        cut = n_tokens + offset
        if cut <= 0:
            continue
        candidate = decode(ids[:cut])
        if len(encode(candidate)) == n_tokens:
            return candidate
    raise PromptLengthError(
        f"no cut near {n_tokens} tokens re-encodes to exactly {n_tokens} tokens after {max_tries} tries"
    )


class PromptFactory:
    """Exact-length prompts that share no prefix with each other: each starts at its own offset."""

    def __init__(self, tokenizer_json: Path, corpus: Corpus | None = None, chars_per_token: float = 4.0):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.corpus = corpus or load_corpus()
        self.chars_per_token = chars_per_token

    def encode(self, text: str) -> list[int]:
        # Count as the server does for a completion: with the tokenizer's own special tokens.
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _slice(self, start: int, n_chars: int) -> str:
        text = self.corpus.text
        start %= len(text)
        piece = text[start : start + n_chars]
        while len(piece) < n_chars:  # wrap around a short corpus
            piece += text[: n_chars - len(piece)]
        return piece

    def prompt(self, n_tokens: int, index: int, salt: str = "measure") -> str:
        """Prompt number ``index`` of exactly ``n_tokens`` tokens; distinct (index, salt) → distinct start."""
        start = int(hashlib.sha256(f"{salt}:{index}".encode()).hexdigest()[:12], 16)
        n_chars = int((n_tokens + 256) * self.chars_per_token)
        for _ in range(8):
            source = self._slice(start, n_chars)
            try:
                return exact_length_text(self.encode, self.decode, source, n_tokens)
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

    Layout: ``[lead-in][passage][filler][the passage's first cue_tokens]``. A model that copies goes on
    with the passage; a draft that attends only to a sink and a recent window shorter than the distance
    back to the passage cannot see it. The lead-in (at least one KV block of a hybrid model) keeps the
    passage out of the attention sink. The filler's length is converged on until the whole prompt
    re-tokenises to exactly ``n_tokens``, or PromptLengthError — never approximate.
    """
    if passage_tokens < cue_tokens + max_tries:
        raise ValueError(f"passage_tokens ({passage_tokens}) must exceed cue_tokens ({cue_tokens}) by {max_tries}")
    lead = factory.prompt(lead_tokens, index, salt=f"{salt}/lead")
    passage = factory.prompt(passage_tokens, index, salt=f"{salt}/passage")
    cue = exact_length_text(factory.encode, factory.decode, passage, cue_tokens, max_tries)
    head = f"{lead}\n\n{passage}\n\n"
    head_tokens = len(factory.encode(head))
    tail = f"\n\n{cue}"
    filler_tokens = n_tokens - head_tokens - len(factory.encode(tail))
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
            filler = factory.prompt(filler_tokens + offset, index, salt=filler_salt)
            text = head + filler + tail
            if len(factory.encode(text)) == n_tokens:
                return CopyTask(
                    text, len(factory.encode(f"{lead}\n\n")), passage_tokens, cue_tokens, passage[len(cue) :]
                )
    raise PromptLengthError(f"no filler length near {filler_tokens} makes the copy task exactly {n_tokens} tokens")


def workload_prompt(factory: PromptFactory, workload: str, n_tokens: int, index: int, salt: str) -> str:
    """Prompt number ``index`` of exactly ``n_tokens`` tokens of ``workload`` (one of :data:`WORKLOADS`)."""
    if workload == "code":
        return factory.prompt(n_tokens, index, salt=salt)
    if workload == "copy":
        return copy_task_prompt(factory, n_tokens, index, salt=f"{salt}/copy").text
    raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
