"""Whether a weightless checkpoint fits the engine that would serve it, decided before any server starts.

A ``generate: dummy`` model has no weight files, but its engine still allocates every weight at the architecture's
full shape (random values): the 35B shape is 66 GiB in bf16. On a CPU engine those bytes come out of the machine's
memory, which is known here; a GPU engine's device memory is known only on the machine that serves, where the
engine reports its own shortfall.
"""

from __future__ import annotations

import os

from wmtp.analyze import costmodel
from wmtp.config import ConfigError, Study, architecture_file

# What share of the machine's memory the weights may take: the server, its KV cache and the pipeline need the rest.
CPU_WEIGHT_SHARE = 0.7


def machine_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weightless_bytes(architecture: str) -> int:
    """The weights (bf16, the MTP head included) an engine allocates for a dummy checkpoint of this architecture."""
    spec = costmodel.load_model(architecture_file(architecture))
    return costmodel.total_params(spec) * costmodel.DTYPE_BYTES["bfloat16"]


def check_weightless_fit(study: Study, memory_bytes: int | None = None) -> None:
    """Refuse a weightless model on a CPU engine whose machine cannot hold its weights."""
    memory = machine_memory_bytes() if memory_bytes is None else memory_bytes
    pairs = {(cell.model, cell.engine) for cell in study.cells()}
    for i, model in enumerate(study.models):
        if model.generate != "dummy" or not model.architecture:
            continue
        for engine in study.engines:
            if (model.name, engine.name) not in pairs or engine.device != "cpu":
                continue
            need = weightless_bytes(model.architecture)
            if need > CPU_WEIGHT_SHARE * memory:
                raise ConfigError(
                    f"config: models[{i}] {model.name!r} (generate: dummy, architecture {model.architecture!r}) "
                    f"allocates {need / 2**30:.0f} GiB of weights, more than engine {engine.name!r} on this "
                    f"machine's CPU can hold ({memory / 2**30:.0f} GiB of memory): serve it on a GPU engine"
                )
