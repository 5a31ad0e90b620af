"""Model packages: reading and verifying ``manifest.json`` and its files. Torch-free.

A package is a directory (DESIGN.md "The model package"): ``manifest.json``, the graphs,
``spm.model`` (and, for TensorRT, ``*.plan`` engines). ``Package.load`` checks the format name
and version, that every listed file exists, and every sha256, before anything runs; whatever
it cannot use it refuses with a PackageError that says what is wrong and what to do.

Manifest schema (``MANIFEST_VERSION`` 1)::

    format            "aiayn-package"
    format_version    1
    variant           "fp32" | "optimized" | "fp16" | "int8" | "tensorrt"
    created           ISO-8601 UTC time
    model_config      the checkpoint's config.json (train.config.ModelConfig fields)
    special_ids       {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    tokenizer         {"file": "spm.model", "sha256": ...}
    opset             ONNX opset of the graphs
    graphs            {"encoder"|"decoder"|"decoder_init": {"file", "sha256", "precision",
                       "opset", "inputs": [{"name", "dtype", "axes"}], "outputs": [...],
                       "external_data": [{"file", "sha256"}]}}
    engines           (tensorrt) {"encoder"|"decoder"|"decoder_init": {"file", "sha256",
                       "profiles": ...}}, "tensorrt_version", "gpu_name"
    versions          {"aiayn", "torch", "onnx", "onnxruntime", "onnxscript", ...}
    parity            summary of the validation (max abs diff per output, shapes, tolerance)
    source_checkpoint {"sha256": sha256 of model.safetensors, "path": as exported}
    languages         {"src": "en", "tgt": "de"} (when known)
    data, scores      free-form provenance (when known)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import contract as C
from .checksums import sha256_file
from .errors import PackageError


@dataclass
class Package:
    """A verified model package. ``path`` is absolute, so a package opened from any working
    directory (or moved to another folder) resolves its files."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, path: str | os.PathLike, verify_hashes: bool = True) -> Package:
        """Open and verify a package.

        Raises PackageError if the folder or manifest is missing or not valid JSON, the format
        or its major version is unknown, a listed file is missing, or a sha256 differs.
        """
        path = Path(path).resolve()
        if not path.is_dir():
            raise PackageError(f"package {path} not found (export one with `aiayn export`)")
        mf = path / C.MANIFEST_FILE
        if not mf.is_file():
            raise PackageError(f"{path} is not a model package: no {C.MANIFEST_FILE}")
        try:
            manifest = json.loads(mf.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise PackageError(f"{mf} is not valid JSON ({e}); re-export the package") from None
        if not isinstance(manifest, dict) or manifest.get("format") != C.MANIFEST_FORMAT:
            raise PackageError(f"{mf} is not an aiayn package manifest (format is "
                               f"{manifest.get('format') if isinstance(manifest, dict) else None!r})")
        version = manifest.get("format_version")
        if version != C.MANIFEST_VERSION:
            raise PackageError(
                f"{mf} has format_version {version!r}; this aiayn reads version "
                f"{C.MANIFEST_VERSION} only — re-export the package with this aiayn, or upgrade aiayn")
        for key in ("model_config", "tokenizer", "graphs", "special_ids"):
            if key not in manifest:
                raise PackageError(f"{mf} lacks the required field {key!r}; re-export the package")
        ids = manifest["special_ids"]
        expected = {"pad": C.PAD_ID, "unk": C.UNK_ID, "bos": C.BOS_ID, "eos": C.EOS_ID}
        if ids != expected:
            raise PackageError(f"{mf}: special ids {ids} differ from the contract's {expected}")
        package = cls(path, manifest)
        for rel, digest in package.files():
            f = path / rel
            if not f.is_file():
                raise PackageError(f"{f} is listed in the manifest but missing; the package is "
                                   "incomplete — re-export it")
            if verify_hashes and digest is not None and sha256_file(f) != digest:
                raise PackageError(f"{f} does not match its sha256 in the manifest (damaged or "
                                   "modified); re-export the package")
        return package

    def files(self) -> list[tuple[str, str | None]]:
        """(relative file, sha256) of every file the manifest lists."""
        m = self.manifest
        out = [(m["tokenizer"]["file"], m["tokenizer"].get("sha256"))]
        for section in ("graphs", "engines"):
            for g in m.get(section, {}).values():
                out.append((g["file"], g.get("sha256")))
                out += [(x["file"], x.get("sha256")) for x in g.get("external_data", [])]
        return out

    # -- accessors ----------------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest["model_config"]

    @property
    def variant(self) -> str:
        return self.manifest.get("variant", "fp32")

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["tokenizer"]["file"]

    def has_graph(self, name: str) -> bool:
        return name in self.manifest["graphs"]

    def graph_path(self, name: str) -> Path:
        """Absolute path of graph ``name`` ("encoder", "decoder", "decoder_init")."""
        try:
            return self.path / self.manifest["graphs"][name]["file"]
        except KeyError:
            raise PackageError(f"package {self.path} has no {name} graph") from None

    def precision(self, name: str) -> str:
        return self.manifest["graphs"][name].get("precision", "fp32")

    def engine_path(self, name: str) -> Path:
        try:
            return self.path / self.manifest["engines"][name]["file"]
        except KeyError:
            raise PackageError(f"package {self.path} has no TensorRT {name} engine; export "
                               "it with `aiayn export --tensorrt` on the GPU it will run on") from None


def is_package(path: str | os.PathLike) -> bool:
    """True if ``path`` is a folder holding a manifest.json."""
    return (Path(path) / C.MANIFEST_FILE).is_file()


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` atomically (temp file + rename)."""
    path = Path(directory) / C.MANIFEST_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
