"""Loader: both name layouts, shards, the fp32-kept tensors, and one clear error per bad checkpoint."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inkling_compiled import CheckpointError, ConfigError, load_model
from inkling_compiled.checkpoint import deinterleave, interleave

from conftest import random_prompt


def logits_of(path, prompt):
    model, _ = load_model(path)
    return model.forward_sequences([prompt])[0]


def test_original_layout_loads_to_identical_logits(checkpoint):
    prompt = random_prompt(30, seed=1)
    hf_names = logits_of(checkpoint("tiny"), prompt)
    original = logits_of(checkpoint("tiny", layout="original"), prompt)
    assert torch.equal(hf_names, original)


def _mtp_names(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return [n for n in f.keys() if n.startswith("model.mtp.")]


def test_original_layout_reports_skipped_towers(checkpoint):
    original, hf = checkpoint("tiny", layout="original"), checkpoint("tiny")
    _, report = load_model(original)
    assert report == f"skipped non-text tensors: audio 1, mtp {len(_mtp_names(original))}, vision 1"
    _, report = load_model(hf)
    assert report == f"skipped non-text tensors: mtp {len(_mtp_names(hf))}"
    _, report = load_model(checkpoint("tiny-k3"), mtp_depths=2)  # every depth and the chain norm loaded
    assert report is None


def test_mtp_head_loads_from_either_layout(checkpoint):
    """The original layout (transformer_block.*, fused interleaved w13) and ours (block.*) give the same head;
    depths past the ones asked for are skipped, and asking for more than the checkpoint has is refused."""
    from inkling_compiled.errors import OptionError

    heads = [load_model(checkpoint("tiny", layout=layout), mtp_depths=2)[0].model.mtp for layout in
             ("transformers", "original")]
    a, b = (dict(h.state_dict()) for h in heads)
    assert a.keys() == b.keys() and len(a) > 30
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(".block.mlp.gate_up_proj" in n for n in a) and "layers.2.hidden_norm.weight" not in a
    with pytest.raises(OptionError, match="MTP depth"):
        load_model(checkpoint("tiny"), mtp_depths=5)


def test_sharded_equals_single_file(checkpoint):
    prompt = random_prompt(25, seed=2)
    assert torch.equal(logits_of(checkpoint("tiny-k3"), prompt), logits_of(checkpoint("tiny-k3", shards=3), prompt))


def test_interleave_roundtrip_and_layout():
    fused = torch.arange(12.0).reshape(2, 6)  # rows of [g0, u0, g1, u1, g2, u2] along dim 1
    split = deinterleave(fused, 1)
    assert split[0].tolist() == [0, 2, 4, 1, 3, 5]
    assert torch.equal(interleave(split, 1), fused)


def test_multimodal_transformers_prefix_loads(checkpoint, tmp_path):
    src = checkpoint("tiny")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: f.get_tensor(k)
                   for k in f.keys()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    prompt = random_prompt(10, seed=3)
    assert torch.equal(logits_of(src, prompt), logits_of(tmp_path, prompt))


def test_convs_are_held_tap_by_tap_on_cpu_with_the_checkpoints_values(checkpoint):
    """The C++ conv kernels read each tap of every channel together: on CPU each conv weight [D, 1, K] is
    held as [K, 1, D] in memory, its values those of the file."""
    from safetensors.torch import load_file

    model, _ = load_model(checkpoint("tiny"), mtp_depths=2)
    stored = load_file(str(checkpoint("tiny") / "model.safetensors"))
    convs = {n: p for n, p in model.named_parameters() if n.endswith("sconv.conv1d.weight")}
    assert len(convs) == 4 * (model.config.num_hidden_layers + 2)
    for name, p in convs.items():
        D, _, K = p.shape
        assert p.stride() == (1, D, D) and torch.equal(p, stored[name].float()), name


def test_bf16_keeps_convs_and_router_bias_in_fp32(checkpoint):
    model, _ = load_model(checkpoint("tiny"), dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.attn_sconv.conv1d.weight"] == torch.float32
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.1.mlp.gate.global_scale"] == torch.float32
    assert dtypes["model.layers.0.self_attn.qkvr_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.global_scale"] == torch.bfloat16
    logits = model.forward_sequences([random_prompt(20, seed=4)])[0]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_lm_head_keeps_only_unpadded_rows(checkpoint):
    model, _ = load_model(checkpoint("tiny"))
    assert model.lm_head.weight.shape == (264, 64)


# ---- bad checkpoints: one clear error each -------------------------------------------------------

def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(path, edit):
    f = path / "model.safetensors"
    with safe_open(str(f), framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")
    rewrite_tensors(path, lambda t: t.pop("model.layers.2.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model.layers.2.self_attn.k_norm.weight"):
        load_model(path)


def test_wrong_shape_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")

    def shrink(t):
        t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.1.mlp.experts.down_proj"][:, :, :5].contiguous()

    rewrite_tensors(path, shrink)
    with pytest.raises(CheckpointError, match=r"wrong shape .*model.layers.1.mlp.experts.down_proj.*"
                                              r"expected \[8, 64, 32\], got \[8, 64, 5\]") as e:
        load_model(path)
    assert "missing" not in str(e.value)  # there, only the wrong shape


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")
    rewrite_tensors(path, lambda t: t.__setitem__("model.layers.9.input_layernorm.weight", torch.ones(64)))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor\(s\): model.layers.9.input_layernorm.weight"):
        load_model(path)


def test_unknown_model_type(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "inkling2_text"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'inkling2_text'"):
        load_model(path)


def test_truncated_file(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")
    f = path / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as h:
        h.truncate(size // 2)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_no_weights_and_broken_index(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")
    os.remove(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard files that do not exist: \['shard-1.safetensors'\]"):
        load_model(path)


def test_bf16_weights_are_the_fp32_weights_rounded_once(checkpoint):
    fp32, _ = load_model(checkpoint("tiny"))
    bf16, _ = load_model(checkpoint("tiny"), dtype=torch.bfloat16)
    want = dict(fp32.named_parameters())
    for name, p in bf16.named_parameters():
        assert torch.equal(p, want[name].to(p.dtype)), name  # fp32-kept tensors exactly, the rest rounded once


def test_non_finite_weights_are_refused_by_name_unless_allowed(checkpoint, tmp_path):
    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")

    def poison(tensors):
        tensors["model.layers.1.mlp.experts.down_proj"][2, 0, 0] = float("nan")
        tensors["model.norm.weight"][3] = float("inf")

    rewrite_tensors(path, poison)
    with pytest.raises(CheckpointError, match=r"non-finite values \(NaN or inf\) in .*model.layers.1.mlp.experts."
                                              r"down_proj.*check_finite=False"):
        load_model(path)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(path)
    model, _ = load_model(path, check_finite=False)
    assert model.model.norm.weight[3].isinf()


def test_a_corrupt_tokenizer_is_named(checkpoint, tmp_path):
    from inkling_compiled.engine import Engine

    path = copy_checkpoint(checkpoint("tiny"), tmp_path / "ck")
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json cannot be read as a tokenizer"):
        Engine.from_pretrained(path, compile=False)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_pages=0), "num_pages must be an integer >= 2, got 0"),
    (dict(num_pages=1), "num_pages must be an integer >= 2, got 1"),
    (dict(prefill_chunk_tokens=0), "prefill_chunk_tokens must be an integer >= 1, got 0"),
    (dict(idle_prefill_tokens=0), "idle_prefill_tokens must be an integer >= 1, got 0"),
    (dict(idle_prefill_tokens=100), "idle_prefill_tokens=100 is below prefill_chunk_tokens=256"),
    (dict(prefill_chunk_tokens=64, idle_prefill_tokens=32), "idle_prefill_tokens=32 is below prefill_chunk_tokens=64"),
    (dict(max_batch_size=0), "max_batch_size must be an integer >= 1, got 0"),
    (dict(page_size=0), "page_size must be an integer >= 1"),
    (dict(dtype="garbage"), "unsupported dtype 'garbage'"),
    (dict(device="gpu"), "unknown device 'gpu'"),
    (dict(buckets=(4,), max_batch_size=2), r"buckets must be integers in 1..max_batch_size=2"),
    (dict(seed=[1]), "seed must be an integer >= 0"),
    (dict(num_pages=2, page_size=1), "num_pages=2 holds no request"),
])
def test_engine_options_out_of_range_are_named(kwargs, needle, checkpoint):
    from inkling_compiled.engine import Engine
    from inkling_compiled.errors import OptionError

    with pytest.raises(OptionError, match=needle):
        Engine.from_pretrained(checkpoint("tiny"), compile=False, **kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(compile_mode="bogus"), "unknown compile mode 'bogus'"),
    (dict(graph_per_bucket="yes"), "graph_per_bucket must be True or False, got .yes."),
    (dict(buckets=5), "buckets must be integers in 1..max_batch_size=4, got 5"),
    (dict(compile="no"), "compile must be True or False, got 'no'"),
])
def test_compile_options_out_of_range_are_named(kwargs, needle, checkpoint):
    from inkling_compiled.engine import Engine
    from inkling_compiled.errors import OptionError

    kwargs = {"compile": True, "warmup": False, "max_batch_size": 4, **kwargs}
    with pytest.raises(OptionError, match=needle):
        Engine.from_pretrained(checkpoint("tiny"), **kwargs)


def test_a_layer_transfer_counter_needs_wait_until(checkpoint):
    from inkling_compiled.engine import Engine
    from inkling_compiled.errors import OptionError

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False)
    with pytest.raises(OptionError, match="needs a wait_until"):
        engine.attach_layer_transfer_counter(object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_named(checkpoint):
    from inkling_compiled.engine import Engine
    from inkling_compiled.errors import OptionError

    with pytest.raises(OptionError, match="'cuda' asked for, but this torch sees no CUDA device"):
        Engine.from_pretrained(checkpoint("tiny"), device="cuda", compile=False)


def test_the_embedded_checkpoint_follows_its_config(tmp_path, monkeypatch):
    """The demo's cached checkpoint is named after its config: one built before a config change (an MTP
    head added, say) is not reused after it."""
    from inkling_compiled import tiny

    monkeypatch.setenv("INKLING_CACHE_DIR", str(tmp_path))
    first = tiny.embedded_checkpoint("tiny-k3")
    assert tiny.embedded_checkpoint("tiny-k3") == first
    monkeypatch.setitem(tiny.TINY_CONFIGS, "tiny-k3", {**tiny.TINY_CONFIGS["tiny-k3"], "route_scale": 3.0})
    second = tiny.embedded_checkpoint("tiny-k3")
    assert second != first and json.loads((second / "config.json").read_text())["route_scale"] == 3.0
