import json

import pytest

from inkling_compiled import ConfigError, InklingConfig
from inkling_compiled.tiny import TINY_CONFIGS


def text(**kw):
    return InklingConfig.from_dict({"model_type": "inkling_text", **kw})


def test_default_layer_types_put_global_layers_at_5_11():
    c = text(num_hidden_layers=12)
    assert [i for i, t in enumerate(c.layer_types) if t == "hybrid"] == [5, 11]
    assert set(c.mlp_layer_types) == {"sparse"}


def test_fewer_than_six_layers_are_all_sliding():
    assert set(text(num_hidden_layers=4).layer_types) == {"hybrid_sliding"}


def test_local_layer_ids_and_dense_prefix():
    c = text(num_hidden_layers=4, local_layer_ids=[1, 2], dense_mlp_idx=2)
    assert c.layer_types == ("hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid")
    assert c.mlp_layer_types == ("dense", "dense", "sparse", "sparse")


def test_dense_intermediate_size_renames_widths():
    c = text(intermediate_size=3072, moe_intermediate_size=999, dense_intermediate_size=24576)
    assert (c.intermediate_size, c.moe_intermediate_size) == (24576, 3072)


def test_aliases_and_unpadded_vocab():
    c = text(embedding_multiplier=3.0, sliding_window=32, num_local_experts=12, sconv_kernel_size=3,
             vocab_size=100, unpadded_vocab_size=90)
    assert (c.logits_mup_width_multiplier, c.sliding_window_size, c.n_routed_experts, c.conv_kernel_size) == (
        3.0, 32, 12, 3)
    assert c.logits_vocab_size == 90
    assert text(vocab_size=100).logits_vocab_size == 100


def test_geometry_differs_by_layer_type():
    c = text(**TINY_CONFIGS["tiny"])
    sliding, glob = c.geometry(0), c.geometry(1)
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.rel_extent, sliding.window) == (1, 8, 8, 8)
    assert (glob.num_kv_heads, glob.head_dim, glob.rel_extent, glob.window, glob.log_scaling) == (2, 16, 16, None, True)
    assert not sliding.log_scaling


def test_multimodal_config_reads_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "inkling_mm_model", "text_config": {"hidden_size": 32, "num_hidden_layers": 2}}))
    c = InklingConfig.from_file(tmp_path)
    assert (c.hidden_size, c.num_hidden_layers) == (32, 2)


@pytest.mark.parametrize("raw, needle", [
    ({"model_type": "llama"}, "unsupported model_type 'llama'"),
    ({"model_type": "inkling_mm_model"}, "no text_config"),
    ({"model_type": "inkling_text", "num_hidden_layers": 2, "layer_types": ["hybrid"]}, "layer_types has 1"),
    ({"model_type": "inkling_text", "num_hidden_layers": 1, "layer_types": ["full"]}, "unknown layer_types"),
    ({"model_type": "inkling_text", "num_attention_heads": 6, "num_key_value_heads": 4}, "not a multiple"),
    ({"model_type": "inkling_text", "n_routed_experts": 2, "num_experts_per_tok": 3}, "exceeds n_routed_experts"),
    ({"model_type": "inkling_text", "n_shared_experts": 0}, "n_shared_experts must be a positive"),
    ({"model_type": "inkling_text", "vocab_size": 10, "unpadded_vocab_size": 11}, "unpadded_vocab_size=11"),
    ({"model_type": "inkling_text", "hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_configs_name_the_problem(raw, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        InklingConfig.from_dict(raw)


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        InklingConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        InklingConfig.from_file(tmp_path)


def test_problems_are_listed_together_and_unhashable_entries_named():
    raw = {**TINY_CONFIGS["tiny"], "hidden_size": "64", "num_hidden_layers": -1, "vocab_size": None}
    with pytest.raises(ConfigError) as e:
        text(**raw)
    assert all(f"{name} must be a positive integer" in str(e.value)
               for name in ("hidden_size", "num_hidden_layers", "vocab_size"))
    with pytest.raises(ConfigError, match=r"unknown layer_types \[1\]"):
        text(**{**TINY_CONFIGS["tiny"], "layer_types": [[1], "hybrid", "hybrid", "hybrid"]})
    with pytest.raises(ConfigError, match=r"unknown mlp_layer_types \{\}"):
        text(**{**TINY_CONFIGS["tiny"], "mlp_layer_types": [{}, "dense", "dense", "dense"]})


@pytest.mark.parametrize("field, value, needle", [
    ("log_scaling_n_floor", "x", "log_scaling_n_floor must be a positive integer or null, got 'x'"),
    ("rms_norm_eps", "x", "rms_norm_eps must be a finite number > 0, got 'x'"),
    ("route_scale", None, "route_scale must be a finite number, got None"),
    ("eos_token_id", "two", "eos_token_id must be a token id or null, got 'two'"),
    ("eos_token_id", 9999, "eos_token_id=9999 is outside the vocabulary"),
    ("num_hidden_layers", "4", "num_hidden_layers must be a positive integer, got '4'"),
    ("hidden_size", 64.0, "hidden_size must be a positive integer, got 64.0"),
    ("log_scaling_alpha", float("nan"), "log_scaling_alpha must be a finite number"),
    ("layer_types", "hybrid", "layer_types must be a list"),
    ("dense_mlp_idx", "1", "dense_mlp_idx must be an integer"),
    ("local_layer_ids", 3, "local_layer_ids must be a list of integers"),
])
def test_every_field_is_typed_and_named_in_the_error(field, value, needle):
    raw = {**TINY_CONFIGS["tiny"], field: value}
    if field in ("dense_mlp_idx", "local_layer_ids"):
        raw.pop("layer_types"), raw.pop("mlp_layer_types")
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        text(**raw)
