"""Seeded RULER-style question-answering prompts of an exact token length, and their scoring.

Three tasks, each a long input and a question whose answer is a list of items:

* ``niah_multiquery``: a haystack (standard-library source, as the code workload's) with :data:`NIAH_KEYS` needles
  "One of the special magic numbers for <key> is: <7-digit number>." on lines of their own at seeded depths; the
  question asks for the number of every one of :data:`NIAH_QUERIES` keys, in a seeded order.
* ``fwe``: a text of synthetic six-letter words whose counts follow a Zipf law (:data:`FWE_ALPHA`) over the word's
  rank, the top rank being dots the question says to ignore; the answer is the :data:`FWE_TOP` most frequent words.
* ``cwe``: a numbered list in which :data:`CWE_COMMON` words appear :data:`CWE_COMMON_REPEATS` times each and many
  others :data:`CWE_UNCOMMON_REPEATS` times; the answer is the common words.

The text that stretches with the rung (the haystack, the number of words, the number of uncommon words) is sized
first; a short neutral tail (haystack cut at any token, dots, words that appear once) then makes the whole prompt
exactly ``n_tokens`` long as the server counts it (:meth:`PromptFactory.length`), or PromptLengthError. A prompt is
a function of (salt, index, n_tokens) and the tokenizer only.

Scoring is RULER's string-match recall: the fraction of expected items that appear in the output, ignoring case.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from wmtp.config import (
    CWE_COMMON,
    CWE_COMMON_REPEATS,
    CWE_UNCOMMON_REPEATS,
    FWE_ALPHA,
    FWE_TOP,
    NIAH_KEYS,
    NIAH_QUERIES,
    RULER_WORKLOADS,
)
from wmtp.measure.workload import PromptFactory, PromptLengthError


@dataclass(frozen=True)
class RulerTask:
    """A question-answering prompt and the items a right answer names (in the order the answer gives them)."""

    text: str
    answer: tuple[str, ...]


def answer_recall(output: str, answer: Sequence[str]) -> float:
    """The fraction of ``answer``'s items that appear in ``output`` (as substrings, ignoring case)."""
    if not answer:
        raise ValueError("an answer with no items has no recall")
    found = output.lower()
    return sum(item.lower() in found for item in answer) / len(answer)


# One scorer per task; all three are string-match recall, as in RULER.
SCORERS: dict[str, Callable[[str, Sequence[str]], float]] = {workload: answer_recall for workload in RULER_WORKLOADS}


def score(workload: str, output: str, answer: Sequence[str]) -> float:
    """The task's score of ``output`` against its expected ``answer``."""
    try:
        return SCORERS[workload](output, answer)
    except KeyError:
        raise ValueError(f"{workload!r} is not a question-answering workload ({', '.join(RULER_WORKLOADS)})") from None


def _rng(salt: str, index: int, n_tokens: int, part: str) -> random.Random:
    return random.Random(hashlib.sha256(f"{salt}:{index}:{n_tokens}:{part}".encode()).digest())


def _converge(
    n_tokens: int, build: Callable[[int], str], measure: Callable[[str], int], start: int, low: int, high: int
) -> str | None:
    """``build(x)`` for the x in [low, high] whose text measures exactly ``n_tokens``, or None.

    x counts tokens of a tail that grows about one token per step, so the miss is the next step; where the length
    jumps over ``n_tokens`` the untried neighbours are walked in the miss's direction.
    """
    tried: set[int] = set()
    x = min(max(start, low), high)
    for _ in range(32):
        text = build(x)
        miss = n_tokens - measure(text)
        if miss == 0:
            return text
        tried.add(x)
        nxt = x + miss
        if nxt in tried or not low <= nxt <= high:
            step = 1 if miss > 0 else -1
            nxt = x + step
            while nxt in tried:
                nxt += step
        if not low <= nxt <= high:
            return None
        x = nxt
    return None


def _cut(factory: PromptFactory, text: str) -> tuple[Callable[[int], str], int]:
    """The first x tokens of ``text`` (for any x up to its length), and that length."""
    ids = factory.tokenizer.encode(text, add_special_tokens=False).ids
    return (lambda x: factory.decode(ids[:x]) if x > 0 else ""), len(ids)


