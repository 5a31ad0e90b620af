"""Export variants (issue 4): --optimize, --fp16, --int8 packages of a tiny random model pass
their own checks; decoder_init.onnx (TensorRT variant) is validated on the CPU; the TensorRT
engines themselves need TensorRT and a GPU and skip here. DESIGN.md "The graph contract"
(fp16 variants) and "The model package" (variants are separate packages).
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from export.cli import main as cli_main  # noqa: E402
from export.errors import ExportError  # noqa: E402
from export.graphs import export_decoder, export_decoder_init, export_encoder  # noqa: E402
from export.package import export_package  # noqa: E402
from export.validate import (  # noqa: E402
    INT8_MIN_TOP1_AGREEMENT,
    OPTIMIZE_ATOL,
    TOLERANCES,
    open_session,
    run,
    validate_graphs,
    validate_package,
)
from export.variants import FP16_MAX, check_fp16_range  # noqa: E402
from runtime import contract as C  # noqa: E402
from runtime.tokenizer import train_tokenizer  # noqa: E402
from train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from train.config import ModelConfig  # noqa: E402
from train.model import Transformer  # noqa: E402

try:
    import tensorrt  # noqa: F401

    HAVE_TENSORRT = True
except ImportError:
    HAVE_TENSORRT = False

SENTENCES = [
    "a man rides a red bike down the street .", "ein mann fährt ein rotes fahrrad .",
    "two dogs play in the green grass .", "zwei hunde spielen im grünen gras .",
    "a woman is reading a book .", "eine frau liest ein buch .",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny random model (d_model 32, 2 + 2 layers, vocab <= 60), as in test_export.py."""
    root = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer(SENTENCES * 3, root / "spm.model", vocab_size=60, num_threads=1)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, d_ff=64, h=4, encoder_layers=2,
                      decoder_layers=2, max_positions=128)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.embed.weight.mul_(2.0)
    return save_checkpoint(root / "ckpt", model, root / "spm.model")


@pytest.fixture(scope="module")
def model(ckpt):
    return load_checkpoint(ckpt)[0]


@pytest.fixture(scope="module")
def out_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("variants")


@pytest.fixture(scope="module")
def traced(model, out_root) -> dict[str, Path]:
    """The three fp32 graphs, traced once (torch.export is the slow step: ~8 s a graph)."""
    d = out_root / "traced"
    d.mkdir()
    return {"encoder": export_encoder(model, d / C.ENCODER_FILE),
            "decoder": export_decoder(model, d / C.DECODER_FILE),
            "decoder_init": export_decoder_init(model, d / C.DECODER_INIT_FILE)}


def export_reusing_trace(ckpt, out: Path, variant: str, traced: dict[str, Path], **options):
    """export_package with its torch.export step replaced by a copy of the module's fp32
    traces (byte-for-byte what it would trace: the fp32 trace is tested in test_export.py).
    Everything variant-specific (optimizer, quantizer, manifest, validation) runs for real."""
    import shutil

    import export.package

    def trace(model, directory, names, *args, **kwargs):
        for name in names:
            shutil.copyfile(traced[name], directory / traced[name].name)
        return {name: directory / traced[name].name for name in names}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export.package, "_trace", trace)
        return export_package(ckpt, out, variant=variant, **options)


@pytest.fixture(scope="module")
def optimized(ckpt, out_root, traced):
    return export_reusing_trace(ckpt, out_root / "opt", "optimized", traced)


@pytest.fixture(scope="module")
def fp16(ckpt, out_root):
    # traced for real: fp16 packages are traced with the fp16-safe mask value
    return export_package(ckpt, out_root / "fp16", variant="fp16")


@pytest.fixture(scope="module")
def int8(ckpt, out_root, traced):
    return export_reusing_trace(ckpt, out_root / "int8", "int8", traced)


def op_counts(path: Path) -> collections.Counter:
    graph = onnx.load(str(path))
    return collections.Counter((n.domain or "ai.onnx", n.op_type) for n in graph.graph.node)


# ---- --optimize --------------------------------------------------------------------------------


