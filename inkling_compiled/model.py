"""The Inkling text model: math only.

Tokens are packed: every tensor is `[T, ...]` over the T tokens of one forward, whatever requests
they belong to. Anything that depends on where a token sits (its position, its sequence, its conv
history, its keys and values) is asked of a *forward context* passed down the layers:

    ctx.enter_layer(layer_id)  -> before a layer touches any state (where a HiCache barrier goes)
    ctx.short_conv(x32, weight, layer_id, stream) -> conv(x32) without residual, fp32
    ctx.attention(layer_id, geometry, q, k, v, r, rel_proj) -> [T, nh, hd]

`contexts.FullSequenceContext` runs sequences from scratch; `contexts.PoolContext` answers the same
calls from the serving engine's state pool. Parameter names equal transformers' module names, so a
transformers state dict loads as is (see `checkpoint.py`).

Every projection, expert bank and the lm_head may be int8 (weight-only quantization, `quantize.py`):
each then has a `<name>_scale` parameter, one fp32 scale per output row, None in an fp32 or bf16 model,
and goes through the int8 ops.

Projections that read the same input are one weight here (`FUSED_PROJECTIONS`): q, k, v and r of an
attention layer, gate and up of a dense MLP and of each shared expert. A step then makes one call where
the checkpoint has several (each call has a fixed cost that a batch-1 decode step pays dozens of times),
and the rows of each part are the checkpoint's own, so every output is the same dot product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inkling_compiled import custom_ops  # noqa: F401  (registers torch.ops.inkling)

from .config import InklingConfig
from .contexts import FullSequenceContext
from .nvtx import nvtx_range
from .parallel.group import TensorParallel
from .quantize import SCALE_SUFFIX, is_matmul_weight
from .streams import ATTN_STREAM, K_STREAM, MLP_STREAM, V_STREAM

# Projections go through the op: a few-row fast path at decode, ATen's GEMM otherwise.
linear = torch.ops.inkling.linear


def project(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T: W as loaded, or int8 with one scale per output row."""
    return linear(x, weight) if scale is None else torch.ops.inkling.linear_int8(x, weight, scale)

# A model weight -> (the dimension its parts stack along, the checkpoint's names of the parts, in order).
# Matched as name suffixes; the loader stacks the parts (and an int8 weight's scales) as it reads them.
FUSED_PROJECTIONS = {
    "self_attn.qkvr_proj.weight": (0, ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                       "self_attn.v_proj.weight", "self_attn.r_proj.weight")),
    "mlp.gate_up_proj.weight": (0, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.shared_experts.gate_up_proj": (1, ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
}

CONV_WEIGHT = "sconv.conv1d.weight"  # each short conv's taps [D, 1, K]

