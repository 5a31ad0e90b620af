"""``aiayn export`` and ``aiayn validate`` (DESIGN.md "The command line").

Thin wrappers over ``export.package.export_package`` and ``export.validate.validate_package``:
progress and per-output parity lines go to stderr / stdout, user errors (missing checkpoint,
existing --out, failed parity) become one line and exit status 2 (runtime/cli_common.py).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path

from runtime import contract as C
from runtime.cli_common import run_cli


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _result(line: str) -> None:
    print(line, flush=True)


def _sigterm_as_interrupt() -> None:
    """Turn SIGTERM into KeyboardInterrupt so an export's temp folder is cleaned up."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, handler)


def build_export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiayn export", description=(
        "Export a checkpoint to an ONNX model package (encoder.onnx + incremental decoder.onnx "
        "+ spm.model + manifest.json), validated against PyTorch at N 1/3/12, P 0/1/7, "
        "S 1/17/101. Variants are separate packages: give at most one of --optimize, --fp16, "
        "--int8, --tensorrt."))
    p.add_argument("checkpoint", type=Path, help="checkpoint folder or training run")
    p.add_argument("--out", type=Path, required=True, help="package folder to create")
    variant = p.add_mutually_exclusive_group()
    variant.add_argument("--optimize", action="store_true",
                         help="ONNX Runtime offline optimization for the CPU (ORT_ENABLE_ALL by "
                              "default; the package then runs on ONNX Runtime only)")
    variant.add_argument("--fp16", action="store_true",
                         help="float16 graphs for GPUs (LayerNorm and softmax kept in fp32)")
    variant.add_argument("--int8", action="store_true",
                         help="int8 dynamic quantization for the CPU (onnxruntime.quantization)")
    variant.add_argument("--tensorrt", action="store_true",
                         help="add decoder_init.onnx and TensorRT fp16 engines built on this GPU "
                              "(needs `pip install tensorrt`)")
    p.add_argument("--optimize-level", choices=("basic", "extended", "all"), default="all",
                   help="ORT level for --optimize (default all; basic keeps standard ONNX ops)")
    p.add_argument("--external-data", action="store_true",
                   help="store each graph's weights beside it in <graph>.onnx.data (needed above "
                        "2 GB)")
    p.add_argument("--force", action="store_true", help="replace an existing package at --out")
    p.add_argument("--opset", type=int, default=C.OPSET,
                   help=f"ONNX opset, >= {C.MIN_OPSET} (default {C.OPSET})")
    p.add_argument("--seed", type=int, default=None, help="seed of the validation inputs")
    p.add_argument("--timing-cache", type=Path, default=None,
                   help="TensorRT timing cache file to reuse and update (--tensorrt)")
    return p


def export_main(argv: list[str]) -> int:
    args = build_export_parser().parse_args(argv)
    variant = ("optimized" if args.optimize else "fp16" if args.fp16 else "int8" if args.int8
               else "tensorrt" if args.tensorrt else "fp32")

    def body():
        from .package import export_package

        _sigterm_as_interrupt()
        package = export_package(args.checkpoint, args.out, force=args.force, opset=args.opset,
                                 variant=variant, external_data=args.external_data,
                                 optimize_level=args.optimize_level, seed=args.seed,
                                 timing_cache=args.timing_cache, progress=_progress,
                                 results=_result)
        parity = package.manifest.get("parity", {})
        print(f"{package.path}: {variant} package, parity "
              f"{'passed' if parity.get('passed') else 'NOT recorded'} "
              f"({parity.get('cases', 0)} cases; record in {package.path / C.PARITY_FILE})")

    return run_cli(body, "export")


def build_validate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiayn validate", description=(
        "Re-run a package's parity validation against the PyTorch checkpoint it was exported "
        "from; prints max|Δ| per output, writes parity.json and the manifest's summary, and "
        "exits non-zero if any output is beyond tolerance."))
    p.add_argument("package", type=Path, help="model package folder")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the source checkpoint (default: the path recorded in the manifest); "
                        "its sha256 must match the manifest's source_checkpoint")
    p.add_argument("--seed", type=int, default=None, help="seed of the validation inputs")
    p.add_argument("--no-write", action="store_true",
                   help="do not update parity.json and the manifest (read-only packages)")
    return p


def validate_main(argv: list[str]) -> int:
    args = build_validate_parser().parse_args(argv)

    def body():
        from .validate import DEFAULT_SEED, validate_package

        report = validate_package(args.package, args.checkpoint,
                                  seed=DEFAULT_SEED if args.seed is None else args.seed,
                                  write=not args.no_write, progress=_progress, results=_result)
        print(f"{args.package}: parity passed ({report.info.get('cases')} cases)")

    return run_cli(body, "validate")


COMMANDS = {"export": export_main, "validate": validate_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"export.cli: expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
