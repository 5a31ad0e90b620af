"""The Python API: text in, ``Translation`` out, over a model package. Torch-free.

    from runtime.translator import Translator
    t = Translator.load()          # the bundled model (its package is built on first use)
    r = t.translate(["A man rides a bike."], beam_size=4, nbest=2)[0]
    r.text                         # 'Ein Mann fährt auf einem Fahrrad.'
    r.nbest[1].text, r.score       # 'Ein Mann fährt Fahrrad.', -1.07 (log-prob / lp)

``Translator`` glues the tokenizer (runtime/tokenizer.py), a backend (runtime/backends) and
the numpy search (runtime/search.py); sources are prepared and results built by
runtime/translation.py exactly as for the PyTorch reference translator
(``train.translator.TorchTranslator``, backend ``torch``), whose ``translate`` has the same
signature and results. ``load_translator`` picks between the two.

The bundled model's package (DESIGN.md "The bundled default model"): with no path (or a
checkpoint path), ``Translator.load`` exports the checkpoint once into
``${XDG_CACHE_HOME:-~/.cache}/aiayn/packages/<first 12 hex of the checkpoint's sha256>/``, so a
changed checkpoint never meets a stale package. Two processes (or threads) doing this at once
are serialized by a lock file beside the package; the export itself writes a temp folder and
renames it into place, and the result is verified (sha256 of every file) before use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .backends import load_backend
from .checksums import sha256_file
from .cli_common import BACKENDS, cache_root, default_model
from .contract import CHECKPOINT_WEIGHTS
from .errors import BackendError, PackageError
from .package import Package, is_package
from .search import beam_search
from .searchspec import check_search_args
from .tokenizer import Tokenizer
from .translation import Translation, translate_batched


class Translator:
    """A model package on a runtime backend (``ort-cpu``, ``ort-cuda``, ``ort-tensorrt``,
    ``tensorrt``).

    Attributes:
        package: the verified Package.
        engine: the Backend that runs its graphs.
        backend: the backend's name (what ``auto`` resolved to).
        tokenizer: the package's sentencepiece tokenizer.
        max_positions: the model's position table size.
        source: the package folder (what ``aiayn eval`` reports as the model).

    Safe for concurrent callers: searches share the sessions (ONNX Runtime runs them
    concurrently), and backends that are not thread-safe (``tensorrt``) are serialized.
    """

    def __init__(self, package: Package, engine, tokenizer: Tokenizer):
        self.package = package
        self.engine = engine
        self.backend = engine.name
        self.tokenizer = tokenizer
        self.max_positions = int(package.config["max_positions"])
        self.source = package.path
        self._lock = None if getattr(engine, "thread_safe", True) else threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, backend: str = "auto",
             threads: int | None = None, **backend_options: Any) -> Translator:
        """Load a package (``path``), or with None the default model's package.

        ``path`` may also be a checkpoint (or a training run): its package is exported once
        into the cache (this needs the export extra). ``backend`` is "auto" or a runtime
        backend; ``threads`` sets ONNX Runtime's intra-op threads.

        Raises PackageError (missing/damaged package, export not possible), BackendError
        (backend cannot run here), ValueError (unknown backend).
        """
        if backend == "torch":
            raise ValueError("Translator runs packages; for the torch backend use "
                             "load_translator(model, 'torch') or train.translator.TorchTranslator")
        package = Package.load(resolve_package(path))
        tokenizer = Tokenizer(package.tokenizer_path)
        vocab = int(package.config["vocab_size"])
        if tokenizer.vocab_size != vocab:
            raise PackageError(f"{package.path}: tokenizer has {tokenizer.vocab_size} pieces "
                               f"but the model's vocab_size is {vocab}; re-export the package")
        engine = load_backend(backend, package, threads=threads, **backend_options)
        return cls(package, engine, tokenizer)

    def translate(self, texts: Sequence[str], beam_size: int = 4, length_penalty: float = 0.6,
                  lp_type: str = "gnmt", max_len_a: float = 1.0, max_len_b: int = 50,
                  nbest: int = 1, return_attention: bool = False, max_tokens: int = 4096,
                  on_long: str = "truncate", progress: Callable[[int], None] | None = None
                  ) -> list[Translation]:
        """Translate ``texts``; results in input order (runtime.translation.Translation).

        Args:
            texts: a list of strings (one sentence each).
            beam_size: K (1 = greedy). length_penalty, lp_type: the final ranking (alpha,
                "gnmt" or "power"). max_len_a, max_len_b: at most a * S_src + b output
                tokens with EOS.
            nbest: hypotheses per input in ``Translation.nbest`` (clipped to beam_size).
            return_attention: fill ``Translation.attention`` (len(tokens) + 1, S_src).
            max_tokens: padded source tokens per batch (batches are formed from
                length-sorted inputs).
            on_long: "truncate" (with a warning) or "error" for inputs longer than
                max_positions.
            progress: called with the number of sentences of each finished batch.

        Empty and whitespace-only texts translate to "" without running the model. Raises
        ValueError for a bad option, InputTooLongError for an over-long input with
        ``on_long="error"``, TypeError if ``texts`` is a single string.
        """
        check_search_args(beam_size, length_penalty, lp_type, max_len_a, max_len_b, nbest)
        max_sentences = None
        if self.engine.max_rows is not None:
            max_sentences = self.engine.max_rows // beam_size
            if max_sentences < 1:
                raise BackendError(f"beam {beam_size} needs more rows than backend "
                                   f"{self.backend}'s engines take ({self.engine.max_rows})")

        def search(sources):
            kwargs = dict(beam_size=beam_size, length_penalty=length_penalty, lp_type=lp_type,
                          max_len_a=max_len_a, max_len_b=max_len_b, nbest=nbest,
                          return_attention=return_attention, return_token_scores=True)
            if self._lock is None:
                return beam_search(self.engine, sources, **kwargs)
            with self._lock:
                return beam_search(self.engine, sources, **kwargs)

        return translate_batched(self.tokenizer, texts, self.max_positions, search,
                                 max_tokens=max_tokens, on_long=on_long, progress=progress,
                                 max_sentences=max_sentences)

    def describe(self) -> dict[str, Any]:
        """Package and backend facts (for info output and the demo)."""
        return {"package": str(self.package.path), "variant": self.package.variant,
                **self.engine.describe()}


# ---------------------------------------------------------------------------------------------
# Where packages come from


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True for a checkpoint folder (``model.safetensors``) or a training run
    (``checkpoints/step_*``)."""
    path = Path(path)
    return (path / CHECKPOINT_WEIGHTS).is_file() or (path / "checkpoints").is_dir()


