"""Derived quantities of the Spark study (DESIGN.md, "Formulas"). Pure functions, no I/O."""

from __future__ import annotations

import math


def decode_tok_s(completion_tokens: int, e2e_s: float, ttft_s: float) -> float:
    """Decode rate excluding the first token, which belongs to prefill."""
    window = e2e_s - ttft_s
    if completion_tokens < 2 or window <= 0:
        return math.nan
    return (completion_tokens - 1) / window


def prefill_tok_s(prompt_tokens: int, ttft_s: float) -> float:
    return prompt_tokens / ttft_s if ttft_s > 0 else math.nan


def tok_per_verify(d_accepted: float, d_drafts: float) -> float:
    """Tokens emitted per verify cycle: 1 (the target's own) + accepted drafts per cycle."""
    if d_drafts <= 0:
        return math.nan
    return 1.0 + d_accepted / d_drafts


def acceptance_rate(d_accepted: float, d_draft_tokens: float) -> float:
    return d_accepted / d_draft_tokens if d_draft_tokens > 0 else math.nan


def position_rate(d_accepted_at_position: float, d_drafts: float) -> float:
    return d_accepted_at_position / d_drafts if d_drafts > 0 else math.nan


def cycle_ms(tokens_per_verify: float, decode_tokens_per_s: float) -> float:
    """Wall time of one verify cycle (k draft forwards + one target forward); 1000/tok_s without a draft."""
    if not decode_tokens_per_s or math.isnan(decode_tokens_per_s):
        return math.nan
    return tokens_per_verify * 1000.0 / decode_tokens_per_s
