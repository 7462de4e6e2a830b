"""Roofline cost model of one speculative-decode step, from ``config/models/*.json``.

Decode at batch 1 is memory-bound: a forward costs the bytes it must move through device
memory divided by the bandwidth (plus, optionally, a fixed per-forward overhead for launches).
One *step* (the paper's unit, acceptance-free) is one verify forward of the target over
``k + 1`` query tokens plus ``k`` draft forwards of the MTP head, one query token each.

Bytes counted per forward (bf16 unless the model file says otherwise):

- weights touched: every dense matrix of every layer once; for a MoE layer the router, the
  shared expert(s), the latent projections (LatentMoE) and the *expected number of distinct
  routed experts* for ``T`` tokens under uniform routing, ``E * (1 - (1 - top_k / E) ** T)``;
- KV reads: each full-attention layer reads the K and V of every visible token once (a
  split-KV kernel reads each byte once whatever the query length), and writes the new tokens';
- recurrent state (Gated DeltaNet / Mamba2): the verify reads the state once and writes one
  state per query token (engines keep a state per speculative position for rollback; set
  ``state_writes="final"`` for one write), plus the short-convolution state;
- lm_head: ``vocab * hidden`` once per forward (the MTP head shares the target's).

Arms: ``none`` (plain decode, T = 1, no draft), ``mtp`` (draft attends over the whole
context), ``wmtp`` (draft attends over an attention sink of S tokens plus the last W tokens
only).  The draft's KV pool is full-context in ``mtp``/``wmtp``; a ring buffer of S + W slots
(``wmtp-ring``) reclaims it, which is what :func:`kv_memory` and :func:`capacity` count.

The entry point for reports is :func:`predict`; everything here is pure and torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from wmtp.analyze.analysis import cost_side_ratio

Arm = Literal["none", "mtp", "wmtp"]
StateWrites = Literal["per_token", "final"]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "nvfp4": 1,  # rounded up; a quantised checkpoint's bytes are ModelSpec.quantized_parts / quantized_bytes
}

#: NVFP4's bytes a weight: four bits, and one FP8 (E4M3) scale per 16 weights (the per-tensor FP32 scale is
#: negligible).
NVFP4_BYTES = 0.5 + 1 / 16
#: What ModelOpt's NVFP4 recipe quantises in these hybrids: the attention projections and the MoE's experts (routed
#: and shared; its routing, moe_routing_params, stays 16-bit); the recurrent layers, the embedding, the lm_head and
#: the MTP head stay 16-bit.
NVFP4_PARTS = ("attn", "moe")


def with_quantization(spec: ModelSpec, scheme: str | None) -> ModelSpec:
    """``spec`` with its target's weights quantised as ``scheme`` says (None: as it is; "nvfp4")."""
    if scheme is None:
        return spec
    if scheme != "nvfp4":
        raise ValueError(f"quantization {scheme!r}: the cost model knows nvfp4 only")
    return replace(spec, quantized_parts=NVFP4_PARTS, quantized_bytes=NVFP4_BYTES)


def hf_quantization(quant: Mapping[str, Any]) -> str | None:
    """The scheme of a checkpoint's ``quantization_config`` that the cost model counts: "nvfp4" for ModelOpt's
    NVFP4 (``quant_algo``) and compressed-tensors' (a ``nvfp4-pack-quantized`` format), None where there is none.
    Another scheme, or a quantised KV cache, is refused rather than counted as 16-bit. The checkpoint's own list of
    unquantised modules is not read: NVFP4 is counted as ModelOpt's recipe (NVFP4_PARTS)."""
    if not quant:
        return None
    kv = quant.get("kv_cache_quant_algo") or (quant.get("quantization") or {}).get("kv_cache_quant_algo")
    if kv or quant.get("kv_cache_scheme"):
        raise ValueError(f"quantization_config quantises the KV cache ({kv or quant.get('kv_cache_scheme')!r}): the "
                         "cost model counts a 16-bit KV cache only")  # fmt: skip
    method = quant.get("quant_method")
    algo = str(quant.get("quant_algo") or (quant.get("quantization") or {}).get("quant_algo") or "").upper()
    formats = {str(group.get("format", "")) for group in (quant.get("config_groups") or {}).values()}
    formats.add(str(quant.get("format", "")))
    if (method == "modelopt" and algo == "NVFP4") or (
        method == "compressed-tensors" and "nvfp4-pack-quantized" in formats
    ):
        return "nvfp4"
    raise ValueError(f"quantization_config {method!r} {algo or sorted(formats)!r}: the cost model knows NVFP4 only")


