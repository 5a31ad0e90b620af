"""``tensorrt``: the export's prebuilt TensorRT engines (``*.plan``), run with the TensorRT
Python API (pip install 'aiayn[gpu]').

A package of the ``tensorrt`` variant lists ``engines`` in its manifest: ``encoder``,
``decoder_init`` (step 0: TensorRT forbids the zero-length past of P = 0) and ``decoder``
(P >= 1). Engines run only on the GPU model and TensorRT version that built them (both are
recorded in the manifest); deserialization fails otherwise, and that is reported as a
BackendError telling to rebuild them (``aiayn export --tensorrt`` on this GPU).

Memory: device buffers are ONNX Runtime OrtValues on CUDA (``onnxruntime-gpu`` is part of
the same extra), so the self-attention cache, the cross K/V and ``log_probs`` stay on the GPU
between steps exactly as in ``ort-cuda``; cross K/V rows are re-gathered on the GPU by the
runtime's two-node gather graph on ONNX Runtime's CUDA provider. Only the top-k values and
ids are copied to the host. Each engine call is ``set_input_shape`` + ``set_tensor_address``
per I/O tensor, then ``execute_async_v3`` on a CUDA stream, then a stream synchronize
(TensorRT >= 8.5 name-based I/O API). Shape-tensor inputs (``topk``, and ``step`` when the
engine treats it as one: ``engine.get_tensor_location(name) == TensorLocation.HOST``) live in
host memory, as TensorRT requires. Batches are capped to the engines' largest profile
(``max_rows``: the translator forms batches of at most max_rows // K sentences), and top-k to
the ``topk`` shape-input range the manifest records. Engine I/O dtypes are read from the
engine (fp16 caches, int32 ids, say), and host inputs are converted to them.

An execution context is not thread-safe, so this backend reports ``thread_safe = False`` and
the translator serializes its calls.

UNVERIFIED: written against NVIDIA's documented TensorRT 10 Python API; no GPU exists on the
machines this project's CI runs on, and its tests skip with that reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import numpy as np

from ..errors import BackendError
from ..package import Package
from .base import Backend, StepOutput
from .ort_common import (
    CPU,
    CUDA,
    INSTALL_GPU,
    Cache,
    Encoded,
    create_session,
    cuda_options,
    gather_model_bytes,
    import_onnxruntime,
    select_rows,
    session_options,
)

_OUTPUTS = ("log_probs", "topk_log_probs", "topk_ids", "present_k", "present_v", "cross_attn")


class _CudaStream:
    """A CUDA stream and its synchronize, via cuda-python when installed, else the CUDA
    runtime library (libcudart) through ctypes (its documented C API)."""

    def __init__(self):
        self._cudart = None
        self._lib = None
        try:
            try:
                from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
            except ImportError:
                from cuda import cudart  # older cuda-python
            err, stream = cudart.cudaStreamCreate()
            if int(err) != 0:
                raise BackendError(f"cudaStreamCreate failed ({err})")
            self._cudart, self.handle = cudart, int(stream)
            return
        except ImportError:
            pass
        for name in ("libcudart.so.12", "libcudart.so", ctypes.util.find_library("cudart"),
                     "cudart64_12.dll"):
            if not name:
                continue
            try:
                self._lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if self._lib is None:
            raise BackendError("backend tensorrt needs the CUDA runtime library (libcudart) "
                               "or cuda-python: pip install cuda-python")
        stream = ctypes.c_void_p()
        if self._lib.cudaStreamCreate(ctypes.byref(stream)) != 0:
            raise BackendError("cudaStreamCreate failed: no usable CUDA device")
        self.handle = int(stream.value or 0)

    def synchronize(self) -> None:
        if self._cudart is not None:
            (err,) = self._cudart.cudaStreamSynchronize(self.handle)
            ok = int(err) == 0
        else:
            ok = self._lib.cudaStreamSynchronize(ctypes.c_void_p(self.handle)) == 0
        if not ok:
            raise BackendError("CUDA stream synchronize failed (a TensorRT kernel failed)")


class _Engine:
    """One deserialized engine with one execution context."""

    def __init__(self, trt, runtime, path, device_id: int, ort):
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise BackendError(f"TensorRT could not deserialize {path}: engines run only on the "
                               "GPU model and TensorRT version that built them; rebuild them "
                               "here with `aiayn export --tensorrt`")
        self.engine = engine
        self.context = engine.create_execution_context()
        self.ort, self.device_id, self.path = ort, device_id, path
        self.inputs, self.outputs, self.dtype, self.host_io = [], [], {}, set()
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = engine.get_tensor_mode(name)
            (self.inputs if mode == trt.TensorIOMode.INPUT else self.outputs).append(name)
            self.dtype[name] = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            if mode == trt.TensorIOMode.INPUT and \
                    engine.get_tensor_location(name) == trt.TensorLocation.HOST:
                self.host_io.add(name)  # a shape tensor (topk, step): host memory
        rows = "tokens" if "tokens" in self.inputs else "src_ids"
        self.max_rows = int(engine.get_tensor_profile_shape(rows, 0)[2][0])

    def run(self, feeds: dict[str, Any], stream: _CudaStream) -> dict[str, Any]:
        """Run with ``feeds`` (numpy arrays or CUDA OrtValues); returns CUDA OrtValues."""
        ort, ctx = self.ort, self.context
        keep = []  # host arrays and OrtValues must outlive the launch
        for name in self.inputs:
            value = feeds[name]
            want = self.dtype[name]
            if name in self.host_io:  # shape tensors: host memory
                arr = np.ascontiguousarray(value, dtype=want)
                keep.append(arr)
                ctx.set_tensor_address(name, arr.ctypes.data)
                continue
            if isinstance(value, np.ndarray):
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value, dtype=want),
                                                         "cuda", self.device_id)
            elif np.dtype(_np_type(value)) != want:  # rare: an engine with other I/O dtypes
                value = ort.OrtValue.ortvalue_from_numpy(value.numpy().astype(want), "cuda",
                                                         self.device_id)
            keep.append(value)
            if not ctx.set_input_shape(name, tuple(value.shape())):
                raise BackendError(f"{self.path.name}: input {name} of shape {value.shape()} is "
                                   "outside the engine's optimization profile; use smaller "
                                   "batches (--max-tokens) or rebuild the engines")
            ctx.set_tensor_address(name, value.data_ptr())
        missing = ctx.infer_shapes()  # output shapes follow from input shapes and shape inputs
        if missing:
            raise BackendError(f"{self.path.name}: TensorRT cannot infer the shapes of "
                               f"{', '.join(missing)} from the inputs given")
        results = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise BackendError(f"{self.path.name}: output {name} has unresolved shape {shape}")
            out = ort.OrtValue.ortvalue_from_shape_and_type(shape, self.dtype[name], "cuda",
                                                            self.device_id)
            ctx.set_tensor_address(name, out.data_ptr())
            results[name] = out
        if not ctx.execute_async_v3(stream.handle):
            raise BackendError(f"TensorRT failed to run {self.path.name}")
        stream.synchronize()
        del keep
        return results


def _np_type(ortvalue) -> Any:
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16,
            "tensor(int64)": np.int64, "tensor(int32)": np.int32,
            "tensor(bool)": np.bool_}.get(ortvalue.data_type(), np.float32)


class TensorRTBackend(Backend):
    """The package's ``.plan`` engines on GPU ``device_id`` (default 0).

    Raises BackendError when tensorrt, onnxruntime-gpu's CUDA provider or a CUDA runtime is
    missing, or an engine does not deserialize here; PackageError when the package has no
    engines (export them with ``aiayn export --tensorrt`` on the GPU they will run on).
    """

    name = "tensorrt"
    thread_safe = False
    device = "cuda"

    def __init__(self, package: Package, threads: int | None = None, device_id: int = 0,
                 **options: Any):
        super().__init__(package.config)
        try:
            import tensorrt as trt
        except ImportError:
            raise BackendError(f"backend tensorrt needs the tensorrt package: {INSTALL_GPU}"
                               ) from None
        ort = import_onnxruntime()
        self.package, self.device_id, self.threads = package, int(device_id), threads
        paths = {n: package.engine_path(n) for n in ("encoder", "decoder_init", "decoder")}
        so = session_options(threads)
        providers = [(CUDA, cuda_options(self.device_id)), CPU]
        cfg = package.config
        self.L, self.H = int(cfg["decoder_layers"]), int(cfg["h"])
        self.Dh = int(cfg["d_model"]) // self.H
        self.stream = _CudaStream()
        self.logger = trt.Logger(trt.Logger.ERROR)
        self.runtime = trt.Runtime(self.logger)
        self.engines = {n: _Engine(trt, self.runtime, p, self.device_id, ort)
                        for n, p in paths.items()}
        self.max_rows = min(e.max_rows for e in self.engines.values())
        topk = (package.manifest["engines"]["decoder"].get("profiles") or [{}])[0] \
            .get("shape_inputs", {}).get("topk", {})
        self.max_topk = topk.get("max")
        float_dtype = self.engines["encoder"].dtype.get("cross_k", np.dtype(np.float32))
        self.gather = create_session(gather_model_bytes(float_dtype), so, providers, self.name,
                                     CUDA, INSTALL_GPU)
        self.trt_version = trt.__version__

    def encode(self, src_ids: np.ndarray) -> Encoded:
        out = self.engines["encoder"].run({"src_ids": np.asarray(src_ids, np.int64)}, self.stream)
        return Encoded(out["cross_k"], out["cross_v"], out["src_pad_mask"], src_ids.shape[0])

    def select(self, encoded: Encoded, rows: np.ndarray) -> Encoded:
        return select_rows(self.gather, encoded, rows, "cuda", self.device_id)

    def step(self, tokens: np.ndarray, step: int, cache: Cache | None, beam_origin: np.ndarray,
             cross: Encoded, topk: int) -> StepOutput:
        engine = self.engines["decoder_init" if cache is None else "decoder"]
        if self.max_topk is not None and topk > self.max_topk:
            raise BackendError(f"the TensorRT engines take top-k <= {self.max_topk} (beam <= "
                               f"{(self.max_topk - 2) // 2}); asked for {topk}")
        if len(tokens) > engine.max_rows:
            raise BackendError(f"{len(tokens)} decoder rows exceed the TensorRT engines' "
                               f"profile ({engine.max_rows}); use smaller batches (--max-tokens)")
        feeds: dict[str, Any] = {"tokens": tokens, "step": np.array(step, np.int64),
                                 "cross_k": cross.cross_k, "cross_v": cross.cross_v,
                                 "src_pad_mask": cross.src_pad_mask,
                                 "topk": np.array(topk, np.int64)}
        if cache is not None:
            feeds.update(past_k=cache.k, past_v=cache.v, beam_origin=beam_origin)
        feeds = {k: v for k, v in feeds.items() if k in engine.inputs}
        out = engine.run(feeds, self.stream)
        return StepOutput(topk_log_probs=out["topk_log_probs"].numpy().astype(np.float32),
                          topk_ids=out["topk_ids"].numpy().astype(np.int64),
                          cache=Cache(out["present_k"], out["present_v"]),
                          _log_probs=out["log_probs"].numpy, _cross_attn=out["cross_attn"].numpy)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "device": f"cuda:{self.device_id}",
                "tensorrt": self.trt_version,
                "built_for": self.package.manifest.get("gpu_name"),
                "variant": self.package.variant}
