"""``aiayn translate``'s input and output: one line in, one line out (or n-best lines
``i ||| text ||| score``), stdin/stdout or files, a progress bar on stderr for files.
Torch-free."""

from __future__ import annotations

import argparse
import sys

from .errors import AiaynError


def add_io_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", default=None, help="input file (default: stdin)")
    p.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar for files")


class _PlainProgress:
    """A minimal stand-in for tqdm (a runtime-only install has no tqdm): ``desc: n/total``
    rewritten in place on stderr, at most every 2 %."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self._shown = total, desc, 0, -1

    def update(self, n: int = 1) -> None:
        self.n += n
        pct = 100 * self.n // max(self.total, 1)
        if pct >= self._shown + 2 or self.n >= self.total:
            self._shown = pct
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} ({pct}%)")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total: int, desc: str):
    """A progress bar on stderr with ``update(n)`` and ``close()``: tqdm when installed,
    else a plain counter."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="sent", file=sys.stderr)


def format_nbest(i: int, text: str, score: float) -> str:
    """An n-best line: ``i ||| text ||| score`` (i the 0-based input line)."""
    return f"{i} ||| {text} ||| {score:.6f}"


def run_translate(translator, args: argparse.Namespace) -> None:
    from .cli_common import search_kwargs

    if args.input:
        try:
            with open(args.input, encoding="utf-8") as f:
                lines = [line.rstrip("\r\n") for line in f]
        except OSError as e:
            raise AiaynError(f"cannot read input {args.input}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise AiaynError(f"input {args.input} is not UTF-8: {e}") from None
    else:
        lines = [line.rstrip("\r\n") for line in sys.stdin]
    bar = None
    if args.input and not args.no_progress:
        bar = progress_bar(len(lines), "translating")
    results = translator.translate(lines, progress=bar.update if bar else None,
                                   **search_kwargs(args))
    if bar:
        bar.close()
    out_lines = []
    for i, r in enumerate(results):
        if args.nbest > 1:
            out_lines += [format_nbest(i, n.text, n.score) for n in r.nbest]
        else:
            out_lines.append(r.text)
    text = "".join(line + "\n" for line in out_lines)
    if args.output:
        from pathlib import Path

        out = Path(args.output)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
