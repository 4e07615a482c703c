"""Write a seeded random Inkling checkpoint (config.json, safetensors, tokenizer.json).

    python tools/make_tiny_checkpoint.py OUT_DIR [--config tiny|tiny-k3|small] [--seed 0]
                                         [--layout transformers|original] [--shards N]
"""

import argparse

from inkling_compiled.tiny import TINY_CONFIGS, build_tiny_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--config", default="tiny", choices=sorted(TINY_CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="transformers", choices=["transformers", "original"])
    p.add_argument("--shards", type=int, default=1)
    args = p.parse_args()
    path = build_tiny_checkpoint(args.out_dir, args.config, seed=args.seed, layout=args.layout, shards=args.shards)
    print(path)


if __name__ == "__main__":
    main()