def test_optimized_package_passes_its_checks(optimized):
    m = optimized.manifest
    assert m["variant"] == "optimized" and m["parity"]["passed"]
    opt = m["optimization"]
    assert (opt["level"], opt["provider"], opt["load_level"]) == (
        "ORT_ENABLE_ALL", "CPUExecutionProvider", "disable")
    outs = m["parity"]["outputs"]
    # ORT_DISABLE_ALL (unoptimized graph) vs the saved ORT_ENABLE_ALL graph: within 1e-4 and
    # the same argmax at every decoder shape.
    assert outs["optimize.decoder.log_probs"]["passed"]
    assert outs["optimize.decoder.log_probs"]["value"] <= OPTIMIZE_ATOL
    assert outs["optimize.decoder.argmax"]["passed"]
    assert outs["decoder.log_probs"]["value"] <= 1e-4
    fused = op_counts(optimized.graph_path("decoder"))
    assert any(domain == "com.microsoft" for domain, _ in fused), "graph was not optimized"
    assert validate_package(optimized.path, write=False).passed


# ---- --fp16 ------------------------------------------------------------------------------------


def test_fp16_package_follows_the_contract(fp16, model):
    m = fp16.manifest
    assert m["variant"] == "fp16" and m["parity"]["passed"]
    assert {g["precision"] for g in m["graphs"].values()} == {"fp16"}
    dec = open_session(fp16.graph_path("decoder"))
    types = {x.name: x.type for x in dec.get_inputs() + dec.get_outputs()}
    for name in ("past_k", "past_v", "cross_k", "cross_v", "present_k", "present_v"):
        assert types[name] == "tensor(float16)", name
    for name in ("log_probs", "topk_log_probs", "cross_attn"):
        assert types[name] == "tensor(float)", name
    enc = open_session(fp16.graph_path("encoder"))
    assert {o.name: o.type for o in enc.get_outputs()}["cross_k"] == "tensor(float16)"
    manifest_types = {o["name"]: o["dtype"] for o in m["graphs"]["decoder"]["outputs"]}
    assert manifest_types["present_k"] == "float16" and manifest_types["log_probs"] == "float32"


def test_fp16_keeps_layernorm_and_softmax_fp32_and_masks_finite(fp16):
    for name in ("encoder", "decoder"):
        graph = onnx.load(str(fp16.graph_path(name)))
        check_fp16_range(graph, name)  # every constant finite in fp16 (masks at -3e4)
        inits = {t.name: t.data_type for t in graph.graph.initializer}
        producers = {o: n for n in graph.graph.node for o in n.output}
        kept = 0
        for node in graph.graph.node:
            if node.op_type not in ("Softmax", "LayerNormalization", "LogSoftmax"):
                continue
            kept += 1
            for x in node.input:  # every input is float32: a float32 weight or a Cast to it
                if x in inits:
                    assert inits[x] == onnx.TensorProto.FLOAT, (node.name, x)
                else:
                    src = producers[x]
                    assert src.op_type == "Cast" and src.attribute[0].i == onnx.TensorProto.FLOAT
        assert kept >= 3 * 2  # per layer: 2 (encoder) or 3 (decoder) norms + softmaxes
        mask_values = [v for n in graph.graph.node if n.op_type == "Constant"
                       for v in np.atleast_1d(onnx.numpy_helper.to_array(n.attribute[0].t))
                       if n.attribute[0].t.data_type == onnx.TensorProto.FLOAT16]
        mask_values += [onnx.numpy_helper.to_array(t) for t in graph.graph.initializer
                        if t.data_type == onnx.TensorProto.FLOAT16 and not t.dims]
        assert any(float(v) == -30000.0 for v in mask_values)  # MASK_VALUE_FP16, not -1e9


