"""The graph contract shared by ``export/`` (writer) and ``runtime/`` (reader). Torch-free.

Everything both sides must agree on lives here: special ids, graph file names, input and
output names with their named axes and dtypes, and the manifest schema version. The shape
legend (STYLE.md): B sentences, S source length, N decoder rows, P past length, L decoder
layers, H heads, Dh head dim (d_k), V vocabulary, K top-k.

``encoder.onnx``
    in  ``src_ids``  int64 (B, S)              subword ids + EOS, PAD_ID-padded on the right
    out ``cross_k``  float (L, B, H, S, Dh)    every decoder layer's cross-attention keys
        ``cross_v``  float (L, B, H, S, Dh)    ... and values, computed once per sentence
        ``src_pad_mask`` bool (B, S)          true at padding

``decoder.onnx`` (one incremental step for N rows in lock-step)
    in  ``tokens``   int64 (N,)                the token at position ``step`` (BOS at step 0)
        ``step``     int64 ()                  position of ``tokens`` (0 for BOS)
        ``past_k``   float (L, N_prev, H, P, Dh)  self-attention keys of positions 0..P-1; P may be 0
        ``past_v``   float (L, N_prev, H, P, Dh)
        ``beam_origin`` int64 (N,)            row of the past each new row continues
                                               (the graph gathers past_k/past_v with it)
        ``cross_k``  float (L, N, H, S, Dh)    one row per decoder row
        ``cross_v``  float (L, N, H, S, Dh)
        ``src_pad_mask`` bool (N, S)
        ``topk``     int64 ()                  how many top entries per row to return
    out ``log_probs``      float32 (N, V)      log-softmax of the next-token distribution
        ``topk_log_probs`` float32 (N, topk)  sorted descending; ties: lower id first (ONNX TopK)
        ``topk_ids``       int64 (N, topk)
        ``present_k``      float (L, N, H, P+1, Dh)
        ``present_v``      float (L, N, H, P+1, Dh)
        ``cross_attn``     float32 (N, S)     last decoder layer's cross-attention weights,
                                               averaged over heads

``decoder_init.onnx`` (TensorRT variant only: TensorRT forbids zero-length dimensions)
    The same step traced with no past: inputs are ``decoder.onnx``'s minus ``past_k``,
    ``past_v`` and ``beam_origin``; ``step`` is still an input (always 0); outputs are the
    same, with P+1 = 1. ``decoder.onnx`` optimization profiles then start at P = 1.

"float" is float32 in fp32 packages and float16 in fp16 packages (caches and cross K/V);
``log_probs``, ``topk_log_probs`` and ``cross_attn`` are float32 in every precision.

Decisions recorded here (DESIGN.md leaves them open):
- ``topk`` is an input rather than a constant so one graph serves every beam size; the runtime
  asks for 2K + 2 entries so that PAD/BOS (never generated) can be dropped and 2K remain.
- ``cross_attn`` is float32 in every precision (it is small and leaves the device).
- The manifest schema is versioned by ``MANIFEST_VERSION``; a reader refuses any other major.
"""

from __future__ import annotations

from dataclasses import dataclass

# Special ids (DESIGN.md "The model"): fixed for every model, tokenizer and graph.
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3

# Opset: DESIGN.md asks >= 17 (one LayerNormalization node); 18 is the lowest that torch's
# torch.export-based exporter implements natively (17 would need a lossy version conversion).
MIN_OPSET = 17
OPSET = 18

# Model package layout.
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "spm.model"
PARITY_FILE = "parity.json"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
DECODER_INIT_FILE = "decoder_init.onnx"
MANIFEST_FORMAT = "aiayn-package"
MANIFEST_VERSION = 1

# Checkpoint layout (train/).
CHECKPOINT_WEIGHTS = "model.safetensors"
CHECKPOINT_CONFIG = "config.json"
CHECKPOINT_TOKENIZER = "spm.model"
CHECKPOINT_CHECKSUMS = "checksums.json"