# Tensors transformers keeps in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`).
FP32_SUFFIXES = (CONV_WEIGHT, "gate.e_score_correction_bias", "gate.global_scale")


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Linear(nn.Module):
    """A projection without bias (`weight` [out, in]); `weight_scale` is set when the weight is int8."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("weight_scale", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.weight_scale)


class _Tensor(nn.Module):
    """Holds one named parameter, so state-dict names match transformers (`conv1d.weight`, `proj`)."""

    def __init__(self, name: str, shape: tuple[int, ...]):
        super().__init__()
        self.register_parameter(name, nn.Parameter(torch.empty(shape)))


class ShortConv(nn.Module):
    """Depthwise causal conv with its own residual, computed in fp32: out = x + conv(x)."""

    def __init__(self, channels: int, kernel: int, layer_id: int, stream: int):
        super().__init__()
        self.conv1d = _Tensor("weight", (channels, 1, kernel))
        self.layer_id = layer_id
        self.stream = stream

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        x32 = x.float()
        y = ctx.short_conv(x32, self.conv1d.weight[:, 0, :], self.layer_id, self.stream)
        return (y + x32).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: InklingConfig, layer_id: int):
        super().__init__()
        g = self.geometry = config.geometry(layer_id)
        H, K = config.hidden_size, config.conv_kernel_size
        self.layer_id = layer_id
        self.widths = (g.q_width, g.kv_width, g.kv_width, g.num_heads * config.d_rel)  # q, k, v, r
        self.qkvr_proj = Linear(H, sum(self.widths))
        self.o_proj = Linear(g.q_width, H)
        self.k_sconv = ShortConv(g.kv_width, K, layer_id, K_STREAM)
        self.v_sconv = ShortConv(g.kv_width, K, layer_id, V_STREAM)
        self.q_norm = RMSNorm(g.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(g.head_dim, config.rms_norm_eps)
        self.rel_logits_proj = _Tensor("proj", (config.d_rel, g.rel_extent))

    def forward(self, a: torch.Tensor, ctx) -> torch.Tensor:
        g, T = self.geometry, a.shape[0]
        q, k, v, r = self.qkvr_proj(a).split(self.widths, dim=-1)
        q = self.q_norm(q.view(T, g.num_heads, g.head_dim))
        k = self.k_norm(self.k_sconv(k, ctx).view(T, g.num_kv_heads, g.head_dim))
        v = self.v_sconv(v, ctx).view(T, g.num_kv_heads, g.head_dim)
        r = r.view(T, g.num_heads, -1)
        o = ctx.attention(self.layer_id, g, q, k, v, r, self.rel_logits_proj.proj)
        return self.o_proj(o.reshape(T, g.q_width))


class DenseMLP(nn.Module):
    """Under tensor parallelism each rank holds a slice of the intermediate width: its partial output is
    summed with the others' by the layer's all-reduce (global_scale commutes with the sum)."""

    def __init__(self, config: InklingConfig, tp: TensorParallel):
        super().__init__()
        start, stop = tp.span(config.intermediate_size)
        H, I = config.hidden_size, stop - start
        self.gate_up_proj = Linear(H, 2 * I)  # rows [0, I) gate, [I, 2I) up
        self.down_proj = Linear(I, H)
        self.global_scale = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return self.down_proj(hidden) * self.global_scale


class Router(nn.Module):
    """Sigmoid router over routed + shared experts; the correction bias only picks the top-k."""

    def __init__(self, config: InklingConfig):
        super().__init__()
        E, S = config.n_routed_experts, config.n_shared_experts
        self.num_routed, self.top_k, self.route_scale = E, config.num_experts_per_tok, config.route_scale
        self.weight = nn.Parameter(torch.empty(E + S, config.hidden_size))
        self.global_scale = nn.Parameter(torch.empty(1))
        self.e_score_correction_bias = nn.Parameter(torch.empty(E))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (routed expert ids [T,k], routed weights [T,k], shared weights [T,S]) in x.dtype."""
        E = self.num_routed
        logits = F.linear(x.float(), self.weight.float())
        choice = logits[:, :E].sigmoid() + self.e_score_correction_bias
        idx = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        chosen = torch.cat([logits[:, :E].gather(-1, idx), logits[:, E:]], dim=-1)
        log_w = F.logsigmoid(chosen)
        w = torch.exp(log_w - torch.logsumexp(log_w, dim=-1, keepdim=True))
        w = (w * self.route_scale * self.global_scale).to(x.dtype)
        return idx, w[:, : self.top_k], w[:, self.top_k:]


class RoutedExperts(nn.Module):
    """The experts [first, first + count) of the router's E (all of them on one rank): under expert
    parallelism a rank runs its own experts for the tokens routed to them and skips the other choices."""

    def __init__(self, config: InklingConfig, tp: TensorParallel):
        super().__init__()
        self.first, stop = tp.span(config.n_routed_experts)
        self.partial = stop - self.first < config.n_routed_experts
        E, H, I = stop - self.first, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))  # rows [0, I) gate, [I, 2I) up
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.register_parameter("gate_up_proj_scale", None)  # [E, 2I] and [E, H] when the banks are int8
        self.register_parameter("down_proj_scale", None)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.partial:  # another rank's expert becomes id -1, which the op skips
            local = idx - self.first
            idx = torch.where((local >= 0) & (local < self.gate_up_proj.shape[0]), local, -1)
        # An op, so that a compiled step keeps static shapes and still reads only the chosen experts.
        if self.gate_up_proj_scale is None:
            return torch.ops.inkling.moe_experts(x, idx, w, self.gate_up_proj, self.down_proj)
        return torch.ops.inkling.moe_experts_int8(x, idx, w, self.gate_up_proj, self.gate_up_proj_scale,
                                                  self.down_proj, self.down_proj_scale)


