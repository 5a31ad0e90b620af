"""Checkpoints: ``model.safetensors`` + ``config.json`` + ``spm.model`` (+ ``train_state.pt``
for resuming) + ``checksums.json``, written into a temp folder and renamed into place, so a
write killed midway never damages an existing checkpoint. Loading never unpickles untrusted
data: weights come from safetensors and training state through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from runtime.checksums import checksums_json, sha256_file, verify_checksums
from runtime.contract import (
    CHECKPOINT_CHECKSUMS,
    CHECKPOINT_CONFIG,
    CHECKPOINT_TOKENIZER,
    CHECKPOINT_WEIGHTS,
)
from runtime.errors import CheckpointError
from runtime.tokenizer import Tokenizer

from .config import ConfigError, ModelConfig
from .model import Transformer

TRAIN_STATE = "train_state.pt"
META = "meta.json"  # optional provenance: languages, data, step, scores (not needed to load)
CHECKPOINTS_DIR = "checkpoints"
STEP_PREFIX = "step_"


def save_checkpoint(ckpt_dir: str | os.PathLike, model: Transformer, tokenizer_file: str | os.PathLike,
                    train_state: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
                    meta: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint folder atomically and return its path.

    ``model``'s weights go to safetensors (optionally cast to ``dtype``, e.g. float16 for a
    shipped model), its config to config.json, the tokenizer beside them, ``train_state``
    (optimizer, schedule, step, RNG) to train_state.pt, ``meta`` (languages, data, scores) to
    meta.json. Everything is written into
    ``.<name>.tmp`` and renamed into place; an existing folder of that name is replaced only
    after the new one is complete.
    """
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous()
             for k, v in unwrap(model).state_dict().items()}
    save_file(state, str(tmp / CHECKPOINT_WEIGHTS), metadata={"format": "pt"})
    unwrap(model).cfg.save(tmp / CHECKPOINT_CONFIG)
    shutil.copyfile(tokenizer_file, tmp / CHECKPOINT_TOKENIZER)
    names = [CHECKPOINT_WEIGHTS, CHECKPOINT_CONFIG, CHECKPOINT_TOKENIZER]
    if train_state is not None:
        torch.save(train_state, tmp / TRAIN_STATE)
        names.append(TRAIN_STATE)
    if meta is not None:
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        names.append(META)
    (tmp / CHECKPOINT_CHECKSUMS).write_text(checksums_json(tmp, names))
    for name in names + [CHECKPOINT_CHECKSUMS]:
        os.chmod(tmp / name, 0o644)
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    old = ckpt_dir.with_name(f".{ckpt_dir.name}.old")
    if ckpt_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(ckpt_dir, old)
    os.replace(tmp, ckpt_dir)
    if old.exists():
        shutil.rmtree(old)
    return ckpt_dir


