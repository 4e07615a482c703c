"""Train the shipped Inkling checkpoint: a small code model with a two-depth MTP head, on the source of the
running Python's own standard library (PSF licence), with a byte-level BPE tokenizer trained on the same files.

    python tools/train_tiny.py OUT_DIR [--steps 800] [--threads 2] [--seed 0]

Everything is seeded: the same Python, torch and thread count give the same files, tokenizer and weights.
Training runs transformers' own differentiable `InklingForCausalLM`; each MTP depth is a one-layer
`InklingTextModel` whose decoder layer's output is taken (as tests/test_mtp.py reads the head), fed as
inkling-mtp.md section 3 lays out, and trained on its own target: depth d predicts the token d+1 ahead.
The router's correction bias, which no gradient reaches, is steered towards equal expert loads (the
auxiliary-loss-free balancing of DeepSeek-V3). OUT_DIR gets config.json, model.safetensors (bf16, the fp32
modules transformers keeps in fp32 stay fp32), tokenizer.json, tokenizer_config.json (with a chat template),
corpus.json (the file lists and their hash), held_out.json (prompts from held-out files), the corpus's
LICENSE-PSF.txt, loss.json, loss.png (with matplotlib) and README.md.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from inkling_compiled.checkpoint import expected_shapes
from inkling_compiled.config import InklingConfig
from inkling_compiled.tiny import write_checkpoint

SPECIALS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2, as in every tiny checkpoint
EOS = 2

# 8 layers (sliding x3 then global, twice), dense MLPs at 0 and 4, 8 routed experts top-2 plus one shared;
# about 9M parameters with the head, so the bf16 file stays under 20 MB.
CONFIG = dict(
    vocab_size=2048, unpadded_vocab_size=2000, hidden_size=256, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=64,
    sliding_window_size=128, d_rel=16, rel_extent=256, log_scaling_n_floor=128, log_scaling_alpha=0.1,
    layer_types=["hybrid_sliding"] * 3 + ["hybrid"] + ["hybrid_sliding"] * 3 + ["hybrid"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"] * 2,
    conv_kernel_size=4, intermediate_size=512, moe_intermediate_size=96,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, route_scale=2.0,
    logits_mup_width_multiplier=4.0, num_mtp_layers=2, mtp_local_layer_ids=[0],
    max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=EOS,
    rms_norm_eps=1e-6, hidden_act="silu", initializer_range=0.02)

# Modules transformers keeps in fp32 whatever the checkpoint's dtype; stored so, the rest in bf16.
FP32_KEPT = ("attn_sconv", "mlp_sconv", "k_sconv", "v_sconv", "e_score_correction_bias", "gate.global_scale")


# ---- corpus ------------------------------------------------------------------------------------

def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's own modules: every .py under it but third-party packages and test suites."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def split_files(files: list[Path], root: Path, held_out_every: int = 20) -> tuple[list[Path], list[Path]]:
    """Whole files held out: those whose path hashes to 0 modulo `held_out_every` (about 5 %)."""
    def held(p):
        return int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), 16) % held_out_every == 0
    return [p for p in files if not held(p)], [p for p in files if held(p)]


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def corpus_record(root: Path, train: list[Path], held: list[Path]) -> dict:
    digest = hashlib.sha256()
    for p in train + held:
        digest.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return {"python": sys.version.split()[0], "stdlib": str(root), "sha256": digest.hexdigest(),
            "train_files": [str(p.relative_to(root)) for p in train],
            "held_out_files": [str(p.relative_to(root)) for p in held]}


# ---- tokenizer ---------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every byte has a token, so any text encodes) with the three special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    return tok


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """All files' ids end to end, each file closed by <eos>."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


# ---- model -------------------------------------------------------------------------------------