#: Copy bandwidth (read + write bytes per second) measured on an H200 (docs/design.md, "Measured facts").
H200_COPY_BANDWIDTH = 4.29e12

#: Read bandwidth measured on a GPU (bytes/s), by a word of its NVML name: the rate no decode step beats, so a
#: step's bytes at this rate are its floor (the H200's from measurements/h200/replica_bandwidth.csv).
MEASURED_READ_BANDWIDTH: dict[str, float] = {"H200": 4.33e12}
#: The datasheet's peak bandwidth (bytes/s): more bytes can never cost less than their count at this rate.
PEAK_BANDWIDTH: dict[str, float] = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "GB10": 2.73e11}


def device_bandwidth(gpu_name: str | None, table: Mapping[str, float] = MEASURED_READ_BANDWIDTH) -> float | None:
    """The bandwidth of the table's entry whose key is a word of ``gpu_name`` ("NVIDIA H200" → H200); None when
    the device is not in the table (a CPU, or a GPU never measured)."""
    words = set((gpu_name or "").upper().replace("-", " ").split())
    return next((rate for key, rate in table.items() if key in words), None)


COMPONENTS = ("attn", "gdn", "mamba2", "moe")


# --------------------------------------------------------------------------------------------
# The model file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionSpec:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool


@dataclass(frozen=True)
class GdnSpec:
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class Mamba2Spec:
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    activation: str  # "swiglu" (gate, up, down) or "relu2" (up, down)
    latent_size: int | None
    shared_experts: int
    shared_intermediate_size: int
    shared_expert_gate: bool

    @property
    def matrices_per_expert(self) -> int:
        return 3 if self.activation == "swiglu" else 2


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of one model, as read from ``config/models/<name>.json``."""

    name: str
    family: str
    hidden_size: int
    vocab_size: int
    layers: tuple[tuple[str, ...], ...]
    mtp_layers: tuple[tuple[str, ...], ...]
    attention: AttentionSpec
    gdn: GdnSpec | None
    mamba2: Mamba2Spec | None
    moe: MoESpec
    mtp_fusion_proj: bool
    mtp_blocks: int
    weight_bytes: int
    kv_bytes: int
    state_bytes: int
    conv_state_bytes: int
    # The target's parts whose weights are quantised, at ``quantized_bytes`` a parameter (scales included); every
    # other weight (the draft's, the embedding, the lm_head, the recurrent layers) at ``weight_bytes``.
    quantized_parts: tuple[str, ...] = ()
    quantized_bytes: float = 0.0

    def count(self, component: str, *, mtp: bool = False) -> int:
        layers = self.mtp_layers if mtp else self.layers
        return sum(component in layer for layer in layers)

    @property
    def n_attn(self) -> int:
        return self.count("attn")

    @property
    def n_draft_attn(self) -> int:
        return self.count("attn", mtp=True)


def _expand(pattern: str, legend: Mapping[str, list[str]], what: str) -> tuple[tuple[str, ...], ...]:
    out = []
    for i, ch in enumerate(pattern):
        if ch not in legend:
            raise ValueError(f"{what}[{i}] = {ch!r} is not in pattern_legend {sorted(legend)}")
        parts = tuple(legend[ch])
        unknown = [p for p in parts if p not in COMPONENTS]
        if unknown:
            raise ValueError(f"pattern_legend[{ch!r}] names unknown components {unknown}; known: {COMPONENTS}")
        out.append(parts)
    return tuple(out)


def model_from_dict(d: Mapping[str, Any]) -> ModelSpec:
    """Parse the JSON model file (already loaded) into a :class:`ModelSpec`."""
    legend = d["pattern_legend"]
    layers = _expand(d["layer_pattern"], legend, "layer_pattern")
    mtp = d["mtp"]
    mtp_layers = _expand(mtp["layer_pattern"], legend, "mtp.layer_pattern") * int(mtp["num_layers"])
    dtypes = d.get("dtypes", {})
    gdn = GdnSpec(**d["gdn"]) if d.get("gdn") else None
    mamba2 = Mamba2Spec(**d["mamba2"]) if d.get("mamba2") else None
    spec = ModelSpec(
        name=d["name"],
        family=d.get("family", ""),
        hidden_size=int(d["hidden_size"]),
        vocab_size=int(d["vocab_size"]),
        layers=layers,
        mtp_layers=mtp_layers,
        attention=AttentionSpec(**d["attention"]),
        gdn=gdn,
        mamba2=mamba2,
        moe=MoESpec(**d["moe"]),
        mtp_fusion_proj=bool(mtp.get("fusion_proj", True)),
        mtp_blocks=int(mtp["num_layers"]),
        weight_bytes=DTYPE_BYTES[dtypes.get("weights", "bfloat16")],
        kv_bytes=DTYPE_BYTES[dtypes.get("kv", "bfloat16")],
        state_bytes=DTYPE_BYTES[dtypes.get("recurrent_state", "float32")],
        conv_state_bytes=DTYPE_BYTES[dtypes.get("conv_state", "bfloat16")],
    )
    all_parts = {p for layer in layers + mtp_layers for p in layer}
    if "gdn" in all_parts and gdn is None:
        raise ValueError(f"model {spec.name}: layer_pattern has gdn layers but the file has no 'gdn' section")
    if "mamba2" in all_parts and mamba2 is None:
        raise ValueError(f"model {spec.name}: layer_pattern has mamba2 layers but no 'mamba2' section")
    return spec


def model_from_hf_config(checkpoint: Mapping[str, Any], name: str = "", *, weights: bool = True) -> ModelSpec:
    """A Qwen3-Next-shaped (``layer_types``, linear-attention and MoE keys) or Nemotron-H Hugging Face
    ``config.json`` (a multimodal one's ``text_config``) as a :class:`ModelSpec`, so checkpoints such as the
    embedded study's tiny model get the same predictions. With ``weights`` its ``quantization_config`` is read
    (:func:`hf_quantization`); without, for what needs the model's KV and state alone, it is not."""
    config = checkpoint.get("text_config", checkpoint)
    quant = checkpoint.get("quantization_config") or config.get("quantization_config") or {}
    scheme = hf_quantization(quant) if weights else None
    if config.get("model_type") == "nemotron_h":
        return with_quantization(_nemotron_from_hf_config(config, name), scheme)
    kinds = {"linear_attention": "L", "full_attention": "A"}
    pattern = "".join(kinds[t] for t in config["layer_types"])
    spec = model_from_dict(
        {
            "name": name or config.get("model_type", "model"),
            "family": "gdn_moe",
            "hidden_size": config["hidden_size"],
            "vocab_size": config["vocab_size"],
            "layer_pattern": pattern,
            "pattern_legend": {"L": ["gdn", "moe"], "A": ["attn", "moe"]},
            "attention": {
                "num_q_heads": config["num_attention_heads"],
                "num_kv_heads": config["num_key_value_heads"],
                "head_dim": config["head_dim"],
                "output_gate": True,
            },
            "gdn": {
                "num_k_heads": config["linear_num_key_heads"],
                "num_v_heads": config["linear_num_value_heads"],
                "k_head_dim": config["linear_key_head_dim"],
                "v_head_dim": config["linear_value_head_dim"],
                "conv_kernel": config["linear_conv_kernel_dim"],
            },
            "moe": {
                "num_experts": config["num_experts"],
                "top_k": config["num_experts_per_tok"],
                "expert_intermediate_size": config["moe_intermediate_size"],
                "activation": "swiglu",
                "latent_size": None,
                "shared_experts": 1 if config.get("shared_expert_intermediate_size") else 0,
                "shared_intermediate_size": config.get("shared_expert_intermediate_size") or 0,
                "shared_expert_gate": True,
            },
            "mtp": {"num_layers": config.get("num_nextn_predict_layers", 1), "layer_pattern": "A"},
            "dtypes": {"recurrent_state": config.get("mamba_ssm_dtype", "float32")},
        }
    )
    return with_quantization(spec, scheme)


def _nemotron_from_hf_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """A Nemotron-H ``config.json`` (``hybrid_override_pattern``: M Mamba-2, * attention, E MoE, - dense MLP is not
    modelled) as a :class:`ModelSpec`."""
    hidden = config["hidden_size"]
    return model_from_dict(
        {
            "name": name or "nemotron_h",
            "family": "mamba2_moe",
            "hidden_size": hidden,
            "vocab_size": config["vocab_size"],
            "layer_pattern": config["hybrid_override_pattern"],
            "pattern_legend": {"M": ["mamba2"], "E": ["moe"], "*": ["attn"]},
            "attention": {
                "num_q_heads": config["num_attention_heads"],
                "num_kv_heads": config["num_key_value_heads"],
                "head_dim": config["head_dim"],
                "output_gate": False,
            },
            "gdn": None,
            "mamba2": {
                "num_heads": config["mamba_num_heads"],
                "head_dim": config["mamba_head_dim"],
                "n_groups": config["mamba_n_groups"],
                "state_size": config["ssm_state_size"],
                "conv_kernel": config["mamba_d_conv"],
            },
            "moe": {
                "num_experts": config["n_routed_experts"],
                "top_k": config["num_experts_per_tok"],
                "expert_intermediate_size": config["moe_intermediate_size"],
                "activation": config.get("mlp_hidden_act", "relu2"),
                "latent_size": config.get("moe_latent_size"),
                "shared_experts": config.get("n_shared_experts", 1),
                "shared_intermediate_size": config["moe_shared_expert_intermediate_size"],
                "shared_expert_gate": False,
            },
            "mtp": {
                "num_layers": config.get("num_nextn_predict_layers", 1),
                "layer_pattern": config.get("mtp_hybrid_override_pattern", "*E"),
            },
        }
    )


def load_model(path: str | Path) -> ModelSpec:
    """Read ``config/models/<name>.json``."""
    with open(path) as f:
        return model_from_dict(json.load(f))


def _as_spec(model: ModelSpec | Mapping[str, Any] | str | Path) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Mapping):
        return model_from_dict(model)
    return load_model(model)


