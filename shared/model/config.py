"""The model's shape, read once from an HF `config.json` (or GGUF metadata) into one typed object.

Every other part of the worker (layers, loaders, KV cache sizing, the runner) reads only
`ModelConfig`, never a raw HF dict, so a new checkpoint format only needs a new constructor here.
transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are both
accepted and normalised into `RopeScaling`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.kv.groups import STATE, KVGroupSpec, LayerCache, kv_groups_for

RopeType = Literal["default", "linear", "dynamic", "llama3", "yarn"]
#: "mamba": a Mamba2 state-space mixer in place of attention (hybrid families); its cache is a
#: recurrent state (shared/kv/groups.py's state group), not per-token K/V.
LayerType = Literal["full_attention", "sliding_attention", "mamba"]
#: activations of the gated MLP (gate and up projections), by their HF names
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "BambaForCausalLM",
        "GraniteMoeHybridForCausalLM",
    }
)
"""The HF architectures whose config this module normalises. The worker's model registry
(services/worker/models/registry.py) maps each to the class that runs it; a unit test keeps
the two sets equal."""


class UnsupportedModelError(ValueError):
    """The checkpoint names an architecture or feature this worker cannot run."""


class RopeScaling(BaseModel):
    """RoPE frequencies: the base `theta` and an optional context-extension variant.

    Field names follow transformers' `rope_parameters`; a field a variant does not use is ignored.
    `original_max_position_embeddings` of 0 means "the model's max_position_embeddings".
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: RopeType = "default"
    theta: float = 10000.0
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


