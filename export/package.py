"""``aiayn export``: a checkpoint becomes a self-describing, validated model package.

A fixed pipeline (STYLE.md): load -> trace -> (optimize | fp16 | int8) -> manifest -> validate
-> (TensorRT engines) -> save. Everything is written into a temp folder beside the target
(``.<name>.tmp-<pid>``) and renamed into place only when complete and validated, so a failed,
interrupted (Ctrl-C) or invalid export never leaves a half-written package, and an existing
package is replaced only with ``force``. Variants (runtime.contract.VARIANTS) are separate
packages, one per export, each with its own manifest and parity record.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import shutil
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from runtime import contract as C
from runtime.checksums import sha256_file
from runtime.package import Package, is_package, write_manifest

from .errors import ExportError, require_modules

Progress = Callable[[str], None]

# Precision of the ONNX graphs of each variant (TensorRT engines are fp16, recorded apart).
VARIANT_PRECISION = {"fp32": "fp32", "optimized": "fp32", "fp16": "fp16", "int8": "int8",
                     "tensorrt": "fp32"}
_GRAPH_SPECS = {
    "encoder": (C.ENCODER_FILE, C.ENCODER_INPUTS, C.ENCODER_OUTPUTS),
    "decoder": (C.DECODER_FILE, C.DECODER_INPUTS, C.DECODER_OUTPUTS),
    "decoder_init": (C.DECODER_INIT_FILE, C.DECODER_INIT_INPUTS, C.DECODER_INIT_OUTPUTS),
}
_PRECISION_NOTE = {
    "fp32": "float32",
    "fp16": "float16 weights, caches and cross K/V; LayerNormalization, Softmax, LogSoftmax and "
            "TopK computed in float32; log_probs, topk_log_probs, cross_attn float32",
    "int8": "int8 weights of MatMul nodes with constant weights, activations quantized to uint8 "
            "per call (dynamic quantization); everything else float32",
}


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shaped a package."""
    out = {}
    for dist in ("aiayn", "torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu",
                 "onnxconverter-common", "tensorrt"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


def tensor_specs(specs: tuple[C.TensorSpec, ...], precision: str) -> list[dict[str, Any]]:
    """Manifest entries for graph inputs/outputs; "float" resolves to the graph's precision."""
    float_dtype = "float16" if precision == "fp16" else "float32"
    return [{"name": s.name, "dtype": float_dtype if s.dtype == "float" else s.dtype,
             "axes": list(s.axes)} for s in specs]


def graph_entry(package_dir: Path, file: str, inputs, outputs, precision: str, opset: int
                ) -> dict[str, Any]:
    """The manifest entry of one graph: file, sha256, precision, opset, I/O specs, and its
    external data file (with sha256) when it has one."""
    entry = {"file": file, "sha256": sha256_file(package_dir / file), "precision": precision,
             "precision_detail": _PRECISION_NOTE[precision], "opset": opset,
             "inputs": tensor_specs(inputs, precision),
             "outputs": tensor_specs(outputs, precision)}
    data = package_dir / f"{file}{C.EXTERNAL_DATA_SUFFIX}"
    if data.is_file():
        entry["external_data"] = [{"file": data.name, "sha256": sha256_file(data)}]
    return entry


def graph_opset(path: Path) -> int:
    """The default-domain opset a graph imports."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def build_manifest(package_dir: Path, ckpt: Path, cfg: dict[str, Any], variant: str,
                   graphs: dict[str, dict[str, Any]], extra: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The manifest of a package (schema: runtime/package.py), without its parity summary."""
    from train.checkpoint import checkpoint_sha256, load_meta

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
        "exporter": "torch.onnx.export(dynamo=True) of train.model.Transformer.encode_for_step "
                    "/ step (export/graphs.py)",
        "versions": library_versions(),
        "source_checkpoint": {"sha256": checkpoint_sha256(ckpt), "path": str(ckpt.resolve())},
    }
    manifest.update(extra or {})
    for key in ("languages", "data"):
        if key in meta:
            manifest[key] = meta[key]
    if "scores" in meta:
        # The checkpoint's scores describe the fp32 PyTorch model: a variant that changes the
        # arithmetic (fp16, int8) must not present them as its own.
        key = "scores" if variant in ("fp32", "optimized") else "source_checkpoint_scores"
        manifest[key] = meta["scores"]
    return manifest