# --------------------------------------------------------------------------------------------
# Parameter counts (elements) of each component
# --------------------------------------------------------------------------------------------


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that ``tokens`` tokens touch under uniform routing."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def attn_params(spec: ModelSpec) -> int:
    a, h = spec.attention, spec.hidden_size
    q_out = a.num_q_heads * a.head_dim * (2 if a.output_gate else 1)
    kv_out = 2 * a.num_kv_heads * a.head_dim
    return h * q_out + h * kv_out + a.num_q_heads * a.head_dim * h


def gdn_params(spec: ModelSpec) -> int:
    g, h = spec.gdn, spec.hidden_size
    assert g is not None
    qkvz = 2 * g.num_k_heads * g.k_head_dim + 2 * g.num_v_heads * g.v_head_dim
    ba = 2 * g.num_v_heads
    return h * qkvz + h * ba + g.conv_dim * g.conv_kernel + g.num_v_heads * g.v_head_dim * h


def mamba2_params(spec: ModelSpec) -> int:
    m, h = spec.mamba2, spec.hidden_size
    assert m is not None
    in_proj = 2 * m.d_inner + 2 * m.n_groups * m.state_size + m.num_heads
    return h * in_proj + m.conv_dim * m.conv_kernel + m.d_inner * h


def expert_params(spec: ModelSpec) -> int:
    m = spec.moe
    width = m.latent_size or spec.hidden_size
    return m.matrices_per_expert * width * m.expert_intermediate_size


