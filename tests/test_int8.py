"""Weight-only int8 (quantization="int8"): the kernels against the rule written out here, the engine
against transformers on the weights int8 stands for, quantized checkpoints (round trip, refusals).

The rule, from the issue and README, applied by these tests themselves (never by calling the
engine's quantizer): per output row, scale = max |w| / 127 (1 for an all-zero row), q = round(w / scale)
with ties to even, clamped to [-127, 127]; the weight int8 stands for is q * scale.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from inkling_compiled import Engine, SamplingParams, load_model
from inkling_compiled.cli import main as cli_main
from inkling_compiled.errors import CheckpointError, OptionError

from conftest import checkpoint_named, random_prompt
from forced_build import run_in_build

# The tensors int8 stores (transformers names): projections, expert banks, lm_head.
MATMUL_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "r_proj.weight", "o_proj.weight",
                   "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_proj.weight",
                   "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                   "shared_experts.down_proj", "lm_head.weight")
GREEDY = SamplingParams(max_new_tokens=12, logprobs=True, ignore_eos=True)


def rule(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    scale = w.abs().amax(-1) / 127
    scale[scale == 0] = 1.0
    return torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8), scale


def stands_for(w: torch.Tensor) -> torch.Tensor:
    q, scale = rule(w)
    return q.float() * scale[..., None]


def exactly_representable(w: torch.Tensor) -> torch.Tensor:
    """Each row an int8 vector times a power of two, its largest magnitude exactly 127 of them: int8
    stores it without loss (q * scale == w bit for bit)."""
    w = w.float()
    scale = torch.exp2(torch.round(torch.log2(w.abs().amax(-1) / 127)))
    q = torch.round(w / scale[..., None]).clamp(-127, 127)
    top = q.abs().argmax(-1, keepdim=True)
    q.scatter_(-1, top, torch.where(q.gather(-1, top) < 0, -127.0, 127.0))
    return q * scale[..., None]


def rewritten(src, dst, fn):
    """A copy of checkpoint `src` whose int8-stored tensors are fn(tensor)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors = {n: fn(t) if n.endswith(MATMUL_SUFFIXES) else t for n, t in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def transformers_greedy(path, prompts, n):
    transformers = pytest.importorskip("transformers")
    hf = transformers.InklingForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, len(prompt):]
        logprobs = torch.log_softmax(torch.stack(gen.logits, 1)[0].float(), -1).gather(-1, tokens[:, None])[:, 0]
        out.append((tokens.tolist(), logprobs))
    return out


def assert_matches(outs, want):
    for out, (tokens, logprobs) in zip(outs, want):
        assert out.token_ids == tokens
        assert (torch.tensor(out.logprobs) - logprobs).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def exact(checkpoint, tmp_path_factory):
    """The tiny checkpoint with every int8-stored tensor made exactly representable."""
    return rewritten(checkpoint("tiny"), tmp_path_factory.mktemp("exact") / "ckpt", exactly_representable)


# A shared prefix (the second wave reads it from the prefix cache) and prompts long enough to cross
# pages and the sliding window.
PREFIX = random_prompt(40, seed=7)
PROMPTS = [PREFIX + random_prompt(n, seed=n) for n in (3, 11)] + [random_prompt(25, seed=2)]


# ---- kernels ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("column_major", [False, True])
def test_linear_int8_matches_the_rule_from_1_to_300_rows(column_major):
    g = torch.Generator().manual_seed(1)
    # odd widths: vector tails, partial panels; past 32 rows 300 x 257 and 300 x 1030 are two blocks of
    # outputs each (288 + 12, 240 + 60), dequantized and multiplied into their columns of the output
    for o, h in ((96, 40), (37, 19), (50, 130), (300, 257), (300, 1030)):
        w = torch.randn(o, h, generator=g) / 10
        q, scale = rule(w)
        q = q.t().contiguous().t() if column_major else q
        for rows in (1, 2, 3, 4, 5, 9, 17, 32, 33, 64, 300):  # the kernel to 32 rows, then a GEMM
            x = torch.randn(rows, h, generator=g)
            got = torch.ops.inkling.linear_int8(x, q, scale)
            want = x @ (q.float() * scale[:, None]).t()
            assert (got - want).abs().max().item() < 1e-4, (o, h, rows)


