"""Inference backends for the runtime: one small interface (``base.Backend``: run the encoder,
gather cross K/V rows, run one decoder step), one file per backend. Torch-free; a backend's
libraries (onnxruntime, tensorrt) are imported only when it is loaded.

======================  ==============================================  ======================
name                    what                                            install
======================  ==============================================  ======================
``ort-cpu``             ONNX Runtime, CPU provider                      ``aiayn[cpu]``
``ort-cuda``            ONNX Runtime, CUDA provider, IO binding         ``aiayn[gpu]``
``ort-tensorrt``        ONNX Runtime, TensorRT provider (engine cache)  ``aiayn[gpu]``
``tensorrt``            the package's prebuilt ``.plan`` engines        ``aiayn[gpu]``
``auto``                the first of the above that loads here          —
======================  ==============================================  ======================

``auto`` tries, in order: ``tensorrt`` (only if the package has engines), ``ort-tensorrt``
(only for the ``tensorrt`` variant: on any other package its first run spends minutes
building engines), ``ort-cuda`` (not for ``int8`` packages, whose dynamically quantized
operators are CPU kernels), ``ort-cpu``. "Loads" means its sessions were created and really
got the provider (runtime/backends/ort_common.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import BackendError
from ..package import Package
from .base import Backend, StepOutput

REGISTRY = {
    "ort-cpu": "runtime.backends.ort_cpu:OrtCpuBackend",
    "ort-cuda": "runtime.backends.ort_cuda:OrtCudaBackend",
    "ort-tensorrt": "runtime.backends.ort_tensorrt:OrtTensorRTBackend",
    "tensorrt": "runtime.backends.tensorrt:TensorRTBackend",
}
BACKEND_NAMES = ("auto", *REGISTRY)

__all__ = ["Backend", "StepOutput", "REGISTRY", "BACKEND_NAMES", "auto_order", "load_backend"]


def auto_order(package: Package) -> list[str]:
    """The backends ``auto`` tries for ``package``, best first."""
    order = []
    if package.manifest.get("engines"):
        order.append("tensorrt")
    if package.variant == "tensorrt":
        order.append("ort-tensorrt")
    if package.variant != "int8":
        order.append("ort-cuda")
    order.append("ort-cpu")
    return order


def backend_class(name: str) -> type[Backend]:
    """The class of backend ``name``. Raises ValueError for an unknown name."""
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; use one of {', '.join(BACKEND_NAMES)} "
                         "(torch runs a checkpoint, not a package)")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_backend(name: str, package: Package, threads: int | None = None,
                 **options: Any) -> Backend:
    """Create backend ``name`` ("auto" or one of REGISTRY) for ``package``.

    ``threads`` sets ONNX Runtime's intra-op threads; ``options`` go to the backend
    (``device_id``; ``engine_cache``, ``max_rows``, ``fp16`` for ort-tensorrt). Raises
    BackendError if the backend cannot run here (for ``auto``: none can; the message lists why
    each failed), PackageError if the package's graphs do not load, ValueError for an unknown
    name.
    """
    if name != "auto":
        return backend_class(name)(package, threads=threads, **options)
    reasons = []
    for candidate in auto_order(package):
        try:
            return backend_class(candidate)(package, threads=threads, **options)
        except BackendError as e:
            reasons.append(f"{candidate}: {e}")
    raise BackendError("no backend can run this package here:\n  " + "\n  ".join(reasons))
