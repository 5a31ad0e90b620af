"""sha256 checksums of model files (checkpoints, packages). Torch-free."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .errors import CheckpointError


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_checksums(directory: str | os.PathLike, checksums_file: str = "checksums.json") -> bool:
    """Check every file listed in ``directory/checksums.json``; False if there is no such file.

    Raises CheckpointError naming the first file that is missing or whose sha256 differs.
    """
    directory = Path(directory)
    listing = directory / checksums_file
    if not listing.is_file():
        return False
    try:
        expected = json.loads(listing.read_text())["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{listing} is not a valid checksums file: {e}") from None
    for name, digest in sorted(expected.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in {listing.name} but missing")
        actual = sha256_file(path)
        if actual != digest:
            raise CheckpointError(
                f"checksum mismatch for {path}: expected sha256 {digest[:16]}…, found "
                f"{actual[:16]}…; the file was modified or damaged — restore it (git checkout) "
                "or re-download the model")
    return True


def checksums_json(directory: str | os.PathLike, names: list[str]) -> str:
    """The text of a checksums.json covering ``names`` in ``directory``."""
    directory = Path(directory)
    return json.dumps({"sha256": {n: sha256_file(directory / n) for n in sorted(names)}},
                      indent=2) + "\n"