def moe_routing_params(spec: ModelSpec) -> int:
    """The parts of a MoE layer that route rather than compute: the router, the latent projections around the
    routed experts and the shared expert's gate (a quantised checkpoint keeps them 16-bit)."""
    m, h = spec.moe, spec.hidden_size
    n = h * m.num_experts  # router
    if m.latent_size:
        n += 2 * h * m.latent_size
    if m.shared_expert_gate:
        n += h
    return n


def moe_dense_params(spec: ModelSpec) -> int:
    """The parts of a MoE layer every token touches: router, latent projections, shared experts."""
    m, h = spec.moe, spec.hidden_size
    return moe_routing_params(spec) + m.shared_experts * m.matrices_per_expert * h * m.shared_intermediate_size


def moe_params_touched(spec: ModelSpec, tokens: int) -> float:
    m = spec.moe
    return moe_dense_params(spec) + expected_distinct_experts(m.num_experts, m.top_k, tokens) * expert_params(spec)


def layer_params_touched(spec: ModelSpec, parts: tuple[str, ...], tokens: int) -> float:
    n = 0.0
    for p in parts:
        if p == "attn":
            n += attn_params(spec)
        elif p == "gdn":
            n += gdn_params(spec)
        elif p == "mamba2":
            n += mamba2_params(spec)
        elif p == "moe":
            n += moe_params_touched(spec, tokens)
    return n


