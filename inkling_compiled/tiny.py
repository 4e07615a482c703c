"""Seeded random Inkling checkpoints small enough for tests, the demo and benchmarks.

Weights are drawn so that every branch of the model shows in the logits: no identity norms, no
unit scales, no zero correction bias (transformers' default init would hide all three). The files
are written with the safetensors library only; transformers is not needed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import INDEX_FILE, SINGLE_FILE, expected_shapes, transformers_to_original
from .config import InklingConfig
from .errors import CheckpointError
from .paths import default_cache_dir
from .tokenizer import write_byte_tokenizer

_COMMON = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6, hidden_act="silu")

TINY_CONFIGS: dict[str, dict] = {
    # Every (sliding, global) x (dense, sparse) pair, K=4, log scaling from position 4; an MTP head of
    # four depths (sliding, global, sliding, global).
    "tiny": dict(
        vocab_size=272, unpadded_vocab_size=264, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=8,
        sliding_window_size=8, d_rel=4, rel_extent=16, log_scaling_n_floor=4, log_scaling_alpha=0.2,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        conv_kernel_size=4, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, route_scale=8.0,
        logits_mup_width_multiplier=4.0, num_mtp_layers=4, mtp_local_layer_ids=[0, 2], **_COMMON),
    # Kernel 3, global layer first, one shared expert, odd window and extent; two global MTP depths with
    # the chain norm.
    "tiny-k3": dict(
        vocab_size=272, unpadded_vocab_size=261, hidden_size=48, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        swa_num_attention_heads=3, swa_num_key_value_heads=3, swa_head_dim=16,
        sliding_window_size=5, d_rel=3, rel_extent=11, log_scaling_n_floor=3, log_scaling_alpha=0.15,
        layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        conv_kernel_size=3, intermediate_size=80, moe_intermediate_size=24,
        n_routed_experts=6, num_experts_per_tok=3, n_shared_experts=1, route_scale=2.5,
        logits_mup_width_multiplier=3.0, num_mtp_layers=2, chain_hidden_post_norm=True, **_COMMON),
    # The benchmark model: hidden 512, 8 layers, 16 experts top-2 + 1 shared, vocab 4096.
    "small": dict(
        vocab_size=4096, unpadded_vocab_size=4000, hidden_size=512, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=64,
        sliding_window_size=64, d_rel=16, rel_extent=256, log_scaling_n_floor=64, log_scaling_alpha=0.1,
        local_layer_ids=[0, 1, 2, 4, 5, 6], dense_mlp_idx=1,
        conv_kernel_size=4, intermediate_size=1024, moe_intermediate_size=512,
        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, route_scale=2.0,
        logits_mup_width_multiplier=8.0, num_mtp_layers=2, mtp_local_layer_ids=[0], **_COMMON),
}


def random_weights(config: InklingConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 tensors in transformers names, each drawn from a scale that fits its role; the MTP head's
    (when the config has one) from a generator of its own, so the trunk's weights do not depend on it."""
    out = _draw(expected_shapes(config), seed)
    depths = config.num_mtp_layers or 0
    if depths:
        trunk = set(out)
        out.update(_draw({n: s for n, s in expected_shapes(config, depths).items() if n not in trunk}, seed + 1))
    return out


def _draw(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        normal = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * normal
        elif name.endswith("global_scale"):
            t = 0.5 + torch.rand(shape, generator=gen)
        elif "sconv" in name:
            t = 0.2 * normal
        elif name.endswith("rel_logits_proj.proj"):
            t = 0.5 * normal
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * normal
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            t = normal
        else:  # projections and expert banks: unit-variance outputs
            t = normal / math.sqrt(shape[-1])
        out[name] = t.contiguous()
    return out


# A plain role-tagged template, so that /v1/chat/completions works on every tiny checkpoint out of the box.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_checkpoint(out_dir: str | Path, raw_config: dict, tensors: dict[str, torch.Tensor], *,
                     layout: str = "transformers", shards: int = 1, tokenizer=None) -> Path:
    """Writes config.json, the safetensors file(s) and tokenizer.json: `tokenizer` (a `tokenizers.Tokenizer`
    whose ids 0, 1, 2 are pad, bos and eos) or, without one, a byte-level tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if layout == "original":
        tensors = transformers_to_original(tensors)
        # Real original checkpoints are multimodal: the text config nests, and other towers ride along.
        config_json = {"model_type": "inkling_mm_model", "text_config": {**raw_config, "model_type": "inkling_text"}}
        gen = torch.Generator().manual_seed(1)
        tensors["model.visual.layers.linear_0.weight"] = torch.randn(8, 8, generator=gen)
        tensors["model.audio.encoder.weight"] = torch.randn(4, 8, generator=gen)
        if not any(n.startswith("model.mtp.") for n in tensors):  # a head of some kind rides along
            tensors["model.mtp.layers.0.attn_norm.weight"] = torch.randn(8, generator=gen)
    elif layout == "transformers":
        config_json = {**raw_config, "model_type": "inkling_text"}
    else:
        raise ValueError(f"unknown layout {layout!r}: 'transformers' or 'original'")
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")

    names = sorted(tensors)
    if shards <= 1:
        save_file({n: tensors[n] for n in names}, str(out / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = names[k::shards]
            save_file({n: tensors[n] for n in part}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    if tokenizer is None:
        write_byte_tokenizer(out / "tokenizer.json", bos_id=1, eos_id=2, pad_id=0)
    else:
        tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TINY_CHAT_TEMPLATE, "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        indent=2) + "\n")
    return out


def build_tiny_checkpoint(out_dir: str | Path, name: str = "tiny", *, seed: int = 0, layout: str = "transformers",
                          shards: int = 1, overrides: dict | None = None) -> Path:
    """Writes the named tiny config with seeded random weights; returns the folder."""
    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny config {name!r}: choose one of {sorted(TINY_CONFIGS)}")
    raw = {**TINY_CONFIGS[name], **(overrides or {})}
    config = InklingConfig.from_dict({"model_type": "inkling_text", **raw})
    return write_checkpoint(out_dir, raw, random_weights(config, seed), layout=layout, shards=shards)


TRAINED_CHECKPOINT = Path(__file__).resolve().parent / "trained" / "pystd"


def trained_checkpoint() -> Path:
    """The checkpoint shipped in the package: a small Inkling code model with a two-depth MTP head, trained by
    tools/train_tiny.py on Python's standard library (its README.md is the model card)."""
    if not (TRAINED_CHECKPOINT / "config.json").is_file():
        raise CheckpointError(f"the shipped checkpoint is missing from {TRAINED_CHECKPOINT}: reinstall the package, "
                              "or make it with tools/train_tiny.py")
    return TRAINED_CHECKPOINT


def embedded_checkpoint(name: str = "tiny") -> Path:
    """A random tiny checkpoint for quick use (tests, `--model` of the demo): built on first use under the
    cache dir, reused afterwards. The folder is named after the config's contents (and the chat template's),
    so a changed config (an MTP head added, say) builds a new one."""
    digest = hashlib.sha256(json.dumps([TINY_CONFIGS[name], TINY_CHAT_TEMPLATE], sort_keys=True).encode()).hexdigest()[:12]
    path = default_cache_dir() / "checkpoints" / f"{name}-seed0-{digest}"
    if not all((path / f).is_file() for f in ("config.json", "tokenizer.json", "tokenizer_config.json")):
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        build_tiny_checkpoint(tmp, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path
