"""``aiayn demo``: serve the Gradio translation demo.

    aiayn demo [--model PATH] [--backend NAME] [--threads N] [--host 127.0.0.1]
               [--port 7860] [--share] [--on-long truncate|error] [--concurrency 2]

Loads every backend that can run here once (the bundled model's ONNX package is built on
first use), then serves the page on http://HOST:PORT. Binds to 127.0.0.1 unless ``--host``
says otherwise; a public share link only with ``--share``.
"""

from __future__ import annotations

import argparse
import socket
import sys

from runtime.cli_common import BACKENDS, add_model_args, run_cli
from runtime.errors import AiaynError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiayn demo", description=(
        "Serve the translation demo: translate, see the n-best list and the attention "
        "alignment, and compare the PyTorch reference with the ONNX runtime."))
    add_model_args(p)
    p.set_defaults(backend="auto")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 "
                        "serves the local network)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", action="store_true",
                   help="also create a public *.gradio.live link (off by default)")
    p.add_argument("--on-long", choices=("truncate", "error"), default="truncate",
                   help="input longer than the model accepts: translate its beginning and "
                        "say so (truncate, default) or refuse it with a message (error)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests translated at once; the rest wait in Gradio's queue "
                        "(default 2)")
    return p


def _check_port(host: str, port: int) -> None:
    """Raise AiaynError if ``host:port`` cannot be bound (taken, or not an address here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise AiaynError(f"cannot serve on {host}:{port}: {e.strerror or e}; choose another "
                             f"--port") from None


def serve(args: argparse.Namespace) -> int:
    """Load the backends, build the page and serve it until interrupted."""
    try:
        from .app import DEFAULT_CONCURRENCY, build_app, launch
        from .engine import Backends
    except ImportError as e:
        raise AiaynError(f"the demo needs the 'demo' extra ({e.name} is missing): "
                         f"pip install 'aiayn[demo]'") from None

    if args.backend not in BACKENDS:
        raise AiaynError(f"unknown backend {args.backend!r}")
    if args.concurrency is not None and args.concurrency < 1:
        raise AiaynError("--concurrency must be at least 1")
    if not 0 < args.port < 65536:
        raise AiaynError(f"--port must be in 1-65535, got {args.port}")
    _check_port(args.host, args.port)  # before minutes of loading, not after
    backends = Backends(args.model, threads=args.threads)
    default = backends.probe(args.backend)
    print(f"aiayn demo: offering {', '.join(backends.available)} (default {default})",
          flush=True)
    app = build_app(backends, default_backend=default, on_long=args.on_long)
    try:
        launch(app, host=args.host, port=args.port, share=args.share,
               concurrency=args.concurrency or DEFAULT_CONCURRENCY)
    except OSError as e:
        raise AiaynError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    return run_cli(lambda: serve(args), "demo")


if __name__ == "__main__":
    sys.exit(main())