class SharedExperts(nn.Module):
    def __init__(self, config: InklingConfig, tp: TensorParallel):
        super().__init__()
        start, stop = tp.span(config.moe_intermediate_size)  # split like the dense MLP's width
        S, H, I = config.n_shared_experts, config.hidden_size, stop - start
        self.gate_up_proj = nn.Parameter(torch.empty(S, 2 * I, H))  # rows [0, I) gate, [I, 2I) up
        self.down_proj = nn.Parameter(torch.empty(S, H, I))
        for name in ("gate_up_proj", "down_proj"):
            self.register_parameter(f"{name}_scale", None)  # [S, rows] when int8

    def forward(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        # One expert at a time through the projection op: at decode that is the few-row kernel, and
        # unlike bmm it lowers for a batch dimension of unknown size.
        total = None
        for s in range(self.gate_up_proj.shape[0]):
            gate, up = project(x, self.gate_up_proj[s], self._scale("gate_up_proj", s)).chunk(2, dim=-1)
            act = F.silu(gate) * up * gammas[:, s:s + 1]  # gamma applies before down_proj
            down = project(act, self.down_proj[s], self._scale("down_proj", s)).float()
            total = down if total is None else total + down
        return total.to(x.dtype)

    def _scale(self, name: str, s: int) -> torch.Tensor | None:
        scale = getattr(self, f"{name}_scale")
        return None if scale is None else scale[s]


class MoE(nn.Module):
    def __init__(self, config: InklingConfig, tp: TensorParallel):
        super().__init__()
        self.gate = Router(config)  # replicated: every rank routes every token the same way
        self.experts = RoutedExperts(config, tp)
        self.shared_experts = SharedExperts(config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w, shared_w = self.gate(x)
        return self.experts(x, idx, w) + self.shared_experts(x, shared_w)


class DecoderLayer(nn.Module):
    """With tensor parallelism attention and MLP give partial sums, each all-reduced before its output conv
    (which, like the norms, runs replicated on the full hidden)."""

    def __init__(self, config: InklingConfig, layer_id: int, tp: TensorParallel | None = None):
        super().__init__()
        H, K = config.hidden_size, config.conv_kernel_size
        self.tp = tp = tp or TensorParallel(config, 0, 1)
        self.layer_id = layer_id
        self.range_name = f"layer {layer_id}"
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.attn_sconv = ShortConv(H, K, layer_id, ATTN_STREAM)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.mlp = MoE(config, tp) if config.is_sparse(layer_id) else DenseMLP(config, tp)
        self.mlp_sconv = ShortConv(H, K, layer_id, MLP_STREAM)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        with nvtx_range(self.range_name):
            ctx.enter_layer(self.layer_id)
            x = x + self.attn_sconv(self.tp.all_reduce(self.self_attn(self.input_layernorm(x), ctx)), ctx)
            return x + self.mlp_sconv(self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x))), ctx)


class NormedEmbedding(nn.Module):
    """Vocabulary-parallel under tensor parallelism: a rank looks up the ids in its share of rows, zeros
    the others, and the all-reduce puts every row together before the (replicated) norm."""

    def __init__(self, config: InklingConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.first, _, rows = tp.padded_span(config.vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, config.hidden_size))
        self.embed_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return self.embed_norm(F.embedding(ids, self.weight))
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return self.embed_norm(self.tp.all_reduce(rows))


