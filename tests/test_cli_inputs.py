"""Command-line input handling found by a new-user review: line splitting, refused options."""

import math

import pytest

from runtime.dispatch import main
from runtime.errors import AiaynError
from runtime.searchspec import check_search_args
from runtime.translate_io import split_lines
from train.config import ConfigError
from train.trainer import TrainConfig


def test_lines_split_at_newline_only_so_outputs_align_with_inputs():
    assert split_lines(b"A dog runs.\rA cat sits.\r\nA man walks.\n\n", "x") == [
        "A dog runs.\rA cat sits.", "A man walks.", ""]
    assert split_lines("\ufeffeins\nzwei".encode(), "x") == ["eins", "zwei"]
    with pytest.raises(AiaynError, match="f is not UTF-8"):
        split_lines(b"caf\xe9\n", "f")


def test_output_file_may_not_be_the_input(tmp_path, capsys):
    f = tmp_path / "in.en"
    f.write_text("A dog.\n")
    assert main(["translate", "--backend", "torch", "-i", str(f), "-o", str(f)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert f.read_text() == "A dog.\n"


@pytest.mark.parametrize("command", ["eval", "parity"])
@pytest.mark.parametrize("limit", ["0", "-3"])
def test_limit_must_be_positive(command, limit, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--limit", limit])
    assert e.value.code == 2
    assert "--limit: must be >= 1" in capsys.readouterr().err


def test_non_finite_alpha_and_zero_max_steps_are_refused():
    for alpha in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            check_search_args(4, alpha, "gnmt", 1.0, 50, 1)
    with pytest.raises(ConfigError, match="max_steps must be >= 1"):
        TrainConfig(data="d", out="o", max_steps=0)
    with pytest.raises(ConfigError, match="max_time must be > 0"):
        TrainConfig(data="d", out="o", max_time=0)