@pytest.mark.parametrize("h", [12, 24, 40, 130])  # a vector tail of 8-15 terms (AVX-512), of 4-7 (AVX2), of 2
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(h):
    """In W's layout below 20 rows each output is one dot product whatever the batch: a row alone or in a
    batch of several blocks of rows gives the same bits, int8 and fp32. The int8 kernel once widened
    the weights of a multi-block batch into a float panel and summed their vector tail unfused there,
    fused otherwise."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, h, generator=g) / 10
    q, scale = rule(w)
    x = torch.randn(9, h, generator=g)
    for op, args in (("linear_int8", (q, scale)), ("linear", (w,))):
        batch = getattr(torch.ops.inkling, op)(x, *args)
        for rows in range(1, 9):
            alone = getattr(torch.ops.inkling, op)(x[:rows], *args)
            assert torch.equal(alone, batch[:rows]), (op, h, rows)


@pytest.mark.parametrize("h", [130, 520])  # past 16 rows: two groups of 28 rows and 4; groups of 4
def test_past_16_rows_a_rows_result_still_does_not_depend_on_the_rows_beside_it(h):
    """From 17 rows the few-row kernel takes its panels in chunks and the rows in groups that fit in L1 (int8
    always to 32 rows; fp32 where the measured choice gives it those rows, forced here): only the order of
    the (row, output) pairs changes, so a row alone and a row among 32 give the same bits. 70 outputs are
    two chunks of panels and a rest."""
    from inkling_compiled import kernel_choice

    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, h, generator=g) / 10
    q, scale = rule(w)
    x = torch.randn(32, h, generator=g)
    kernel_choice._set_choice(70, h, False, torch.get_num_threads(), (1 << 64) - 1)  # fp32: the kernel to 64 rows
    try:
        for op, args in (("linear_int8", (q, scale)), ("linear", (w,))):
            batch = getattr(torch.ops.inkling, op)(x, *args)
            for rows in (1, 5, 16, 17, 23, 29, 31):
                assert torch.equal(getattr(torch.ops.inkling, op)(x[:rows], *args), batch[:rows]), (op, h, rows)
    finally:
        kernel_choice.forget_installed()


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it_in_every_build(isa):
    """The same, in the builds this CPU does not pick itself (forced, in a subprocess): each reduces a
    block of rows' sums its own width at a time, and a row alone takes another path."""
    script = (
        "import torch\n"
        "from inkling_compiled.custom_ops.library import cpu_isa\n"
        "g = torch.Generator().manual_seed(4)\n"
        "differ = []\n"
        "for o, h in [(8, 12), (8, 24), (12, 40), (16, 130)]:\n"
        "    w = torch.randn(o, h, generator=g) / 10\n"
        "    q = torch.randint(-127, 128, (o, h), generator=g, dtype=torch.int8)\n"
        "    scale = torch.rand(o, generator=g) / 100\n"
        "    x = torch.randn(9, h, generator=g)\n"
        "    for op, args in (('linear_int8', (q, scale)), ('linear', (w,))):\n"
        "        batch = getattr(torch.ops.inkling, op)(x, *args)\n"
        "        differ += [(op, o, h, rows) for rows in range(1, 9)\n"
        "                   if not torch.equal(getattr(torch.ops.inkling, op)(x[:rows], *args), batch[:rows])]\n"
        "print(cpu_isa(), len(differ), differ[:3])")
    (differ,) = run_in_build(isa, script)
    assert differ.startswith("0 "), differ