def layer_weight_bytes(spec: ModelSpec, parts: tuple[str, ...], tokens: int, *, draft: bool = False) -> float:
    """The bytes of the weights ``tokens`` tokens touch in one layer of ``parts``: each part at its own bytes a
    weight (a quantised part of the target at ``quantized_bytes``; the draft's at ``weight_bytes``)."""
    total = 0.0
    for part in parts:
        params = layer_params_touched(spec, (part,), tokens)
        if part in spec.quantized_parts and not draft:
            kept = moe_routing_params(spec) if part == "moe" else 0
            total += (params - kept) * spec.quantized_bytes + kept * spec.weight_bytes
        else:
            total += params * spec.weight_bytes
    return total


def total_params(spec: ModelSpec, *, include_mtp: bool = True) -> int:
    """All weights (embedding and lm_head included), for cross-checks against published totals."""
    m = spec.moe
    per_layer = {
        "attn": attn_params(spec),
        "gdn": gdn_params(spec) if spec.gdn else 0,
        "mamba2": mamba2_params(spec) if spec.mamba2 else 0,
        "moe": moe_dense_params(spec) + m.num_experts * expert_params(spec),
    }
    layers = spec.layers + (spec.mtp_layers if include_mtp else ())
    n = sum(per_layer[p] for layer in layers for p in layer)
    n += 2 * spec.vocab_size * spec.hidden_size
    if include_mtp and spec.mtp_fusion_proj:
        n += spec.mtp_blocks * 2 * spec.hidden_size * spec.hidden_size
    return n


# --------------------------------------------------------------------------------------------
# Bytes per forward
# --------------------------------------------------------------------------------------------


def kv_bytes_per_token_layer(spec: ModelSpec) -> int:
    """K and V of one token in one full-attention layer."""
    a = spec.attention
    return 2 * a.num_kv_heads * a.head_dim * spec.kv_bytes


def recurrent_state_bytes(spec: ModelSpec, component: str) -> tuple[int, int]:
    """(SSM state, conv state) bytes of one request in one layer of ``component``."""
    if component == "gdn" and spec.gdn:
        g = spec.gdn
        ssm = g.num_v_heads * g.k_head_dim * g.v_head_dim * spec.state_bytes
        conv = g.conv_dim * (g.conv_kernel - 1) * spec.conv_state_bytes
        return ssm, conv
    if component == "mamba2" and spec.mamba2:
        m = spec.mamba2
        ssm = m.num_heads * m.head_dim * m.state_size * spec.state_bytes
        conv = m.conv_dim * (m.conv_kernel - 1) * spec.conv_state_bytes
        return ssm, conv
    return 0, 0


@dataclass(frozen=True)
class ForwardBytes:
    """Bytes one forward moves, by kind."""

    weights: float
    kv: float
    state: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.state + self.lm_head

    def __add__(self, other: ForwardBytes) -> ForwardBytes:
        return ForwardBytes(
            self.weights + other.weights,
            self.kv + other.kv,
            self.state + other.state,
            self.lm_head + other.lm_head,
        )

    def scaled(self, f: float) -> ForwardBytes:
        return ForwardBytes(self.weights * f, self.kv * f, self.state * f, self.lm_head * f)


