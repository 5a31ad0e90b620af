"""Model configuration: one dataclass, serialized as ``config.json`` beside every artifact.

Presets follow Table 3 of Vaswani et al. (2017) ("base", "big") plus a small preset sized
for Multi30k, whose 29k short caption pairs overfit a base model within a few epochs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from runtime.contract import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from runtime.errors import AiaynError


class ConfigError(AiaynError, ValueError):
    """A configuration that cannot be used (unknown key, bad value, unknown preset)."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the Transformer (paper notation, Table 3).

    Attributes:
        vocab_size: V, size of the joint source/target sentencepiece vocabulary (§3.4).
        d_model: model width (paper: 512 base, 1024 big).
        d_ff: inner width of the position-wise FFN, eq. 2 (paper: 2048 / 4096).
        h: attention heads; d_k = d_v = d_model / h (§3.2.2).
        encoder_layers: N for the encoder stack (paper: 6).
        decoder_layers: N for the decoder stack (paper: 6).
        dropout: P_drop, applied to each sub-layer output before the residual add and to the
            sums of embeddings and positional encodings (§5.4).
        max_positions: rows of the sinusoidal table (§3.5); bounds source length (with EOS)
            and target length (with BOS).
        pad_id, unk_id, bos_id, eos_id: special ids, fixed by the graph contract.
    """

    vocab_size: int = 8000
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    dropout: float = 0.1
    max_positions: int = 1024
    pad_id: int = PAD_ID
    unk_id: int = UNK_ID
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "d_ff", "h", "encoder_layers", "decoder_layers",
                     "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config {name} must be a positive integer, got {value!r}")
        if self.d_model % self.h:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by h ({self.h})")
        if self.d_model % 2:
            raise ConfigError(f"d_model ({self.d_model}) must be even for sinusoidal positions")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if (self.pad_id, self.unk_id, self.bos_id, self.eos_id) != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ConfigError(
                f"special ids must be pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID} "
                "(the graph contract fixes them)")
        if self.vocab_size <= EOS_ID:
            raise ConfigError(f"vocab_size must exceed the special ids, got {self.vocab_size}")

    @property
    def d_k(self) -> int:
        """Per-head key/value width d_k = d_v = d_model / h (§3.2.2)."""
        return self.d_model // self.h

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild from a dict; unknown keys raise ConfigError (never a silent drop)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}")
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        return self.from_dict({**self.to_dict(), **changes})

    def save(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` atomically (temp file + rename)."""
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


# Table 3: base and big. "multi30k": 29k caption pairs of ~12 words are far too few for the base
# model (63M parameters overfit in a few epochs); published Multi30k Transformers use 3-4 layers,
# d_model 256 and heavy dropout. d_ff = 4 * d_model keeps the paper's ratio; d_k = 64 as in the paper.
PRESETS: dict[str, dict[str, Any]] = {
    "base": dict(d_model=512, d_ff=2048, h=8, encoder_layers=6, decoder_layers=6, dropout=0.1),
    "big": dict(d_model=1024, d_ff=4096, h=16, encoder_layers=6, decoder_layers=6, dropout=0.3),
    "multi30k": dict(d_model=256, d_ff=1024, h=4, encoder_layers=3, decoder_layers=3,
                     dropout=0.3, max_positions=256),
}

# Training recipe per preset (paper §5.3: warmup 4000; Multi30k's few steps per epoch want less).
PRESET_TRAINING: dict[str, dict[str, Any]] = {
    "base": dict(warmup_steps=4000, max_tokens=25000, label_smoothing=0.1),
    "big": dict(warmup_steps=4000, max_tokens=25000, label_smoothing=0.1),
    "multi30k": dict(warmup_steps=1000, max_tokens=4096, label_smoothing=0.1),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Return the ModelConfig of a named preset with ``overrides`` applied.

    Raises ConfigError for an unknown preset name or override key.
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to ``path`` via a temp file in the same folder and an atomic rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
