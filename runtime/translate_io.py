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


def split_lines(data: bytes, name: str) -> list[str]:
    """Input lines: UTF-8, split at \\n only (a stray \\r or other Unicode line break inside a
    line stays in it, so output lines always match input lines); \\r\\n endings are dropped.

    Raises AiaynError for input that is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AiaynError(f"{name} is not UTF-8 ({e.reason} at byte {e.start}); convert it, "
                         "e.g. iconv -f latin1 -t utf-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def run_translate(translator, args: argparse.Namespace) -> None:
    from pathlib import Path

    from .cli_common import search_kwargs

    if args.input and args.output and Path(args.input).resolve() == Path(args.output).resolve():
        raise AiaynError(f"-o {args.output} is the input file; write the translation elsewhere")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise AiaynError(f"cannot write {args.output}: its folder does not exist")
    if args.input:
        try:
            data = Path(args.input).read_bytes()
        except OSError as e:
            raise AiaynError(f"cannot read input {args.input}: {e.strerror}") from None
    else:
        stdin = sys.stdin
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode("utf-8")
    lines = split_lines(data, args.input or "standard input")
    nbest = getattr(args, "nbest", 1)
    if nbest > args.beam:
        print(f"aiayn translate: warning: --nbest {nbest} is more than --beam {args.beam}; "
              f"listing {args.beam} hypotheses per line", file=sys.stderr)
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
        out = Path(args.output)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