def lm_head_bytes(spec: ModelSpec) -> int:
    return spec.vocab_size * spec.hidden_size * spec.weight_bytes


def verify_bytes(
    spec: ModelSpec, context: int, query_tokens: int, *, batch: int = 1, state_writes: StateWrites = "per_token"
) -> ForwardBytes:
    """The target forward over ``query_tokens`` new tokens after ``context`` cached tokens, for each of ``batch``
    requests at that context: the weights its ``batch × query_tokens`` tokens touch, read once; each request's own
    KV and recurrent state."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1 (got {batch})")
    t = query_tokens
    tokens = batch * t
    weights = sum(layer_weight_bytes(spec, parts, tokens) for parts in spec.layers)
    weights += tokens * spec.hidden_size * spec.weight_bytes  # embedding rows
    kv_tok = kv_bytes_per_token_layer(spec)
    kv = batch * (spec.n_attn * (context + t) * kv_tok + spec.n_attn * t * kv_tok)  # read all visible, write new
    writes = t if state_writes == "per_token" else 1
    state = 0.0
    for comp in ("gdn", "mamba2"):
        ssm, conv = recurrent_state_bytes(spec, comp)
        n = spec.count(comp)
        state += n * (ssm * (1 + writes) + 2 * conv)
    return ForwardBytes(weights=weights, kv=kv, state=batch * state, lm_head=lm_head_bytes(spec))


def draft_kv_tokens(context: int, arm: Arm, sink: int, window: int) -> int:
    """Tokens the draft's attention reads (its own new token included)."""
    visible = context + 1
    if arm == "wmtp":
        return min(visible, sink + window)
    return visible


def draft_bytes(
    spec: ModelSpec, context: int, arm: Arm, sink: int = 0, window: int = 0, *, batch: int = 1
) -> ForwardBytes:
    """One draft forward of the MTP head (one query token for each of ``batch`` requests at ``context``)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1 (got {batch})")
    weights = sum(layer_weight_bytes(spec, parts, batch, draft=True) for parts in spec.mtp_layers)
    if spec.mtp_fusion_proj:
        weights += spec.mtp_blocks * 2 * spec.hidden_size * spec.hidden_size * spec.weight_bytes
    weights += batch * spec.hidden_size * spec.weight_bytes  # embedding rows
    kv_tok = kv_bytes_per_token_layer(spec)
    kv = batch * spec.n_draft_attn * (draft_kv_tokens(context, arm, sink, window) + 1) * kv_tok
    return ForwardBytes(weights=weights, kv=kv, state=0.0, lm_head=lm_head_bytes(spec))


@dataclass(frozen=True)
class StepCost:
    """One decode step of one arm: a verify forward plus ``k`` draft forwards."""

    arm: str
    context: int
    k: int
    verify: ForwardBytes
    draft: ForwardBytes  # one draft forward
    bandwidth: float
    overhead_per_forward_s: float

    @property
    def n_forwards(self) -> int:
        return 1 + (self.k if self.arm != "none" else 0)

    @property
    def bytes(self) -> ForwardBytes:
        return self.verify + self.draft.scaled(self.k if self.arm != "none" else 0)

    @property
    def verify_s(self) -> float:
        return self.verify.total / self.bandwidth + self.overhead_per_forward_s

    @property
    def draft_s(self) -> float:
        """One draft forward."""
        return self.draft.total / self.bandwidth + self.overhead_per_forward_s

    @property
    def time_s(self) -> float:
        return self.bytes.total / self.bandwidth + self.n_forwards * self.overhead_per_forward_s


def step_cost(
    model: ModelSpec | Mapping[str, Any] | str | Path,
    context: int,
    k: int,
    arm: Arm,
    *,
    sink: int = 0,
    window: int = 0,
    bandwidth: float = H200_COPY_BANDWIDTH,
    overhead_per_forward_s: float = 0.0,
    state_writes: StateWrites = "per_token",
) -> StepCost:
    if arm not in ("none", "mtp", "wmtp"):
        raise ValueError(f"arm must be one of none, mtp, wmtp (got {arm!r})")
    if arm != "none" and k < 1:
        raise ValueError(f"k must be >= 1 for arm {arm!r} (got {k})")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s (got {bandwidth})")
    spec = _as_spec(model)
    q = 1 if arm == "none" else k + 1
    kk = 0 if arm == "none" else k
    return StepCost(
        arm=arm,
        context=context,
        k=kk,
        verify=verify_bytes(spec, context, q, state_writes=state_writes),
        draft=draft_bytes(spec, context, "mtp" if arm == "none" else arm, sink, window),
        bandwidth=bandwidth,
        overhead_per_forward_s=overhead_per_forward_s,
    )


# --------------------------------------------------------------------------------------------
# Memory: the draft's share of the KV pool and what a ring buffer reclaims
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVMemory:
    """KV (and recurrent state) of one request at ``context`` tokens."""

    target_kv: int
    draft_kv: int  # the draft's pool as allocated: full context, or S + W slots with a ring
    state: int
    ring: bool

    @property
    def total(self) -> int:
        return self.target_kv + self.draft_kv + self.state

    @property
    def draft_share(self) -> float:
        """The draft's share of the KV (state excluded)."""
        kv = self.target_kv + self.draft_kv
        return self.draft_kv / kv if kv else 0.0


