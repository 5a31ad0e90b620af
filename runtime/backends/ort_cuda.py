"""``ort-cuda``: ONNX Runtime's CUDA execution provider (pip install 'aiayn[gpu]').

IO binding keeps everything on the GPU between steps: the encoder's cross K/V, their
per-row gathers, the self-attention cache (``present_k``/``present_v`` of one step are bound
as the next step's ``past_k``/``past_v``) and ``log_probs``. Only the top-k values and ids
(N x 2K + 2 numbers) are bound to host memory each step; ``log_probs`` is copied to the host
only when the search needs a full row (a sentence's last step, or a row whose top-k is not
conclusive).

Unverified on this project's CPU machines (no GPU); written against ONNX Runtime's
documented IOBinding API (``bind_output(name, "cuda", device_id)``,
``bind_ortvalue_input``) and checked by the GPU tests (``pytest -m gpu``).
"""

from __future__ import annotations

from .ort_common import CPU, CUDA, INSTALL_GPU, OrtBackend, cuda_options


class OrtCudaBackend(OrtBackend):
    """The package's graphs on ``CUDAExecutionProvider`` (GPU ``device_id``, default 0).

    Raises BackendError when this onnxruntime has no CUDA provider or the provider does not
    start (no GPU, missing CUDA 12 / cuDNN 9 libraries).
    """

    name = "ort-cuda"
    provider = CUDA
    device = "cuda"
    install = INSTALL_GPU

    def providers(self, graph: str = "decoder") -> list:
        return [(CUDA, cuda_options(self.device_id, arena_extend_strategy="kSameAsRequested")),
                CPU]