class MTPDepth(torch.nn.Module):
    """One draft depth in transformers' modules: the two norms, the fusing projection, one decoder layer."""

    def __init__(self, config, depth: int):
        from transformers.models.inkling.modeling_inkling import InklingRMSNorm, InklingTextModel

        super().__init__()
        H = config.hidden_size
        self.hidden_norm = InklingRMSNorm(H, eps=config.rms_norm_eps)
        self.embed_norm = InklingRMSNorm(H, eps=config.rms_norm_eps)
        self.input_proj = torch.nn.Linear(2 * H, H, bias=False)
        block_config = copy.deepcopy(config)
        block_config.num_hidden_layers = 1
        block_config.layer_types = [config.mtp_layer_types[depth]]
        block_config.mlp_layer_types = ["dense"]
        self.block = InklingTextModel(block_config)  # only its layer is saved; the model gives it masks
        self._out = []
        self.block.layers[0].register_forward_hook(lambda mod, args, out: self._out.append(out))

    def forward(self, prev: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        fused = self.input_proj(torch.cat([self.hidden_norm(prev), self.embed_norm(embedded)], -1))
        self.block(inputs_embeds=fused, use_cache=False)
        return self._out.pop()

    def checkpoint_tensors(self, depth: int) -> dict[str, torch.Tensor]:
        p = f"model.mtp.layers.{depth}."
        out = {p + "hidden_norm.weight": self.hidden_norm.weight, p + "embed_norm.weight": self.embed_norm.weight,
               p + "input_proj.weight": self.input_proj.weight}
        out.update({p + "block." + k: v for k, v in self.block.layers[0].state_dict().items()})
        return out


def build_model(raw: dict, seed: int):
    from transformers import InklingForCausalLM, InklingTextConfig

    torch.manual_seed(seed)
    config = InklingTextConfig(**raw)
    model = InklingForCausalLM(config)
    heads = torch.nn.ModuleList(MTPDepth(config, d) for d in range(raw["num_mtp_layers"]))
    return model, heads


def logits_by_depth(model, heads, x: torch.Tensor) -> list[torch.Tensor]:
    """The trunk's logits over x (position q predicts x_{q+1}), then each depth d's over positions
    0..T-1-d (position q takes the hidden at q and the token x_{q+d}, and predicts x_{q+d+1})."""
    cfg = model.config
    vocab, mup = cfg.unpadded_vocab_size or cfg.vocab_size, cfg.logits_mup_width_multiplier
    T = x.shape[1]
    h = model.model(input_ids=x, use_cache=False).last_hidden_state
    out = [model.lm_head(h / mup)[..., :vocab]]
    embedded = model.model.embed_tokens(x)  # the trunk's normed embedding, as the engine feeds the head
    prev = h
    for d, head in enumerate(heads, start=1):
        prev = head(prev[:, :T - d], embedded[:, d:])
        out.append(model.lm_head(prev / mup)[..., :vocab])
    return out


def losses(model, heads, x: torch.Tensor) -> list[torch.Tensor]:
    """Cross-entropy of the trunk (next token) and of each depth d (the token d+1 further on), in that order."""
    out = []
    for d, logits in enumerate(logits_by_depth(model, heads, x)):
        predicted = logits[:, :-1]  # the last position's target lies past the window
        out.append(F.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), x[:, d + 1:].reshape(-1)))
    return out


class ExpertBalancer:
    """Nudges each router's correction bias up for under-used experts and down for over-used ones."""

    # DeepSeek-V3 used 1e-3 over many thousands of steps; a run of hundreds needs a faster pull.
    def __init__(self, model, rate: float = 1e-2):
        from transformers.models.inkling.modeling_inkling import InklingTopkRouter

        self.rate, self.counts = rate, {}
        self.routers = [m for m in model.modules() if isinstance(m, InklingTopkRouter)]
        for r in self.routers:
            r.register_forward_hook(self._count)

    def _count(self, router, args, out):
        loads = torch.bincount(out[2].reshape(-1), minlength=router.num_experts).float()
        self.counts[router] = self.counts.get(router, 0) + loads

    @torch.no_grad()
    def step(self) -> float:
        """Updates every bias; returns the busiest expert's load over the mean, averaged over the layers."""
        ratios = []
        for r, loads in self.counts.items():
            r.e_score_correction_bias += self.rate * torch.sign(loads.mean() - loads)
            ratios.append((loads.max() / loads.mean().clamp(min=1)).item())
        self.counts.clear()
        return sum(ratios) / max(1, len(ratios))


# ---- training ----------------------------------------------------------------------------------

