"""``aiayn translate``, ``aiayn eval`` and ``aiayn info`` on the runtime (model packages).

``runtime/dispatch.py`` sends ``translate`` and ``eval`` here for every backend: a checkpoint
(or ``--backend torch``) goes through ``load_translator``, which imports torch and train/ only
for it; ``info`` comes here for packages (``train/cli.py`` describes checkpoints). Torch-free
otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .cli_common import add_model_args, add_search_args, default_model, run_cli
from .errors import AiaynError, PackageError


def _load(args):
    """The translator for ``--model``/``--backend``/``--threads``, after checking the search
    options (a bad one is a one-line error, exit 2, before any model is loaded)."""
    from .searchspec import check_search_args
    from .translator import load_translator

    try:
        check_search_args(args.beam, args.alpha, args.lp_type, args.max_len_a, args.max_len_b,
                          args.nbest)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
    except ValueError as e:
        raise AiaynError(str(e)) from None
    return load_translator(args.model, args.backend, args.threads)


def translate_main(argv: list[str]) -> int:
    from .translate_io import add_io_args, run_translate

    p = argparse.ArgumentParser(prog="aiayn translate", description=(
        "Translate one sentence a line (stdin or -i FILE) with a model package on ONNX "
        "Runtime (or a checkpoint on the PyTorch reference); one output line per input line, "
        "or with --nbest N > 1 lines 'i ||| text ||| score' (i the 0-based input line)."))
    add_model_args(p)
    add_io_args(p)
    add_search_args(p)
    args = p.parse_args(argv)
    return run_cli(lambda: run_translate(_load(args), args), "translate")


def eval_main(argv: list[str]) -> int:
    from .evaluate import add_eval_args, run_eval

    p = argparse.ArgumentParser(prog="aiayn eval", description=(
        "BLEU and chrF (sacreBLEU: detokenized, cased, with signatures) of a model package "
        "(any variant) on any backend, over a test split."))
    add_model_args(p)
    add_eval_args(p)
    add_search_args(p)
    args = p.parse_args(argv)
    return run_cli(lambda: run_eval(_load(args), args), "eval")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def package_info(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """What ``aiayn info`` reports for a package: format, variant, model config, languages,
    files with sizes and sha256 (verified when ``verify``), graph precisions and opsets,
    library versions, parity record, scores, source checkpoint and TensorRT engines.

    Raises PackageError if the package is missing, damaged or of an unknown version.
    """
    from .package import Package

    pkg = Package.load(path, verify_hashes=verify)
    m = pkg.manifest
    listed = dict(pkg.files())
    files = {}
    for f in sorted(pkg.path.iterdir()):
        if f.is_file():
            files[f.name] = {"bytes": f.stat().st_size, "sha256": listed.get(f.name)}
    graphs = {name: {"file": g["file"], "precision": g.get("precision", "fp32"),
                     "opset": g.get("opset"), "sha256": g.get("sha256")}
              for name, g in m["graphs"].items()}
    info: dict[str, Any] = {
        "kind": "package", "path": str(pkg.path), "format": f"{m['format']} v{m['format_version']}",
        "variant": pkg.variant, "created": m.get("created"),
        "languages": m.get("languages"), "model_config": pkg.config,
        "graphs": graphs, "tokenizer": m["tokenizer"],
        "files": files, "total_bytes": sum(f["bytes"] for f in files.values()),
        "hashes": "verified" if verify else "not checked",
        "source_checkpoint": m.get("source_checkpoint"),
        "versions": m.get("versions"),
    }
    for key in ("optimization", "engines", "tensorrt_version", "gpu_name", "parity", "data",
                "scores", "source_checkpoint_scores"):
        if key in m:
            info[key] = m[key]
    return info


def _print_info(info: dict[str, Any]) -> None:
    cfg = info["model_config"]
    langs = info.get("languages") or {}
    print(f"package    {info['path']}")
    print(f"format     {info['format']}, variant {info['variant']}, created {info['created']}")
    if langs:
        print(f"languages  {langs.get('src')} -> {langs.get('tgt')}")
    print("model      " + ", ".join(f"{k}={cfg[k]}" for k in (
        "vocab_size", "d_model", "d_ff", "h", "encoder_layers", "decoder_layers",
        "max_positions") if k in cfg))
    print(f"files      ({_size(info['total_bytes'])} in all; sha256 {info['hashes']})")
    for name, f in info["files"].items():
        digest = f"sha256 {f['sha256'][:16]}…" if f["sha256"] else ""
        print(f"  {name:24s} {_size(f['bytes']):>10s}  {digest}")
    for name, g in info["graphs"].items():
        print(f"graph      {name}: {g['file']} ({g['precision']}, opset {g['opset']})")
    src = info.get("source_checkpoint") or {}
    if src:
        print(f"checkpoint sha256 {str(src.get('sha256'))[:16]}… ({src.get('path')})")
    if info.get("versions"):
        print("versions   " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    for key in ("optimization", "engines", "tensorrt_version", "gpu_name", "parity", "data",
                "scores", "source_checkpoint_scores"):
        if key in info:
            value = info[key]
            if isinstance(value, dict):
                print(f"{key}:")
                _print_tree(value, 1)
            else:
                print(f"{key:10s} {value}")


def _print_tree(value: dict, depth: int) -> None:
    """Nested manifest records as indented ``key: value`` lines (leaf dicts on one line)."""
    pad = "  " * depth
    for k, v in value.items():
        if isinstance(v, dict) and any(isinstance(x, (dict, list)) for x in v.values()):
            print(f"{pad}{k}:")
            _print_tree(v, depth + 1)
        elif isinstance(v, dict):
            print(f"{pad}{k}: " + ", ".join(f"{kk}={vv}" for kk, vv in v.items()))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            print(f"{pad}{k}: {len(v)} entries")
        else:
            print(f"{pad}{k}: {v}")


def info_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="aiayn info", description=(
        "Describe a model package (manifest summary, file sizes and verified sha256, "
        "precision, library versions, parity record, scores) or a checkpoint."))
    p.add_argument("path", nargs="?", type=Path, default=None,
                   help="package or checkpoint (default: the default model)")
    p.add_argument("--model", type=Path, default=None, help="same as PATH")
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 checks")
    p.add_argument("--json", action="store_true", help="print as JSON")
    args = p.parse_args(argv)
    target = args.path or args.model or default_model()
    from .package import is_package

    if not is_package(target) and Path(target).exists():
        try:  # a checkpoint: train/ describes it (that needs torch)
            from train.cli import info_main as checkpoint_info
        except ImportError as e:
            print(f"aiayn info: error: {target} is a checkpoint; describing it needs the train "
                  f"extra ({e.name} is missing): pip install 'aiayn[train]'", file=sys.stderr)
            return 2
        return checkpoint_info([str(target)] + (["--json"] if args.json else []))

    def body():
        if not is_package(target):
            raise PackageError(f"{target} not found (expected a model package or a checkpoint)")
        info = package_info(target, verify=not args.no_verify)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_info(info)

    return run_cli(body, "info")


COMMANDS = {"translate": translate_main, "eval": eval_main, "info": info_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"runtime.cli: expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
