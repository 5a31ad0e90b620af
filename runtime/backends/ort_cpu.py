"""``ort-cpu``: ONNX Runtime's CPU execution provider (pip install 'aiayn[cpu]').

The cache and cross K/V stay as ONNX Runtime OrtValues in host memory between steps (bound
with IO binding, never copied into numpy); ``threads`` sets the intra-op thread pool.
"""

from __future__ import annotations

from .ort_common import CPU, INSTALL_CPU, OrtBackend


class OrtCpuBackend(OrtBackend):
    """The package's graphs on ``CPUExecutionProvider``. Raises BackendError if onnxruntime
    is not installed, PackageError if a graph does not load."""

    name = "ort-cpu"
    provider = CPU
    device = "cpu"
    install = INSTALL_CPU

    def providers(self, graph: str = "decoder") -> list:
        return [CPU]