class MambaConfig(BaseModel):
    """The Mamba2 mixer of a hybrid family's mamba layers (HF `mamba_*` keys).

    in_proj rows are [gate z: intermediate; x: intermediate; B: groups * d_state; C: groups *
    d_state; dt: n_heads]; the causal depthwise conv runs over [x; B; C] (`conv_dim` channels)
    and keeps its last `d_conv - 1` inputs as state; the SSM state is [n_heads, head_dim,
    d_state] per request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    d_state: int = Field(ge=1)
    n_groups: int = Field(1, ge=1)
    d_conv: int = Field(4, ge=2)
    intermediate_size: int = Field(ge=1)  # mamba_expand * hidden_size = n_heads * head_dim
    chunk_size: int = Field(256, ge=1)
    conv_bias: bool = True
    proj_bias: bool = False

    @model_validator(mode="after")
    def _check_shapes(self) -> MambaConfig:
        if self.n_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"mamba n_heads={self.n_heads} x head_dim={self.head_dim} != "
                f"intermediate_size={self.intermediate_size}"
            )
        if self.n_heads % self.n_groups:
            raise ValueError(f"mamba n_heads={self.n_heads} not a multiple of n_groups")
        return self

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state


class ModelConfig(BaseModel):
    """The architecture-independent description of a decoder-only transformer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    architecture: str
    model_type: str = "llama"
    hidden_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    rms_norm_eps: float = 1e-6
    rope: RopeScaling = Field(default_factory=RopeScaling)
    max_position_embeddings: int = Field(2048, ge=1)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = Field(default_factory=list)
    torch_dtype: str = "float32"
    # Attention variants. `attention_bias` biases q/k/v and o (Llama); `qkv_bias` only q/k/v
    # (Qwen2). `qk_norm`: per-head RMSNorm of q and k before RoPE (Qwen3, Gemma3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # Sliding windows: `layer_types[i]` says whether layer i attends to the last
    # `sliding_window` positions only (see shared/kv/groups.py); empty = every layer full.
    sliding_window: int | None = Field(None, ge=1)
    layer_types: list[LayerType] = Field(default_factory=list)
    # Gemma-style: attention scale query_pre_attn_scalar**-0.5 instead of head_dim**-0.5, and a
    # separate RoPE for sliding layers.
    query_pre_attn_scalar: float | None = None
    rope_local: RopeScaling | None = None
    # Sparse MoE (0 experts = dense). Layer i is sparse iff i not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0 (Qwen-MoE's rule; Mixtral: every layer).
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int = Field(0, ge=0)  # Qwen2-MoE's sigmoid-gated expert
    decoder_sparse_step: int = Field(1, ge=1)
    mlp_only_layers: list[int] = Field(default_factory=list)
    # Multi-token-prediction modules the checkpoint ships after its decoder layers
    # (`num_nextn_predict_layers`, DeepSeek-V3 style): a speculative drafter's, not the model's.
    num_mtp_layers: int = Field(0, ge=0)
    # Hybrid attention + Mamba2 families (Bamba, GraniteMoeHybrid): `layer_types` marks the
    # mamba layers, `mamba` describes their mixer. GraniteMoeHybrid's muP-style multipliers
    # (1.0 = none): embeddings x embedding_multiplier, attention scale = attention_multiplier
    # (instead of head_dim**-0.5), sub-layer outputs x residual_multiplier before the residual
    # add, logits / logits_scaling; `use_rope` False = no positional embedding ("nope").
    mamba: MambaConfig | None = None
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_rope: bool = True
    shared_mlp_intermediate_size: int = Field(0, ge=0)  # GraniteMoeHybrid's dense shared MLP

    @model_validator(mode="after")
    def _check_supported(self) -> ModelConfig:
        # Raised inside pydantic this surfaces as a ValidationError (also a ValueError);
        # from_hf_dict checks the same first so that checkpoints get UnsupportedModelError.
        problem = _unsupported(self.num_attention_heads, self.num_key_value_heads, self.hidden_act)
        if problem:
            raise ValueError(problem)
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers"
            )
        if ("mamba" in self.layer_types) != (self.mamba is not None):
            raise ValueError("mamba layers need a mamba config, and a mamba config mamba layers")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        return self

    @property
    def layer_windows(self) -> list[LayerCache]:
        """Per layer: its sliding window, None for full attention, STATE for a mamba layer
        (kv_groups_for's input)."""
        if not self.layer_types:
            return [None] * self.num_hidden_layers
        return [
            STATE if t == "mamba" else self.sliding_window if t == "sliding_attention" else None
            for t in self.layer_types
        ]

    @property
    def mamba_layers(self) -> list[int]:
        """Indices of the mamba (state) layers, ascending."""
        return [i for i, t in enumerate(self.layer_types) if t == "mamba"]

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers with a per-token K/V cache, ascending."""
        return [
            i
            for i, t in enumerate(self.layer_types or ["full_attention"] * self.num_hidden_layers)
            if t != "mamba"
        ]

    @property
    def kv_groups(self) -> list[KVGroupSpec]:
        return kv_groups_for(self.layer_windows)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers whose MLP is a sparse MoE block, ascending."""
        if not self.num_experts:
            return []
        return [
            i
            for i in range(self.num_hidden_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        ]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` for extra eos ids) from an HF dir."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{path} has no config.json")
        hf = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
        return cls.from_hf_dict(hf, generation)

    @classmethod
    def from_hf_dict(
        cls, hf: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Normalise an HF config dict. Raises UnsupportedModelError for unknown architectures."""
        archs = hf.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        hidden_act = str(hf.get("hidden_act") or hf.get("hidden_activation") or "silu")
        problem = _unsupported(heads, kv_heads, hidden_act)
        if problem:
            raise UnsupportedModelError(problem)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                raise UnsupportedModelError(f"{key}={hf[key]}: logit soft-capping is not supported")
        num_layers = int(hf["num_hidden_layers"])
        hybrid = _hybrid_fields(known[0], hf, num_layers)
        window, layer_types = (None, []) if hybrid else _sliding_layers(hf, num_layers)
        rope, rope_local = parse_layer_ropes(hf)
        if known[0] == "BambaForCausalLM" and not _states_partial_rotary(hf):
            # BambaConfig's default is 0.5 ("hardcode for BC"), and config.json files saved by
            # transformers 4.x omit it: without the key, half of each head rotates
            rope = rope.model_copy(update={"partial_rotary_factor": 0.5})
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        eos = _merge_ids(hf.get("eos_token_id"), (generation or {}).get("eos_token_id"))
        fields: dict[str, Any] = dict(
            architecture=known[0],
            model_type=str(hf.get("model_type", "llama")),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hidden_act,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
            qkv_bias=bool(hf.get("qkv_bias", hf.get("model_type") in _QKV_BIAS_TYPES)),
            qk_norm=hf.get("model_type") in _QK_NORM_TYPES,
            sliding_window=window,
            layer_types=layer_types,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            rope_local=rope_local,
            num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(
                hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0
            )
            if num_experts
            else 0,
            # Mixtral always renormalises; Qwen-MoE says so in the config.
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=[int(i) for i in hf.get("mlp_only_layers") or []],
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
        )
        return cls(**{**fields, **hybrid})


_HYBRID_ARCHITECTURES = ("BambaForCausalLM", "GraniteMoeHybridForCausalLM")
#: HF spellings of a hybrid layer's kind (Bamba's layers_block_type, GraniteMoeHybrid's
#: layer_types; transformers 5 writes linear_attention/full_attention, IBM's checkpoints
#: mamba/attention)
_HYBRID_LAYER_KINDS: dict[str, LayerType] = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "full_attention",
    "full_attention": "full_attention",
}


def _hybrid_fields(arch: str, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields a hybrid attention + Mamba2 family sets ({} for other families);
    UnsupportedModelError for what the worker does not implement."""
    if arch not in _HYBRID_ARCHITECTURES:
        return {}
    if arch == "BambaForCausalLM":
        attn = {int(i) for i in hf.get("attn_layer_indices") or []}
        if any(not 0 <= i < num_layers for i in attn):
            raise UnsupportedModelError(f"attn_layer_indices {sorted(attn)} outside the layers")
        kinds = ["attention" if i in attn else "mamba" for i in range(num_layers)]
    else:
        kinds = list(hf.get("layer_types") or hf.get("layers_block_type") or [])
        if not kinds:
            kinds = ["mamba"] * num_layers
    unknown = sorted(set(kinds) - set(_HYBRID_LAYER_KINDS))
    if unknown:
        raise UnsupportedModelError(f"hybrid layer types {unknown} are not supported")
    if len(kinds) != num_layers:
        raise UnsupportedModelError(f"{len(kinds)} layer types for {num_layers} layers")
    limit = hf.get("time_step_limit")
    if limit is not None:
        low, high = (_json_float(v) for v in limit)
        if low > 0.0 or high != float("inf"):
            raise UnsupportedModelError(
                f"time_step_limit={list(limit)}: only the unclamped (0, inf) is supported"
            )
    hidden = int(hf["hidden_size"])
    n_heads = int(hf.get("mamba_n_heads") or 128)
    intermediate = int(hf.get("mamba_expand") or 2) * hidden
    head_dim = hf.get("mamba_d_head")
    head_dim = intermediate // n_heads if head_dim in (None, "auto") else int(head_dim)
    mamba = MambaConfig(
        n_heads=n_heads,
        head_dim=head_dim,
        d_state=int(hf.get("mamba_d_state") or 256),
        n_groups=int(hf.get("mamba_n_groups") or 1),
        d_conv=int(hf.get("mamba_d_conv") or 4),
        intermediate_size=intermediate,
        chunk_size=int(hf.get("mamba_chunk_size") or 256),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
    )
    fields: dict[str, Any] = {
        "layer_types": [_HYBRID_LAYER_KINDS[k] for k in kinds],
        "mamba": mamba,
        "num_experts": 0,
    }
    if arch == "GraniteMoeHybridForCausalLM":
        position = hf.get("position_embedding_type")
        if position not in (None, "rope", "nope"):
            raise UnsupportedModelError(f"position_embedding_type={position!r} is not supported")
        experts = int(hf.get("num_local_experts") or 0)
        fields.update(
            embedding_multiplier=float(hf.get("embedding_multiplier") or 1.0),
            attention_multiplier=float(hf.get("attention_multiplier") or 1.0),
            residual_multiplier=float(hf.get("residual_multiplier") or 1.0),
            logits_scaling=float(hf.get("logits_scaling") or 1.0),
            use_rope=position == "rope",
            shared_mlp_intermediate_size=int(hf.get("shared_intermediate_size") or 0),
            num_experts=experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if experts else 0,
            moe_intermediate_size=int(hf["intermediate_size"]) if experts else 0,
            norm_topk_prob=True,  # softmax over the top-k logits = renormalised top-k
        )
        if fields["shared_mlp_intermediate_size"] < 1:
            raise UnsupportedModelError("GraniteMoeHybrid without a shared MLP is not supported")
    return fields


def _json_float(value: Any) -> float:
    """A float from config.json, where transformers writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


#: model types whose q/k/v projections carry biases while o_proj does not (no config key)
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
#: model types with per-head q/k RMSNorm
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")


def _sliding_layers(hf: dict[str, Any], num_layers: int) -> tuple[int | None, list[LayerType]]:
    """(window, per-layer types) with transformers' rules: `layer_types` when given; else
    Qwen2-style `max_window_layers` (layers at or past it slide) when `use_sliding_window`;
    else every layer slides when a window is set (Mistral, Mixtral)."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return None, []
    window = int(window)
    types = hf.get("layer_types")
    if types:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer types {unknown} are not supported")
        if len(types) != num_layers:
            raise UnsupportedModelError(f"{len(types)} layer_types for {num_layers} layers")
        return window, list(types)
    if "max_window_layers" in hf:
        slides = [i >= int(hf["max_window_layers"]) for i in range(num_layers)]
    elif hf.get("sliding_window_pattern"):  # transformers 4.x Gemma3: every n-th layer is full
        slides = [(i + 1) % int(hf["sliding_window_pattern"]) != 0 for i in range(num_layers)]
    else:
        slides = [True] * num_layers
    return window, ["sliding_attention" if s else "full_attention" for s in slides]


def _states_partial_rotary(hf: dict[str, Any]) -> bool:
    return "partial_rotary_factor" in hf or "partial_rotary_factor" in (
        hf.get("rope_parameters") or {}
    )


def parse_layer_ropes(hf: dict[str, Any]) -> tuple[RopeScaling, RopeScaling | None]:
    """(RoPE of full layers, RoPE of sliding layers or None when the same). transformers 5 keys
    `rope_parameters` by layer type where they differ (Gemma3)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = parse_rope({**hf, "rope_parameters": params.get("full_attention") or {}})
        local = params.get("sliding_attention")
        return full, parse_rope({**hf, "rope_parameters": local}) if local else None
    rope = parse_rope(hf)
    local_theta = hf.get("rope_local_base_freq")  # transformers 4.x Gemma3
    if local_theta is not None:
        return rope, RopeScaling(theta=float(local_theta))
    return rope, None


def parse_rope(hf: dict[str, Any]) -> RopeScaling:
    """Both spellings: 5.x `rope_parameters` (theta inside) and 4.x `rope_theta`+`rope_scaling`."""
    params: dict[str, Any] = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    if "rope_theta" in params:
        params["theta"] = params.pop("rope_theta")
    elif "rope_theta" in hf:
        params["theta"] = hf["rope_theta"]
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported")
    if "partial_rotary_factor" not in params and "partial_rotary_factor" in hf:
        params["partial_rotary_factor"] = hf["partial_rotary_factor"]
    if params.get("factor") is None:
        params.pop("factor", None)
    return RopeScaling(rope_type=rope_type, **params)


def _unsupported(heads: int, kv_heads: int, hidden_act: str) -> str:
    if heads % kv_heads:
        return f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        return f"hidden_act={hidden_act!r}: supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
    return ""


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    out: list[int] = []
    for value in values:
        items = value if isinstance(value, list) else [value] if value is not None else []
        for item in items:
            if int(item) not in out:
                out.append(int(item))
    return out
