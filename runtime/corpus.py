"""Parallel text: one sentence a line, plain or gzip, ``DIR/{split}.{lang}[.gz]``. Torch-free."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from .errors import CorpusError

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path:
    """``$AIAYN_DATA`` if set, else ``../shared/data/multi30k`` beside the checkout."""
    env = os.environ.get("AIAYN_DATA")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "data" / "multi30k"


def find_file(data_dir: str | os.PathLike, split: str, lang: str) -> Path:
    """The file of ``split`` in ``lang``: ``DIR/split.lang`` or ``DIR/split.lang.gz``.

    Raises CorpusError naming both candidates if neither exists.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise CorpusError(f"data directory {data_dir} does not exist (--data DIR)")
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        if (data_dir / name).is_file():
            return data_dir / name
    raise CorpusError(
        f"no {lang!r} file for split {split!r}: expected {data_dir / f'{split}.{lang}'} "
        f"or {data_dir / f'{split}.{lang}.gz'}")


def read_lines(path: str | os.PathLike) -> list[str]:
    """Lines of a UTF-8 text file (gzip if it ends in .gz), without line endings."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="\n") as f:
            return [line.rstrip("\r\n") for line in f]
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read {path}: {e}") from None


def read_parallel(data_dir: str | os.PathLike, split: str, src: str, tgt: str
                  ) -> tuple[list[str], list[str]]:
    """Source and target lines of ``split``. Raises CorpusError if a file is missing or the
    two sides have different line counts (the message names both files and counts)."""
    src_path, tgt_path = find_file(data_dir, split, src), find_file(data_dir, split, tgt)
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise CorpusError(
            f"line counts differ: {src_path} has {len(src_lines)} lines, "
            f"{tgt_path} has {len(tgt_lines)}; the two sides must be parallel")
    return src_lines, tgt_lines