class TextModel(nn.Module):
    def __init__(self, config: InklingConfig, mtp_depths: int, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = NormedEmbedding(config, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if mtp_depths:  # the multi-token-prediction head, built only when asked for (`model.mtp.*`)
            self.mtp = MtpHead(config, mtp_depths)


# ---- the multi-token-prediction head (inkling-mtp.md §3; the drafter that serves it is mtp.py) ---------

class MtpDepth(nn.Module):
    """One depth: input_proj(cat[hidden_norm(prev), embed_norm(embedded)]) (hidden first unless the config
    says otherwise), then one decoder layer of the head's block config."""

    def __init__(self, config: InklingConfig, block_config: InklingConfig, depth: int):
        super().__init__()
        H = config.hidden_size
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.embed_norm = RMSNorm(H, config.rms_norm_eps)
        self.input_proj = Linear(2 * H, H)
        self.block = DecoderLayer(block_config, depth)
        self.hidden_first = config.mtp_hidden_states_first

    def forward(self, prev: torch.Tensor, embedded: torch.Tensor, ctx) -> torch.Tensor:
        """prev [T, H], embedded [T, H] (the trunk's normed embedding of each x_{q+m}) -> block output."""
        parts = [self.hidden_norm(prev), self.embed_norm(embedded)]
        fused = self.input_proj(torch.cat(parts if self.hidden_first else parts[::-1], dim=-1))
        return self.block(fused, ctx)


class MtpHead(nn.Module):
    """`depths` MTP depths (`model.mtp.layers.{i}`) and the optional `model.mtp.chain_norm`."""

    def __init__(self, config: InklingConfig, depths: int):
        super().__init__()
        self.block_config = config.mtp_block(depths)
        self.layers = nn.ModuleList(MtpDepth(config, self.block_config, i) for i in range(depths))
        self.chain_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.chain_hidden_post_norm else None
        # The drafts' own lm_head, when drafting reads an int8 copy of the trunk's (`spec.mtp.int8_head`).
        self.draft_lm_head: Linear | None = None

    def logits(self, model: "InklingForCausalLM", out: torch.Tensor) -> torch.Tensor:
        """A depth's draft logits from its output: the trunk's lm_head, or the head's draft copy of it (as
        `model.logits` computes them; the MTP head never runs sharded, so no gather)."""
        if self.draft_lm_head is None:
            return model.logits(out)
        return self.draft_lm_head(out / model.config.logits_mup_width_multiplier)

    def depth(self, index: int, prev: torch.Tensor, embedded: torch.Tensor, ctx) -> torch.Tensor:
        """Depth `index` (0-based): its output, which is both what its logits read and the next depth's prev."""
        y = self.layers[index](prev, embedded, ctx)
        return self.chain_norm(y) if self.chain_norm is not None else y

    @torch.no_grad()
    def forward_sequence(self, model, hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Every depth over one whole sequence from scratch: hidden [n, H] the target's final-normed hidden
        at positions 0..n-1, tokens [n] the sequence. Depth m covers positions 0..n-1-m; returns its
        logits there ([n-m, V]), depth by depth."""
        outs, prev = [], hidden
        for index in range(len(self.layers)):
            m = index + 1
            n = tokens.shape[0] - m
            if n <= 0:
                break
            ctx = FullSequenceContext([n], self.block_config, tokens.device)
            prev = self.depth(index, prev[:n], model.model.embed_tokens(tokens[m:m + n]), ctx)
            outs.append(self.logits(model, prev))
        return outs


class InklingForCausalLM(nn.Module):
    """Embedding -> layers -> final norm -> lm_head / mup multiplier, logits cut to the unpadded vocab.

    With `tp` (a `parallel.TensorParallel` of more than one rank) this is one rank's shard: `config` is
    then the rank's view (its own head counts) and lm_head holds the rank's share of the vocabulary,
    gathered into whole logits on every rank."""

    def __init__(self, config: InklingConfig, mtp_depths: int = 0, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel(config, 0, 1)
        if tp.world > 1 and mtp_depths:
            raise ValueError("the MTP head is not sharded: no MTP depths with tensor parallelism")
        self.config = config = tp.local_config()
        self.model = TextModel(config, mtp_depths, tp)
        # Only the rows that survive the unpadded-vocab cut are kept.
        _, _, rows = tp.padded_span(config.logits_vocab_size)
        self.lm_head = Linear(config.hidden_size, rows)

    def add_int8_scales(self) -> None:
        """Gives every matmul weight its `<name>_scale` parameter (shape [..., rows], on the weight's device:
        meta before a load), so that an int8 state dict loads into this model."""
        for name, p in list(self.named_parameters()):
            if is_matmul_weight(name, tuple(p.shape)):
                owner, _, attr = name.rpartition(".")
                scale = torch.empty(p.shape[:-1], dtype=torch.float32, device=p.device)
                setattr(self.get_submodule(owner), attr + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms'): the weights' too, unless they are int8."""
        return self.model.norm.weight.dtype

    def hidden_states(self, ids: torch.Tensor, ctx) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for index in range(len(self.model.layers)):  # indexed, not iterated: no guard on the list's key order
            layer = self.model.layers[index]
            x = layer(x, ctx)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden / self.config.logits_mup_width_multiplier)
        if self.tp.world == 1:
            return logits
        return self.tp.gather_last(logits)[..., :self.config.logits_vocab_size]

    def forward(self, ids: torch.Tensor, ctx) -> torch.Tensor:
        return self.logits(self.hidden_states(ids, ctx))

    @torch.no_grad()
    def forward_sequences(self, sequences: list[list[int]] | list[torch.Tensor]) -> list[torch.Tensor]:
        """Full-sequence forward of each sequence from scratch, packed into one pass; per-sequence logits."""
        device = self.lm_head.weight.device
        seqs = [torch.as_tensor(s, dtype=torch.long, device=device) for s in sequences]
        ctx = FullSequenceContext([len(s) for s in seqs], self.config, device)
        logits = self(torch.cat(seqs), ctx)
        return list(logits.split([len(s) for s in seqs]))

