"""Command-line pieces every subcommand shares: option names (DESIGN.md "The command line"),
the default model, and turning user errors into one line and a non-zero exit. Torch-free."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import AiaynError

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO_ROOT / "models" / "multi30k-en-de"
BACKENDS = ("auto", "torch", "ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt")


def default_model() -> Path:
    """``$AIAYN_MODEL`` if set, else the bundled ``models/multi30k-en-de`` of this checkout."""
    env = os.environ.get("AIAYN_MODEL")
    return Path(env) if env else BUNDLED_MODEL


def cache_root() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/aiayn``: where the bundled model's package is exported on
    first use (``packages/<sha12>/``) and TensorRT engine caches live (``trt/``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiayn"


def add_model_args(p: argparse.ArgumentParser, backend: bool = True) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="a checkpoint, a training run or a model package "
                        "(default: $AIAYN_MODEL, else the bundled models/multi30k-en-de)")
    if backend:
        p.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="torch runs a checkpoint; ort-* and tensorrt run a package; auto "
                            "picks the best that loads here (default: auto)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (ONNX Runtime / torch); default: the library's")


def add_search_args(p: argparse.ArgumentParser) -> None:
    """--beam --alpha --lp-type --max-len-a --max-len-b --nbest (DESIGN.md search spec)."""
    g = p.add_argument_group("search")
    g.add_argument("--beam", type=int, default=4, help="beam size K; 1 = greedy (default 4)")
    g.add_argument("--alpha", type=float, default=0.6,
                   help="length penalty alpha (default 0.6, the paper's)")
    g.add_argument("--lp-type", choices=("gnmt", "power"), default="gnmt",
                   help="gnmt: ((5+len)/6)^alpha (default); power: len^alpha "
                        "(fairseq, CTranslate2)")
    g.add_argument("--max-len-a", type=float, default=1.0,
                   help="output at most a*source_len + b tokens (default a=1)")
    g.add_argument("--max-len-b", type=int, default=50, help="(default b=50)")
    g.add_argument("--nbest", type=int, default=1, help="hypotheses per input (<= beam)")
    g.add_argument("--max-tokens", type=int, default=4096,
                   help="padded source tokens per batch (default 4096)")
    g.add_argument("--on-long", choices=("truncate", "error"), default="truncate",
                   help="inputs longer than max_positions: truncate with a warning (default) "
                        "or refuse")


def search_kwargs(args: argparse.Namespace) -> dict:
    return dict(beam_size=args.beam, length_penalty=args.alpha, lp_type=args.lp_type,
                max_len_a=args.max_len_a, max_len_b=args.max_len_b, nbest=args.nbest,
                max_tokens=args.max_tokens, on_long=args.on_long)


def run_cli(fn: Callable[[], int | None], prog: str) -> int:
    """Run a subcommand body; user errors become ``aiayn PROG: error: ...`` and exit 2."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"aiayn {prog}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    try:
        return fn() or 0
    except AiaynError as e:
        print(f"aiayn {prog}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"aiayn {prog}: error: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aiayn {prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