# Precisions a graph may carry.
PRECISIONS = ("fp32", "fp16", "int8")

# Package variants (manifest ``variant``); each is a separate package with its own parity record
# (DESIGN.md "The model package"). Decided here: one variant per package, so ``aiayn export``
# takes at most one of --optimize / --fp16 / --int8 / --tensorrt.
#   fp32       torch.export graphs as traced
#   optimized  ORT offline-optimized fp32 graphs (ORT_ENABLE_ALL by default: may hold CPU-specific
#              fused contrib ops; the manifest's "optimization" records provider and level)
#   fp16       float16 weights, caches and cross K/V; LayerNorm, softmax, log-softmax, top-k fp32
#   int8       onnxruntime dynamic quantization (int8 weights, per-call uint8 activations), CPU
#   tensorrt   fp32 graphs + decoder_init.onnx + TensorRT engines built on the target GPU
VARIANTS = ("fp32", "optimized", "fp16", "int8", "tensorrt")

# External data (``aiayn export --external-data``, needed above protobuf's 2 GB limit): a
# graph's weights live in one file beside it named ``<graph file> + EXTERNAL_DATA_SUFFIX``, at a
# location relative to the graph, so a package can be moved; listed with sha256 in the manifest.
EXTERNAL_DATA_SUFFIX = ".data"

# TensorRT variant: one engine per graph (they run only on the GPU model and TensorRT version
# that built them, recorded in the manifest) and the builder's timing cache.
ENCODER_ENGINE = "encoder.plan"
DECODER_ENGINE = "decoder.plan"
DECODER_INIT_ENGINE = "decoder_init.plan"
TIMING_CACHE_FILE = "timing.cache"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, dtype (numpy name) and named axes."""

    name: str
    dtype: str  # "int64", "bool", "float" (= the graph's float precision) or "float32"
    axes: tuple[str, ...]


ENCODER_INPUTS = (TensorSpec("src_ids", "int64", ("B", "S")),)
ENCODER_OUTPUTS = (
    TensorSpec("cross_k", "float", ("L", "B", "H", "S", "Dh")),
    TensorSpec("cross_v", "float", ("L", "B", "H", "S", "Dh")),
    TensorSpec("src_pad_mask", "bool", ("B", "S")),
)

DECODER_INPUTS = (
    TensorSpec("tokens", "int64", ("N",)),
    TensorSpec("step", "int64", ()),
    TensorSpec("past_k", "float", ("L", "N_prev", "H", "P", "Dh")),
    TensorSpec("past_v", "float", ("L", "N_prev", "H", "P", "Dh")),
    TensorSpec("beam_origin", "int64", ("N",)),
    TensorSpec("cross_k", "float", ("L", "N", "H", "S", "Dh")),
    TensorSpec("cross_v", "float", ("L", "N", "H", "S", "Dh")),
    TensorSpec("src_pad_mask", "bool", ("N", "S")),
    TensorSpec("topk", "int64", ()),
)
DECODER_OUTPUTS = (
    TensorSpec("log_probs", "float32", ("N", "V")),
    TensorSpec("topk_log_probs", "float32", ("N", "K")),
    TensorSpec("topk_ids", "int64", ("N", "K")),
    TensorSpec("present_k", "float", ("L", "N", "H", "P+1", "Dh")),
    TensorSpec("present_v", "float", ("L", "N", "H", "P+1", "Dh")),
    TensorSpec("cross_attn", "float32", ("N", "S")),
)

_NO_PAST = {"past_k", "past_v", "beam_origin"}
DECODER_INIT_INPUTS = tuple(s for s in DECODER_INPUTS if s.name not in _NO_PAST)
DECODER_INIT_OUTPUTS = DECODER_OUTPUTS


def names(specs: tuple[TensorSpec, ...]) -> list[str]:
    """The names of ``specs`` in order."""
    return [s.name for s in specs]
