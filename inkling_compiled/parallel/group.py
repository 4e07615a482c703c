"""One rank's share of the model: which heads, channels, experts and vocabulary rows it holds, and the
two collectives its step needs.

Tensor parallelism splits every layer Megatron-style: query heads (with their relative-bias rows) and
KV heads (with their k/v convs, which are depthwise, so a channel's conv follows its head) go to ranks
in order; o_proj is row-parallel; the dense MLP and the shared experts split their intermediate width;
routed experts are whole, split by expert index (expert parallelism); embedding and lm_head split the
vocabulary. One all-reduce after attention and one after the MLP sum the partial outputs, so the
attention-output and MLP-output convs, the norms and the router run replicated on the full hidden.

Splits that do not divide go as evenly as they can (5 experts on 2 ranks are 3 + 2), except query heads:
they must divide, and KV heads either divide or are fewer than the ranks (then each is replicated on
the ranks whose query heads read it, as vLLM does).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed._functional_collectives as funcol

from ..config import InklingConfig, LayerGeometry
from ..errors import ConfigError
from ..quantize import SCALE_SUFFIX, is_weight_scale

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# torch 2.13 renamed all_gather_tensor (which still works, with a warning); 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def even_span(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's part when n items split as evenly as they go (the first n % world get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_divisible(config: InklingConfig, world: int) -> None:
    """A ConfigError naming each head count that cannot be split over `world` ranks."""
    problems = []
    for heads, kv in (("num_attention_heads", "num_key_value_heads"),
                      ("swa_num_attention_heads", "swa_num_key_value_heads")):
        h, k = getattr(config, heads), getattr(config, kv)
        if h % world:
            problems.append(f"{heads}={h} is not divisible by tensor_parallel_size={world}")
        elif k % world and world % k:
            problems.append(f"{kv}={k} neither divides by nor divides tensor_parallel_size={world}")
    if problems:
        raise ConfigError("cannot shard this model: " + "; ".join(problems))


class TensorParallel:
    """Rank `rank` of `world`; `group` names the process group the step's collectives run on."""

    def __init__(self, config: InklingConfig, rank: int, world: int, group: str | None = None):
        check_divisible(config, world)
        self.config, self.rank, self.world, self.group = config, rank, world, group

    # ---- what this rank holds -------------------------------------------------------------------

    def span(self, n: int) -> tuple[int, int]:
        return even_span(n, self.rank, self.world)

    def padded_span(self, n: int) -> tuple[int, int, int]:
        """(start, stop, rows): an equal share of ceil(n / world) rows per rank, the last ones padded, so
        that the shares gather into one tensor (vocabulary rows)."""
        rows = -(-n // self.world)
        start = min(self.rank * rows, n)
        return start, min(start + rows, n), rows

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """[start, stop) of the KV heads this rank holds: its share, or the one head its query heads read."""
        if num_kv_heads >= self.world:
            per = num_kv_heads // self.world
            return self.rank * per, (self.rank + 1) * per
        head = self.rank * num_kv_heads // self.world
        return head, head + 1

    def local_config(self) -> InklingConfig:
        """The config as one rank sees its attention: its query and KV heads (the pool, the step buffers
        and attention read head counts from it; every other width is split by the modules themselves)."""
        c = self.config
        if self.world == 1:
            return c

        def kv(n: int) -> int:
            start, stop = self.kv_heads(n)
            return stop - start

        return dataclasses.replace(
            c, num_attention_heads=c.num_attention_heads // self.world, num_key_value_heads=kv(c.num_key_value_heads),
            swa_num_attention_heads=c.swa_num_attention_heads // self.world,
            swa_num_key_value_heads=kv(c.swa_num_key_value_heads))

    def shard_rule(self, name: str) -> tuple[int, int, int, int] | None:
        """How checkpoint tensor `name` (transformers names) is cut for this rank: (dim, start, stop, rows
        held) or None when every rank holds all of it. rows > stop - start pads with zeros."""
        c = self.config
        if is_weight_scale(name):  # an int8 weight's scales, one per row: cut as the rows are
            weight = name[:-len(SCALE_SUFFIX)]
            rule = self.shard_rule(weight)
            last = 2 if "experts." in weight else 1  # the weight's input dimension (banks are [E, rows, in])
            return None if rule is None or rule[0] == last else rule
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, stop, rows = self.padded_span(c.vocab_size if name.startswith("model.") else c.logits_vocab_size)
            return 0, start, stop, rows
        m = _LAYER.match(name)
        if m is None:
            return None
        suffix = name[m.end():]
        g: LayerGeometry = c.geometry(int(m.group(1)))

        def by_head(dim: int, per_head: int) -> tuple[int, int, int, int]:
            per_rank = g.num_heads // self.world
            return dim, self.rank * per_rank * per_head, (self.rank + 1) * per_rank * per_head, per_rank * per_head

        def by_kv_head(dim: int) -> tuple[int, int, int, int]:
            start, stop = self.kv_heads(g.num_kv_heads)
            return dim, start * g.head_dim, stop * g.head_dim, (stop - start) * g.head_dim

        def even(dim: int, n: int) -> tuple[int, int, int, int]:
            start, stop = self.span(n)
            return dim, start, stop, stop - start

        rules = {
            "self_attn.q_proj.weight": lambda: by_head(0, g.head_dim),
            "self_attn.r_proj.weight": lambda: by_head(0, c.d_rel),
            "self_attn.o_proj.weight": lambda: by_head(1, g.head_dim),
            "self_attn.k_proj.weight": lambda: by_kv_head(0),
            "self_attn.v_proj.weight": lambda: by_kv_head(0),
            "self_attn.k_sconv.conv1d.weight": lambda: by_kv_head(0),
            "self_attn.v_sconv.conv1d.weight": lambda: by_kv_head(0),
            "mlp.gate_proj.weight": lambda: even(0, c.intermediate_size),
            "mlp.up_proj.weight": lambda: even(0, c.intermediate_size),
            "mlp.down_proj.weight": lambda: even(1, c.intermediate_size),
            "mlp.experts.gate_up_proj": lambda: even(0, c.n_routed_experts),
            "mlp.experts.down_proj": lambda: even(0, c.n_routed_experts),
            "mlp.shared_experts.gate_proj": lambda: even(1, c.moe_intermediate_size),
            "mlp.shared_experts.up_proj": lambda: even(1, c.moe_intermediate_size),
            "mlp.shared_experts.down_proj": lambda: even(2, c.moe_intermediate_size),
        }
        rule = rules.get(suffix)
        return rule() if rule is not None else None

    def take(self, name: str, read) -> torch.Tensor:
        """This rank's part of tensor `name`; `read(index)` reads the tensor at an index (a tuple of slices),
        so that a lazy reader touches only the slice."""
        rule = self.shard_rule(name)
        if rule is None:
            return read(())
        dim, start, stop, rows = rule
        part = read((slice(None),) * dim + (slice(start, stop),))
        if stop - start < rows:  # the last vocabulary share: zero rows, cut off after the gather
            pad = list(part.shape)
            pad[dim] = rows - (stop - start)
            # (an int8 weight's padding rows are zero at scale 1: a zero scale marks a broken checkpoint)
            fill = part.new_ones if is_weight_scale(name) else part.new_zeros
            part = torch.cat([part, fill(pad)], dim=dim)
        return part

    # ---- the step's collectives (traceable: a compiled step stays one graph) ----------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        return funcol.all_reduce(x, "sum", self.group)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dimension (the vocabulary shares of the logits)."""
        if self.world == 1:
            return x
        return _all_gather(x.contiguous(), x.dim() - 1, self.group)


