"""The command line: bad input is one clear line and a non-zero exit, never a traceback;
and the happy path works end to end (train -> average -> eval -> translate -> info)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.dispatch import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["--set", "d_model=32", "--set", "d_ff=64", "--set", "h=4", "--set", "encoder_layers=1",
        "--set", "decoder_layers=1"]
PAIRS = [(f"a {w} cat sits {i}", f"eine {w} katze sitzt {i}") for i, w in
         enumerate(["big", "small", "red", "blue"] * 6)]


def corpus(folder: Path, pairs=PAIRS, splits=("train", "val")) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split in splits:
        (folder / f"{split}.en").write_text("".join(p[0] + "\n" for p in pairs))
        (folder / f"{split}.de").write_text("".join(p[1] + "\n" for p in pairs))
    return folder


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


def test_missing_data_file(tmp_path, capsys):
    d = corpus(tmp_path / "d", splits=("val",))
    code, _, err = run_cli(capsys, "train", "--data", str(d), "--out", str(tmp_path / "r"))
    assert code != 0
    assert "no 'en' file for split 'train'" in one_line_error(err)


def test_mismatched_line_counts(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    (d / "train.de").write_text("nur eine zeile\n")
    code, _, err = run_cli(capsys, "train", "--data", str(d), "--out", str(tmp_path / "r"))
    assert code != 0
    line = one_line_error(err)
    assert "train.en has 24 lines" in line and "train.de has 1" in line


def test_empty_training_split(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    (d / "train.en").write_text("\n\n")
    (d / "train.de").write_text("\n\n")
    code, _, err = run_cli(capsys, "train", "--data", str(d), "--out", str(tmp_path / "r"))
    assert code != 0
    assert "empty" in one_line_error(err)


def test_unknown_preset(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "huge", "--data", str(d), "--out", str(tmp_path / "r")])
    assert e.value.code != 0
    assert "invalid choice: 'huge'" in one_line_error(capsys.readouterr().err.splitlines()[-1])


def test_unknown_config_key(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    code, _, err = run_cli(capsys, "train", "--data", str(d), "--out", str(tmp_path / "r"),
                           "--set", "d_modle=64")
    assert code != 0
    assert "unknown config key(s) d_modle" in one_line_error(err)
    assert not (tmp_path / "r").exists()  # nothing written for a refused run


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    args = ["train", "--data", str(d), "--out", str(tmp_path / "r"), "--vocab-size", "50",
            "--max-steps", "1", "--no-progress", "--no-valid-bleu", *TINY]
    assert run_cli(capsys, *args)[0] == 0
    code, _, err = run_cli(capsys, *args)
    assert code != 0 and "--resume" in one_line_error(err)


def test_the_pipeline_end_to_end(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--data", str(d), "--out", str(run),
                             "--vocab-size", "50", "--epochs", "3", "--max-tokens", "64",
                             "--no-progress", "--valid-beam", "2", "--keep-last", "3", *TINY)
    assert code == 0, err
    assert "final validation BLEU" in out
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["event"] == "valid"]
    assert len(valid) == 3 and all("bleu" in r and "ppl" in r for r in valid)
    assert valid[0]["signature"].startswith("nrefs:1|case:mixed")

    code, out, err = run_cli(capsys, "average", str(run), "--last", "2", "--out",
                             str(tmp_path / "avg"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "average", str(run), "--last", "9", "--out",
                           str(tmp_path / "avg2"))
    assert code != 0 and "keeps only 3" in one_line_error(err)

    code, out, err = run_cli(capsys, "eval", "--model", str(tmp_path / "avg"), "--data", str(d),
                             "--split", "val", "--beam", "2", "--json")
    assert code == 0, err
    scores = json.loads(out)
    assert scores["sentences"] == 24 and 0 <= scores["bleu"] <= 100
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")

    code, out, err = run_cli(capsys, "info", str(tmp_path / "avg"), "--json")
    assert code == 0 and json.loads(out)["checksums"] == "verified"


def test_translate_reads_stdin_and_writes_one_line_per_input(tmp_path, capsys):
    d = corpus(tmp_path / "d")
    run = tmp_path / "run"
    assert run_cli(capsys, "train", "--data", str(d), "--out", str(run), "--vocab-size", "50",
                   "--max-steps", "2", "--no-progress", "--no-valid-bleu", *TINY)[0] == 0
    proc = subprocess.run([sys.executable, "-m", "runtime.dispatch", "translate", "--model",
                           str(run), "--beam", "2", "--nbest", "2", "--max-len-b", "3"],
                          input="a big cat\n\n   \na red cat sits\n", capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    ids = [int(line.split(" ||| ")[0]) for line in lines]
    assert sorted(set(ids)) == [0, 1, 2, 3]
    assert all(line.split(" ||| ")[1] == "" for line in lines if line.startswith(("1 ", "2 ")))


def test_version_and_unknown_command(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("aiayn ")
    code, _, err = run_cli(capsys, "trian")
    assert code == 2 and "unknown command 'trian'" in err
