"""bf16 as transformers does it: our bf16 against transformers' InklingForCausalLM in bf16, on CPU.

The oracle is transformers in bf16 with its own modules' casts: fp32 short convs (residual included),
fp32 router, fp32 softmax rounded to bf16, fp32 RMSNorm statistics, fp32 tau, fp32 shared-expert sum,
bf16 everywhere else (`attn_implementation="eager"`, `experts_implementation="eager"`). transformers'
default kernels round differently in bf16 and are not the oracle: sdpa's fused CPU kernel keeps the
scores in fp32 (against eager: up to 4.3 max |logit diff| on `tiny`, via a router flip), and the
grouped_mm experts sum the top-k expert outputs in fp32 where the eager loop adds them in bf16 (the
same for k=2; for `tiny-k3`, k=3, 0.06 at one token). `tools/bf16_drift.py` reports both.

Tolerances, from what was measured (2-core x86 CPU, torch 2.13, transformers 5.23):
- Our full-sequence bf16 forward equals transformers' bf16 forward bit for bit (max |logit diff| 0
  over lengths 1..80, both configs), and so does the engine's decode with transformers' attention
  casts, except where a bf16 GEMM's row count changes an output's last bit (ATen rounds about 2e-5 of
  them differently for one row than for thirty): transformers' own bf16 decode (one row) and its own
  full forward (L rows) differ that way too, by one ulp in a logit of 4-8, 0.029 in its logprob.
  The tolerance, for logits and logprobs alike, is one bf16 ulp at the top of the logit range:
  2**-4 for 8 <= |logit| < 16 (every logit here is below 16, checked).
- transformers' own bf16-vs-fp32 drift on the same prompts is max 3-6 in the logits (50-100x the
  tolerance; the median of each position's max is 0.09-0.12) and up to 0.5-8 in chosen-token
  logprobs. Every cast broken on purpose (conv output or router logits rounded to bf16, RMSNorm
  weight multiply, SwiGLU product or attention probabilities left in fp32) moved the logits by
  0.125-5.4, and 73-92% of them by at least one ulp.
- Greedy tokens must agree where fp32 transformers' top-2 margin is WIDE (0.5 logits, 8 ulps at the
  top of the range) at that step and every step before: bf16-vs-fp32 per-step logit drift is a
  median 0.09-0.12 and a 90th percentile 0.18-0.34, so a wide margin does not close in bf16 short of
  a discontinuity (a router top-k flip).

The C++ CPU decode-attention kernels (paged and ring) round in bf16 as transformers (and the ops'
reference and CUDA kernels) do: q*tau, q.k, its 1/hd product, bias*tau, the scores and the
probabilities each to bf16, the softmax in fp32 (ATen's own kernel: std::exp's last bit differs, and
moved a probability's bf16 rounding), p.v summed in fp32 and rounded once. On every decode call of
both configs they equal the reference kernels bit for bit, and the eager engine is held to the same
tolerance on them as on the reference kernels. The compiled step is held to the
greedy tokens only: its inductor kernels skip the bf16 rounding of intermediates inside fused
elementwise chains (`emulate_precision_casts` is off), which moves logprobs by the size of
bf16-vs-fp32 drift itself.
"""

import contextlib
import dataclasses

import pytest
import torch

from inkling_compiled import load_model
from inkling_compiled.custom_ops.library import native_kernels, reference_kernels
from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams

from conftest import PARITY_CONFIGS, PARITY_LENGTHS, checkpoint_named, random_prompt

transformers = pytest.importorskip("transformers")

LOGIT_RANGE = 16.0  # every logit of the tiny models is below this (checked): bf16 spacing there is <= 2**-4
TOL_LOGIT = 2.0 ** -4
TOL_LOGPROB = TOL_LOGIT
WIDE = 0.5
NEW = 8
TOP = 20  # top logprobs compared per step, beside the chosen token's
PROMPTS = [random_prompt(n, seed=3000 + n) for n in range(1, 61, 2)]  # 30 prompts: past window, band and log floor
DECODE_ATTENTION_OPS = ("paged_attention", "ring_attention")


