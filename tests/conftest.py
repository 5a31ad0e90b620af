"""Shared fixtures: tiny random checkpoints and their packages, the bundled model's package,
and the Multi30k corpus. Everything heavy is session-scoped (built once per test run).

- ``tiny_checkpoint`` / ``tiny_package``: a 2-layer d_model=32 model over a 120-piece
  sentencepiece vocabulary trained here on synthetic English-like sentences (max_positions
  64); seconds to build and export.
- ``bundled_cache_home``: an ``XDG_CACHE_HOME`` whose ``aiayn/packages/<sha12>/`` holds the
  bundled model's fp32 package (exported once, ~15 s), exactly where ``Translator.load()``
  looks; ``bundled_package`` is that package's folder. With ``$AIAYN_BUNDLED_PACKAGE`` set to
  a prebuilt fp32 package of the bundled model (``aiayn export models/multi30k-en-de --out
  PKG``; e.g. carried to a GPU machine), that package is copied there instead of exporting;
  one that does not verify or is of another checkpoint is replaced by a fresh export.
- ``multi30k_dir``: ``$AIAYN_DATA`` or ``../shared/data/multi30k``; skips when absent.

Helpers ``make_tiny_checkpoint``, ``synthetic_sentences`` and ``seed_package_cache`` are
importable for tests that need their own variants (``from conftest import ...``).
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "multi30k-en-de"

_WORDS = ("the", "a", "man", "woman", "dog", "cat", "child", "runs", "sits", "stands", "on",
          "in", "at", "near", "with", "red", "blue", "green", "big", "small", "old", "young",
          "park", "street", "house", "car", "ball", "water", "grass", "beach")


def synthetic_sentences(n: int = 400, seed: int = 0, words=_WORDS) -> list[str]:
    """``n`` random short sentences over ``words`` (deterministic for a seed)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 10))).capitalize() + "."
            for _ in range(n)]


def make_tiny_checkpoint(out: Path, vocab_size: int = 120, seed: int = 0, sentences=None,
                         eos_scale: float = 3.0, **config) -> Path:
    """A random tiny Transformer + a sentencepiece tokenizer trained on ``sentences``, saved
    as a checkpoint folder at ``out``. ``eos_scale`` enlarges EOS's (tied) embedding so that
    random models end hypotheses at varied lengths. Returns ``out``."""
    import torch

    from runtime.contract import EOS_ID
    from runtime.tokenizer import train_tokenizer
    from train.checkpoint import save_checkpoint
    from train.config import ModelConfig
    from train.model import Transformer

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spm_file = out.parent / f"{out.name}.spm.model"
    tok = train_tokenizer(sentences or synthetic_sentences(seed=seed), spm_file,
                          vocab_size=vocab_size, num_threads=1)
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**dict(vocab_size=tok.vocab_size, d_model=32, d_ff=64, h=4,
                                encoder_layers=2, decoder_layers=2, dropout=0.0,
                                max_positions=64), **config})
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.embed.weight[EOS_ID] *= eos_scale
    return save_checkpoint(out, model, spm_file, meta={"languages": {"src": "en", "tgt": "de"}})


def seed_package_cache(cache_home: Path, checkpoint: Path, package: Path) -> Path:
    """Copy ``package`` to where ``runtime.translator.cached_package`` looks for
    ``checkpoint``'s package under ``cache_home`` (an XDG_CACHE_HOME), so a test can use the
    cache without exporting. Returns the cached folder."""
    import shutil

    from runtime.checksums import sha256_file

    sha = sha256_file(Path(checkpoint) / "model.safetensors")
    out = Path(cache_home) / "aiayn" / "packages" / sha[:12]
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(package, out)
    return out


@contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def tiny_package(tiny_checkpoint, tmp_path_factory) -> Path:
    pytest.importorskip("onnx")
    from export.package import export_package

    return export_package(tiny_checkpoint, tmp_path_factory.mktemp("tiny_pkg") / "pkg").path


@pytest.fixture(scope="session")
def bundled_cache_home(tmp_path_factory) -> Path:
    """An XDG_CACHE_HOME holding the bundled model's package where Translator.load() finds
    it (exported once per session through runtime.translator.cached_package)."""
    if not (BUNDLED / "model.safetensors").is_file():
        pytest.skip(f"the bundled model is absent ({BUNDLED})")
    pytest.importorskip("onnx")
    home = tmp_path_factory.mktemp("xdg_cache")
    from runtime.translator import cached_package

    prebuilt = os.environ.get("AIAYN_BUNDLED_PACKAGE")
    if prebuilt:  # cached_package verifies it (checksums, source checkpoint) before use
        seed_package_cache(home, BUNDLED, Path(prebuilt))
    with _env(XDG_CACHE_HOME=home):
        cached_package(BUNDLED)
    return home


@pytest.fixture(scope="session")
def bundled_package(bundled_cache_home) -> Path:
    """The bundled model's fp32 package folder."""
    from runtime.checksums import sha256_file

    sha = sha256_file(BUNDLED / "model.safetensors")
    return bundled_cache_home / "aiayn" / "packages" / sha[:12]


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    from runtime.corpus import default_data_dir

    d = default_data_dir()
    if not (d / "test_2016_flickr.en.gz").is_file() and not (d / "test_2016_flickr.en").is_file():
        pytest.skip(f"Multi30k is absent ({d}; set AIAYN_DATA)")
    return d


@pytest.fixture(scope="session")
def multi30k_test(multi30k_dir) -> tuple[list[str], list[str]]:
    """test_2016_flickr (en, de): 1000 sentence pairs."""
    from runtime.corpus import read_parallel

    return read_parallel(multi30k_dir, "test_2016_flickr", "en", "de")


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory):
    """One real ``aiayn demo`` server in a subprocess on a free port, shared by the demo tests
    (startup bounded by its timeout; stopped at the end of the session)."""
    pytest.importorskip("gradio", reason="the demo needs the 'demo' extra")
    from demo.screenshot import DemoServer

    srv = DemoServer(log_path=tmp_path_factory.mktemp("demo") / "server.log")
    srv.start(timeout=300)
    yield srv
    srv.stop()
