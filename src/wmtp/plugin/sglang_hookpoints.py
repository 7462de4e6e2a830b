"""The names in SGLang that the SGLang plugin patches or relies on: one place, shared by the plugin
(``wmtp.plugin.sglang``) and by the source check ``wmtp.engines.sglang_hooks.check_hook_points``."""

from __future__ import annotations

# The server's environment variable that carries the window's settings (JSON: sink, window); unset, no window.
SETTINGS_ENV = "WMTP_SGLANG_WINDOW"

# The SGLang release the plugin is written and checked against (its sources: ``python -m wmtp sglang-sources``).
TARGET_VERSION = "0.5.17"

# SGLang's general plugins: load_plugins() calls every entry point of this group in each of its processes.
PLUGINS_MODULE = "sglang.srt.plugins"
PLUGINS_GROUP = "sglang.srt.plugins"
PLUGINS_GROUP_CONSTANT = "GENERAL_PLUGINS_GROUP"
PLUGINS_LOADER = "load_plugins"

# The FlashAttention backend's multi-step draft decode: one step backend per draft step after the first.
BACKEND_MODULE = "sglang.srt.layers.attention.flashattention_backend"
MULTI_STEP_CLASS = "FlashAttentionMultiStepBackend"
# The wrapped methods and their parameters after self, in order: eager, and outside the CUDA graph (before every
# replay and at capture).
WRAPPED_METHODS: dict[str, tuple[str, ...]] = {
    "init_forward_metadata": ("forward_batch",),
    "init_forward_metadata_out_graph": ("forward_batch", "in_capture"),
}
# Set by MULTI_STEP_CLASS.__init__: the step backends and the draft's tree width.
STEP_BACKENDS_ATTR = "attn_backends"
TOPK_ATTR = "topk"
MULTI_STEP_ATTRIBUTES = (STEP_BACKENDS_ATTR, TOPK_ATTR)

# Each step backend: its metadata for the step's forward, and the tokens per page-table column.
STEP_CLASS = "FlashAttentionBackend"
METADATA_ATTR = "forward_metadata"
PAGE_SIZE_ATTR = "page_size"
STEP_ATTRIBUTES = (METADATA_ATTR, PAGE_SIZE_ATTR)
# The step backend's method that hands the metadata to the kernel: it must read these fields of it.
DECODE_METHOD = "forward_decode"

METADATA_CLASS = "FlashAttentionMetadata"
# Rewritten in place: the table the kernel reads, each request's key count and their cumulative sum.
WINDOWED_FIELDS = ("page_table", "cache_seqlens_int32", "cu_seqlens_k")
# A step whose metadata sets one of these is refused: another table of the same keys (sliding-window pools,
# prefill-aware SWA, chunked local attention) or a kernel schedule planned for the full lengths.
REFUSED_FIELDS = ("swa_page_table", "pa_swa_page_table", "local_attn_metadata", "scheduler_metadata")

# Where the version stands in a source tree and an installed package.
VERSION_MODULE = "sglang._version"


class HookPointError(RuntimeError):
    """The running SGLang lacks something the plugin patches; names it and the SGLang version."""