def test_fp16_padding_gets_no_attention_and_no_nan(fp16, model):
    """Finite fp16 masks: padded keys get exactly zero weight; nothing overflows."""
    enc = open_session(fp16.graph_path("encoder"))
    dec = open_session(fp16.graph_path("decoder"))
    src = torch.full((2, 20), C.PAD_ID)
    src[0, :19] = torch.arange(19) % (model.cfg.vocab_size - 4) + 4
    src[0, 19] = C.EOS_ID
    src[1, :3] = torch.tensor([5, 6, C.EOS_ID])
    e = run(enc, {"src_ids": src})
    cfg = model.cfg
    empty = np.zeros((cfg.decoder_layers, 2, cfg.h, 0, cfg.d_k), dtype=np.float16)
    out = run(dec, {"tokens": np.full(2, C.BOS_ID), "step": np.array(0), "past_k": empty,
                    "past_v": empty, "beam_origin": np.arange(2), "cross_k": e["cross_k"],
                    "cross_v": e["cross_v"], "src_pad_mask": e["src_pad_mask"],
                    "topk": np.array(3)})
    for name, value in out.items():
        assert np.isfinite(value.astype(np.float64)).all(), name
    assert np.all(out["cross_attn"][1, 3:] == 0)
    with torch.no_grad():
        ref = torch.log_softmax(model(src, torch.full((2, 1), C.BOS_ID)), -1)[:, 0].numpy()
    assert np.abs(out["log_probs"] - ref).max() <= TOLERANCES["fp16"]["log_probs"].atol


def test_fp16_parity_within_the_stated_tolerance(fp16):
    outs = fp16.manifest["parity"]["outputs"]
    assert outs["decoder.log_probs"]["value"] <= TOLERANCES["fp16"]["log_probs"].atol
    assert outs["sequence.log_probs"]["value"] <= TOLERANCES["fp16"]["log_probs"].atol
    assert 0 < outs["decoder.present_k"]["value"] <= 5e-2  # really rounded to fp16
    assert outs["decoder.topk_ids"]["passed"]


def test_masks_must_be_fp16_safe(traced):
    """A graph traced with the fp32 mask (-1e9) cannot become an fp16 graph."""
    with pytest.raises(ExportError, match="outside float16's range"):
        check_fp16_range(onnx.load(str(traced["encoder"])), "encoder.onnx")
    assert FP16_MAX == 65504.0


# ---- --int8 ------------------------------------------------------------------------------------


def test_int8_package_passes_its_checks(int8):
    m = int8.manifest
    assert m["variant"] == "int8" and m["parity"]["passed"]
    assert {g["precision"] for g in m["graphs"].values()} == {"int8"}
    assert m["quantization"]["tool"] == "onnxruntime.quantization.quantize_dynamic"
    agreement = m["parity"]["outputs"]["top1_agreement"]
    assert agreement["limit"] == INT8_MIN_TOP1_AGREEMENT
    assert INT8_MIN_TOP1_AGREEMENT <= agreement["value"] <= 1.0
    ops = op_counts(int8.graph_path("decoder"))
    assert ops[("ai.onnx", "MatMulInteger")] >= 2 * 4  # q, k, v, out projections per layer
    assert ops[("ai.onnx", "DynamicQuantizeLinear")] >= 1
    # float outputs are reported, not bounded; they did move
    assert m["parity"]["outputs"]["decoder.log_probs"]["value"] > 1e-4


def test_variants_are_separate_packages(optimized, fp16, int8):
    digests = {p.manifest["graphs"]["decoder"]["sha256"] for p in (optimized, fp16, int8)}
    assert len(digests) == 3
    for p in (optimized, fp16, int8):
        assert (p.path / C.PARITY_FILE).is_file()
        assert p.manifest["parity"]["variant"] == p.variant


def test_variant_with_external_data_survives_a_move(ckpt, traced, tmp_path, monkeypatch):
    """--optimize --external-data: the optimizer writes the weights beside the graph with a
    relative location; the moved package validates from another working directory."""
    import shutil

    pkg = export_reusing_trace(ckpt, tmp_path / "a" / "opt", "optimized", traced,
                               external_data=True)
    for entry in pkg.manifest["graphs"].values():
        assert entry["external_data"][0]["file"] == entry["file"] + C.EXTERNAL_DATA_SUFFIX
    moved = tmp_path / "b"
    shutil.move(str(pkg.path), moved)
    monkeypatch.chdir(tmp_path)
    assert validate_package("b", write=False).passed