def _size(
    n_tokens: int, length_of: Callable[[int], int], start: int, low: int, room: tuple[int, int], what: str
) -> list[int]:
    """Sizes y ≥ low (each unit many tokens) whose prompt leaves between room[0] and room[1] tokens for the tail,
    best first: Newton steps on the measured length, a unit's tokens varying little along a long text."""
    lo_room, hi_room = room
    target = n_tokens - (lo_room + hi_room) // 2
    seen = {low: length_of(low)}
    if n_tokens - seen[low] < lo_room:
        raise PromptLengthError(f"{n_tokens} tokens cannot hold the {what} task ({seen[low]} tokens at its smallest)")
    y = max(start, low)
    for _ in range(24):
        if y not in seen:
            seen[y] = length_of(y)
        if lo_room <= n_tokens - seen[y] <= hi_room:
            break
        other = min((s for s in seen if s != y), key=lambda s: abs(s - y), default=None)
        per_unit = (seen[y] - seen[other]) / (y - other) if other is not None else 1.0
        step = round((target - seen[y]) / max(per_unit, 0.5)) or (1 if target > seen[y] else -1)
        y = max(low, y + step)
    fits = sorted((s for s, length in seen.items() if lo_room <= n_tokens - length <= hi_room), reverse=True)
    if not fits:
        raise PromptLengthError(f"no size of the {what} task comes within {hi_room} tokens of {n_tokens}")
    # Neighbours of the best size too: a tail that cannot meet n_tokens after one may after another.
    best = fits[0]
    return [*fits, *(s for s in (best - 1, best + 1, best - 2) if s >= low and s not in fits)]


# --- needle in a haystack, multi-query ------------------------------------------------------------------------------

# Keys are adjective-noun pairs; a fixed list keeps them words every tokenizer knows.
_ADJECTIVES = [
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "faded",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "mellow",
    "narrow",
    "odd",
    "pale",
    "quiet",
    "rapid",
    "rusty",
    "silent",
    "tall",
    "tidy",
    "urban",
    "vivid",
    "wary",
    "wild",
    "young",
    "zesty",
    "bold",
    "crisp",
    "damp",
    "fierce",
    "grand",
    "humble",
    "lucky",
    "noble",
    "plain",
    "proud",
    "royal",
    "shy",
    "smooth",
    "sour",
    "spare",
    "stern",
    "sunny",
    "swift",
]
_NOUNS = [
    "anchor",
    "badge",
    "basket",
    "beacon",
    "bridge",
    "candle",
    "canyon",
    "castle",
    "cellar",
    "comet",
    "desert",
    "engine",
    "falcon",
    "feather",
    "fountain",
    "garden",
    "glacier",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "lantern",
    "meadow",
    "mirror",
    "needle",
    "orchard",
    "palace",
    "pebble",
    "pillar",
    "quarry",
    "river",
    "saddle",
    "signal",
    "spoon",
    "tablet",
    "temple",
    "thistle",
    "tunnel",
    "valley",
    "wagon",
    "window",
    "wizard",
    "yacht",
]

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. Memorize them: afterwards I will ask you "
    "for the number of each key.\n\n"
)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def niah_multiquery_task(
    factory: PromptFactory,
    n_tokens: int,
    index: int,
    salt: str = "niah",
    keys: int = NIAH_KEYS,
    queries: int = NIAH_QUERIES,
    min_haystack_tokens: int = 256,
) -> RulerTask:
    """Prompt number ``index``: ``keys`` needles at seeded depths in exactly ``n_tokens`` tokens; the answer is the
    numbers of ``queries`` of the keys, in the order the question names them."""
    if not 1 <= queries <= keys:
        raise ValueError(f"queries ({queries}) must be between 1 and keys ({keys})")
    rng = _rng(salt, index, n_tokens, "needles")
    names = rng.sample([f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS], keys)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), keys)]
    needles = [_needle(k, v) for k, v in zip(names, values, strict=True)]
    depths = sorted(rng.random() for _ in range(keys))
    order = rng.sample(range(keys), queries)
    asked = [names[i] for i in order]
    question = (
        "\n\nWhat are the special magic numbers for "
        + ", ".join(asked[:-1])
        + (" and " if len(asked) > 1 else "")
        + asked[-1]
        + "? Answer with one line per key, in this order, as 'key: number'.\nAnswer:"
    )

    def build(haystack: str) -> str:
        # Each needle on a line of its own, before the line at its depth: insertion from the deepest keeps the
        # shallower lines' indices.
        lines = haystack.split("\n")
        at = [int(d * len(lines)) for d in depths]
        for line, needle in sorted(zip(at, needles, strict=True), key=lambda p: p[0], reverse=True):
            lines.insert(line, needle)
        return NIAH_INTRO + "\n".join(lines) + question

    empty = factory.length(build(""))
    room = n_tokens - empty
    if room < min_haystack_tokens:
        raise PromptLengthError(
            f"{n_tokens} tokens cannot hold {keys} needles and the question ({empty} tokens) with a haystack of "
            f"{min_haystack_tokens} tokens or more"
        )
    start = int.from_bytes(hashlib.sha256(f"{salt}:{index}:{n_tokens}:haystack".encode()).digest()[:6], "big")
    for variant in range(4):
        # Another stretch of the corpus for the rare haystack whose cuts all step over n_tokens.
        n_chars = int((room + 512) * factory.chars_per_token)
        cut, available = _cut(factory, factory._slice(start + 7919 * variant, n_chars))
        while available < room + 256:
            n_chars *= 2
            cut, available = _cut(factory, factory._slice(start + 7919 * variant, n_chars))
        text = _converge(n_tokens, lambda x, c=cut: build(c(x)), factory.length, room, min_haystack_tokens, room + 256)
        if text is not None:
            return RulerTask(text, tuple(values[i] for i in order))
    raise PromptLengthError(f"no haystack makes the niah_multiquery task exactly {n_tokens} tokens")


