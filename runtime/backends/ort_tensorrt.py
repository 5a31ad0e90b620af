"""``ort-tensorrt``: ONNX Runtime's TensorRT execution provider, CUDA for what TensorRT
does not take (pip install 'aiayn[gpu]').

TensorRT engines are built by ONNX Runtime on first use (minutes) and kept in an engine
cache, ``${XDG_CACHE_HOME:-~/.cache}/aiayn/trt/<first 12 hex of the decoder's sha256>/``
(``engine_cache`` overrides), with a timing cache beside them, so later runs load in seconds.
Optimization profiles cover N rows 1..``max_rows`` and S, P 1..max_positions.

TensorRT forbids zero-length dimensions, so step 0 (P = 0) cannot run on ``decoder.onnx``'s
engine: it runs on ``decoder_init.onnx`` when the package has one (the ``tensorrt`` variant)
and otherwise on ``decoder.onnx`` under the CUDA provider alone. Everything else is the
IO-bound flow of ``ort-cuda`` (caches on the device, only top-k to the host).

Unverified on this project's CPU machines (no GPU); written against ONNX Runtime's
documented TensorRT provider options (``trt_engine_cache_enable``, ``trt_engine_cache_path``,
``trt_timing_cache_enable``, ``trt_profile_{min,opt,max}_shapes``).
"""

from __future__ import annotations

from pathlib import Path

from ..cli_common import cache_root
from .ort_common import (
    CPU,
    CUDA,
    INSTALL_GPU,
    TENSORRT,
    OrtBackend,
    create_session,
    cuda_options,
    import_onnxruntime,
)


class OrtTensorRTBackend(OrtBackend):
    """The package's graphs on ``TensorrtExecutionProvider`` (GPU ``device_id``).

    Options: ``engine_cache`` (folder), ``max_rows`` (largest N the profiles cover, default
    512), ``fp16`` (let TensorRT use fp16 kernels; off by default, so fp32 packages keep fp32
    numerics). Raises BackendError when the TensorRT provider does not start.
    """

    name = "ort-tensorrt"
    provider = TENSORRT
    device = "cuda"
    install = INSTALL_GPU

    def engine_cache(self) -> Path:
        folder = self.options.get("engine_cache")
        if folder:
            return Path(folder)
        sha = self.package.manifest["graphs"]["decoder"].get("sha256") or "unknown"
        return cache_root() / "trt" / sha[:12]

    @property
    def max_rows(self) -> int:
        """The largest N (decoder rows) the optimization profiles cover."""
        return int(self.options.get("max_rows", 512))

    def _profiles(self, graph: str) -> dict[str, str]:
        """trt_profile_{min,opt,max}_shapes for ``graph``'s dynamic inputs: N rows
        1..max_rows, S and P 1..max_positions (P = 0 never reaches TensorRT)."""
        L, H, Dh, M = self.L, self.H, self.Dh, self.max_positions
        n_max = self.max_rows

        def shapes(N: int, P: int, S: int) -> str:
            if graph == "encoder":
                return f"src_ids:{N}x{S}"
            cross = f"{L}x{N}x{H}x{S}x{Dh}"
            items = [f"tokens:{N}", f"cross_k:{cross}", f"cross_v:{cross}",
                     f"src_pad_mask:{N}x{S}"]
            if graph == "decoder":
                past = f"{L}x{N}x{H}x{P}x{Dh}"
                items += [f"past_k:{past}", f"past_v:{past}", f"beam_origin:{N}"]
            return ",".join(items)

        return {"trt_profile_min_shapes": shapes(1, 1, 1),
                "trt_profile_opt_shapes": shapes(min(128, n_max), 32, 32),
                "trt_profile_max_shapes": shapes(n_max, M, M)}

    def providers(self, graph: str = "decoder") -> list:
        cache = self.engine_cache()
        if TENSORRT in import_onnxruntime().get_available_providers():
            cache.mkdir(parents=True, exist_ok=True)
        trt_options = {
            "device_id": self.device_id,
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(cache),
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": str(cache),
            "trt_fp16_enable": bool(self.options.get("fp16", False)),
            **self._profiles(graph),
        }
        return [(TENSORRT, trt_options), (CUDA, cuda_options(self.device_id)), CPU]

    def gather_providers(self) -> list:
        # Two Gather nodes: not worth an engine; CUDA runs them on the same device.
        return [(CUDA, cuda_options(self.device_id)), CPU]

    def _init_session(self):
        if self.package.has_graph("decoder_init"):
            sess = self._session(self.package.graph_path("decoder_init"),
                                 self.providers("decoder_init"))
        else:  # P = 0 is a zero-length dimension: run step 0 without TensorRT
            sess = create_session(self.package.graph_path("decoder"), self.so,
                                  [(CUDA, cuda_options(self.device_id)), CPU], self.name,
                                  CUDA, self.install)
        return sess, {i.name for i in sess.get_inputs()}