def test_one_variant_per_export(ckpt, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["export", str(ckpt), "--out", str(tmp_path / "p"), "--fp16", "--int8"])
    assert "not allowed with argument" in capsys.readouterr().err


# ---- TensorRT ----------------------------------------------------------------------------------


def test_decoder_init_graph_matches_pytorch(model, traced):
    """decoder_init.onnx (the TensorRT variant's first step, no past inputs) against PyTorch,
    and as step 0 of a decoded sequence continued by decoder.onnx: validated on the CPU."""
    graphs = dict(traced)
    s = open_session(graphs["decoder_init"])
    assert [i.name for i in s.get_inputs()] == C.names(C.DECODER_INIT_INPUTS)
    report = validate_graphs(model, graphs)
    report.raise_if_failed()
    outs = report.summary()["outputs"]
    assert outs["decoder_init.log_probs"]["value"] <= 1e-5
    assert outs["decoder_init.present_k"]["cases"] == 9
    assert any("(decoder_init)" in c["case"]
               for c in report.measurements["sequence.log_probs"].cases)


def test_topk_can_be_folded_for_tensorrt(traced, model):
    """The TensorRT fallback for parsers that want a constant TopK K: the folded graph has no
    topk input and computes what the original does with that topk."""
    from export.graphs import dummy_decoder_inputs
    from export.tensorrt import fold_topk

    folded = fold_topk(traced["decoder"], 7)
    try:
        s = open_session(folded)
        assert "topk" not in [i.name for i in s.get_inputs()]
        inp = dummy_decoder_inputs(model, 3, 2, 4, 9, topk=7, seed=1)
        a = run(s, inp)
        b = run(open_session(traced["decoder"]), inp)
    finally:
        folded.unlink()
    assert a["topk_ids"].shape == (3, 7)
    np.testing.assert_array_equal(a["topk_ids"], b["topk_ids"])
    np.testing.assert_allclose(a["log_probs"], b["log_probs"], atol=1e-6)


def test_engine_profiles_start_at_p1(model):
    from export.tensorrt import EngineShapes, profile_shapes

    ranges = EngineShapes().resolved(model.cfg)
    shapes = profile_shapes(C.DECODER_INPUTS, model.cfg, ranges)
    L, H, Dh = model.cfg.decoder_layers, model.cfg.h, model.cfg.d_k
    assert shapes["past_k"]["min"] == [L, 1, H, 1, Dh]
    assert shapes["past_k"]["max"][3] == model.cfg.max_positions - 1
    for spec in shapes.values():
        assert min(spec["min"]) >= 1  # TensorRT forbids zero-length dimensions
        assert all(a <= b <= c for a, b, c in zip(spec["min"], spec["opt"], spec["max"]))
    init = profile_shapes(C.DECODER_INIT_INPUTS, model.cfg, ranges)
    assert "past_k" not in init and init["cross_k"]["min"] == [L, 1, H, 1, Dh]


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed: the refusal does not apply")
def test_tensorrt_export_refuses_clearly_without_tensorrt(ckpt, tmp_path, capsys):
    out = tmp_path / "trt"
    with pytest.raises(ExportError, match=r"pip install tensorrt.*aiayn\[gpu\]"):
        export_package(ckpt, out, variant="tensorrt")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert cli_main(["export", str(ckpt), "--out", str(out), "--tensorrt"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "`tensorrt`" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TENSORRT,
                    reason="TensorRT is not installed (pip install tensorrt / aiayn[gpu]); "
                           "the engine build needs it and a CUDA GPU")
def test_tensorrt_package_builds_engines(ckpt, tmp_path):
    pkg = export_package(ckpt, tmp_path / "trt", variant="tensorrt")
    m = pkg.manifest
    assert set(m["engines"]) == {"encoder", "decoder", "decoder_init"}
    assert m["tensorrt_version"] and m["gpu_name"]
    assert (pkg.path / C.TIMING_CACHE_FILE).is_file()
    assert m["engines"]["decoder"]["profiles"][0]["shapes"]["past_k"]["min"][3] == 1
    assert m["tensorrt"].get("parity", {}).get("passed", True)
