"""Errors of ``aiayn export`` / ``aiayn validate``. Each is an AiaynError, so the command line
prints its message as one line and exits 2 (runtime/cli_common.py ``run_cli``)."""

from __future__ import annotations

from runtime.errors import AiaynError, PackageError


class ExportError(AiaynError, RuntimeError):
    """An export that cannot run: conflicting options, a missing optional dependency
    (TensorRT), an output folder that must not be replaced, or a converter that failed."""


class ParityError(PackageError):
    """A graph whose outputs differ from PyTorch's beyond tolerance (or hold NaN).

    Attributes: ``output`` ("decoder.log_probs"), ``case`` (the shape, "N=12, P=7, S=101"),
    ``value`` (max abs diff or agreement rate) and ``limit`` (the tolerance it broke).
    """

    def __init__(self, message: str, output: str = "", case: str = "", value: float = float("nan"),
                 limit: float = float("nan")):
        super().__init__(message)
        self.output, self.case, self.value, self.limit = output, case, value, limit


# module -> the extra that provides it (pyproject.toml)
_EXTRAS = {"torch": "train", "safetensors": "train", "onnx": "export", "onnxscript": "export",
           "onnxruntime": "cpu"}


def require_modules(*modules: str) -> None:
    """Raise ExportError naming the extra to install if any of ``modules`` cannot be imported
    (torch for tracing and the reference, onnx/onnxscript for export, onnxruntime for
    validation and the variants)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extras = sorted({_EXTRAS.get(m, "export") for m in missing})
        raise ExportError(f"{', '.join(missing)} not installed: pip install "
                          f"'aiayn[{','.join(extras)}]' (onnxruntime-gpu, from the gpu extra, "
                          "also provides onnxruntime)")
