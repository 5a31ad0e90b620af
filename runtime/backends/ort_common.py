"""What every ONNX Runtime backend shares: session options, provider checks, and the IO-bound
encoder / decoder-step runner. Torch-free; imports onnxruntime only when a backend is built.

Design (issue 5, item 1):

- Availability is decided by creating a session and reading ``session.get_providers()``:
  ONNX Runtime silently falls back to the CPU when a requested provider cannot start, so a
  provider that merely appears in ``get_available_providers()`` proves nothing. A missing or
  failing provider is a BackendError that names what to install.
- Every graph runs through IO binding. The self-attention cache (``present_k``/``present_v``)
  and the cross K/V stay as OrtValues where they were computed (host memory on ``ort-cpu``,
  device memory on ``ort-cuda``/``ort-tensorrt``) and are bound as the next step's inputs,
  so no per-step numpy copy of them is ever made; only the top-k values and ids are bound to
  host memory. ``log_probs`` and ``cross_attn`` stay with the backend and are read only when
  the search asks (on the CPU ``OrtValue.numpy()`` is a view, not a copy).
- Cross K/V rows are re-gathered (when the set of sentences changes) by a two-node ONNX graph
  (``Gather`` on axis 1 / axis 0) run on the same provider, so they never leave the device.
  The graph is serialized here by hand (a few protobuf fields) because the runtime must not
  depend on the ``onnx`` package.
- Sessions are created once per backend and shared by all threads: ``InferenceSession.run``
  is thread-safe, and each call builds its own IOBinding.
- CPU threading (measured on this project's shared 2-core machine): intra-op threads do not
  spin (``session.intra_op.allow_spinning`` 0; busy-waiting threads were 2-3x slower per
  step whenever other processes wanted the cores), and decoder steps of at most
  ``SMALL_ROWS`` rows (a single sentence's beam, the tail of a batch) run on a second,
  single-threaded decoder session, because ops that small do not gain from splitting (1
  thread was 15-20 % faster per step at N <= 16). Backend options ``spin=True`` and
  ``small_rows=0`` restore ONNX Runtime's defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import DECODER_OUTPUTS, names
from ..errors import BackendError, PackageError
from ..package import Package
from .base import Backend, StepOutput

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def cuda_options(device_id: int = 0, **extra) -> dict:
    """CUDA provider options. ``use_tf32`` "0": by default the provider runs fp32 MatMul/Gemm
    in TF32 (10-bit mantissa), which moved log-probs by up to 6e-3 against PyTorch's fp32 on
    an H200 and broke fp32 parity in 3 of 1000 sentences; fp32 packages promise fp32
    arithmetic (fp16 graphs are unaffected)."""
    return {"device_id": device_id, "use_tf32": "0", **extra}
TENSORRT = "TensorrtExecutionProvider"

INSTALL_CPU = "pip install 'aiayn[cpu]' (onnxruntime)"
INSTALL_GPU = ("pip install 'aiayn[gpu]' (onnxruntime-gpu and tensorrt; uninstall the CPU "
               "'onnxruntime' first, the two cannot coexist) with an NVIDIA driver, CUDA 12 and "
               "cuDNN 9 visible to it")

# ONNX TensorProto element types of the tensors the gather graph moves.
_ONNX_TYPES = {np.dtype(np.float32): 1, np.dtype(np.float16): 10, np.dtype(np.bool_): 9,
               np.dtype(np.int64): 7}
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(bool)": np.bool_, "tensor(int32)": np.int32}

# log_probs, topk_log_probs, topk_ids, present_k, present_v, cross_attn
_DEC_OUT = names(DECODER_OUTPUTS)
SMALL_ROWS = 16  # decoder steps with at most this many rows use a single-threaded session


def import_onnxruntime():
    """The ``onnxruntime`` module, or BackendError naming the extra to install."""
    try:
        import onnxruntime
    except ImportError:
        raise BackendError(f"the ONNX Runtime backends need onnxruntime: {INSTALL_CPU}, or "
                           f"for NVIDIA GPUs {INSTALL_GPU}") from None
    return onnxruntime


def session_options(threads: int | None = None, spin: bool = False):
    """SessionOptions for the runtime's graphs.

    ``threads`` sets ONNX Runtime's intra-op threads (None: ONNX Runtime's default, one per
    physical core). Graphs run sequentially (one decoder step is one chain of ops), with all
    graph optimizations; memory patterns are off because every call has new shapes (P grows
    each step, N shrinks as sentences finish).

    ``spin``: whether idle intra-op threads busy-wait for work (ONNX Runtime's default). Off
    here: a decoder step is ~150 small ops, and when the cores are shared (other processes,
    or several translators) spinning threads burn the time slices the working ones need —
    measured on a busy 2-core machine, 2 spinning threads were 2-3x slower per step than
    2 blocking threads or 1 thread; on idle cores spinning is ~15-20 % faster. Raises
    ValueError for threads < 1.
    """
    ort = import_onnxruntime()
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = threads or 0
    so.inter_op_num_threads = 1
    so.enable_mem_pattern = False
    so.log_severity_level = 3  # errors only; provider fall-backs are reported by us
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def create_session(model: str | os.PathLike | bytes, so, providers: list, backend: str,
                   provider: str, install: str):
    """An InferenceSession on ``providers`` whose first provider really is ``provider``.

    Raises BackendError if ``provider`` is not built into this onnxruntime, or the session
    fell back to another provider (missing CUDA/cuDNN/TensorRT libraries, no GPU); raises
    PackageError if ONNX Runtime cannot load the graph file itself.
    """
    ort = import_onnxruntime()
    available = ort.get_available_providers()
    if provider not in available:  # cannot work; the converse is proven only by a session
        raise BackendError(f"backend {backend} needs ONNX Runtime's {provider}, which this "
                           f"onnxruntime {ort.__version__} does not have (it has "
                           f"{', '.join(available)}): {install}")
    what = "the gather graph" if isinstance(model, bytes) else str(model)
    try:
        sess = ort.InferenceSession(model if isinstance(model, bytes) else str(model), so,
                                    providers=providers)
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if provider != CPU and any(w in text for w in ("CUDA", "cuda", "TensorRT", "cudnn",
                                                       "provider", "Provider")):
            raise BackendError(f"backend {backend}: ONNX Runtime could not start {provider} "
                               f"({text}); {install}") from None
        raise PackageError(f"ONNX Runtime cannot load {what}: {text}; re-export the "
                           "package (a graph from a newer exporter may need a newer "
                           "onnxruntime)") from None
    got = sess.get_providers()
    if not got or got[0] != provider:
        raise BackendError(f"backend {backend}: ONNX Runtime could not start {provider} and "
                           f"fell back to {', '.join(got) or 'nothing'}; {install}")
    return sess


# ---------------------------------------------------------------------------- gather graph

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_int(num: int, value: int) -> bytes:
    return _varint(num << 3) + _varint(value)


def _field_bytes(num: int, value: bytes | str) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    return _varint((num << 3) | 2) + _varint(len(value)) + value


def _value_info(name: str, elem_type: int, dims: list[str]) -> bytes:
    shape = b"".join(_field_bytes(1, _field_bytes(2, d)) for d in dims)  # Dimension.dim_param
    tensor = _field_int(1, elem_type) + _field_bytes(2, shape)  # TypeProto.Tensor
    return _field_bytes(1, name) + _field_bytes(2, _field_bytes(1, tensor))


def _gather_node(data: str, out: str, axis: int) -> bytes:
    attr = _field_bytes(1, "axis") + _field_int(3, axis) + _field_int(20, 2)  # type INT
    return (_field_bytes(1, data) + _field_bytes(1, "rows") + _field_bytes(2, out)
            + _field_bytes(3, f"gather_{out}") + _field_bytes(4, "Gather") + _field_bytes(5, attr))


def gather_model_bytes(float_dtype) -> bytes:
    """A serialized ONNX model (opset 13) that selects decoder rows of the encoder outputs.

    in  ``cross_k``, ``cross_v`` float (L, B, H, S, Dh); ``src_pad_mask`` bool (B, S);
        ``rows`` int64 (N,)
    out ``cross_k_rows``, ``cross_v_rows`` (L, N, H, S, Dh); ``src_pad_mask_rows`` (N, S)

    ``float_dtype`` is numpy float32 or float16 (the package's cache precision).
    """
    ft = _ONNX_TYPES[np.dtype(float_dtype)]
    big, big_rows = ["L", "B", "H", "S", "Dh"], ["L", "N", "H", "S", "Dh"]
    nodes = [_gather_node("cross_k", "cross_k_rows", 1), _gather_node("cross_v", "cross_v_rows", 1),
             _gather_node("src_pad_mask", "src_pad_mask_rows", 0)]
    graph = (b"".join(_field_bytes(1, n) for n in nodes)
             + _field_bytes(2, "aiayn_select_rows")
             + _field_bytes(11, _value_info("cross_k", ft, big))
             + _field_bytes(11, _value_info("cross_v", ft, big))
             + _field_bytes(11, _value_info("src_pad_mask", 9, ["B", "S"]))
             + _field_bytes(11, _value_info("rows", 7, ["N"]))
             + _field_bytes(12, _value_info("cross_k_rows", ft, big_rows))
             + _field_bytes(12, _value_info("cross_v_rows", ft, big_rows))
             + _field_bytes(12, _value_info("src_pad_mask_rows", 9, ["N", "S"])))
    opset = _field_bytes(1, "") + _field_int(2, 13)
    return (_field_int(1, 8) + _field_bytes(2, "aiayn-runtime") + _field_bytes(7, graph)
            + _field_bytes(8, opset))


# ---------------------------------------------------------------------------- the backend

@dataclass
class Encoded:
    """Encoder outputs as OrtValues: cross_k/cross_v (L, B, H, S, Dh), src_pad_mask (B, S)."""

    cross_k: Any
    cross_v: Any
    src_pad_mask: Any
    batch: int


@dataclass
class Cache:
    """The self-attention cache as OrtValues: present_k/present_v (L, N, H, P, Dh)."""

    k: Any
    v: Any


def select_rows(gather, encoded: Encoded, rows: np.ndarray, device: str, device_id: int
                ) -> Encoded:
    """Rows ``rows`` (N,) of the encoder outputs, gathered by the ``gather`` session (see
    ``gather_model_bytes``) into OrtValues on ``device``; the identity selection (step 0 with
    every sentence) returns ``encoded`` itself."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)  # (N,)
    if len(rows) == encoded.batch and np.array_equal(rows, np.arange(encoded.batch)):
        return encoded
    b = gather.io_binding()
    b.bind_ortvalue_input("cross_k", encoded.cross_k)
    b.bind_ortvalue_input("cross_v", encoded.cross_v)
    b.bind_ortvalue_input("src_pad_mask", encoded.src_pad_mask)
    b.bind_cpu_input("rows", rows)
    for name in ("cross_k_rows", "cross_v_rows", "src_pad_mask_rows"):
        b.bind_output(name, device, device_id)
    gather.run_with_iobinding(b)
    ck, cv, mask = b.get_outputs()
    return Encoded(ck, cv, mask, len(rows))


class OrtBackend(Backend):
    """The encoder and one decoder step on an ONNX Runtime execution provider, IO-bound.

    Subclasses set ``name``, ``provider``, ``device`` ("cpu" or "cuda") and ``install`` and
    may override ``providers()``. Construction creates every session once (raising
    BackendError when the provider does not start here, PackageError when a graph does not
    load); the sessions are reused by every call and thread.

    Options: ``device_id`` (GPU), ``spin`` (intra-op busy-waiting, default False),
    ``small_rows`` (steps of at most this many rows use a single-threaded decoder session on
    the CPU; default 16, 0 turns it off).
    """

    provider = CPU
    device = "cpu"
    install = INSTALL_CPU

    def __init__(self, package: Package, threads: int | None = None, device_id: int = 0,
                 **options: Any):
        super().__init__(package.config)
        self.package = package
        self.threads = threads
        self.device_id = int(device_id)
        self.options = options
        cfg = package.config
        self.L, self.H = int(cfg["decoder_layers"]), int(cfg["h"])
        self.Dh = int(cfg["d_model"]) // self.H
        self.so = session_options(threads, spin=bool(options.get("spin", False)))
        self.encoder = self._session(package.graph_path("encoder"), self.providers("encoder"))
        providers = self.providers("decoder")
        self.decoder = self._session(package.graph_path("decoder"), providers)
        # Small steps (one sentence's beam) run fastest on one thread: the ops are too small
        # to split (measured on 2 cores: N <= 16 rows, 1 thread 15-20 % faster per step).
        self.small_rows = int(options.get("small_rows", SMALL_ROWS))
        self.decoder_small = None
        multi = threads is None and (os.cpu_count() or 1) > 1 or (threads or 1) > 1
        if self.device == "cpu" and multi and self.small_rows > 0:
            self.decoder_small = self._session(package.graph_path("decoder"), providers,
                                               session_options(1))
        self.decoder_init, self.init_inputs = self._init_session()
        types = {i.name: i.type for i in self.decoder.get_inputs()}
        self.float_dtype = np.dtype(_ORT_TYPES.get(types.get("cross_k", "tensor(float)"),
                                                   np.float32))
        gp = self.gather_providers()
        self.gather = create_session(gather_model_bytes(self.float_dtype), self.so, gp,
                                     self.name, gp[0] if isinstance(gp[0], str) else gp[0][0],
                                     self.install)

    # -- configuration hooks -------------------------------------------------------------

    def providers(self, graph: str = "decoder") -> list:
        """The provider list for ``graph`` ("encoder", "decoder", "decoder_init"; first = the
        provider that must start)."""
        return [CPU]

    def gather_providers(self) -> list:
        return self.providers("gather")

    def _session(self, path: Path, providers: list, so=None):
        return create_session(path, so or self.so, providers, self.name, self.provider,
                              self.install)

    def _init_session(self):
        """A session for step 0 (P = 0), or None to use ``decoder`` with an empty past."""
        return None, set()

    # -- the interface ---------------------------------------------------------------------

    def encode(self, src_ids: np.ndarray) -> Encoded:
        src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)  # (B, S)
        b = self.encoder.io_binding()
        b.bind_cpu_input("src_ids", src_ids)
        for name in ("cross_k", "cross_v", "src_pad_mask"):
            b.bind_output(name, self.device, self.device_id)
        self.encoder.run_with_iobinding(b)
        ck, cv, mask = b.get_outputs()
        return Encoded(ck, cv, mask, src_ids.shape[0])

    def select(self, encoded: Encoded, rows: np.ndarray) -> Encoded:
        return select_rows(self.gather, encoded, rows, self.device, self.device_id)

    def step(self, tokens: np.ndarray, step: int, cache: Cache | None, beam_origin: np.ndarray,
             cross: Encoded, topk: int) -> StepOutput:
        N = len(tokens)
        use_init = cache is None and self.decoder_init is not None
        if use_init:
            sess = self.decoder_init
        elif self.decoder_small is not None and len(tokens) <= self.small_rows:
            sess = self.decoder_small
        else:
            sess = self.decoder
        b = sess.io_binding()
        b.bind_cpu_input("tokens", np.ascontiguousarray(tokens, dtype=np.int64))
        b.bind_cpu_input("step", np.array(step, dtype=np.int64))
        if not use_init or "past_k" in self.init_inputs:
            if cache is None:
                empty = np.zeros((self.L, N, self.H, 0, self.Dh), dtype=self.float_dtype)
                b.bind_cpu_input("past_k", empty)
                b.bind_cpu_input("past_v", empty)
            else:
                b.bind_ortvalue_input("past_k", cache.k)
                b.bind_ortvalue_input("past_v", cache.v)
            b.bind_cpu_input("beam_origin", np.ascontiguousarray(beam_origin, dtype=np.int64))
        b.bind_ortvalue_input("cross_k", cross.cross_k)
        b.bind_ortvalue_input("cross_v", cross.cross_v)
        b.bind_ortvalue_input("src_pad_mask", cross.src_pad_mask)
        b.bind_cpu_input("topk", np.array(topk, dtype=np.int64))
        # Only the top-k leaves the device; everything else stays where it was computed.
        for name in _DEC_OUT:
            dev = "cpu" if name in ("topk_log_probs", "topk_ids") else self.device
            b.bind_output(name, dev, self.device_id)
        sess.run_with_iobinding(b)
        out = dict(zip(_DEC_OUT, b.get_outputs()))
        lp, attn = out["log_probs"], out["cross_attn"]
        return StepOutput(topk_log_probs=out["topk_log_probs"].numpy(),
                          topk_ids=out["topk_ids"].numpy(),
                          cache=Cache(out["present_k"], out["present_v"]),
                          _log_probs=lp.numpy, _cross_attn=attn.numpy)

    def describe(self) -> dict[str, Any]:
        import onnxruntime as ort

        return {"backend": self.name, "providers": self.decoder.get_providers(),
                "device": f"{self.device}:{self.device_id}" if self.device != "cpu" else "cpu",
                "threads": self.threads, "onnxruntime": ort.__version__,
                "single_thread_rows": self.small_rows if self.decoder_small else 0,
                "cache_dtype": str(self.float_dtype), "variant": self.package.variant}