# 520 x 600 and 300 wide: past 32 rows an expert, each projection in two blocks of outputs (496 + 104 and
# 512 + 8), each written into its columns of the expert's rows
@pytest.mark.parametrize("E, H, I, counts", [(8, 48, 40, (1, 5, 40, 200)), (4, 520, 300, (200,))])
def test_moe_experts_int8_matches_a_plain_loop(E, H, I, counts):
    g = torch.Generator().manual_seed(2)
    k = 2
    gate_up, down = rule(torch.randn(E, 2 * I, H, generator=g) / 10), rule(torch.randn(E, H, I, generator=g) / 10)
    for tokens in counts:  # decode rows to prefill chunks (ATen past 32 rows an expert)
        for column_major in (False, True):
            gu, dn = (w.transpose(1, 2).contiguous().transpose(1, 2) if column_major else w
                      for w in (gate_up[0], down[0]))
            x = torch.randn(tokens, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
            ids[0, 0] = -1  # another rank's expert
            weights = torch.rand(tokens, k, generator=g)
            got = torch.ops.inkling.moe_experts_int8(x, ids, weights, gu, gate_up[1], dn, down[1])
            want = torch.zeros_like(x)
            for t in range(tokens):
                for j in range(k):
                    e = int(ids[t, j])
                    if e < 0:
                        continue
                    wg = gate_up[0][e].float() * gate_up[1][e][:, None]
                    wd = down[0][e].float() * down[1][e][:, None]
                    gate, up = (x[t] @ wg.t()).chunk(2)
                    want[t] += weights[t, j] * (F.silu(gate) * up) @ wd.t()
            assert (got - want).abs().max().item() < 1e-4, (tokens, column_major)


def test_quantizing_leaves_the_source_tensor_as_it_was():
    """quantize_rows divides and rounds in place on its one fp32 copy, never on an fp32 input itself."""
    from inkling_compiled.quantize import quantize_rows

    w = torch.randn(5, 7)
    before = w.clone()
    quantize_rows(w)
    assert torch.equal(w, before)


# ---- the engine against transformers ---------------------------------------------------------------

def test_exactly_representable_weights_give_transformers_tokens_eager(exact):
    """int8 loses nothing on these weights: the eager engine with the prefix cache and n-gram speculation
    is transformers on the fp32 checkpoint, two waves (the second from the prefix cache)."""
    engine = Engine.from_pretrained(exact, compile=False, quantization="int8", max_batch_size=4, page_size=16,
                                    speculative="ngram", num_speculative_tokens=2, progress=False)
    want = transformers_greedy(exact, PROMPTS, GREEDY.max_new_tokens)
    assert_matches(engine.generate(PROMPTS, GREEDY), want)
    second = engine.generate(PROMPTS, GREEDY)
    assert_matches(second, want)
    assert all(out.cached_tokens >= 32 for out in second[:2])  # the shared prefix's pages, from the cache


def test_exactly_representable_weights_give_transformers_tokens_compiled(exact):
    """The compiled decode and verify steps over the int8 ops (aot_eager: Dynamo and AOT see the ops as
    inductor does, without its minute of C++ compiles a cold CI run pays; the inductor build of the same
    steps runs in `bench --quantization none int8`)."""
    torch._dynamo.reset()
    engine = Engine.from_pretrained(exact, compile=True, compile_backend="aot_eager", quantization="int8",
                                    max_batch_size=2, buckets=(2,), speculative="ngram", num_speculative_tokens=2,
                                    progress=False)
    assert_matches(engine.generate(PROMPTS, GREEDY), transformers_greedy(exact, PROMPTS, GREEDY.max_new_tokens))
    params = checkpoint_named(engine.model)
    int8 = [n for n, p in params.items() if p.dtype == torch.int8]
    assert len(int8) == sum(n.endswith(MATMUL_SUFFIXES) for n in params)
    saved = sum(3 * params[n].numel() - 4 * params[n + "_scale"].numel() for n in int8)  # fp32: 4 bytes, int8: 1
    assert engine.memory_report()["int8 saved"] == saved > 0
    assert "int8: " in engine.memory_summary()


def test_any_weights_give_transformers_tokens_on_the_weights_int8_stands_for(checkpoint, tmp_path):
    """Random weights, quantized as the engine loads them, against transformers run on q * scale."""
    stood_for = rewritten(checkpoint("tiny"), tmp_path / "stood-for", stands_for)
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, quantization="int8", progress=False)
    assert_matches(engine.generate(PROMPTS, GREEDY), transformers_greedy(stood_for, PROMPTS, GREEDY.max_new_tokens))


# ---- quantized checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized(exact, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "ckpt"
    assert cli_main(["quantize", str(exact), str(out)]) == 0
    return out


def test_quantize_writes_the_rule_and_loads_back_bit_exact(exact, quantized):
    stored = load_file(str(quantized / "model.safetensors"))
    source = load_file(str(exact / "model.safetensors"))
    for name, w in source.items():
        if name.endswith(MATMUL_SUFFIXES):
            q, scale = rule(w)
            assert torch.equal(stored[name], q) and torch.equal(stored[name + "_scale"], scale), name
        else:
            assert torch.equal(stored[name], w), name
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"] == "inkling-int8"
    assert (quantized / "tokenizer.json").is_file() == (exact / "tokenizer.json").is_file()
    from_file, _ = load_model(quantized)  # recognised without asking
    at_load, _ = load_model(exact, quantization="int8")
    ours, theirs = dict(from_file.named_parameters()), dict(at_load.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) and ours[n].dtype == theirs[n].dtype for n in ours)
    assert ours["lm_head.weight"].dtype == torch.int8