@dataclasses.dataclass
class Reference:
    """transformers bf16 greedy run of one prompt, and how many leading steps have a wide fp32 margin."""
    prompt: list[int]
    tokens: list[int]
    logprobs: torch.Tensor  # [NEW, V] log-softmax of transformers' bf16 logits at each step
    wide_steps: int


@pytest.fixture(scope="module")
def hf_bf16(checkpoint):
    models = {}

    def get(name):
        if name not in models:
            m = transformers.InklingForCausalLM.from_pretrained(
                checkpoint(name), dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager")
            m.generation_config.eos_token_id = None
            models[name] = m.eval()
        return models[name]

    return get


@pytest.fixture(scope="module")
def references(hf_bf16, hf_model):
    cache = {}

    def get(name):
        if name not in cache:
            rows = []
            for p in PROMPTS:
                out = hf_bf16(name).generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                             output_logits=True, return_dict_in_generate=True)
                seq = out.sequences[0]
                tokens = seq[len(p):]
                logits = torch.stack(out.logits, 1)[0].float()
                assert logits.abs().max() < LOGIT_RANGE
                # fp32 transformers on the same tokens: its top-2 margin at each step (narrow where it picks another)
                with torch.no_grad():
                    top2 = hf_model(name)(seq[None, :-1]).logits[0, len(p) - 1:].topk(2, dim=-1)
                wide = (top2.indices[:, 0] == tokens) & (top2.values[:, 0] - top2.values[:, 1] >= WIDE)
                rows.append(Reference(p, tokens.tolist(), torch.log_softmax(logits, -1),
                                      int(wide.int().cumprod(0).sum())))
            cache[name] = rows
        return cache[name]

    return get


def transformers_attention_casts():
    """Decode attention on the ops' reference kernels (the CUDA kernels' math: transformers' casts)
    in place of the C++ CPU kernels, for as long as the block runs."""
    return reference_kernels(*DECODE_ATTENTION_OPS)


_outputs = {}


def engine_outputs(checkpoint, name, mode):
    """The engine's greedy outputs for PROMPTS in bf16: mode "eager", "compiled" (tiny, 2 slots, buckets
    1 and 2) or "eager-transformers-attention"; built and run once per module."""
    if (name, mode) not in _outputs:
        if mode == "compiled":
            engine = Engine.from_pretrained(checkpoint(name), dtype=torch.bfloat16, compile=True, max_batch_size=2,
                                            buckets=(1, 2), progress=False)
        else:
            engine = Engine.from_pretrained(checkpoint(name), dtype=torch.bfloat16, compile=False,
                                            max_batch_size=len(PROMPTS), progress=False)
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=True, top_logprobs=TOP)
        casts = transformers_attention_casts() if mode == "eager-transformers-attention" else contextlib.nullcontext()
        with casts:
            _outputs[name, mode] = engine.generate(PROMPTS, params)
    return _outputs[name, mode]


def logprob_diffs(ref: Reference, out) -> torch.Tensor:
    """|engine - transformers| over the chosen and top logprobs of each step up to and including the
    first token that differs (the prefixes are equal up to there)."""
    same = next((i for i, (a, b) in enumerate(zip(ref.tokens, out.token_ids)) if a != b), NEW - 1)
    diffs = []
    for step in range(same + 1):
        pairs = [(out.token_ids[step], out.logprobs[step])] + list(out.top_logprobs[step])
        want = ref.logprobs[step, [t for t, _ in pairs]]
        diffs.append((torch.tensor([lp for _, lp in pairs]) - want).abs())
    return torch.cat(diffs)


# ---- loading and the full-sequence forward -----------------------------------------------------------