def unwrap(model: torch.nn.Module) -> Transformer:
    """The Transformer inside a DDP (or other) wrapper."""
    return getattr(model, "module", model)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from a checkpoint path or a training run (its latest checkpoint).

    Raises CheckpointError if neither is found.
    """
    path = Path(path)
    if (path / CHECKPOINT_WEIGHTS).is_file():
        return path
    if (path / CHECKPOINTS_DIR).is_dir():
        latest = list_checkpoints(path)
        if latest:
            return latest[-1]
        raise CheckpointError(f"run {path} has no checkpoint yet")
    if not path.exists():
        raise CheckpointError(f"model {path} not found (expected a checkpoint folder with "
                              f"{CHECKPOINT_WEIGHTS}, a training run, or a package)")
    raise CheckpointError(f"{path} is not a checkpoint: no {CHECKPOINT_WEIGHTS} in it")


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp folders of a killed write excluded)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and (p / CHECKPOINT_WEIGHTS).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def load_config(ckpt: Path) -> ModelConfig:
    try:
        return ModelConfig.load(ckpt / CHECKPOINT_CONFIG)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(ckpt / CHECKPOINT_WEIGHTS))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{ckpt / CHECKPOINT_WEIGHTS} is damaged or unreadable: {e}") from None


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[Transformer, Tokenizer, Path]:
    """Load a checkpoint (or a run's latest) for inference; returns (model in eval mode,
    tokenizer, checkpoint folder).

    Checksums in checksums.json are verified first; weights are cast to ``dtype``.
    Raises CheckpointError for a missing, damaged or tampered checkpoint, or weights that
    do not match config.json.
    """
    ckpt = resolve_checkpoint(path)
    verify_checksums(ckpt, CHECKPOINT_CHECKSUMS)
    cfg = load_config(ckpt)
    model = Transformer(cfg)
    state = {k: v.to(dtype) for k, v in load_weights(ckpt).items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{ckpt / CHECKPOINT_WEIGHTS} does not match its config.json: "
                              f"{str(e).splitlines()[0]}") from None
    tokenizer = Tokenizer(ckpt / CHECKPOINT_TOKENIZER)
    if tokenizer.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{ckpt}: tokenizer has {tokenizer.vocab_size} pieces but the "
                              f"model's vocab_size is {cfg.vocab_size}")
    return model.to(device).eval(), tokenizer, ckpt


def load_meta(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's meta.json (languages, data, scores), or {} if it has none."""
    path = Path(ckpt) / META
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def load_train_state(ckpt: Path, map_location="cpu") -> dict[str, Any]:
    """The training state of a checkpoint (weights_only: no arbitrary unpickling)."""
    path = ckpt / TRAIN_STATE
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no {TRAIN_STATE}; it cannot be resumed "
                              "(averaged or shipped checkpoints hold weights only)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise CheckpointError(f"{path} is damaged or unreadable: {e}") from None


def checkpoint_sha256(ckpt: str | os.PathLike) -> str:
    """sha256 of a checkpoint's weights file: the identity packages record."""
    return sha256_file(Path(ckpt) / CHECKPOINT_WEIGHTS)


def average_checkpoints(paths: list[Path], out_dir: str | os.PathLike) -> Path:
    """Average the weights of ``paths`` (the paper averages the last 5 / 20 checkpoints,
    §6.1) into a new checkpoint at ``out_dir`` (weights only, no training state).

    Raises CheckpointError if the checkpoints have different configs.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    cfg = load_config(paths[0])
    total: dict[str, torch.Tensor] = {}
    for p in paths:
        if load_config(p) != cfg:
            raise CheckpointError(f"{p} has a different config.json from {paths[0]}; "
                                  "only checkpoints of one run can be averaged")
        for k, v in load_weights(p).items():
            total[k] = total.get(k, 0) + v.double()
    model = Transformer(cfg)
    model.load_state_dict({k: (v / len(paths)).float() for k, v in total.items()})
    meta = {**load_meta(paths[-1]), "averaged": [p.name for p in paths]}
    return save_checkpoint(out_dir, model, paths[-1] / CHECKPOINT_TOKENIZER, meta=meta)


def checkpoint_info(path: str | os.PathLike) -> dict[str, Any]:
    """What ``aiayn info`` prints for a checkpoint: config, parameter count, sizes, hashes."""
    ckpt = resolve_checkpoint(path)
    verified = verify_checksums(ckpt, CHECKPOINT_CHECKSUMS)
    cfg = load_config(ckpt)
    weights = load_weights(ckpt)
    info: dict[str, Any] = {
        "kind": "checkpoint", "path": str(ckpt),
        "parameters": sum(v.numel() for v in weights.values()),
        "dtype": str(next(iter(weights.values())).dtype).replace("torch.", ""),
        "config": cfg.to_dict(),
        "files": {p.name: p.stat().st_size for p in sorted(ckpt.iterdir()) if p.is_file()},
        "sha256": checkpoint_sha256(ckpt),
        "checksums": "verified" if verified else "absent",
    }
    meta = load_meta(ckpt)
    if meta:
        info["meta"] = meta
    if (ckpt / TRAIN_STATE).is_file():
        state = load_train_state(ckpt)
        info["step"], info["epoch"] = int(state["step"]), int(state["epoch"])
    return info