def test_a_quantized_checkpoint_serves_two_tensor_parallel_ranks(exact, quantized):
    """Each rank loads its slices of the int8 weights and their whole-row scales."""
    engine = Engine.from_pretrained(quantized, compile=False, tensor_parallel_size=2, progress=False)
    try:
        assert_matches(engine.generate(PROMPTS, GREEDY), transformers_greedy(exact, PROMPTS, GREEDY.max_new_tokens))
    finally:
        engine.close()


def _broken(quantized, tmp_path, edit):
    dst = tmp_path / "broken"
    shutil.copytree(quantized, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


SCALE = "model.layers.0.self_attn.q_proj.weight_scale"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(SCALE), r"missing 1 tensor\(s\): " + SCALE),
    (lambda t: t.update({SCALE: t[SCALE][:-1]}), r"wrong shape .*" + SCALE),
    (lambda t: t[SCALE].__setitem__(0, float("nan")), SCALE + r" \(scales must be positive and finite\)"),
    (lambda t: t[SCALE].__setitem__(3, 0.0), SCALE + r" \(scales must be positive and finite\)"),
    (lambda t: t.update({"lm_head.weight": t["lm_head.weight"].float()}), r"lm_head.weight \(stored as float32"),
], ids=["missing", "misshaped", "nan", "zero", "not-int8"])
def test_a_bad_quantized_checkpoint_is_refused_by_name(quantized, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(_broken(quantized, tmp_path, edit))


def test_int8_weights_without_their_config_block_are_refused_by_name(quantized, tmp_path):
    """An int8 checkpoint whose config.json lost its quantization_config: never raw q taken as weights."""
    config = json.loads((quantized / "config.json").read_text())
    del config["quantization_config"]
    with_scales = _broken(quantized, tmp_path, lambda t: None)
    (with_scales / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="these look like int8 scales, but config.json has no quantization_config"):
        load_model(with_scales)
    scales = [n for n in load_file(str(quantized / "model.safetensors")) if n.endswith("_scale")
              and not n.endswith("global_scale")]
    shutil.rmtree(with_scales)
    bare = _broken(quantized, tmp_path, lambda t: [t.pop(n) for n in scales])
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"q_proj.weight \(stored as int8, but config.json has no quantization_config"):
        load_model(bare)


def test_a_weight_int8_cannot_quantize_is_named_without_the_check_finite_hint(checkpoint, tmp_path):
    def nan_row(tensors):
        tensors["model.layers.0.self_attn.q_proj.weight"][2, 3] = float("nan")

    broken = _broken(checkpoint("tiny"), tmp_path, nan_row)
    with pytest.raises(CheckpointError, match=r"q_proj.weight \(non-finite values, NaN or inf: nothing to quantize\)") as e:
        load_model(broken, quantization="int8", check_finite=False)
    assert "check_finite" not in str(e.value)


def test_quantization_options_are_checked(quantized, exact, tmp_path):
    with pytest.raises(OptionError, match="int8 checkpoint: quantization='none'"):
        load_model(quantized, quantization="none")
    with pytest.raises(OptionError, match="unsupported quantization 'int4'"):
        load_model(exact, quantization="int4")
    other = tmp_path / "other"
    shutil.copytree(quantized, other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="names 'gptq', which this engine does not read"):
        load_model(other)
    config["quantization_config"] = {"quant_method": "inkling-int8", "bits": 4}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="with bits=4: this engine reads bits=8"):
        load_model(other)

def test_quantize_refuses_what_it_cannot_quantize(quantized, checkpoint, tmp_path, capsys):
    assert cli_main(["quantize", str(quantized), str(tmp_path / "again")]) != 0
    assert "already quantized" in capsys.readouterr().err
    assert cli_main(["quantize", str(checkpoint("tiny", layout="original")), str(tmp_path / "original")]) != 0
    assert "original ('model.llm.') layout" in capsys.readouterr().err
    assert not (tmp_path / "again").exists() and not (tmp_path / "original").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "model.safetensors.index.json").write_text("{}")  # a stale index the loader would prefer
    assert cli_main(["quantize", str(checkpoint("tiny")), str(taken)]) != 0
    assert "exists and is not an empty folder" in capsys.readouterr().err
    no_config = tmp_path / "no-config"
    shutil.copytree(checkpoint("tiny"), no_config)
    (no_config / "config.json").unlink()
    assert cli_main(["quantize", str(no_config), str(tmp_path / "out")]) != 0
    assert "no config.json" in capsys.readouterr().err and not (tmp_path / "out").exists()
