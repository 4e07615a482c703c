"""The command line, run in-process."""

import json

from inkling_compiled.cli import DEMO_PROMPTS, main


def test_demo_prints_every_prompt_and_a_rate(checkpoint, capsys):
    assert main(["demo", "--model", str(checkpoint("tiny")), "--max-new-tokens", "3", "--compile-backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert all(repr(p) in out for p in DEMO_PROMPTS)
    assert "tokens/s" in out


def test_generate_token_ids_and_bad_prompt(checkpoint, capsys):
    path = str(checkpoint("tiny"))
    assert main(["generate", "--model", path, "--prompt", "5,6,7", "--token-ids", "--max-new-tokens", "4",
                 "--ignore-eos", "--quiet", "--no-compile"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(json.loads(printed)) == 4
    assert main(["generate", "--model", path, "--prompt", "5,999", "--token-ids", "--quiet", "--no-compile"]) == 2
    assert "token id 999 at position 1 is out of range" in capsys.readouterr().err


def test_bench_writes_json_with_ratios(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--configs", "tiny", "--batches", "1", "2", "--prompt-len", "8", "--new-tokens", "4",
                 "--engines", "eager", "transformers", "--json", str(out), "--png", str(png)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["batch"] for r in runs] == [1, 2]
    assert all(r["eager"]["tok_s"] > 0 and r["transformers"]["tok_s"] > 0 for r in runs)
    printed = capsys.readouterr().out
    assert "eager / transformers" in printed
    assert png.is_file() or "matplotlib is not installed" in printed
