"""Checkpoint reading: safetensors (single file or sharded), two name layouts, shapes checked.

Layouts (see docs in README):
- transformers names (`model.layers.{i}.self_attn.q_proj.weight`, ...), optionally under
  `model.language_model.` as the multimodal transformers class saves them;
- original names under `model.llm.` with row-interleaved fused gate/up tensors. Tensors of the
  vision and audio towers are skipped with a one-line report, and so is the MTP head unless asked for.

The MTP head (`model.mtp.`) has the same two layouts: each depth's `hidden_norm`, `embed_norm`,
`input_proj` and decoder layer, `model.mtp.layers.{i}.block.<transformers layer names>` here and
`model.mtp.layers.{i}.transformer_block.<original layer names>` in the original, plus `model.mtp.chain_norm`.

Tensors are read one at a time from memory-mapped files and handed straight to the model
(`load_state_dict(assign=True)`), so at no point are two copies of the weights alive.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import InklingConfig
from .errors import CheckpointError, OptionError
from .quantize import METHOD, SCALE_SUFFIX, SCHEME, checkpoint_scheme, is_matmul_weight, quantize_rows

log = logging.getLogger("inkling_compiled")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Prefixes of tensors that belong to other towers of a multimodal checkpoint.
OTHER_TOWERS = {
    "model.visual.": "vision", "model.vision_tower.": "vision",
    "model.audio.": "audio", "model.audio_tower.": "audio",
    "model.mtp.": "mtp",
}


def expected_shapes(config: InklingConfig, mtp_depths: int = 0, int8: bool = False) -> dict[str, tuple[int, ...]]:
    """Every text-tower tensor in transformers names, with the shape the config implies; with mtp_depths,
    also the first that many depths of the MTP head; with int8, each matmul weight's scale
    (`quantize.py`)."""
    H, V = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.embed_tokens.embed_norm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (V, H),
    }
    for i in range(config.num_hidden_layers):
        shapes.update(_layer_shapes(config, i, f"model.layers.{i}."))
    if mtp_depths:
        block_config = config.mtp_block(mtp_depths)
        for i in range(mtp_depths):
            p = f"model.mtp.layers.{i}."
            shapes.update({p + "hidden_norm.weight": (H,), p + "embed_norm.weight": (H,),
                           p + "input_proj.weight": (H, 2 * H)})
            shapes.update(_layer_shapes(block_config, i, p + "block."))
        if config.chain_hidden_post_norm:
            shapes["model.mtp.chain_norm.weight"] = (H,)
    if int8:
        shapes.update({name + SCALE_SUFFIX: shape[:-1] for name, shape in shapes.items()
                       if is_matmul_weight(name, shape)})
    return shapes


def _layer_shapes(config: InklingConfig, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Decoder layer i of `config`, its tensors' names starting with p."""
    H, K = config.hidden_size, config.conv_kernel_size
    g = config.geometry(i)
    shapes = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (g.q_width, H),
        p + "self_attn.k_proj.weight": (g.kv_width, H),
        p + "self_attn.v_proj.weight": (g.kv_width, H),
        p + "self_attn.r_proj.weight": (g.num_heads * config.d_rel, H),
        p + "self_attn.o_proj.weight": (H, g.q_width),
        p + "self_attn.q_norm.weight": (g.head_dim,),
        p + "self_attn.k_norm.weight": (g.head_dim,),
        p + "self_attn.k_sconv.conv1d.weight": (g.kv_width, 1, K),
        p + "self_attn.v_sconv.conv1d.weight": (g.kv_width, 1, K),
        p + "self_attn.rel_logits_proj.proj": (config.d_rel, g.rel_extent),
        p + "attn_sconv.conv1d.weight": (H, 1, K),
        p + "mlp_sconv.conv1d.weight": (H, 1, K),
    }
    if config.is_sparse(i):
        E, S, I = config.n_routed_experts, config.n_shared_experts, config.moe_intermediate_size
        shapes.update({
            p + "mlp.gate.weight": (E + S, H),
            p + "mlp.gate.global_scale": (1,),
            p + "mlp.gate.e_score_correction_bias": (E,),
            p + "mlp.experts.gate_up_proj": (E, 2 * I, H),
            p + "mlp.experts.down_proj": (E, H, I),
            p + "mlp.shared_experts.gate_proj": (S, I, H),
            p + "mlp.shared_experts.up_proj": (S, I, H),
            p + "mlp.shared_experts.down_proj": (S, H, I),
        })
    else:
        I = config.intermediate_size
        shapes.update({
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            p + "mlp.global_scale": (1,),
        })
    return shapes