# --- frequent words extraction --------------------------------------------------------------------------------------

FWE_NOISE = "...."
FWE_INTRO = (
    "Read the coded text below and keep count of how often each coded word occurs; ignore the dots. "
    "You will be asked for the most frequent coded words.\n\n"
)
FWE_QUESTION = (
    "\n\nQuestion: Ignore the dots. What are the {top} most frequent coded words in the text above, most frequent "
    "first? Answer with the words only, separated by commas.\nAnswer:"
)
# The tail after the words: dots of varying lengths, noise the question says to ignore, cut to any token count.
_TAIL_ROOM = (16, 96)


def _letters_word(rng: random.Random, length: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(length))


def _zeta(alpha: float, terms: int = 100_000) -> float:
    # The partial sum and the integral of the rest: exact to ~1e-10 for alpha 2.
    return sum(k**-alpha for k in range(1, terms + 1)) + terms ** (1 - alpha) / (alpha - 1)


def fwe_counts(words: int, vocabulary: int, top: int = FWE_TOP, alpha: float = FWE_ALPHA) -> list[int]:
    """How often each rank occurs in a text of about ``words`` words: ``words · r^-alpha / zeta(alpha)``, rounded
    down but at least once, so that every word of the vocabulary is there to be miscounted (a Zipf law alone leaves
    only ~sqrt(words) of them, fewer than the answer at a short rung); and ranks 2 … top + 1 (the answer; rank 1
    is noise) each at least one above the next, so that the top words are the most frequent by a margin at any
    length and their order is unambiguous."""
    norm = _zeta(alpha)
    counts = [max(1, int(words * r**-alpha / norm)) for r in range(1, vocabulary + 1)]
    for r in range(top, 0, -1):  # counts[r] is rank r + 1
        counts[r] = max(counts[r], counts[r + 1] + 1)
    return counts


def fwe_task(
    factory: PromptFactory,
    n_tokens: int,
    index: int,
    salt: str = "fwe",
    top: int = FWE_TOP,
    alpha: float = FWE_ALPHA,
) -> RulerTask:
    """Prompt number ``index``: exactly ``n_tokens`` tokens of coded text whose ``top`` most frequent words (after the
    dots) are the answer, most frequent first."""
    rng = _rng(salt, index, n_tokens, "vocabulary")
    # RULER's vocabulary size: one word per 50 tokens of prompt (a sixth of the text at three tokens a word).
    vocabulary = max(4 * top, n_tokens // 50)
    words: list[str] = []
    seen = {FWE_NOISE}
    while len(words) < vocabulary - 1:
        word = _letters_word(rng, 6)
        if word not in seen:
            seen.add(word)
            words.append(word)
    ranked = [FWE_NOISE, *words]
    tail_rng = _rng(salt, index, n_tokens, "tail")
    tail = " ".join("." * tail_rng.randint(1, 4) for _ in range(4 * _TAIL_ROOM[1]))
    question = FWE_QUESTION.format(top=top)

    def body(size: int) -> str:
        counts = fwe_counts(size, len(ranked), top, alpha)
        text = [word for word, count in zip(ranked, counts, strict=True) for _ in range(count)]
        _rng(salt, index, n_tokens, "order").shuffle(text)
        return " ".join(text)

    def prompt(size: int, tail_text: str = "") -> str:
        return FWE_INTRO + body(size) + (" " + tail_text if tail_text else "") + question

    per_word = max(1.0, factory.token_count(" " + " ".join(words[:64])) / 64)
    start = max(0, int((n_tokens - factory.length(prompt(0))) / per_word))
    cut, available = _cut(factory, tail)
    for size in _size(n_tokens, lambda y: factory.length(prompt(y)), start, 0, _TAIL_ROOM, "fwe"):
        base = factory.length(prompt(size))
        text = _converge(n_tokens, lambda x, s=size: prompt(s, cut(x)), factory.length, n_tokens - base, 1, available)
        if text is not None:
            return RulerTask(text, tuple(ranked[1 : top + 1]))
    raise PromptLengthError(f"no length of coded text makes the fwe task exactly {n_tokens} tokens")


# --- common words extraction ----------------------------------------------------------------------------------------

CWE_INTRO = (
    "Below is a numbered list of words. Some words appear in it much more often than the others; remember which.\n\n"
)
CWE_QUESTION = (
    "\n\nQuestion: What are the {common} words that appear most often in the list above? Answer with the words "
    "only, separated by commas.\nAnswer:"
)
_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "cl",
    "dr",
    "fr",
    "gl",
    "pr",
    "sk",
    "st",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "oa"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m"]


def _made_up_word(rng: random.Random) -> str:
    """A pronounceable made-up word of two or three syllables: any number of distinct ones, none a real word's
    frequency in the model's training to lean on."""
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(2, 3)))


