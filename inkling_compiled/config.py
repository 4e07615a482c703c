"""The Inkling text config: read from config.json, derived fields resolved, checked once.

Field names follow transformers' `InklingTextConfig`; the derivations (layer types, MLP types, the
dense/MoE width rename) follow its `__post_init__` exactly, so a config.json written by either side
means the same model here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .checks import is_finite, is_int
from .errors import ConfigError

SLIDING = "hybrid_sliding"
GLOBAL = "hybrid"
DENSE = "dense"
SPARSE = "sparse"

TEXT_MODEL_TYPE = "inkling_text"
MULTIMODAL_MODEL_TYPE = "inkling_mm_model"

_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "sliding_window_size", "d_rel",
    "rel_extent", "conv_kernel_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "max_position_embeddings",
)


# Older or original names for the same fields (transformers' attribute_map).
_ALIASES = {
    "embedding_multiplier": "logits_mup_width_multiplier",
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
}


def _mtp_fields(block, raw: dict) -> dict[str, Any]:
    """The MTP fields an original checkpoint keeps in its `mtp_config` block, in transformers' names
    (fields the text config sets itself win). The head's sliding depths use the trunk's window."""
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise ConfigError(f"invalid Inkling config: mtp_config must be an object, got {block!r}")
    extent = block.get("local_extent")
    if extent is not None and extent != raw.get("sliding_window_size", InklingConfig.sliding_window_size):
        raise ConfigError(f"mtp_config.local_extent={extent!r} differs from the trunk's sliding window; "
                          "only the trunk's window is supported for the MTP head")
    names = {"num_nextn_predict_layers": "num_mtp_layers", "chain_hidden_post_norm": "chain_hidden_post_norm",
             "local_layer_ids": "mtp_local_layer_ids"}
    return {ours: block[theirs] for theirs, ours in names.items() if theirs in block}


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """Attention shape of one layer; sliding and global layers differ."""

    sliding: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rel_extent: int  # band of the relative bias; the window W on sliding layers
    window: int | None  # keys a query may see (self included); None = unbounded
    log_scaling: bool

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class InklingConfig:
    vocab_size: int = 201024
    unpadded_vocab_size: int | None = None
    hidden_size: int = 6144
    num_hidden_layers: int = 66
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 64
    swa_num_key_value_heads: int = 16
    swa_head_dim: int = 128
    sliding_window_size: int = 512
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    conv_kernel_size: int = 4
    intermediate_size: int = 24576
    moe_intermediate_size: int = 3072
    hidden_act: str = "silu"
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    route_scale: float = 8.0
    logits_mup_width_multiplier: float = 24.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # The multi-token-prediction head (transformers' names; a checkpoint's `mtp_config` block fills them).
    num_mtp_layers: int | None = None
    chain_hidden_post_norm: bool = False
    mtp_hidden_states_first: bool = True
    mtp_local_layer_ids: tuple[int, ...] | None = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "InklingConfig":
        """Accepts an `inkling_text` dict or an `inkling_mm_model` dict with a `text_config`."""
        model_type = raw.get("model_type")
        mtp_block = raw.get("mtp_config")  # the original checkpoints' block, beside text_config if nested
        if model_type == MULTIMODAL_MODEL_TYPE:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("inkling_mm_model config has no text_config object")
            raw = {"model_type": TEXT_MODEL_TYPE, **text}
            model_type = raw.get("model_type")
        if model_type != TEXT_MODEL_TYPE:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: expected {TEXT_MODEL_TYPE!r} "
                f"or {MULTIMODAL_MODEL_TYPE!r} with a text_config"
            )
        raw = {_ALIASES.get(k, k): v for k, v in raw.items()}
        raw = {**_mtp_fields(mtp_block if mtp_block is not None else raw.get("mtp_config"), raw), **raw}
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        n = values.get("num_hidden_layers", cls.num_hidden_layers)
        n = n if is_int(n) and n > 0 else 0  # a bad count is reported with every other problem by validate()

        if not values.get("layer_types"):
            local = raw.get("local_layer_ids")
            if local is not None and (not isinstance(local, list) or not all(is_int(i) for i in local)):
                raise ConfigError(f"invalid Inkling config: local_layer_ids must be a list of integers, got {local!r}")
            local_ids = set(local) if local is not None else {i for i in range(n) if (i + 1) % 6}
            values["layer_types"] = [SLIDING if i in local_ids else GLOBAL for i in range(n)]
        if not values.get("mlp_layer_types"):
            dense_upto = raw.get("dense_mlp_idx", 0)
            if not is_int(dense_upto):
                raise ConfigError(f"invalid Inkling config: dense_mlp_idx must be an integer, got {dense_upto!r}")
            values["mlp_layer_types"] = [DENSE if i < dense_upto else SPARSE for i in range(n)]
        for name in ("layer_types", "mlp_layer_types"):
            if not isinstance(values[name], (list, tuple)):
                raise ConfigError(f"invalid Inkling config: {name} must be a list, got {values[name]!r}")
        if raw.get("dense_intermediate_size") is not None:
            # The checkpoint's intermediate_size is the expert width; the dense width comes separately.
            values["moe_intermediate_size"] = values.get("intermediate_size", cls.intermediate_size)
            values["intermediate_size"] = raw["dense_intermediate_size"]
        values["layer_types"] = tuple(values["layer_types"])
        values["mlp_layer_types"] = tuple(values["mlp_layer_types"])
        if isinstance(values.get("mtp_local_layer_ids"), list):
            values["mtp_local_layer_ids"] = tuple(values["mtp_local_layer_ids"])
        try:
            config = cls(**values)
        except TypeError as e:  # pragma: no cover - dataclass signature mismatch
            raise ConfigError(str(e)) from None
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "InklingConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["mlp_layer_types"] = list(self.mlp_layer_types)
        if self.mtp_local_layer_ids is not None:
            out["mtp_local_layer_ids"] = list(self.mtp_local_layer_ids)
        out["model_type"] = TEXT_MODEL_TYPE
        return out

    def validate(self) -> None:
        """Every field's type and range, all problems in one ConfigError."""
        problems: list[str] = []

        def check(names: tuple[str, ...], ok, what: str) -> None:
            for name in names:
                value = getattr(self, name)
                if not ok(value):
                    problems.append(f"{name} must be {what}, got {value!r}")

        check(_POSITIVE_INTS, lambda v: is_int(v) and v > 0, "a positive integer")
        check(("unpadded_vocab_size", "log_scaling_n_floor"), lambda v: v is None or (is_int(v) and v > 0),
              "a positive integer or null")
        check(("pad_token_id", "bos_token_id", "eos_token_id"), lambda v: v is None or (is_int(v) and v >= 0),
              "a token id or null")
        check(("log_scaling_alpha", "route_scale"), is_finite, "a finite number")
        check(("num_mtp_layers",), lambda v: v is None or (is_int(v) and v >= 0), "a non-negative integer or null")
        check(("chain_hidden_post_norm", "mtp_hidden_states_first"), lambda v: isinstance(v, bool), "true or false")
        check(("mtp_local_layer_ids",), lambda v: v is None or (isinstance(v, tuple) and all(
            is_int(i) and 0 <= i < (self.num_mtp_layers or 0) for i in v)), "null or a list of MTP layer indices")
        check(("rms_norm_eps",), lambda v: is_finite(v) and v > 0, "a finite number > 0")
        check(("logits_mup_width_multiplier",), lambda v: is_finite(v) and v != 0, "a finite non-zero number")
        if problems:  # the checks below assume the types are right
            raise ConfigError("invalid Inkling config: " + "; ".join(problems))
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {n} layers")
        if bad := sorted({repr(t) for t in self.layer_types if t not in (SLIDING, GLOBAL)}):
            problems.append(f"unknown layer_types {', '.join(bad)}: expected {SLIDING!r} or {GLOBAL!r}")
        if len(self.mlp_layer_types) != n:
            problems.append(f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {n} layers")
        if bad := sorted({repr(t) for t in self.mlp_layer_types if t not in (DENSE, SPARSE)}):
            problems.append(f"unknown mlp_layer_types {', '.join(bad)}: expected {DENSE!r} or {SPARSE!r}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        for heads, kv in (("num_attention_heads", "num_key_value_heads"),
                          ("swa_num_attention_heads", "swa_num_key_value_heads")):
            h, k = getattr(self, heads), getattr(self, kv)
            if h % k:
                problems.append(f"{heads}={h} is not a multiple of {kv}={k}")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}"
            )
        if self.unpadded_vocab_size is not None and self.unpadded_vocab_size > self.vocab_size:
            problems.append(f"unpadded_vocab_size={self.unpadded_vocab_size} must be in 1..vocab_size={self.vocab_size}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            token = getattr(self, name)
            if token is not None and token >= self.vocab_size:
                problems.append(f"{name}={token} is outside the vocabulary (vocab_size={self.vocab_size})")
        if problems:
            raise ConfigError("invalid Inkling config: " + "; ".join(problems))

    # ---- derived ------------------------------------------------------------------------------

    @property
    def logits_vocab_size(self) -> int:
        """Width of the logits after the checkpoint's padding rows are dropped."""
        if self.unpadded_vocab_size is None:
            return self.vocab_size
        return min(self.unpadded_vocab_size, self.vocab_size)

    def geometry(self, layer_id: int) -> LayerGeometry:
        sliding = self.layer_types[layer_id] == SLIDING
        if sliding:
            return LayerGeometry(True, self.swa_num_attention_heads, self.swa_num_key_value_heads,
                                 self.swa_head_dim, self.sliding_window_size, self.sliding_window_size, False)
        return LayerGeometry(False, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                             self.rel_extent, None, self.log_scaling_n_floor is not None)

    def mtp_block(self, depths: int) -> "InklingConfig":
        """The config the MTP head's decoder layers are built from: `depths` layers, each dense, sliding or
        global as `mtp_local_layer_ids` says (all global when it is absent)."""
        local = set(self.mtp_local_layer_ids or ())
        return dataclasses.replace(self, num_hidden_layers=depths,
                                   layer_types=tuple(SLIDING if i in local else GLOBAL for i in range(depths)),
                                   mlp_layer_types=(DENSE,) * depths)

    def is_sparse(self, layer_id: int) -> bool:
        return self.mlp_layer_types[layer_id] == SPARSE

    def log_scale(self, positions):
        """tau = 1 + alpha * ln(max((pos+1)/n_floor, 1)) for a float32 position tensor (global layers)."""
        import torch

        n = (positions + 1).to(torch.float32)
        return 1.0 + self.log_scaling_alpha * torch.log((n / self.log_scaling_n_floor).clamp(min=1.0))
