"""The kernel choices this machine has measured (`inkling_compiled/kernel_choice.py`), as a markdown
table: per weight shape and thread count, the layout stored, the row counts the C++ kernel serves, and
its time over ATen's per measured row count in that layout.

    python tools/kernel_choices.py [--threads 1 2] [--min-floats 131072]

Reads the cache files of this machine's key (the kernels' current build); a thread count no engine
has loaded at yet has none.
"""

import argparse

import msgspec

from inkling_compiled.kernel_choice import ROWS, ChoiceFile, choices_path, machine_key


def rows_text(rows: list[int]) -> str:
    if not rows:
        return "none"
    if rows == [r for r in ROWS if rows[0] <= r <= rows[-1]] and len(rows) > 2:
        return f"{rows[0]}-{rows[-1]}"
    return ", ".join(map(str, rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--min-floats", type=int, default=128 * 1024, help="leave out smaller weights")
    args = p.parse_args()
    print("| weight [O, H] | threads | layout | C++ kernel at rows | ours / ATen at " + " / ".join(map(str, ROWS)) + " rows |")
    print("|---|---|---|---|---|")
    for threads in args.threads:
        path = choices_path(machine_key(threads))
        if not path.exists():
            print(f"| (nothing measured at {threads} thread(s): {path}) | | | | |")
            continue
        saved = msgspec.json.decode(path.read_bytes(), type=ChoiceFile)
        for s in sorted(saved.shapes, key=lambda s: (s.out_features * s.in_features, s.out_features)):
            if s.out_features * s.in_features < args.min_floats:
                continue
            ratios = " / ".join(f"{o / a:.2f}" for o, a in zip(s.ours_us[s.layout], s.aten_us[s.layout]))
            print(f"| {s.out_features}x{s.in_features} | {threads} | {s.layout} | {rows_text(s.ours_rows())} | {ratios} |")


if __name__ == "__main__":
    main()