def cwe_task(
    factory: PromptFactory,
    n_tokens: int,
    index: int,
    salt: str = "cwe",
    common: int = CWE_COMMON,
    common_repeats: int = CWE_COMMON_REPEATS,
    uncommon_repeats: int = CWE_UNCOMMON_REPEATS,
) -> RulerTask:
    """Prompt number ``index``: a numbered list of exactly ``n_tokens`` tokens (with its question) in which
    ``common`` words appear ``common_repeats`` times and the rest ``uncommon_repeats`` times or once (a short tail
    of single words closes the list); the answer is the common words."""
    if common_repeats <= max(uncommon_repeats, 1):
        raise ValueError("the common words must repeat more often than the uncommon ones")
    rng = _rng(salt, index, n_tokens, "words")
    seen: set[str] = set()

    def fresh() -> str:
        while True:
            word = _made_up_word(rng)
            if word not in seen:
                seen.add(word)
                return word

    common_words = [fresh() for _ in range(common)]
    # Far more than a rung needs (a listed word takes three tokens or more), drawn once so that a size is a prefix.
    uncommon_words = [fresh() for _ in range(n_tokens // (3 * uncommon_repeats) + 16)]
    single_words = [fresh() for _ in range(4 * _TAIL_ROOM[1])]
    question = CWE_QUESTION.format(common=common)

    def items(size: int) -> list[str]:
        listed = common_words * common_repeats + uncommon_words[:size] * uncommon_repeats
        _rng(salt, index, n_tokens, "order").shuffle(listed)
        return listed

    def numbered(words: list[str], first: int) -> str:
        return "\n".join(f"{first + i}. {word}" for i, word in enumerate(words))

    def prompt(size: int, tail_text: str = "") -> str:
        return CWE_INTRO + numbered(items(size), 1) + ("\n" + tail_text if tail_text else "") + question

    low = common  # at least as many uncommon words as common ones
    if low > len(uncommon_words):
        raise PromptLengthError(f"{n_tokens} tokens cannot hold the cwe task")
    per_word = max(1.0, uncommon_repeats * factory.token_count(numbered(uncommon_words[:32], 1000)) / 32)
    start = max(low, int((n_tokens - factory.length(prompt(0))) / per_word))

    def length_of(size: int) -> int:
        return factory.length(prompt(min(size, len(uncommon_words))))

    for size in _size(n_tokens, length_of, start, low, _TAIL_ROOM, "cwe"):
        size = min(size, len(uncommon_words))
        cut, available = _cut(factory, numbered(single_words, common * common_repeats + size * uncommon_repeats + 1))
        base = factory.length(prompt(size))
        text = _converge(
            n_tokens, lambda x, s=size, c=cut: prompt(s, c(x)), factory.length, n_tokens - base, 1, available
        )
        if text is not None:
            return RulerTask(text, tuple(common_words))
    raise PromptLengthError(f"no length of word list makes the cwe task exactly {n_tokens} tokens")


TASKS: dict[str, Callable[[PromptFactory, int, int, str], RulerTask]] = {
    "niah_multiquery": niah_multiquery_task,
    "fwe": fwe_task,
    "cwe": cwe_task,
}


def ruler_task(factory: PromptFactory, workload: str, n_tokens: int, index: int, salt: str) -> RulerTask:
    """Prompt number ``index`` of exactly ``n_tokens`` tokens of the question-answering ``workload``."""
    if workload not in TASKS:
        raise ValueError(f"{workload!r} is not a question-answering workload ({', '.join(RULER_WORKLOADS)})")
    return TASKS[workload](factory, n_tokens, index, salt)