def kv_memory(
    model: ModelSpec | Mapping[str, Any] | str | Path,
    context: int,
    *,
    sink: int = 0,
    window: int = 0,
    ring: bool = False,
) -> KVMemory:
    spec = _as_spec(model)
    kv_tok = kv_bytes_per_token_layer(spec)
    draft_tokens = min(context, sink + window) if ring else context
    state = 0
    for comp in ("gdn", "mamba2"):
        ssm, conv = recurrent_state_bytes(spec, comp)
        state += spec.count(comp) * (ssm + conv)
    return KVMemory(
        target_kv=spec.n_attn * context * kv_tok,
        draft_kv=spec.n_draft_attn * draft_tokens * kv_tok,
        state=state,
        ring=ring,
    )


@dataclass(frozen=True)
class Capacity:
    """Concurrent ``context``-token requests that fit in a memory budget."""

    context: int
    budget_bytes: int
    per_request_bytes: int
    per_request_bytes_ring: int
    requests: int
    requests_ring: int

    @property
    def reclaimed_fraction(self) -> float:
        """Share of a request's KV + state that the ring returns."""
        return 1.0 - self.per_request_bytes_ring / self.per_request_bytes


def capacity(
    model: ModelSpec | Mapping[str, Any] | str | Path,
    context: int,
    budget_bytes: int,
    *,
    sink: int,
    window: int,
) -> Capacity:
    """How many requests of ``context`` tokens fit in ``budget_bytes`` of KV pool."""
    spec = _as_spec(model)
    full = kv_memory(spec, context, sink=sink, window=window, ring=False).total
    ring = kv_memory(spec, context, sink=sink, window=window, ring=True).total
    return Capacity(
        context=context,
        budget_bytes=budget_bytes,
        per_request_bytes=full,
        per_request_bytes_ring=ring,
        requests=budget_bytes // full,
        requests_ring=budget_bytes // ring,
    )


# --------------------------------------------------------------------------------------------
# The entry point for reports
# --------------------------------------------------------------------------------------------


def limit_ratio(model: ModelSpec | Mapping[str, Any] | str | Path, k: int) -> float:
    """The ratio's long-context limit when weights are negligible: 1 + k * draft KV / target KV."""
    spec = _as_spec(model)
    return 1.0 + k * spec.n_draft_attn / spec.n_attn