def _check_out(out: Path, force: bool, ckpt_arg: Path) -> None:
    """Refuse an existing ``out`` without ``force``, and never replace something that is not a
    package (a checkpoint, a folder of other files) even with it."""
    src = ckpt_arg.resolve()
    dst = out.resolve()
    if dst == src or dst in src.parents:
        raise ExportError(f"--out {out} would overwrite the checkpoint {ckpt_arg}; choose "
                          "another folder")
    if not out.exists():
        return
    if not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder; remove it or choose another --out")
    if any(out.iterdir()) and not is_package(out):
        raise ExportError(f"{out} is a non-empty folder that is not a model package; refusing "
                          "to replace it even with --force")


def _remove_stale_temps(out: Path) -> None:
    """Remove temp folders of exports to ``out`` whose process is gone (killed with -9)."""
    for tmp in out.parent.glob(f".{out.name}.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            pass


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete folder ``src`` to ``dst``, replacing ``dst`` only at the end; if the
    swap is interrupted between its two renames, the old ``dst`` is put back."""
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
    moved = False
    try:
        if dst.exists():
            os.replace(dst, old)
            moved = True
        os.replace(src, dst)
    except BaseException:
        if moved and not dst.exists():
            os.replace(old, dst)
        raise
    if old.exists():
        shutil.rmtree(old)


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def export_package(checkpoint: str | os.PathLike, out: str | os.PathLike, force: bool = False,
                   opset: int = C.OPSET, variant: str = "fp32", external_data: bool = False,
                   optimize_level: str = "all", seed: int | None = None,
                   timing_cache: str | os.PathLike | None = None,
                   progress: Progress | None = None, results: Progress | None = None) -> Package:
    """Export ``checkpoint`` (a checkpoint folder or a training run) to a validated package.

    Args:
        checkpoint: checkpoint folder or run (its latest checkpoint).
        out: the package folder to create.
        force: replace an existing package at ``out``.
        opset: ONNX opset, runtime.contract.MIN_OPSET .. onnx's newest (default OPSET = 18).
        variant: one of runtime.contract.VARIANTS: "fp32", "optimized" (ORT offline
            optimization at ``optimize_level``), "fp16", "int8", "tensorrt" (adds
            decoder_init.onnx and TensorRT engines; needs TensorRT and a CUDA GPU).
        external_data: store each graph's weights in ``<graph>.data`` beside it.
        optimize_level: "basic" | "extended" | "all" for ``variant="optimized"``.
        seed: seed of the validation's random inputs (default export.validate.DEFAULT_SEED).
        timing_cache: TensorRT timing cache file to reuse and update (tensorrt only).
        progress: called with one line per phase.
        results: called with one line per validated output (default: ``progress``).

    Returns the loaded (verified) Package. Raises ExportError for bad options, an ``out`` that
    must not be replaced, a missing TensorRT, or a converter failure; CheckpointError for a
    missing or damaged checkpoint; PackageError / ParityError (nothing is written) if the
    graphs fail validation.
    """
    require_modules("torch", "onnx", "onnxscript", "onnxruntime")
    import onnx

    from .validate import DEFAULT_SEED, validate_graphs, write_parity

    say = progress or (lambda _msg: None)
    started = time.monotonic()
    if variant not in C.VARIANTS:
        raise ExportError(f"unknown variant {variant!r}; expected one of {', '.join(C.VARIANTS)}")
    newest = onnx.defs.onnx_opset_version()
    if not C.MIN_OPSET <= opset <= newest:
        raise ExportError(f"--opset {opset} is not supported: use {C.MIN_OPSET}..{newest} "
                          f"(default {C.OPSET}; the contract needs one LayerNormalization node)")
    if optimize_level not in ("basic", "extended", "all"):
        raise ExportError(f"unknown optimization level {optimize_level!r}; use basic, extended "
                          "or all")
    trt = None
    if variant == "tensorrt":
        from .tensorrt import require_tensorrt

        trt = require_tensorrt()  # before any work
    seed = DEFAULT_SEED if seed is None else seed
    out = Path(out)
    _check_out(out, force, Path(checkpoint))

    from train.checkpoint import load_checkpoint, resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)  # CheckpointError before any output
    say(f"loading checkpoint {ckpt}")
    model, _tokenizer, ckpt = load_checkpoint(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        shutil.copyfile(ckpt / C.CHECKPOINT_TOKENIZER, tmp / C.TOKENIZER_FILE)
        precision = VARIANT_PRECISION[variant]
        derived = variant in ("optimized", "fp16", "int8")
        stage = tmp / ".stage" if derived else tmp
        stage.mkdir(exist_ok=True)
        names = ["encoder", "decoder"] + (["decoder_init"] if variant == "tensorrt" else [])
        traced = _trace(model, stage, names, opset, external_data, fp16=variant == "fp16", say=say)
        extra: dict[str, Any] = {}
        if variant == "optimized":
            from .variants import optimize_graph

            for name in names:
                say(f"optimizing {traced[name].name} (onnxruntime, level {optimize_level})")
                extra["optimization"] = optimize_graph(traced[name], tmp / traced[name].name,
                                                       optimize_level, external_data)
        elif variant == "fp16":
            from .variants import convert_fp16

            for name in names:
                say(f"converting {traced[name].name} to float16")
                fp32_io = [s.name for s in _GRAPH_SPECS[name][2] if s.dtype == "float32"]
                extra["fp16"] = convert_fp16(traced[name], tmp / traced[name].name, fp32_io,
                                             external_data)
        elif variant == "int8":
            from .variants import quantize_int8

            for name in names:
                say(f"quantizing {traced[name].name} to int8 (dynamic)")
                extra["quantization"] = quantize_int8(traced[name], tmp / traced[name].name,
                                                      stage / "work", external_data)
        final = {name: tmp / traced[name].name for name in names}
        entries = {}
        for name in names:
            file, inputs, outputs = _GRAPH_SPECS[name]
            entries[name] = graph_entry(tmp, file, inputs, outputs, precision,
                                        graph_opset(final[name]))
        manifest = build_manifest(tmp, ckpt, model.cfg.to_dict(), variant, entries, extra)
        write_manifest(tmp, manifest)
        Package.load(tmp)

        level = extra.get("optimization", {}).get("load_level", "all")
        report = validate_graphs(model, final, precision, variant, seed=seed, level=level,
                                 baseline=traced if variant == "optimized" else None,
                                 progress=say)
        for line in report.lines():
            (results or say)(line)
        report.raise_if_failed()
        manifest = write_parity(tmp, manifest, report)

        if variant == "tensorrt":
            from .tensorrt import build_engines

            manifest = build_engines(trt, tmp, manifest, model, timing_cache=timing_cache,
                                     seed=seed, progress=say)
            write_manifest(tmp, manifest)
        if derived:
            shutil.rmtree(stage)
        Package.load(tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    package = Package.load(out)
    say(f"wrote {out} ({variant}, {_dir_size(out) / 1e6:.1f} MB) in "
        f"{time.monotonic() - started:.1f} s")
    return package


def _trace(model, directory: Path, names: list[str], opset: int, external_data: bool,
           fp16: bool, say: Progress) -> dict[str, Path]:
    """Trace the named graphs into ``directory``; with ``fp16`` the attention masks are traced
    with the fp16-safe value (graphs.fp16_safe_masks)."""
    import contextlib

    from .graphs import export_decoder, export_decoder_init, export_encoder, fp16_safe_masks

    exporters = {"encoder": export_encoder, "decoder": export_decoder,
                 "decoder_init": export_decoder_init}
    paths = {}
    with fp16_safe_masks() if fp16 else contextlib.nullcontext():
        for name in names:
            file = _GRAPH_SPECS[name][0]
            say(f"tracing {file} (torch.export, opset {opset})")
            paths[name] = exporters[name](model, directory / file, opset, external_data)
            got = graph_opset(paths[name])
            if got != opset:
                raise ExportError(f"torch's exporter produced opset {got} for {file}, not the "
                                  f"requested {opset} (its conversion to {opset} failed); use "
                                  f"--opset {max(got, C.OPSET)} (the default is {C.OPSET})")
    return paths
