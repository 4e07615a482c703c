"""The short-conv streams: what they are called, and which pool stream holds each (layer, stream).

Every Inkling layer has four short convolutions, one per *model stream* (transformers' `conv_idx`
order): keys, values, attention output, MLP output. The state pool keeps one tensor per *pool
stream*: k and v widths differ between sliding and global layers, so each kind has its own k and v
stream, and a pool stream holds only the layers that use it. This module is the one place both are
spelled out; the model, the pool, the step context, the graph census, the C++ kernels' profiler labels
and the tests all read it.
"""

from __future__ import annotations

from .config import InklingConfig

K_STREAM, V_STREAM, ATTN_STREAM, MLP_STREAM = 0, 1, 2, 3
MODEL_STREAMS = (K_STREAM, V_STREAM, ATTN_STREAM, MLP_STREAM)
STREAM_NAMES = ("k", "v", "attn", "mlp")
# The model's conv module of each stream (transformers' attribute names, which the census reads back).
SCONV_MODULES = ("k_sconv", "v_sconv", "attn_sconv", "mlp_sconv")

POOL_STREAMS = ("k_sliding", "v_sliding", "k_global", "v_global", "attn", "mlp")


def pool_stream(sliding: bool, stream: int) -> str:
    """The pool stream that holds `stream` of a sliding or a global layer."""
    if stream in (K_STREAM, V_STREAM):
        return f"{STREAM_NAMES[stream]}_{'sliding' if sliding else 'global'}"
    return STREAM_NAMES[stream]


class StreamTable:
    """Per config: the layers and width of each pool stream, and where every (layer, stream) lives.

    `layers[name]` lists the model layers a pool stream holds, in order; `widths[name]` its channels;
    `locate(layer, stream)` gives (pool stream, index of the layer inside it). Pool streams no layer
    uses (all layers global, say) are absent.
    """

    def __init__(self, config: InklingConfig):
        n = config.num_hidden_layers
        sliding = [config.geometry(i).sliding for i in range(n)]
        self.sliding_layers = tuple(i for i in range(n) if sliding[i])
        self.global_layers = tuple(i for i in range(n) if not sliding[i])
        swa_kv = config.swa_num_key_value_heads * config.swa_head_dim
        global_kv = config.num_key_value_heads * config.head_dim
        H = config.hidden_size
        widths = {"k_sliding": swa_kv, "v_sliding": swa_kv, "k_global": global_kv, "v_global": global_kv,
                  "attn": H, "mlp": H}
        layers: dict[str, list[int]] = {name: [] for name in POOL_STREAMS}
        self._where: dict[tuple[int, int], tuple[str, int]] = {}
        for layer in range(n):
            for stream in MODEL_STREAMS:
                name = pool_stream(sliding[layer], stream)
                self._where[(layer, stream)] = (name, len(layers[name]))
                layers[name].append(layer)
        self.layers = {name: tuple(ls) for name, ls in layers.items() if ls}
        self.widths = {name: widths[name] for name in self.layers}

    def locate(self, layer_id: int, stream: int) -> tuple[str, int]:
        return self._where[(layer_id, stream)]

    def kv_locate(self, layer_id: int) -> tuple[bool, int]:
        """(whether the layer is sliding, its index among the layers of its kind): where its K/V live."""
        if layer_id in self.sliding_layers:
            return True, self.sliding_layers.index(layer_id)
        return False, self.global_layers.index(layer_id)
