"""Decode tokens/s: eager engine (and the compiled one, when available) vs transformers' generate.

    OMP_NUM_THREADS=1 python tools/bench_decode.py [--configs tiny small] [--batches 1 8 32]
                                                   [--prompt-len 64] [--new-tokens 64] [--json out.json]

Same process, same weights, one thread. Prints one line per (config, batch), a markdown table of
ratios, and writes JSON. Also available as `inkling-compiled bench`.
"""

import sys

from inkling_compiled.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
