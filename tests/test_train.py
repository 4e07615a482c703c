"""The training script (tools/train_tiny.py) on a toy corpus, a few steps: the loss falls, what it writes
loads in the engine and in transformers with equal greedy tokens, and its MTP head is the head the engine
runs (the training forward's depth logits equal the engine's for the same tokens)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

transformers = pytest.importorskip("transformers")
import train_tiny  # noqa: E402

from inkling_compiled import load_model  # noqa: E402
from inkling_compiled.engine import Engine  # noqa: E402
from inkling_compiled.sampling import SamplingParams  # noqa: E402

TOY = dict(train_tiny.CONFIG, vocab_size=320, unpadded_vocab_size=300, hidden_size=32, num_hidden_layers=4,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, swa_num_attention_heads=2,
           swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=8, d_rel=4, rel_extent=16,
           log_scaling_n_floor=8, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
           mlp_layer_types=["dense", "sparse", "dense", "sparse"], intermediate_size=48, moe_intermediate_size=16,
           n_routed_experts=4, logits_mup_width_multiplier=2.0)
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n" * 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.manual_seed(0)
    tok = train_tiny.train_tokenizer([TEXT], TOY["unpadded_vocab_size"])
    stream = train_tiny.token_stream(tok, [TEXT])
    model, heads = train_tiny.build_model(TOY, seed=0)
    history = train_tiny.train(model, heads, stream, steps=30, batch=4, seq=32, seed=0, peak_lr=1e-2, warmup=5,
                               log=lambda line: None)
    out = tmp_path_factory.mktemp("toy") / "toy"
    train_tiny.write_checkpoint(out, TOY, train_tiny.checkpoint_tensors(model, heads, TOY), tokenizer=tok)
    return out, history, stream, model, heads


def test_a_few_steps_lower_every_loss(trained):
    _, history, *_ = trained
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"] - 1.0
    assert all(b < a - 0.5 for a, b in zip(first["mtp_loss"], last["mtp_loss"]))
    assert len(history) == 30 and all(r["lr"] > 0 for r in history)


def test_the_written_checkpoint_decodes_as_transformers_does(trained):
    out, _, stream, _, _ = trained
    prompt = stream[:12].tolist()
    engine = Engine.from_pretrained(out, compile=False)
    ours = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    hf = transformers.InklingForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    assert ours == theirs


def test_the_trained_head_is_the_head_the_engine_runs(trained):
    """Depth d's logits at every position, from the training forward (transformers' modules, the bf16 weights
    as written), equal the engine's MTP head over the same tokens."""
    out, _, stream, _, _ = trained
    tokens = stream[:20]
    hf = transformers.InklingForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    heads = train_tiny.build_model(TOY, seed=1)[1]  # same modules; the written weights loaded below
    from safetensors.torch import load_file

    written = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    for d, head in enumerate(heads):
        p = f"model.mtp.layers.{d}."
        head.hidden_norm.weight.data.copy_(written[p + "hidden_norm.weight"])
        head.embed_norm.weight.data.copy_(written[p + "embed_norm.weight"])
        head.input_proj.weight.data.copy_(written[p + "input_proj.weight"])
        head.block.layers[0].load_state_dict({k[len(p + "block."):]: v for k, v in written.items()
                                              if k.startswith(p + "block.")})
    heads.eval()
    with torch.no_grad():
        h = hf.model(input_ids=tokens[None]).last_hidden_state
        want = [logits[0] for logits in train_tiny.logits_by_depth(hf, heads, tokens[None])[1:]]
    model, _ = load_model(out, mtp_depths=2)
    with torch.no_grad():  # the head's input: the trunk's hidden states (transformers' here; parity is tested elsewhere)
        ours = model.model.mtp.forward_sequence(model, h[0], tokens)
    for a, b in zip(ours, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
