"""``aiayn translate`` / ``aiayn eval`` / ``aiayn info`` on packages (runtime/cli.py), called
through the dispatcher as the console script does."""

from __future__ import annotations

import json

import pytest

from runtime.dispatch import main as aiayn
from runtime.dispatch import owner_for


def test_dispatch_sends_packages_to_the_runtime(bundled_package, tiny_checkpoint):
    assert owner_for("translate", ["--model", str(bundled_package)]) == "runtime.cli"
    assert owner_for("eval", ["--model", str(bundled_package)]) == "runtime.cli"
    assert owner_for("info", [str(bundled_package)]) == "runtime.cli"
    assert owner_for("translate", []) == "runtime.cli"
    # translate/eval choose the torch backend inside runtime.translator.load_translator
    assert owner_for("translate", ["--model", str(tiny_checkpoint)]) == "runtime.cli"
    assert owner_for("translate", ["--backend", "torch"]) == "runtime.cli"
    assert owner_for("info", [str(tiny_checkpoint)]) == "train.cli"
    assert owner_for("info", ["--model", str(tiny_checkpoint)]) == "train.cli"


def test_translate_files_one_line_per_line(bundled_package, tmp_path, capsys):
    src = tmp_path / "in.en"
    src.write_text("A dog runs through the grass.\n\n   \nTwo men are talking.\n", encoding="utf-8")
    out = tmp_path / "out.de"
    code = aiayn(["translate", "--model", str(bundled_package), "-i", str(src), "-o", str(out),
                  "--beam", "4", "--threads", "1", "--no-progress"])
    assert code == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 5 and lines[-1] == ""  # 4 lines, each newline-terminated
    assert "Hund" in lines[0] and lines[1] == "" and lines[2] == "" and "Männer" in lines[3]


def test_translate_stdin_nbest_format(bundled_package, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("A dog runs.\nA cat sleeps.\n"))
    code = aiayn(["translate", "--model", str(bundled_package), "--beam", "3", "--nbest", "2",
                  "--alpha", "1.0", "--lp-type", "power", "--backend", "ort-cpu"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    for line, i in zip(lines, [0, 0, 1, 1]):
        index, text, score = line.split(" ||| ")
        assert int(index) == i and text and float(score) < 0
    assert float(lines[0].split(" ||| ")[2]) >= float(lines[1].split(" ||| ")[2])


def test_translate_on_long_error_and_missing_backend(bundled_package, capsys, tmp_path):
    long = tmp_path / "long.en"
    long.write_text(" ".join(["dog"] * 400) + "\n", encoding="utf-8")
    code = aiayn(["translate", "--model", str(bundled_package), "-i", str(long),
                  "--on-long", "error", "--no-progress"])
    assert code == 2
    assert "max_positions" in capsys.readouterr().err
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        code = aiayn(["translate", "--model", str(bundled_package), "--backend", "ort-cuda",
                      "-i", str(long)])
        assert code == 2
        err = capsys.readouterr().err
        assert "aiayn translate: error:" in err and "onnxruntime-gpu" in err


def test_eval_scores_a_package(bundled_package, multi30k_dir, capsys):
    code = aiayn(["eval", "--model", str(bundled_package), "--data", str(multi30k_dir),
                  "--split", "test_2016_flickr", "--limit", "40", "--beam", "2", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 40 and result["backend"] == "ort-cpu"
    assert result["bleu"] > 25 and result["chrf"] > 50
    assert result["bleu_signature"].startswith("nrefs:1|case:mixed")


def test_info_describes_a_package(bundled_package, capsys):
    assert aiayn(["info", str(bundled_package)]) == 0
    text = capsys.readouterr().out
    assert "variant fp32" in text and "decoder.onnx" in text and "sha256 verified" in text
    assert aiayn(["info", "--model", str(bundled_package), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "package" and info["variant"] == "fp32"
    assert info["model_config"]["vocab_size"] == 8000
    assert info["files"]["decoder.onnx"]["sha256"] == info["graphs"]["decoder"]["sha256"]
    assert info["scores"]["test_2016_flickr"]["bleu"] > 35
    assert info["source_checkpoint"]["sha256"]


def test_info_refuses_a_damaged_package(bundled_package, tmp_path, capsys):
    import shutil

    copy = tmp_path / "pkg"
    shutil.copytree(bundled_package, copy)
    with open(copy / "encoder.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    assert aiayn(["info", str(copy)]) == 2
    assert "sha256" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["translate", "--beam", "0"], ["eval", "--beam", "0"]])
def test_bad_search_options_exit_2(bundled_package, argv, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("A dog.\n"))
    assert aiayn([argv[0], "--model", str(bundled_package), *argv[1:], "--limit", "1"]
                 if argv[0] == "eval" else [argv[0], "--model", str(bundled_package),
                                             *argv[1:]]) == 2