@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_bf16_keeps_the_tensors_transformers_keeps_in_fp32(name, checkpoint, hf_bf16):
    ours, _ = load_model(checkpoint(name), dtype=torch.bfloat16)
    theirs = hf_bf16(name).state_dict()
    dtypes = {n: t.dtype for n, t in checkpoint_named(ours).items()}
    assert dtypes == {n: theirs[n].dtype for n in dtypes}
    assert {torch.float32, torch.bfloat16} == set(dtypes.values())


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_bf16_on_cpu_keeps_every_weight_as_stored(name, checkpoint):
    """ATen's bf16 GEMM rounds by the weight's layout on some CPUs (a transposed W moved tiny's logits by
    0.086 on an AVX2 EPYC): bf16 weights stay [out, in] contiguous, as transformers holds them."""
    model, _ = load_model(checkpoint(name), dtype=torch.bfloat16)
    matmuls = {n: p for n, p in model.state_dict().items() if p.dim() >= 2 and p.dtype == torch.bfloat16}
    assert len(matmuls) > 10
    assert [n for n, p in matmuls.items() if not p.is_contiguous()] == []


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_full_sequence_logits_match_transformers_bf16(name, checkpoint, hf_bf16, hf_model):
    model, _ = load_model(checkpoint(name), dtype=torch.bfloat16)
    prompts = [random_prompt(n, seed=n) for n in PARITY_LENGTHS]
    ours = model.forward_sequences(prompts)  # packed varlen, one pass
    worst = drift = 0.0
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            want = hf_bf16(name)(torch.tensor([prompt])).logits[0].float()
            fp32 = hf_model(name)(torch.tensor([prompt])).logits[0]
        assert got.dtype == torch.bfloat16 and want.abs().max() < LOGIT_RANGE
        worst = max(worst, (got.float() - want).abs().max().item())
        drift = max(drift, (want - fp32).abs().max().item())
    print(f"\n{name}: max |logit diff| bf16 vs transformers bf16 {worst:.3g}; transformers bf16 vs fp32 {drift:.3g}")
    assert worst <= TOL_LOGIT
    assert drift > 8 * TOL_LOGIT  # the tolerance tells bf16-as-transformers from bf16 drift


# ---- the engine: prefill, then decode through the pool's paged and ring attention --------------------

@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_engine_with_transformers_attention_casts_matches_transformers_bf16(name, checkpoint, references):
    """Everything but the C++ attention kernels as the engine runs it (pool, pages, rings, conv ops,
    batched prefill and decode, sampler): identical tokens at every step, logprobs within TOL_LOGPROB."""
    refs = references(name)
    outs = engine_outputs(checkpoint, name, "eager-transformers-attention")
    for ref, out in zip(refs, outs):
        assert out.token_ids == ref.tokens
    worst = max(logprob_diffs(ref, out).max().item() for ref, out in zip(refs, outs))
    print(f"\n{name}: {len(refs)} prompts x {NEW} steps, max |logprob diff| {worst:.2g}")
    assert worst <= TOL_LOGPROB


ENGINE_CASES = [("tiny", "eager"), ("tiny-k3", "eager"), ("tiny", "compiled")]


@pytest.mark.parametrize("name, mode", ENGINE_CASES)
def test_engine_greedy_matches_transformers_bf16_where_fp32_margin_is_wide(name, mode, checkpoint, references):
    """The default engine (C++ kernels; compiled: inductor): on each prompt, the leading steps where fp32
    transformers picks the same token with a top-2 margin of at least WIDE give the same tokens."""
    refs = references(name)
    outs = engine_outputs(checkpoint, name, mode)
    steps = sum(r.wide_steps for r in refs)
    prompts = sum(r.wide_steps > 0 for r in refs)
    assert steps >= 30 and prompts >= 12, f"only {steps} steps of {prompts} prompts have a wide margin"
    for ref, out in zip(refs, outs):
        assert out.token_ids[:ref.wide_steps] == ref.tokens[:ref.wide_steps]
    print(f"\n{name} {mode}: greedy tokens equal on {steps} wide-margin steps of {prompts} prompts")


@pytest.mark.parametrize("name, mode", [case for case in ENGINE_CASES if case[1] == "eager"])
def test_engine_logprobs_match_transformers_bf16(name, mode, checkpoint, references):
    """The default eager engine (C++ decode-attention kernels): identical tokens at every step,
    logprobs within TOL_LOGPROB."""
    assert native_kernels(), "the C++ CPU kernels should build on a machine with a compiler"
    refs = references(name)
    outs = engine_outputs(checkpoint, name, mode)
    worst = max(logprob_diffs(ref, out).max().item() for ref, out in zip(refs, outs))
    print(f"\n{name} {mode}: max |logprob diff| vs transformers bf16 {worst:.2g}")
    for ref, out in zip(refs, outs):
        assert out.token_ids == ref.tokens
    assert worst <= TOL_LOGPROB
