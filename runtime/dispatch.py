"""The ``aiayn`` console script: maps each subcommand to the ``main(argv)`` of the package
that owns it, importing that package only when the subcommand runs (so ``aiayn translate`` on a
package never imports torch)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .contract import MANIFEST_FILE

USAGE = """usage: aiayn [--version] <command> [options]

commands:
  train      train a Transformer on a parallel corpus (the paper's recipe)
  average    average the last N checkpoints of a run
  eval       BLEU and chrF (sacreBLEU) of a model on a test split
  export     export a checkpoint to an ONNX model package
  validate   re-run a package's parity validation against PyTorch
  translate  translate text (stdin or -i FILE) with a checkpoint or a package
  parity     PyTorch reference vs a package over a test split
  info       describe a checkpoint or a package
  demo       serve the Gradio translation demo

Run `aiayn <command> --help` for its options."""

# subcommand -> module whose main(argv) receives [subcommand, *options]
OWNERS = {
    "train": "train.cli", "average": "train.cli", "export": "export.cli",
    "validate": "export.cli", "parity": "export.parity", "demo": "demo.cli",
    # eval / translate pick their backend in runtime.translator.load_translator (a checkpoint
    # or --backend torch loads train/ lazily); info depends on what it describes
    "eval": "runtime.cli", "translate": "runtime.cli", "info": None,
}
EXTRAS = {"train": "train", "export": "export", "demo": "demo", "runtime": "cpu"}


def _option(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def owner_for(command: str, argv: list[str]) -> str:
    """The module that runs ``command`` with options ``argv``."""
    owner = OWNERS[command]
    if owner is not None:
        return owner
    # info: a checkpoint (or run) is described by train/, a package by the runtime
    model = _option(argv, "--model") or next((a for a in argv if not a.startswith("-")), None)
    if model is not None and not (Path(model) / MANIFEST_FILE).is_file() and Path(model).exists():
        return "train.cli"
    return "runtime.cli"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"aiayn {version('aiayn')}")
        except PackageNotFoundError:
            print("aiayn (not installed)")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in OWNERS:
        print(f"aiayn: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module = owner_for(command, rest)
    try:
        cli = importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS[module.split(".")[0]]
        print(f"aiayn {command}: needs the '{extra}' extra ({e.name} is missing): "
              f"pip install 'aiayn[{extra}]'", file=sys.stderr)
        return 2
    return cli.main([command, *rest])


if __name__ == "__main__":
    sys.exit(main())
