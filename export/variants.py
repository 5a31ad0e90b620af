"""Package variants derived from the traced fp32 graphs (DESIGN.md "The model package"):
ORT offline optimization, float16 and int8 dynamic quantization. Each function reads one
graph file and writes one, with the libraries doing the graph work (onnxruntime's offline
optimizer, ``onnxruntime.transformers.float16``, ``onnxruntime.quantization``); each returns
the facts the manifest records about it.

External data: with ``external_data`` the output's weights go to ``<dst>.data`` beside it
(runtime.contract.EXTERNAL_DATA_SUFFIX), referenced by a relative path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from runtime import contract as C

from .errors import ExportError

# Kept in float32 by the fp16 conversion (DESIGN.md "The graph contract", fp16 variants:
# LayerNorm and softmax in fp32), on top of onnxruntime's default block list (ops without
# fp16 kernels). LogSoftmax and TopK too, so log_probs / topk_log_probs are computed (not
# merely returned) in fp32 and top-k ties are broken on fp32 values.
FP16_KEEP_FP32_OPS = ("LayerNormalization", "Softmax", "LogSoftmax", "TopK")
FP16_MAX = 65504.0


def external_data_file(graph_file: str | os.PathLike) -> Path:
    """The external data file of a graph: ``<graph file>.data``."""
    return Path(f"{graph_file}{C.EXTERNAL_DATA_SUFFIX}")


def save_graph(model, path: Path, external_data: bool) -> Path:
    """Save an onnx ModelProto, weights inline or (``external_data``) in ``<path>.data``.

    Raises ExportError if the graph exceeds protobuf's 2 GB limit without external data.
    """
    import onnx

    data = external_data_file(path)
    if data.exists():
        data.unlink()  # onnx appends to an existing data file
    try:
        if external_data:
            onnx.save_model(model, str(path), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
        else:
            onnx.save_model(model, str(path))
    except ValueError as e:
        if "2GB" in str(e) or "2 GB" in str(e):
            raise ExportError(f"{path.name} is larger than protobuf's 2 GB limit; export with "
                              "--external-data") from None
        raise
    return path


# ---- ORT offline optimization ------------------------------------------------------------------


def optimize_graph(src: Path, dst: Path, level: str = "all", external_data: bool = False
                   ) -> dict[str, Any]:
    """ONNX Runtime offline optimization of ``src`` into ``dst`` (ORT "offline mode": the
    session's ``optimized_model_filepath``), for the CPUExecutionProvider.

    ``level``: "basic" | "extended" | "all". Above "basic" the saved graph holds ORT contrib
    ops (com.microsoft), so it runs on ONNX Runtime only; "all" adds layout transforms tuned
    to this CPU, so it should run on the same kind of machine. Returns the manifest's
    ``optimization`` record; ``load_level`` "disable" tells the runtime not to re-optimize.
    Raises ExportError if ONNX Runtime fails.
    """
    import onnxruntime as ort

    from .validate import ort_level

    so = ort.SessionOptions()
    so.graph_optimization_level = ort_level(level)
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 3
    if external_data:
        data = external_data_file(dst)
        if data.exists():
            data.unlink()
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    data.name)
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        raise ExportError(f"ONNX Runtime could not optimize {src.name}: {e}") from None
    names = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
             "all": "ORT_ENABLE_ALL"}
    return {"tool": "onnxruntime offline optimization", "level": names[level],
            "provider": "CPUExecutionProvider", "onnxruntime": ort.__version__,
            "load_level": "disable",
            "portable": level == "basic",
            "note": ("runs on ONNX Runtime only (contrib ops)" if level != "basic" else "")
            + ("; layout optimized for the exporting CPU: run it on the same kind of machine"
               if level == "all" else "")}


# ---- float16 -----------------------------------------------------------------------------------


def _float_constants(model):
    """(name, float array) of every float initializer and Constant node value."""
    import onnx
    from onnx import numpy_helper

    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
    for t in model.graph.initializer:
        if t.data_type in floats:
            yield t.name, numpy_helper.to_array(t)
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.t.data_type in floats:
                    yield node.output[0], numpy_helper.to_array(a.t)


def check_fp16_range(model, what: str) -> None:
    """Every float constant of ``model`` must be finite and within float16's range (65504).

    Raises ExportError naming the first that is not, e.g. a -1e9 attention mask traced
    without ``graphs.fp16_safe_masks``.
    """
    for name, value in _float_constants(model):
        value = np.asarray(value, dtype=np.float64)
        if value.size and (not np.isfinite(value).all() or np.abs(value).max() > FP16_MAX):
            worst = value.flat[np.argmax(np.abs(value))]
            raise ExportError(f"{what}: constant {name!r} holds {worst:g}, outside float16's "
                              "range; masks must be traced with the fp16 mask value "
                              "(export.graphs.fp16_safe_masks)")


def convert_fp16(src: Path, dst: Path, fp32_io: list[str], external_data: bool = False
                 ) -> dict[str, Any]:
    """Convert the fp32 graph ``src`` to float16 into ``dst`` with onnxruntime's converter
    (``onnxruntime.transformers.float16.convert_float_to_float16``).

    ``fp32_io``: graph inputs/outputs kept float32 (the contract's log_probs, topk_log_probs,
    cross_attn); every other float input/output (caches, cross K/V) becomes float16. Ops in
    ``FP16_KEEP_FP32_OPS`` and the converter's default block list stay fp32 behind casts.
    The fp32 graph must have been traced with fp16-safe masks (checked: ``check_fp16_range``),
    and the result is topologically sorted (the converter leaves inserted casts out of order)
    and checked again. Returns the manifest's ``fp16`` record. Raises ExportError.
    """
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    check_fp16_range(onnx.load(str(src)), src.name)
    block = sorted(set(DEFAULT_OP_BLOCK_LIST) | set(FP16_KEEP_FP32_OPS))
    model = convert_float_to_float16(str(src), keep_io_types=list(fp32_io), op_block_list=block)
    OnnxModel(model).topological_sort()
    check_fp16_range(model, dst.name)
    save_graph(model, dst, external_data)
    return {"tool": "onnxruntime.transformers.float16", "fp32_ops": list(FP16_KEEP_FP32_OPS),
            "fp32_io": list(fp32_io), "mask_value": -3e4}


# ---- int8 --------------------------------------------------------------------------------------

INT8_OP_TYPES = ("MatMul",)  # dynamic quantization has no Gemm kernel; the tied
# pre-softmax projection (a Gemm) therefore stays fp32


def quantize_int8(src: Path, dst: Path, work: Path, external_data: bool = False,
                  per_channel: bool = True) -> dict[str, Any]:
    """Dynamic int8 quantization for the CPU (``onnxruntime.quantization.quantize_dynamic``).

    The graph is first pre-processed (``quant_pre_process``: shape inference and basic
    optimization, as onnxruntime recommends), then the weights of MatMul nodes with a
    constant weight (``MatMulConstBOnly``: attention's activation x activation products stay
    fp32) are stored as int8 (per output channel with ``per_channel``) and their activations
    quantized to uint8 at run time. Caches, cross K/V and outputs stay float32. ``work`` is a
    scratch folder. Returns the manifest's ``quantization`` record. Raises ExportError.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    work.mkdir(parents=True, exist_ok=True)
    pre = work / f"pre-{src.name}"
    try:
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True,
                          save_as_external_data=external_data, all_tensors_to_one_file=True,
                          external_data_location=f"{pre.name}{C.EXTERNAL_DATA_SUFFIX}")
        data = external_data_file(dst)
        if data.exists():
            data.unlink()
        quantize_dynamic(str(pre), str(dst), weight_type=QuantType.QInt8, per_channel=per_channel,
                         op_types_to_quantize=list(INT8_OP_TYPES),
                         use_external_data_format=external_data,
                         extra_options={"MatMulConstBOnly": True})
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the quantizer raises many types
        raise ExportError(f"onnxruntime.quantization could not quantize {src.name}: {e}") from None
    return {"tool": "onnxruntime.quantization.quantize_dynamic", "weights": "int8 (QInt8)",
            "per_channel": per_channel, "activations": "uint8, quantized per call",
            "op_types": list(INT8_OP_TYPES), "matmul_const_b_only": True, "target": "CPU"}
