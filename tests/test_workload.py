"""Prompts of an exact token length, cut from real text."""

from __future__ import annotations

import pytest

from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.measure.workload import PromptFactory, PromptLengthError, corpus_files, exact_length_text, load_corpus


@pytest.mark.parametrize("n", [1, 7, 48, 512, 1536, 3072])
def test_exact_lengths_with_the_tiny_tokenizer(tiny_tokenizer, n):
    factory = PromptFactory(tiny_tokenizer)
    for index in range(3):
        prompt = factory.prompt(n, index)
        assert len(factory.encode(prompt)) == n


def test_prompts_share_no_prefix(tiny_tokenizer):
    factory = PromptFactory(tiny_tokenizer)
    prompts = [factory.prompt(64, i) for i in range(4)] + [factory.prompt(64, 0, salt="warmup")]
    assert len({p[:20] for p in prompts}) == len(prompts)


def test_prompts_are_real_text(tiny_tokenizer):
    prompt = PromptFactory(tiny_tokenizer).prompt(400, 1)
    assert prompt.isprintable() or "\n" in prompt
    assert any(word in prompt for word in ("def ", "import ", "return", "self", "class "))


def test_corpus_is_stable():
    assert load_corpus().digest == load_corpus().digest
    files = list(corpus_files())
    assert files == sorted(files, key=lambda p: p.as_posix()) or len(files) > 100


def test_converge_or_fail():
    # A tokenizer whose lengths jump by two can never hit an odd length: refuse, never approximate.
    def encode(text: str) -> list[int]:
        return [0] * (2 * (len(text) // 2))

    def decode(ids: list[int]) -> str:
        return "x" * len(ids)

    assert len(encode(exact_length_text(encode, decode, "x" * 400, 10))) == 10
    with pytest.raises(PromptLengthError, match="exactly 11"):
        exact_length_text(encode, decode, "x" * 400, 11)


def test_workload_prompts_have_exact_lengths_and_copy_repeats_a_far_passage(tiny_tokenizer):
    from wmtp.config import COPY_MIN_TOKENS
    from wmtp.measure.tasks import workload_prompt
    from wmtp.measure.workload import copy_task_prompt

    factory = PromptFactory(tiny_tokenizer)
    for n in (COPY_MIN_TOKENS, 4096):
        code = workload_prompt(factory, "code", n, 0, salt=f"measure/{n}")
        copy = workload_prompt(factory, "copy", n, 0, salt=f"measure/{n}")
        assert len(factory.encode(code)) == len(factory.encode(copy)) == n
        assert code != copy
        task = copy_task_prompt(factory, n, 0, salt=f"measure/{n}/copy")
        assert task.text == copy
        cue = copy[-200:].strip()[-60:]
        assert copy.count(cue) == 2, "the prompt ends by starting to repeat a passage that appeared before"
        assert task.distance(n) >= n - 600
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        workload_prompt(factory, "chat", 1024, 0, salt="x")


def test_copy_passage_is_random_tokens_that_only_its_earlier_occurrence_predicts(tiny_tokenizer):
    from wmtp.measure.workload import copy_task_prompt

    factory = PromptFactory(tiny_tokenizer)
    assert factory.rare_tokens and all(len(t.strip()) >= 3 and t.strip().isprintable() for t in factory.rare_tokens)
    passage = factory.random_tokens(256, 0, salt="p")
    assert len(factory.encode(passage)) == 256
    assert passage == factory.random_tokens(256, 0, salt="p")  # deterministic
    assert passage not in (factory.random_tokens(256, 1, salt="p"), factory.random_tokens(256, 0, salt="q"))
    task = copy_task_prompt(factory, 4096, 0)
    probe = task.continuation[:48]
    assert task.text.count(probe) == 1, "the continuation occurs once, in the passage far back"
    assert probe not in factory.corpus.text, "and nowhere in the text the lead-in and filler come from"


def test_copied_tokens_counts_the_output_tokens_that_go_on_with_the_passage(tiny_tokenizer):
    from wmtp.measure.workload import copied_tokens

    factory = PromptFactory(tiny_tokenizer)
    continuation = factory.random_tokens(64, 0, salt="c")
    ids = factory.tokenizer.encode(continuation, add_special_tokens=False).ids
    ten = factory.decode(ids[:10])
    assert copied_tokens(factory.token_count, continuation, continuation) == len(ids) == 64
    assert copied_tokens(factory.token_count, ten, continuation) == 10
    assert copied_tokens(factory.token_count, ten + "\x00 and then something else", continuation) == 10
    assert copied_tokens(factory.token_count, "\x00" + continuation, continuation) == 0  # a miss ends the copy
    assert copied_tokens(factory.token_count, "", continuation) == 0
    assert copied_tokens(factory.token_count, continuation, None) is None  # a code prompt has no passage


def test_workload_task_gives_the_copy_tasks_continuation(tiny_tokenizer):
    from wmtp.measure.tasks import workload_prompt, workload_task
    from wmtp.measure.workload import copy_task_prompt

    factory = PromptFactory(tiny_tokenizer)
    measured = workload_task(factory, "copy", 2048, 1, salt="measure/2048")
    task = copy_task_prompt(factory, 2048, 1, salt="measure/2048/copy")
    assert (measured.text, measured.continuation) == (task.text, task.continuation)
    assert measured.text == workload_prompt(factory, "copy", 2048, 1, salt="measure/2048")
    # The passage starts where its tokens start in the prompt: counted, not assumed from the lead-in's size.
    ids = factory.encode(measured.text)
    cue = measured.text.rsplit("\n\n", 1)[1]
    # At most the blank line between lead-in and passage lies between that token and the passage.
    assert factory.decode(ids[len(ids) - measured.distance :]).lstrip("\n").startswith(cue + task.continuation)
    code = workload_task(factory, "code", 512, 1, salt="m")
    assert (code.text, code.continuation, code.distance) == (factory.prompt(512, 1, salt="m"), None, None)


def test_copy_task_converges_where_a_filler_ending_in_a_newline_steps_over_the_length():
    """With the trained model's tokenizer, copy prompt #1 of 2,048 tokens once failed: every filler
    length either fell one short or one over (its trailing newline merged with the tail's)."""

    from wmtp.measure.workload import copy_task_prompt

    factory = PromptFactory(TRAINED_CHECKPOINT / "tokenizer.json")
    for index in range(6):
        for n in (1024, 2048, 4096):
            task = copy_task_prompt(factory, n, index, salt=f"measure/{n}/copy")
            assert len(factory.encode(task.text)) == n