@dataclass(frozen=True)
class Prediction:
    """Cost-side, acceptance-free prediction at one (model, context, k, S, W, bandwidth)."""

    model: str
    context: int
    k: int
    sink: int
    window: int
    bandwidth: float
    none: StepCost
    native: StepCost
    windowed: StepCost
    kv: KVMemory
    kv_ring: KVMemory

    @property
    def ratio(self) -> float:
        """step_nat / step_win (the paper's cost-side speedup)."""
        return cost_side_ratio(self.native.time_s, self.windowed.time_s)

    @property
    def draft_kv_share(self) -> float:
        return self.kv.draft_share

    @property
    def ring_reclaimed_fraction(self) -> float:
        return 1.0 - self.kv_ring.total / self.kv.total

    def row(self) -> dict[str, Any]:
        """A flat record (for a tidy table)."""
        nat, win = self.native, self.windowed
        return {
            "model": self.model,
            "context": self.context,
            "k": self.k,
            "sink": self.sink,
            "window": self.window,
            "bandwidth": self.bandwidth,
            "step_none_s": self.none.time_s,
            "step_nat_s": nat.time_s,
            "step_win_s": win.time_s,
            "ratio": self.ratio,
            "verify_s": nat.verify_s,
            "draft_nat_s": nat.draft_s,
            "draft_win_s": win.draft_s,
            "verify_weight_bytes": nat.verify.weights,
            "verify_kv_bytes": nat.verify.kv,
            "verify_state_bytes": nat.verify.state,
            "lm_head_bytes": nat.verify.lm_head,
            "draft_weight_bytes": nat.draft.weights,
            "draft_kv_bytes_nat": nat.draft.kv,
            "draft_kv_bytes_win": win.draft.kv,
            "draft_kv_share": self.draft_kv_share,
            "ring_reclaimed_fraction": self.ring_reclaimed_fraction,
            "limit_ratio": 1.0 + self.k * (self.kv.draft_kv / self.kv.target_kv if self.kv.target_kv else 0.0),
        }


def predict(
    model: ModelSpec | Mapping[str, Any] | str | Path,
    context: int,
    k: int,
    sink: int,
    window: int,
    bandwidth: float = H200_COPY_BANDWIDTH,
    *,
    overhead_per_forward_s: float = 0.0,
    state_writes: StateWrites = "per_token",
) -> Prediction:
    """Predict native vs windowed MTP step cost at ``context`` tokens and draft depth ``k``.

    ``model`` is a path to ``config/models/<name>.json``, its parsed dict, or a ModelSpec;
    ``bandwidth`` in bytes/s (the copy bandwidth measured on the GPU is the right roofline).
    """
    spec = _as_spec(model)
    kw = {
        "bandwidth": bandwidth,
        "overhead_per_forward_s": overhead_per_forward_s,
        "state_writes": state_writes,
    }
    return Prediction(
        model=spec.name,
        context=context,
        k=k,
        sink=sink,
        window=window,
        bandwidth=bandwidth,
        none=step_cost(spec, context, 1, "none", **kw),
        native=step_cost(spec, context, k, "mtp", sink=sink, window=window, **kw),
        windowed=step_cost(spec, context, k, "wmtp", sink=sink, window=window, **kw),
        kv=kv_memory(spec, context, sink=sink, window=window, ring=False),
        kv_ring=kv_memory(spec, context, sink=sink, window=window, ring=True),
    )


def as_dict(obj: Any) -> dict[str, Any]:
    """Dataclass to plain dict (for JSON)."""
    return asdict(obj)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def describe(p: Prediction) -> str:
    """A few human-readable lines."""
    lines = [
        f"{p.model} N={p.context} k={p.k} S={p.sink} W={p.window} @ {p.bandwidth / 1e12:.2f} TB/s",
        f"  step none {p.none.time_s * 1e3:.3f} ms  nat {p.native.time_s * 1e3:.3f} ms  "
        f"win {p.windowed.time_s * 1e3:.3f} ms  ratio {p.ratio:.3f}",
        f"  verify {_fmt_bytes(p.native.verify.total)}  draft nat {_fmt_bytes(p.native.draft.total)}  "
        f"draft win {_fmt_bytes(p.windowed.draft.total)}",
        f"  draft KV share {p.draft_kv_share:.1%}  ring reclaims {p.ring_reclaimed_fraction:.1%} of KV+state",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a quick look from the shell
    import sys

    for path in sys.argv[1:] or sorted(Path("config/models").glob("*.json")):
        for n in (2048, 131072, 1048576):
            print(describe(predict(path, n, 3, 4, 2048)))
        print(f"  (limit ratio {limit_ratio(path, 3):.3f}, params {total_params(load_model(path)) / 1e9:.2f}e9)")