def _checkpoint_dir(path: Path) -> Path:
    """The checkpoint folder of a checkpoint or a run (its latest ``step_*``), torch-free."""
    if (path / CHECKPOINT_WEIGHTS).is_file():
        return path
    steps = [p for p in (path / "checkpoints").glob("step_*")
             if (p / CHECKPOINT_WEIGHTS).is_file() and p.name[5:].isdigit()]
    if not steps:
        raise PackageError(f"run {path} has no checkpoint yet")
    return max(steps, key=lambda p: int(p.name[5:]))


def resolve_package(path: str | os.PathLike | None = None) -> Path:
    """The package folder for ``path``: the folder itself if it is a package; for a
    checkpoint (or None: ``$AIAYN_MODEL``, else the bundled model) its cached export.

    Raises PackageError if ``path`` is neither, or the export cannot be made.
    """
    path = Path(path) if path is not None else default_model()
    if is_package(path):
        return path
    if is_checkpoint(path):
        return cached_package(path)
    if not path.exists():
        raise PackageError(f"model {path} not found (expected a model package, a checkpoint "
                           "or a training run)")
    raise PackageError(f"{path} is neither a model package (no manifest.json) nor a "
                       f"checkpoint (no {CHECKPOINT_WEIGHTS})")


def package_cache_dir(checkpoint: str | os.PathLike) -> Path:
    """``<cache>/packages/<first 12 hex of the checkpoint weights' sha256>``."""
    ckpt = _checkpoint_dir(Path(checkpoint))
    return cache_root() / "packages" / sha256_file(ckpt / CHECKPOINT_WEIGHTS)[:12]


def _usable(folder: Path, sha: str) -> bool:
    if not is_package(folder):
        return False
    try:
        pkg = Package.load(folder)
    except PackageError:
        return False
    return pkg.manifest.get("source_checkpoint", {}).get("sha256", sha) == sha


