"""Trace ``Transformer.encode_for_step`` and ``Transformer.step`` into the contract's graphs.

``encoder.onnx`` and ``decoder.onnx`` are exported with torch's ONNX exporter (torch.export
based, ``dynamo=True``) with every contract axis dynamic (DESIGN.md "The graph contract").
Dummy inputs use sizes >= 2 on every dynamic axis, because torch.export specializes axes traced
at size 0 or 1; the graphs still run at N = 1, S = 1 and P = 0 (validation checks exactly
those, export/validate.py).

Every ``export_*`` function takes ``external_data``: the weights then go to one file beside the
graph (``<file>.data``, runtime.contract.EXTERNAL_DATA_SUFFIX) referenced by a relative path.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from runtime import contract as C
from train.model import Transformer

# Dummy sizes used only for tracing; validation runs at other sizes (contract: N 1/3/12, ...).
_TRACE_N, _TRACE_N_PREV, _TRACE_P, _TRACE_S = 5, 4, 3, 6


class EncoderGraph(nn.Module):
    """``encoder.onnx``: src_ids (B, S) -> cross_k, cross_v (L, B, H, S, Dh), src_pad_mask."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, src_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.model.encode_for_step(src_ids)


class DecoderGraph(nn.Module):
    """``decoder.onnx``: ``Transformer.step`` plus the in-graph top-k of its log-probs."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, step, past_k, past_v, beam_origin, cross_k, cross_v, src_pad_mask,
                topk):
        log_probs, present_k, present_v, cross_attn = self.model.step(
            tokens, step, past_k, past_v, beam_origin, cross_k, cross_v, src_pad_mask)
        topk_log_probs, topk_ids = torch.topk(log_probs, topk, dim=-1)
        return log_probs, topk_log_probs, topk_ids, present_k, present_v, cross_attn


class DecoderInitGraph(nn.Module):
    """``decoder_init.onnx`` (TensorRT variant): the first step with no past (P + 1 = 1)."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, step, cross_k, cross_v, src_pad_mask, topk):
        N = tokens.shape[0]
        past_k, past_v = self.model.empty_cache(N, device=tokens.device, dtype=cross_k.dtype)
        beam_origin = torch.arange(N, device=tokens.device)
        return DecoderGraph.forward(self, tokens, step, past_k, past_v, beam_origin, cross_k,
                                    cross_v, src_pad_mask, topk)


def dummy_decoder_inputs(model: Transformer, N: int, N_prev: int, P: int, S: int,
                         step: int | None = None, topk: int = 4,
                         dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Tensor]:
    """Random decoder inputs in contract order (seeded), for tracing and validation.

    Caches (L, N_prev, H, P, Dh) and cross K/V (L, N, H, S, Dh) are standard normal in
    ``dtype``; ``beam_origin`` picks random rows of the past; row 0 of ``src_pad_mask`` has no
    padding, the others random lengths; ``step`` defaults to P.
    """
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    L, H, Dh = cfg.decoder_layers, cfg.h, cfg.d_k
    mask = torch.zeros(N, S, dtype=torch.bool)
    if S > 1:
        lengths = torch.randint(1, S + 1, (N,), generator=g)
        lengths[0] = S
        mask = torch.arange(S)[None, :] >= lengths[:, None]
    return {
        "tokens": torch.randint(C.EOS_ID + 1, cfg.vocab_size, (N,), generator=g),
        "step": torch.tensor(P if step is None else step, dtype=torch.long),
        "past_k": torch.randn(L, N_prev, H, P, Dh, generator=g).to(dtype),
        "past_v": torch.randn(L, N_prev, H, P, Dh, generator=g).to(dtype),
        "beam_origin": torch.randint(0, N_prev, (N,), generator=g),
        "cross_k": torch.randn(L, N, H, S, Dh, generator=g).to(dtype),
        "cross_v": torch.randn(L, N, H, S, Dh, generator=g).to(dtype),
        "src_pad_mask": mask,
        "topk": torch.tensor(min(topk, cfg.vocab_size), dtype=torch.long),
    }


