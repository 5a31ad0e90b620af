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
