"""``aiayn export``: a checkpoint becomes a self-describing model package.

A fixed pipeline (STYLE.md): load -> export -> validate -> (optimize) -> save. Everything is
written into a temp folder beside the target and renamed into place only when complete, so
a failed or interrupted export never leaves a half-written package, and an existing package
is replaced only with ``force``.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from runtime import contract as C
from runtime.checksums import sha256_file
from runtime.errors import PackageError
from runtime.package import Package, write_manifest
from train.checkpoint import checkpoint_sha256, load_checkpoint, load_meta

from .graphs import export_decoder, export_encoder


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shaped a package."""
    out = {}
    for dist in ("aiayn", "torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu",
                 "onnxconverter-common", "tensorrt"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def tensor_specs(specs: tuple[C.TensorSpec, ...], precision: str) -> list[dict[str, Any]]:
    """Manifest entries for graph inputs/outputs; "float" resolves to the graph's precision."""
    float_dtype = "float16" if precision == "fp16" else "float32"
    return [{"name": s.name, "dtype": float_dtype if s.dtype == "float" else s.dtype,
             "axes": list(s.axes)} for s in specs]


def graph_entry(package_dir: Path, file: str, inputs, outputs, precision: str, opset: int
                ) -> dict[str, Any]:
    return {"file": file, "sha256": sha256_file(package_dir / file), "precision": precision,
            "opset": opset, "inputs": tensor_specs(inputs, precision),
            "outputs": tensor_specs(outputs, precision)}


def graph_opset(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def build_manifest(package_dir: Path, ckpt: Path, cfg: dict[str, Any], variant: str,
                   graphs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    meta = load_meta(ckpt)
    manifest: dict[str, Any] = {
        "format": C.MANIFEST_FORMAT,
        "format_version": C.MANIFEST_VERSION,
        "variant": variant,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model_config": cfg,
        "special_ids": {"pad": C.PAD_ID, "unk": C.UNK_ID, "bos": C.BOS_ID, "eos": C.EOS_ID},
        "tokenizer": {"file": C.TOKENIZER_FILE,
                      "sha256": sha256_file(package_dir / C.TOKENIZER_FILE)},
        "opset": min(g["opset"] for g in graphs.values()),
        "graphs": graphs,
        "versions": library_versions(),
        "source_checkpoint": {"sha256": checkpoint_sha256(ckpt), "path": str(ckpt)},
    }
    for key in ("languages", "data", "scores"):
        if key in meta:
            manifest[key] = meta[key]
    return manifest


def export_package(checkpoint: str | os.PathLike, out: str | os.PathLike, force: bool = False,
                   opset: int = C.OPSET) -> Package:
    """Export ``checkpoint`` (a checkpoint folder or a run) to an fp32 package at ``out``.

    Raises PackageError if ``out`` exists and ``force`` is false; CheckpointError for a
    missing or damaged checkpoint. Returns the verified Package.
    """
    out = Path(out)
    if out.exists() and not force:
        raise PackageError(f"{out} already exists; pass --force to replace it")
    model, _tokenizer, ckpt = load_checkpoint(checkpoint)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        shutil.copyfile(ckpt / C.CHECKPOINT_TOKENIZER, tmp / C.TOKENIZER_FILE)
        export_encoder(model, tmp / C.ENCODER_FILE, opset)
        export_decoder(model, tmp / C.DECODER_FILE, opset)
        graphs = {
            "encoder": graph_entry(tmp, C.ENCODER_FILE, C.ENCODER_INPUTS, C.ENCODER_OUTPUTS,
                                   "fp32", graph_opset(tmp / C.ENCODER_FILE)),
            "decoder": graph_entry(tmp, C.DECODER_FILE, C.DECODER_INPUTS, C.DECODER_OUTPUTS,
                                   "fp32", graph_opset(tmp / C.DECODER_FILE)),
        }
        write_manifest(tmp, build_manifest(tmp, ckpt, model.cfg.to_dict(), "fp32", graphs))
        Package.load(tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return Package.load(out)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete folder ``src`` to ``dst``, replacing ``dst`` only at the end."""
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    if old.exists():
        shutil.rmtree(old)