def dummy_src_ids(model: Transformer, B: int, S: int, seed: int = 0) -> Tensor:
    """Random source ids (B, S): subwords + EOS, right-padded to random lengths (row 0 full)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(C.EOS_ID + 1, model.cfg.vocab_size, (B, S), generator=g)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = S
    for b, n in enumerate(lengths.tolist()):
        ids[b, n - 1] = C.EOS_ID
        ids[b, n:] = C.PAD_ID
    return ids


def _quiet_exporter_logs() -> None:
    import logging

    for name in ("torch.onnx", "torch.onnx._internal.exporter._registration",
                 "torch.onnx._internal.exporter._compat"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # a failed down-conversion (--opset 17) is reported by graph_opset's check, not a traceback
    logging.getLogger("onnxscript.version_converter").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def fp16_safe_masks() -> Iterator[None]:
    """Trace with masked attention scores replaced by ``MASK_VALUE_FP16`` (-3e4), not -1e9.

    DESIGN.md "The model": masks must be finite in the graph's dtype; -1e9 overflows float16
    (max 65504), so graphs that will be converted to fp16 are traced with -3e4 (exp(-3e4)
    underflows to exactly 0 in fp32 softmax, so the fp32 math is unchanged). Implemented by
    swapping ``train.model.mask_value`` for the duration of the trace (restored on exit).
    """
    import train.model as M

    original = M.mask_value
    M.mask_value = lambda dtype: M.MASK_VALUE_FP16
    try:
        yield
    finally:
        M.mask_value = original


def _export(module: nn.Module, args: tuple, path: Path, input_names: list[str],
            output_names: list[str], dynamic_shapes: dict, opset: int,
            external_data: bool = False) -> None:
    _quiet_exporter_logs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=input_names,
                          output_names=output_names, opset_version=opset, dynamo=True,
                          dynamic_shapes=dynamic_shapes, optimize=True, verbose=False,
                          external_data=external_data)
    _name_topk_axis(path)


def _name_topk_axis(path: Path) -> None:
    """Name the top-k outputs' second axis "K" (the contract's name; torch calls it "u0").

    Only the graph file is rewritten; external data references stay as they are.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    changed = False
    for out in model.graph.output:
        if out.name in ("topk_log_probs", "topk_ids"):
            dims = out.type.tensor_type.shape.dim
            if len(dims) == 2 and dims[1].dim_param and dims[1].dim_param != "K":
                dims[1].dim_param = "K"
                changed = True
    if changed:
        onnx.save(model, str(path))


def export_encoder(model: Transformer, path: str | Path, opset: int = C.OPSET,
                   external_data: bool = False) -> Path:
    """Export ``encoder.onnx`` (dynamic B, S) to ``path``."""
    from torch.export import Dim

    path = Path(path)
    B, S = Dim("B"), Dim("S")
    src = dummy_src_ids(model, _TRACE_N, _TRACE_S)
    _export(EncoderGraph(model).eval(), (src,), path, C.names(C.ENCODER_INPUTS),
            C.names(C.ENCODER_OUTPUTS), {"src_ids": {0: B, 1: S}}, opset, external_data)
    return path


def export_decoder(model: Transformer, path: str | Path, opset: int = C.OPSET,
                   external_data: bool = False) -> Path:
    """Export ``decoder.onnx`` (dynamic N, N_prev, P, S; topk an input) to ``path``."""
    from torch.export import Dim

    path = Path(path)
    N, N_prev, P, S = Dim("N"), Dim("N_prev"), Dim("P"), Dim("S")
    inputs = dummy_decoder_inputs(model, _TRACE_N, _TRACE_N_PREV, _TRACE_P, _TRACE_S)
    shapes = {"tokens": {0: N}, "step": None, "past_k": {1: N_prev, 3: P},
              "past_v": {1: N_prev, 3: P}, "beam_origin": {0: N}, "cross_k": {1: N, 3: S},
              "cross_v": {1: N, 3: S}, "src_pad_mask": {0: N, 1: S}, "topk": None}
    _export(DecoderGraph(model).eval(), tuple(inputs.values()), path, C.names(C.DECODER_INPUTS),
            C.names(C.DECODER_OUTPUTS), shapes, opset, external_data)
    return path


def export_decoder_init(model: Transformer, path: str | Path, opset: int = C.OPSET,
                        external_data: bool = False) -> Path:
    """Export ``decoder_init.onnx`` (no past inputs; present P + 1 = 1) to ``path``."""
    from torch.export import Dim

    path = Path(path)
    N, S = Dim("N"), Dim("S")
    inputs = dummy_decoder_inputs(model, _TRACE_N, _TRACE_N, 0, _TRACE_S, step=0)
    args = tuple(inputs[n] for n in C.names(C.DECODER_INIT_INPUTS))
    shapes = {"tokens": {0: N}, "step": None, "cross_k": {1: N, 3: S}, "cross_v": {1: N, 3: S},
              "src_pad_mask": {0: N, 1: S}, "topk": None}
    _export(DecoderInitGraph(model).eval(), args, path, C.names(C.DECODER_INIT_INPUTS),
            C.names(C.DECODER_INIT_OUTPUTS), shapes, opset, external_data)
    return path
