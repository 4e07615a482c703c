"""bf16 vs fp32 drift on a tiny checkpoint, and bf16 against transformers in bf16. Reported, not asserted.

    python tools/bf16_drift.py [--config tiny] [--length 40] [--new-tokens 32]

Ours bf16 vs ours fp32: max |logit diff| and greedy agreement (full recomputation). With transformers
installed, also ours bf16 against transformers bf16, which is what tests/test_bf16.py asserts:
- the full-sequence logits against transformers' own casts (eager attention, eager experts), against
  its default kernels (sdpa, grouped_mm experts), and transformers' own bf16-vs-fp32 drift as the scale;
- the eager engine's decode (the C++ CPU attention kernels, then the ops' reference kernels, which round
  as transformers does) against transformers' bf16 `generate`: tokens equal, max |logprob diff| of the
  chosen tokens up to the first token that differs; transformers fp32 on the same tokens as the scale.
"""

import argparse
import contextlib
import tempfile

import torch

from inkling_compiled import load_model
from inkling_compiled.generation import greedy_full_recompute
from inkling_compiled.tiny import build_tiny_checkpoint


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def against_transformers(path, bf16, prompt: list[int], new_tokens: int) -> None:
    try:
        import transformers
    except ImportError:
        print("transformers not installed: no comparison with transformers bf16")
        return
    from inkling_compiled.custom_ops.library import reference_kernels
    from inkling_compiled.engine import Engine
    from inkling_compiled.sampling import SamplingParams

    def hf(dtype, **kw):
        m = transformers.InklingForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
        m.generation_config.eos_token_id = None
        return m

    own_casts = hf(torch.bfloat16, attn_implementation="eager", experts_implementation="eager")
    default = hf(torch.bfloat16)
    fp32 = hf(torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want, want_default, want32 = (m(ids).logits[0].float() for m in (own_casts, default, fp32))
    ours = bf16.forward_sequences([prompt])[0].float()
    print("full sequence, max |logit diff|:")
    for label, a, b in (("ours bf16 vs transformers bf16 (eager attention and experts)", ours, want),
                        ("ours bf16 vs transformers bf16 (defaults: sdpa, grouped_mm) ", ours, want_default),
                        ("transformers bf16 (eager) vs transformers fp32 (the scale)  ", want, want32)):
        print(f"  {label} = {(a - b).abs().max().item():.4f}")

    out = own_casts.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1).gather(-1, tokens[:, None])[:, 0]
    with torch.no_grad():  # the scale: transformers fp32 on the same tokens, every step
        logits32 = fp32(out.sequences[:, :-1]).logits[0, len(prompt) - 1:].float()
    drift = (torch.log_softmax(logits32, -1).gather(-1, tokens[:, None])[:, 0] - logprobs).abs()
    tokens = tokens.tolist()
    print(f"engine decode vs transformers bf16 generate ({new_tokens} greedy tokens):")
    engine = Engine.from_pretrained(path, dtype=torch.bfloat16, compile=False, max_batch_size=1, progress=False)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=True)
    for label, casts in (("C++ attention kernels   ", contextlib.nullcontext()),
                         ("reference attention ops ", reference_kernels("paged_attention", "ring_attention"))):
        with casts:
            got = engine.generate([prompt], params)[0]
        n = first_difference(got.token_ids, tokens)
        diff = (torch.tensor(got.logprobs[:n]) - logprobs[:n]).abs()
        print(f"  {label}: tokens equal {n}/{new_tokens}, max |logprob diff| "
              + (f"{diff.max().item():.4f} (median {diff.median().item():.4f})" if n else "-"))
    print(f"  transformers fp32 on the same tokens (the scale): max |logprob diff| {drift.max().item():.4f} "
          f"(median {drift.median().item():.4f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--length", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_checkpoint(d, args.config)
        fp32, _ = load_model(path, dtype=torch.float32)
        bf16, _ = load_model(path, dtype=torch.bfloat16)
        prompt = torch.randint(3, 259, (args.length,), generator=torch.Generator().manual_seed(0)).tolist()
        a = fp32.forward_sequences([prompt])[0]
        b = bf16.forward_sequences([prompt])[0].float()
        ga = greedy_full_recompute(fp32, prompt, args.new_tokens)
        gb = greedy_full_recompute(bf16, prompt, args.new_tokens)
        first = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), None)
        print(f"config={args.config} prompt={args.length} tokens")
        print(f"max |logit(bf16) - logit(fp32)| = {(a - b).abs().max().item():.3f} "
              f"(max |logit| {a.abs().max().item():.2f})")
        print(f"greedy tokens equal: {sum(x == y for x, y in zip(ga, gb))}/{len(ga)}"
              + (f", first divergence at token {first}" if first is not None else ""))
        against_transformers(path, bf16, prompt, args.new_tokens)


if __name__ == "__main__":
    main()