def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, heads, stream: torch.Tensor, *, steps: int, batch: int, seq: int, seed: int,
          peak_lr: float = 3e-3, warmup: int = 60, mtp_weight: float = 0.3, log=print) -> list[dict]:
    """AdamW over random windows of the stream; returns one record per step (losses, lr, seconds)."""
    params = [p for p in list(model.parameters()) + list(heads.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    balancer = ExpertBalancer(model)
    rng = random.Random(seed)
    history, start = [], time.perf_counter()
    model.train(), heads.train()
    for step in range(steps):
        starts = [rng.randrange(0, len(stream) - seq) for _ in range(batch)]
        x = torch.stack([stream[s:s + seq] for s in starts])
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, steps, peak_lr, warmup)
        parts = losses(model, heads, x)
        total = parts[0] + mtp_weight * sum(parts[1:])
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = balancer.step()
        record = {"step": step + 1, "lr": opt.param_groups[0]["lr"], "seconds": time.perf_counter() - start,
                  "loss": parts[0].item(), "mtp_loss": [p.item() for p in parts[1:]], "expert_imbalance": imbalance}
        history.append(record)
        if (step + 1) % 25 == 0 or step == 0:
            log(f"step {step + 1}/{steps}  loss {record['loss']:.3f}  mtp "
                + " ".join(f"{v:.3f}" for v in record["mtp_loss"])
                + f"  busiest expert / mean {imbalance:.2f}  {record['seconds']:.0f} s")
    model.eval(), heads.eval()
    return history


@torch.no_grad()
def evaluate(model, heads, stream: torch.Tensor, seq: int) -> dict:
    """Mean cross-entropy per token over consecutive windows of the held-out stream: trunk and each depth."""
    sums, count = None, 0
    for s in range(0, len(stream) - seq + 1, seq):
        parts = [p.item() for p in losses(model, heads, stream[s:s + seq][None])]
        sums = parts if sums is None else [a + b for a, b in zip(sums, parts)]
        count += 1
    loss, *mtp = [v / count for v in sums]
    return {"loss": loss, "perplexity": math.exp(loss), "mtp_loss": mtp, "windows": count, "seq": seq}


def checkpoint_tensors(model, heads, raw: dict) -> dict[str, torch.Tensor]:
    """Every tensor the engine and transformers read, in transformers names; bf16 but the fp32-kept ones."""
    tensors = dict(model.state_dict())
    for d, head in enumerate(heads):
        tensors.update(head.checkpoint_tensors(d))
    want = expected_shapes(InklingConfig.from_dict({"model_type": "inkling_text", **raw}), raw["num_mtp_layers"])
    if set(tensors) != set(want) or any(tuple(tensors[n].shape) != s for n, s in want.items()):
        raise RuntimeError(f"the trained tensors do not match the checkpoint's names: missing "
                           f"{sorted(set(want) - set(tensors))[:5]}, extra {sorted(set(tensors) - set(want))[:5]}")
    return {n: t.detach().to(torch.float32 if any(k in n for k in FP32_KEPT) else torch.bfloat16).contiguous()
            for n, t in tensors.items()}


# ---- output ----

SAMPLE_TOKENS = 96  # tokens per held-out sample (each a file's opening)


def held_out_samples(tok, held_texts: list[str], count: int = 8) -> list[list[int]]:
    """The openings of the first `count` held-out files long enough: prompts the tests score and complete
    on any machine, whatever its Python (the corpus itself is this Python's)."""
    out = []
    for enc in tok.encode_batch(held_texts, add_special_tokens=False):
        if len(enc.ids) >= SAMPLE_TOKENS:
            out.append(enc.ids[:SAMPLE_TOKENS])
        if len(out) == count:
            break
    return out


def write_corpus_files(out: Path, root: Path, corpus: dict, tok, held_texts: list[str]) -> None:
    """corpus.json (files and hash), held_out.json (sample prompts) and the corpus's licence beside it."""
    (out / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")
    (out / "held_out.json").write_text(json.dumps({"source": "openings of held-out files (corpus.json)",
                                                   "prompts": held_out_samples(tok, held_texts)}) + "\n")
    licence = root / "LICENSE.txt"
    if licence.is_file():
        (out / "LICENSE-PSF.txt").write_text(licence.read_text(encoding="utf-8", errors="replace"))


# ---- plot and model card -------------------------------------------------------------------------

def plot_losses(history: list[dict], path: Path) -> bool:
    """loss.png: the trunk's and each depth's training loss, smoothed over 25 steps; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def smooth(values, k=25):
        return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, smooth([r["loss"] for r in history]), label="next token (trunk)")
    for d in range(len(history[0]["mtp_loss"])):
        ax.plot(steps, smooth([r["mtp_loss"][d] for r in history]), label=f"MTP depth {d + 1} (token {d + 2} ahead)")
    ax.set_xlabel("step"), ax.set_ylabel("cross-entropy (nats)"), ax.set_title("training loss")
    ax.grid(alpha=0.3), ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def model_card(args, corpus: dict, tokens: dict, history: list[dict], held: dict, params: int, plotted: bool) -> str:
    last = history[-1]
    mtp = ", ".join(f"depth {d + 1} {v:.3f}" for d, v in enumerate(held["mtp_loss"]))
    return f"""# inkling-pystd: a small Inkling code model trained by this repo

Made by `python tools/train_tiny.py OUT_DIR --steps {args.steps} --batch {args.batch} --seq {args.seq} \
--threads {args.threads} --seed {args.seed}`
(torch {torch.__version__}); nothing here was downloaded.

- **Architecture**: the Inkling recipe, {CONFIG['num_hidden_layers']} layers (sliding x3 then global, twice), hidden
  {CONFIG['hidden_size']}, dense MLPs at layers 0 and 4, the rest {CONFIG['n_routed_experts']} routed experts top-\
{CONFIG['num_experts_per_tok']} plus {CONFIG['n_shared_experts']} shared; an MTP head of {CONFIG['num_mtp_layers']} depths
  (depth 1 sliding, depth 2 global); {params / 1e6:.2f}M parameters, stored in bf16 (the short-conv taps and router
  scales in fp32, as transformers keeps them).
- **Corpus**: the standard library of Python {corpus['python']} (`{corpus['stdlib']}`), every module but
  `site-packages` and the test suites: {len(corpus['train_files'])} files for training, {len(corpus['held_out_files'])}
  whole files held out (the path's SHA-256 is 0 modulo 20). Files and their SHA-256 ({corpus['sha256'][:16]}...) are
  in `corpus.json`. Its licence is the Python Software Foundation License (`LICENSE-PSF.txt`, copied from that
  Python); these weights are derived from it.
- **Tokenizer**: byte-level BPE, {tokens['vocab']} tokens (`<pad>`, `<bos>`, `<eos>` first), trained on the training
  files with the `tokenizers` library; {tokens['train']:,} training tokens, {tokens['held_out']:,} held out. The model's
  vocabulary is padded to {CONFIG['vocab_size']}.
- **Training**: {args.steps} steps of AdamW (peak learning rate {args.lr}, warm-up then cosine to a tenth) over
  random windows of {args.seq} tokens, {args.batch} per step ({args.steps * args.batch * args.seq:,} tokens seen);
  each MTP depth's loss weighted {args.mtp_weight}; {last['seconds'] / 60:.1f} minutes on {args.threads} threads.
- **Held-out** ({held['windows']} windows of {held['seq']} tokens): next-token loss {held['loss']:.3f} nats,
  **perplexity {held['perplexity']:.2f}**; MTP loss {mtp}.
- **Chat template**: role-tagged turns (`<|user|>...`), so `/v1/chat/completions` works; the model has only ever
  seen Python source, so ask it for code.

{"![training loss](loss.png)" if plotted else "(matplotlib was not installed, so there is no loss.png; loss.json has the curve)"}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", type=Path, default=None, help="the corpus root (default: this Python's stdlib)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out_dir)

    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"]).resolve()
    train_files, held_files = split_files(stdlib_files(root), root)
    corpus = corpus_record(root, train_files, held_files)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tok = train_tokenizer(train_texts, CONFIG["unpadded_vocab_size"])
    stream, held_stream = token_stream(tok, train_texts), token_stream(tok, held_texts)
    print(f"{len(train_files)} files, {len(stream):,} tokens for training; {len(held_files)} files, "
          f"{len(held_stream):,} held out; tokenizer of {tok.get_vocab_size()} tokens")

    model, heads = build_model(CONFIG, args.seed)
    history = train(model, heads, stream, steps=args.steps, batch=args.batch, seq=args.seq, seed=args.seed,
                    peak_lr=args.lr, mtp_weight=args.mtp_weight)
    held = evaluate(model, heads, held_stream, args.seq)
    print(f"held-out: loss {held['loss']:.3f}, perplexity {held['perplexity']:.2f}, MTP loss "
          + " ".join(f"{v:.3f}" for v in held["mtp_loss"]))

    tensors = checkpoint_tensors(model, heads, CONFIG)
    write_checkpoint(out, CONFIG, tensors, tokenizer=tok)
    write_corpus_files(out, root, corpus, tok, held_texts)
    (out / "loss.json").write_text(json.dumps({"history": history, "held_out": held}) + "\n")
    plotted = plot_losses(history, out / "loss.png")
    params = sum(t.numel() for t in tensors.values())
    tokens = {"vocab": tok.get_vocab_size(), "train": len(stream), "held_out": len(held_stream)}
    (out / "README.md").write_text(model_card(args, corpus, tokens, history, held, params, plotted))
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