class _FileLock:
    """An exclusive advisory lock on a file (fcntl.flock on POSIX, msvcrt on Windows), held
    for a ``with`` block. Raises PackageError if the lock file cannot be created."""

    def __init__(self, path: Path):
        self.path = path
        self.file = None

    def __enter__(self) -> _FileLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a+b")  # noqa: SIM115 - held until __exit__
        except OSError as e:
            raise PackageError(f"cannot write the package cache {self.path.parent} "
                               f"({e.strerror}); set XDG_CACHE_HOME to a writable folder, or "
                               "export a package with `aiayn export` and pass it with "
                               "--model") from None
        try:
            import fcntl

            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)
        except ImportError:  # Windows
            import msvcrt

            self.file.seek(0)
            msvcrt.locking(self.file.fileno(), msvcrt.LK_LOCK, 1)
        return self

    def __exit__(self, *exc) -> None:
        try:
            import fcntl

            fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
        except ImportError:
            import msvcrt

            self.file.seek(0)
            msvcrt.locking(self.file.fileno(), msvcrt.LK_UNLCK, 1)
        finally:
            self.file.close()


def cached_package(checkpoint: str | os.PathLike) -> Path:
    """The fp32 package of ``checkpoint`` in the cache, exported on first use.

    Safe when several processes or threads ask at once: the export runs under a lock file,
    the package is re-checked after the lock is taken (another process may have just made
    it), the export writes a temp folder renamed into place (export.package), and the result
    is verified before it is returned. A damaged cached package is re-exported.

    Raises PackageError if the export extra (torch, onnx) is missing, or the export fails;
    CheckpointError (an AiaynError) for a damaged checkpoint.
    """
    ckpt = _checkpoint_dir(Path(checkpoint))
    sha = sha256_file(ckpt / CHECKPOINT_WEIGHTS)
    out = cache_root() / "packages" / sha[:12]
    if _usable(out, sha):
        return out
    with _FileLock(out.with_name(f".{out.name}.lock")):
        if _usable(out, sha):  # exported by someone else while we waited
            return out
        try:
            from export.package import export_package
        except ImportError as e:
            raise PackageError(
                f"the model {ckpt} has no ONNX package yet, and building it (once, into {out}) "
                f"needs PyTorch and the export extra ({e.name} is missing): pip install "
                "'aiayn[train,export]'; with a runtime-only install, export a package elsewhere "
                "(`aiayn export CHECKPOINT --out PACKAGE`) and pass it with --model") from None

        if out.exists():  # our own cache entry, but damaged or stale: rebuild it
            import shutil

            shutil.rmtree(out)
        import sys
        import time

        print(f"aiayn: building the ONNX package of {ckpt} into {out} (first use only; under a "
              "minute)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        export_package(ckpt, out, force=False)
        print(f"aiayn: package built in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
        if not _usable(out, sha):
            raise PackageError(f"the package exported to {out} does not verify; delete it and "
                               "try again")
    return out


def load_translator(model: str | os.PathLike | None = None, backend: str = "auto",
                    threads: int | None = None, **options: Any):
    """A translator for ``model`` on ``backend`` (the CLI's and the demo's entry point).

    - backend "torch", or "auto" with ``model`` a checkpoint or run: the PyTorch reference
      (``train.translator.TorchTranslator``; torch is imported only then);
    - otherwise a ``Translator`` on the package: ``model`` a package, or None for the default
      model, or a checkpoint with an explicit runtime backend (its package is exported once
      into the cache).

    Raises BackendError (backend unavailable; torch missing for "torch"), PackageError,
    ValueError (unknown backend).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    checkpoint = model is not None and not is_package(model) and is_checkpoint(model)
    if backend == "torch" or (backend == "auto" and checkpoint):
        if model is not None and is_package(model):
            raise BackendError(f"the torch backend runs a checkpoint, and {model} is an ONNX "
                               "package; use --backend auto/ort-cpu, or pass the checkpoint")
        try:
            from train.translator import TorchTranslator
        except ImportError as e:
            raise BackendError(f"the torch backend needs the train extra ({e.name} is "
                               "missing): pip install 'aiayn[train]'") from None
        return TorchTranslator.load(model if model is not None else default_model(),
                                    threads=threads, **options)
    return Translator.load(model, backend=backend, threads=threads, **options)