# ---- the original ("model.llm.*") layout -------------------------------------------------------

# Per-layer renames, original suffix -> transformers suffix.
_ORIGINAL_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_du.weight": "self_attn.q_proj.weight",
    "attn.wk_dv.weight": "self_attn.k_proj.weight",
    "attn.wv_dv.weight": "self_attn.v_proj.weight",
    "attn.wr_du.weight": "self_attn.r_proj.weight",
    "attn.wo_ud.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.k_sconv.weight": "self_attn.k_sconv.conv1d.weight",
    "attn.v_sconv.weight": "self_attn.v_sconv.conv1d.weight",
    "attn.rel_logits_proj.proj": "self_attn.rel_logits_proj.proj",
    "attn_sconv.weight": "attn_sconv.conv1d.weight",
    "mlp_sconv.weight": "mlp_sconv.conv1d.weight",
    "mlp.w2_md.weight": "mlp.down_proj.weight",
    "mlp.global_scale": "mlp.global_scale",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.bias": "mlp.gate.e_score_correction_bias",
    "mlp.gate.global_scale": "mlp.gate.global_scale",
    "mlp.experts.w2_weight": "mlp.experts.down_proj",
    "mlp.shared_experts.shared_w2_weight": "mlp.shared_experts.down_proj",
}
# Fused, row-interleaved [g0, u0, g1, u1, ...] tensors: original suffix -> (dim, targets).
# One target keeps the result fused as [gate; up]; two targets split it.
_ORIGINAL_INTERLEAVED = {
    "mlp.w13_dn.weight": (0, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.experts.w13_weight": (1, ("mlp.experts.gate_up_proj",)),
    "mlp.shared_experts.shared_w13_weight": (1, ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
}
_ORIGINAL_TOP = {
    "model.llm.embed.weight": "model.embed_tokens.weight",
    "model.llm.embed_norm.weight": "model.embed_tokens.embed_norm.weight",
    "model.llm.norm.weight": "model.norm.weight",
    "model.llm.unembed.weight": "lm_head.weight",
}
_ORIGINAL_LAYER = re.compile(r"model\.llm\.layers\.(\d+)\.(.+)")
_ORIGINAL_MTP_LAYER = re.compile(r"model\.mtp\.layers\.(\d+)\.transformer_block\.(.+)")
_MTP_DEPTH = re.compile(r"model\.mtp\.layers\.(\d+)\.")
# Layer prefixes, transformers names -> original names (a decoder layer's tensors follow the tables above).
_LAYER_PREFIXES = ((re.compile(r"model\.layers\.(\d+)\.(.+)"), "model.llm.layers.{}."),
                   (re.compile(r"model\.mtp\.layers\.(\d+)\.block\.(.+)"), "model.mtp.layers.{}.transformer_block."))


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] along dim -> [g0, g1, ..., u0, u1, ...]."""
    n = t.shape[dim]
    if n % 2:
        raise CheckpointError(f"interleaved gate/up tensor has odd size {n} along dim {dim}")
    shape = t.shape[:dim] + (n // 2, 2) + t.shape[dim + 1:]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape).contiguous()


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `deinterleave` (used to write original-layout checkpoints)."""
    n = t.shape[dim]
    shape = t.shape[:dim] + (2, n // 2) + t.shape[dim + 1:]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape).contiguous()


def original_to_transformers(name: str) -> tuple[list[str], Callable[[torch.Tensor], list[torch.Tensor]]] | None:
    """Maps one original-layout name to its transformers name(s) and the conversion; None if unknown."""
    if name in _ORIGINAL_TOP:
        return [_ORIGINAL_TOP[name]], lambda t: [t]
    if m := _ORIGINAL_LAYER.fullmatch(name):
        prefix, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    elif m := _ORIGINAL_MTP_LAYER.fullmatch(name):
        prefix, suffix = f"model.mtp.layers.{m.group(1)}.block.", m.group(2)
    elif name.startswith("model.mtp."):  # the depth's own norms and projection, the chain norm: same names
        return [name], lambda t: [t]
    else:
        return None
    if suffix in _ORIGINAL_RENAMES:
        return [prefix + _ORIGINAL_RENAMES[suffix]], lambda t: [t]
    if suffix in _ORIGINAL_INTERLEAVED:
        dim, targets = _ORIGINAL_INTERLEAVED[suffix]
        if len(targets) == 1:
            return [prefix + targets[0]], lambda t: [deinterleave(t, dim)]
        return [prefix + x for x in targets], lambda t: list(deinterleave(t, dim).chunk(2, dim=dim))
    return None


def transformers_to_original(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Writes a transformers-named state dict in the original layout (fused + interleaved)."""
    out: dict[str, torch.Tensor] = {}
    top = {v: k for k, v in _ORIGINAL_TOP.items()}
    renames = {v: k for k, v in _ORIGINAL_RENAMES.items()}
    layers: set[tuple[str, str]] = set()  # (transformers prefix, original prefix) of each layer
    for name, t in tensors.items():
        if name in top:
            out[top[name]] = t
            continue
        match = next(((m, original) for pattern, original in _LAYER_PREFIXES if (m := pattern.fullmatch(name))), None)
        if match is None:
            assert name.startswith("model.mtp."), name
            out[name] = t
            continue
        m, original = match
        prefix = original.format(m.group(1))
        layers.add((name[:len(name) - len(m.group(2))], prefix))
        if m.group(2) in renames:
            out[prefix + renames[m.group(2)]] = t
    for p, original in layers:
        for orig, (dim, targets) in _ORIGINAL_INTERLEAVED.items():
            parts = [tensors.get(p + x) for x in targets]
            if all(x is not None for x in parts):
                out[original + orig] = interleave(torch.cat(parts, dim=dim), dim)
    return out


# ---- reading files -----------------------------------------------------------------------------

def checkpoint_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        if missing := [f.name for f in files if not f.is_file()]:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def iter_file_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[..., torch.Tensor]]]:
    """Yields (name, loader) for every tensor; a loader reads that one tensor from the mmap, or with an
    index (a tuple of slices) only that part of it, and with `shape=True` only its shape (the header)."""
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"cannot read safetensors file {f.name}: {e}") from None

        def load(name: str, index=None, shape: bool = False, handle=handle, f=f):
            try:
                if shape:
                    return tuple(handle.get_slice(name).get_shape())
                if index is None:
                    return handle.get_tensor(name)
                return handle.get_slice(name)[index] if index else handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {f.name} (truncated file?): {e}") from None

        for name in names:
            yield name, (lambda index=None, shape=False, name=name, load=load: load(name, index, shape))


def read_text_tensors(path: str | Path, config: InklingConfig, convert: Callable[[str, torch.Tensor], torch.Tensor],
                      mtp_depths: int = 0, take=None, int8: bool = False) -> tuple[dict[str, torch.Tensor], str | None]:
    """Reads the text tower in transformers names, each tensor passed through `convert(name, t)`, and
    the first `mtp_depths` depths of the MTP head (deeper ones are skipped like other towers).

    `take(name, read)` (a `parallel.TensorParallel.take`) keeps only part of each tensor: a tensor stored
    under its transformers name is then read only there (its shape checked from the file's header); one
    that needs converting (the original layout's fused tensors) is read whole, converted, then cut.

    Returns the tensors and a one-line report of skipped tower tensors (None if nothing was
    skipped). Raises one CheckpointError that lists every missing, unexpected and mis-shaped tensor
    (with int8, an int8 checkpoint's scales among them).
    """
    path = Path(path)
    files = checkpoint_files(path)
    expected = expected_shapes(config, mtp_depths, int8)
    out: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    bad_shape: list[str] = []
    misshaped: set[str] = set()
    skipped: Counter[str] = Counter()

    for name, load in iter_file_tensors(files):
        hf = name.replace("model.language_model.", "model.", 1)  # the multimodal class's prefix
        tower = next((kind for prefix, kind in OTHER_TOWERS.items() if hf.startswith(prefix)), None)
        if tower == "mtp" and mtp_depths:
            depth = _MTP_DEPTH.match(hf)
            tower = None if (int(depth.group(1)) < mtp_depths if depth else hf == "model.mtp.chain_norm.weight") \
                else tower
        if tower:
            skipped[tower] += 1
            continue
        if hf.startswith("model.llm.") or hf.startswith("model.mtp."):
            mapped = original_to_transformers(hf)
            if mapped is None:
                unexpected.append(name)
                continue
            targets, conversion = mapped
        else:
            if hf not in expected:
                unexpected.append(name)
                continue
            targets, conversion = [hf], (lambda t: [t])
        direct = take is not None and targets == [hf]
        tensor = None if direct else load()
        for target, part in zip(targets, [None] if direct else conversion(tensor)):
            want = expected.get(target)
            got = load(shape=True) if direct else tuple(part.shape)
            if want is None:
                unexpected.append(name)
            elif got != want and not _is_unpadded_head(target, got, config):
                bad_shape.append(f"{target} (from {name}): expected {list(want)}, got {list(got)}")
                misshaped.add(target)
            elif direct:
                out[target] = convert(target, take(target, lambda index: load(index)))
            else:
                out[target] = convert(target, part if take is None else take(target, lambda index: part[index]))
        del tensor

    missing = sorted(set(expected) - set(out) - misshaped)
    if missing or unexpected or bad_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_preview(missing)}")
        if bad_shape:
            parts.append(f"wrong shape for {len(bad_shape)} tensor(s): {_preview(bad_shape)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_preview(sorted(unexpected))}")
            if not int8 and all(name.endswith(SCALE_SUFFIX) for name in unexpected):
                parts.append("these look like int8 scales, but config.json has no quantization_config "
                             "(an int8 checkpoint is written by `inkling-compiled quantize`)")
        raise CheckpointError(f"checkpoint {path} does not match its config: " + "; ".join(parts))
    report = None
    if skipped:
        report = "skipped non-text tensors: " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
        log.info(report)
    return out, report


def _is_unpadded_head(name: str, shape: tuple[int, ...], config: InklingConfig) -> bool:
    # The original layout may store the unembedding unpadded: only the first unpadded rows are used.
    return (name == "lm_head.weight" and shape == (config.logits_vocab_size, config.hidden_size)
            or name == "lm_head.weight" + SCALE_SUFFIX and shape == (config.logits_vocab_size,))


def _preview(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


# ---- writing an int8 copy (`inkling-compiled quantize`) -----------------------------------------

def write_quantized(src: str | Path, dst: str | Path) -> dict[str, int]:
    """Writes `src` (a transformers-layout checkpoint folder) quantized into `dst`: each matmul weight as
    int8 plus its scales (`quantize.py`), everything else as stored; config.json gains the
    `quantization_config` block and the other files (tokenizer, chat template, ...) are copied. Source
    tensors are read one at a time; what is written (int8 for the bulk of the bytes) is held until the
    one file is saved. Returns the bytes of the tensors before and after."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    InklingConfig.from_file(src)  # a missing or broken config.json is found before anything is read
    if checkpoint_scheme(src) is not None:
        raise CheckpointError(f"{src} is already quantized")
    if dst.resolve() == src.resolve():
        raise OptionError("the output folder must differ from the input folder")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise OptionError(f"{dst} exists and is not an empty folder: quantize writes a new one")
    files = checkpoint_files(src)
    out: dict[str, torch.Tensor] = {}
    before = 0
    for name, load in iter_file_tensors(files):
        t = load()
        before += t.numel() * t.element_size()
        hf = name.replace("model.language_model.", "model.", 1)
        if name.startswith(("model.llm.", "model.language_model.llm.")):
            raise CheckpointError(f"{src} is in the original ('model.llm.') layout: load it and save it in "
                                  "transformers names first; quantize reads transformers names only")
        other_tower = any(hf.startswith(p) for p, kind in OTHER_TOWERS.items() if kind != "mtp")
        if is_matmul_weight(hf, tuple(t.shape)) and not other_tower:  # vision and audio towers: as stored
            if not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{src}: non-finite values (NaN or inf) in {name}: nothing to quantize")
            q, scale = quantize_rows(t)
            out[name], out[name + SCALE_SUFFIX] = q, scale
        else:
            out[name] = t.contiguous()
        del t
    after = sum(t.numel() * t.element_size() for t in out.values())
    # Written into a folder of its own, then renamed: a failure leaves no half-written checkpoint.
    scratch = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    save_file(out, str(scratch / "model.safetensors"), metadata={"format": "pt", "quantization": METHOD})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = SCHEME
    (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.name in ("config.json", "model.safetensors", "model.safetensors.index.json") or f in files:
            continue
        if f.is_file():
            shutil.copy2(f, scratch / f.name)
        elif f.is_dir():
            shutil.copytree(f, scratch / f.name)
    if dst.exists():
        dst.rmdir()  # empty (checked above)
    scratch.rename(dst)
    return {"bytes_before": before, "bytes_after": after}
