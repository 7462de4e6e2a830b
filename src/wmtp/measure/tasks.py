"""A workload's prompt by name: plain code, the copy task or a question-answering task, with what a request of
it is scored against (the copy task's continuation, a question's expected answer)."""

from __future__ import annotations

from dataclasses import dataclass

from wmtp.config import RULER_WORKLOADS, WORKLOADS
from wmtp.measure.ruler import ruler_task
from wmtp.measure.workload import PromptFactory, copy_task_prompt


@dataclass(frozen=True)
class PromptTask:
    """One measured prompt: its text and, for a copy task, the text a faithful copy goes on with and how many
    tokens back from the prompt's end its passage starts (None for a prompt without one); for a question-answering
    task, the items a right answer names (None for a prompt without a question)."""

    text: str
    continuation: str | None = None
    distance: int | None = None
    answer: tuple[str, ...] | None = None


def workload_task(factory: PromptFactory, workload: str, n_tokens: int, index: int, salt: str) -> PromptTask:
    """Prompt number ``index`` of exactly ``n_tokens`` tokens of ``workload`` (one of :data:`WORKLOADS`)."""
    if workload == "code":
        return PromptTask(factory.prompt(n_tokens, index, salt=salt))
    if workload == "copy":
        task = copy_task_prompt(factory, n_tokens, index, salt=f"{salt}/copy")
        return PromptTask(task.text, task.continuation, task.distance(n_tokens))
    if workload in RULER_WORKLOADS:
        qa = ruler_task(factory, workload, n_tokens, index, salt=f"{salt}/{workload}")
        return PromptTask(qa.text, answer=qa.answer)
    raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")


def workload_prompt(factory: PromptFactory, workload: str, n_tokens: int, index: int, salt: str) -> str:
    """Prompt number ``index`` of exactly ``n_tokens`` tokens of ``workload`` (one of :data:`WORKLOADS`)."""
    return workload_task(factory, workload, n_tokens, index, salt).text
