"""A stand-in for vLLM's CommonAttentionMetadata where no vLLM is imported: the fields of vLLM 0.24's class that
the plugin's windowing reads or replaces (the in-process tests and the window kernels' test use it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Metadata:
    query_start_loc: object
    query_start_loc_cpu: object
    seq_lens: object
    max_query_len: int
    max_seq_len: int
    block_table_tensor: object
    seq_lens_cpu_upper_bound: object = None
    _seq_lens_cpu: object = None
    _num_computed_tokens_cpu: object = None
    _num_computed_tokens_cache: object = None
