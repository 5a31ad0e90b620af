"""Export (issue 4): the fp32 package of a tiny random model, its graphs against PyTorch, the
package's integrity checks and the command line. DESIGN.md "The graph contract" and "The model
package". Everything runs on the CPU with ONNX Runtime; packages are exported once per module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from export.cli import main as cli_main  # noqa: E402
from export.errors import ExportError, ParityError  # noqa: E402
from export.package import export_package, replace_dir  # noqa: E402
from export.validate import GRID_N, GRID_P, GRID_S, open_session, run, validate_package  # noqa: E402
from runtime import contract as C  # noqa: E402
from runtime.checksums import sha256_file  # noqa: E402
from runtime.errors import PackageError  # noqa: E402
from runtime.package import Package  # noqa: E402
from runtime.tokenizer import train_tokenizer  # noqa: E402
from train.checkpoint import checkpoint_sha256, load_checkpoint, save_checkpoint  # noqa: E402
from train.config import ModelConfig  # noqa: E402
from train.model import Transformer  # noqa: E402

SENTENCES = [
    "a man rides a red bike down the street .", "two dogs play in the green grass .",
    "ein mann fährt ein rotes fahrrad die straße hinunter .", "zwei hunde spielen im gras .",
    "a woman is reading a book in the park .", "eine frau liest ein buch im park .",
    "children are playing football on the beach .", "kinder spielen fußball am strand .",
    "the old man sits on a bench .", "der alte mann sitzt auf einer bank .",
]


def build_checkpoint(root: Path, seed: int = 0) -> Path:
    """A tiny random model (d_model 32, 2 + 2 layers, vocab <= 60) saved as a checkpoint.

    Biases and LayerNorm parameters are randomized (not the init's zeros and ones, which the
    exporter would fold together) and the tied embedding is scaled up so that log-probs are
    peaked like a trained model's rather than near-uniform.
    """
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SENTENCES * 3, root / "spm.model", vocab_size=60, num_threads=1)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, d_ff=64, h=4, encoder_layers=2,
                      decoder_layers=2, max_positions=128)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        model.embed.weight.mul_(2.0)
    return save_checkpoint(root / "ckpt", model, root / "spm.model",
                           meta={"languages": {"src": "en", "tgt": "de"}})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model(ckpt):
    return load_checkpoint(ckpt)[0]


@pytest.fixture(scope="module")
def pkg(ckpt, tmp_path_factory) -> Package:
    return export_package(ckpt, tmp_path_factory.mktemp("export") / "pkg")


@pytest.fixture(scope="module")
def sessions(pkg):
    return {name: open_session(pkg.graph_path(name)) for name in ("encoder", "decoder")}


def copy_package(pkg: Package, dst: Path) -> Path:
    shutil.copytree(pkg.path, dst)
    return dst


def rehash(directory: Path, graph: str) -> None:
    """Recompute a graph's sha256 in the manifest (simulates an exporter that wrote a wrong
    graph with a consistent manifest, so only validation can catch it)."""
    mf = directory / C.MANIFEST_FILE
    manifest = json.loads(mf.read_text())
    entry = manifest["graphs"][graph]
    entry["sha256"] = sha256_file(directory / entry["file"])
    mf.write_text(json.dumps(manifest))


def encode(sessions, src: torch.Tensor) -> dict[str, np.ndarray]:
    return run(sessions["encoder"], {"src_ids": src})


def step_feed(tokens, step, past_k, past_v, beam_origin, enc, topk=5) -> dict:
    return {"tokens": np.asarray(tokens, dtype=np.int64), "step": np.array(step, dtype=np.int64),
            "past_k": past_k, "past_v": past_v,
            "beam_origin": np.asarray(beam_origin, dtype=np.int64), "cross_k": enc["cross_k"],
            "cross_v": enc["cross_v"], "src_pad_mask": enc["src_pad_mask"],
            "topk": np.array(topk, dtype=np.int64)}


def empty_cache(cfg, n: int) -> np.ndarray:
    return np.zeros((cfg.decoder_layers, n, cfg.h, 0, cfg.d_k), dtype=np.float32)


def sources(model, lengths: list[int], seed: int = 0) -> torch.Tensor:
    """A right-padded batch of random sources with the given lengths (EOS included)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), C.PAD_ID, dtype=torch.long)
    for b, n in enumerate(lengths):
        src[b, :n - 1] = torch.randint(C.EOS_ID + 1, model.cfg.vocab_size, (n - 1,), generator=g)
        src[b, n - 1] = C.EOS_ID
    return src


# ---- the package and its validation ------------------------------------------------------------


def test_export_passes_every_validation_shape(pkg, ckpt):
    m = pkg.manifest
    assert (m["format"], m["format_version"], m["variant"]) == (C.MANIFEST_FORMAT,
                                                                 C.MANIFEST_VERSION, "fp32")
    assert m["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert m["source_checkpoint"]["sha256"] == checkpoint_sha256(ckpt)
    assert m["languages"] == {"src": "en", "tgt": "de"}
    assert m["opset"] >= C.MIN_OPSET and {"torch", "onnx", "onnxruntime"} <= set(m["versions"])
    for name, specs in (("encoder", C.ENCODER_OUTPUTS), ("decoder", C.DECODER_OUTPUTS)):
        g = m["graphs"][name]
        assert g["precision"] == "fp32"
        assert g["sha256"] == sha256_file(pkg.path / g["file"])
        assert [o["name"] for o in g["outputs"]] == C.names(specs)

    parity = m["parity"]
    assert parity["passed"] is True and parity["precision"] == "fp32"
    n_grid = len(GRID_N) * len(GRID_S) + len(GRID_N) * len(GRID_P) * len(GRID_S)
    assert parity["cases"] == n_grid + 1  # + the decoded sequence
    record = json.loads((pkg.path / C.PARITY_FILE).read_text())
    cases = [c["case"] for c in record["measurements"]["decoder.log_probs"]["cases"]]
    for N in GRID_N:
        for P in GRID_P:
            for S in GRID_S:
                assert any(c.startswith(f"N={N}, P={P}, S={S},") for c in cases)
    for name in ("encoder.cross_k", "encoder.cross_v", "decoder.log_probs",
                 "decoder.topk_log_probs", "decoder.present_k", "decoder.present_v",
                 "decoder.cross_attn", "sequence.log_probs"):
        out = parity["outputs"][name]
        assert out["passed"] and out["value"] is not None and 0 <= out["value"] <= 1e-4, name
    assert parity["outputs"]["decoder.topk_ids"]["passed"]
    assert parity["outputs"]["top1_agreement"]["value"] == 1.0


def test_graph_io_follows_the_contract(sessions):
    for name, ins, outs in (("encoder", C.ENCODER_INPUTS, C.ENCODER_OUTPUTS),
                            ("decoder", C.DECODER_INPUTS, C.DECODER_OUTPUTS)):
        s = sessions[name]
        assert [i.name for i in s.get_inputs()] == C.names(ins)
        assert [o.name for o in s.get_outputs()] == C.names(outs)
        types = {x.name: x.type for x in s.get_inputs() + s.get_outputs()}
        for spec in ins + outs:
            expected = {"int64": "tensor(int64)", "bool": "tensor(bool)"}.get(spec.dtype,
                                                                               "tensor(float)")
            assert types[spec.name] == expected, spec.name
    dims = {o.name: o.shape for o in sessions["decoder"].get_outputs()}
    assert dims["topk_ids"][1] == "K" and dims["present_k"][3] == "P + 1"


def test_step0_matches_pytorch(model, sessions):
    """P = 0: the BOS step from an empty cache, against PyTorch's step and full forward."""
    src = sources(model, [9, 4, 1])
    enc = encode(sessions, src)
    B = src.shape[0]
    out = run(sessions["decoder"], step_feed([C.BOS_ID] * B, 0, empty_cache(model.cfg, B),
                                             empty_cache(model.cfg, B), range(B), enc))
    assert not np.isnan(out["log_probs"]).any()
    assert out["present_k"].shape == (model.cfg.decoder_layers, B, model.cfg.h, 1, model.cfg.d_k)
    with torch.no_grad():
        ref = torch.log_softmax(model(src, torch.full((B, 1), C.BOS_ID)), -1)[:, 0].numpy()
    assert np.abs(out["log_probs"] - ref).max() <= 1e-5
    np.testing.assert_allclose(np.exp(out["log_probs"]).sum(-1), 1.0, atol=1e-5)


def test_step_by_step_matches_full_decode(model, sessions):
    """Position t of PyTorch's teacher-forced forward == the graph's t-th incremental step."""
    src = sources(model, [12, 7], seed=1)
    B, T = 2, 10
    g = torch.Generator().manual_seed(2)
    tgt = torch.randint(C.EOS_ID + 1, model.cfg.vocab_size, (B, T), generator=g)
    tgt[:, 0] = C.BOS_ID
    with torch.no_grad():
        ref = torch.log_softmax(model(src, tgt), -1).numpy()  # (B, T, V)
    enc = encode(sessions, src)
    past_k = past_v = empty_cache(model.cfg, B)
    for t in range(T):
        out = run(sessions["decoder"], step_feed(tgt[:, t], t, past_k, past_v, range(B), enc))
        assert np.abs(out["log_probs"] - ref[:, t]).max() <= 1e-5, t
        assert out["present_k"].shape[3] == t + 1
        past_k, past_v = out["present_k"], out["present_v"]


def test_beam_origin_reorders_the_cache(model, sessions):
    """beam_origin gathers the past inside the graph: same as reordering the cache by hand."""
    src = sources(model, [8, 8, 8, 8], seed=3)
    enc = encode(sessions, src)
    rng = np.random.default_rng(0)
    cfg = model.cfg
    past = rng.standard_normal((2, cfg.decoder_layers, 3, cfg.h, 5, cfg.d_k)).astype(np.float32)
    origin = np.array([2, 0, 0, 1])
    tokens = rng.integers(C.EOS_ID + 1, cfg.vocab_size, 4)
    a = run(sessions["decoder"], step_feed(tokens, 5, past[0], past[1], origin, enc))
    b = run(sessions["decoder"], step_feed(tokens, 5, past[0][:, origin], past[1][:, origin],
                                           range(4), enc))
    for name in ("log_probs", "present_k", "present_v", "cross_attn"):
        np.testing.assert_allclose(a[name], b[name], atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(a["present_k"][:, :, :, :5], past[0][:, origin])


def test_batching_does_not_change_a_row(model, sessions):
    """A short and a long sentence in one padded batch give each row the log-probs it has
    alone (padding is masked in the encoder and in cross-attention)."""
    cfg = model.cfg
    pair = sources(model, [3, 25], seed=4)
    alone = [pair[:1, :3], pair[1:, :]]
    g = torch.Generator().manual_seed(5)
    tgt = torch.randint(C.EOS_ID + 1, cfg.vocab_size, (2, 6), generator=g)
    tgt[:, 0] = C.BOS_ID

    def decode(src, rows):
        enc = encode(sessions, src)
        pk = pv = empty_cache(cfg, len(rows))
        steps = []
        for t in range(tgt.shape[1]):
            out = run(sessions["decoder"], step_feed(tgt[rows, t], t, pk, pv, range(len(rows)),
                                                     enc))
            steps.append(out)
            pk, pv = out["present_k"], out["present_v"]
        return steps

    both = decode(pair, [0, 1])
    for row, src in enumerate(alone):
        single = decode(src, [row])
        for t, (x, y) in enumerate(zip(both, single)):
            assert np.abs(x["log_probs"][row] - y["log_probs"][0]).max() <= 1e-5, (row, t)
            n = src.shape[1]
            np.testing.assert_allclose(x["cross_attn"][row, :n], y["cross_attn"][0], atol=1e-6)
            assert np.all(x["cross_attn"][row, n:] == 0)  # padding gets no attention


def test_perturbed_weight_is_caught(pkg, tmp_path, capsys):
    """A graph that no longer computes what PyTorch computes fails validation, which names the
    output and the shape (the manifest's hashes are made consistent, so only parity can tell)."""
    from onnx import numpy_helper

    path = copy_package(pkg, tmp_path / "bad")
    graph = onnx.load(str(path / C.DECODER_FILE))
    init = next(t for t in graph.graph.initializer if t.name == "model.embed.weight")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.1, init.name))
    onnx.save(graph, str(path / C.DECODER_FILE))
    rehash(path, "decoder")
    with pytest.raises(ParityError) as e:
        validate_package(path, write=False)
    assert e.value.output == "decoder.log_probs"
    assert "decoder.log_probs" in str(e.value) and "N=" in e.value.case
    assert e.value.value > 1e-4
    capsys.readouterr()
    assert cli_main(["validate", str(path), "--no-write"]) == 2  # the command fails
    out, err = capsys.readouterr()
    assert "decoder.log_probs max|Δ|" in out and "FAILED" in out
    assert "encoder.cross_k" in out and "FAILED" not in out.splitlines()[0]  # encoder untouched
    assert err.strip().splitlines()[-1].startswith("aiayn validate: error: parity check failed")
    assert "Traceback" not in err


def test_validate_writes_the_parity_record(pkg, tmp_path, capsys):
    path = copy_package(pkg, tmp_path / "v")
    (path / C.PARITY_FILE).unlink()
    assert cli_main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decoder.log_probs max|Δ|" in out and "parity passed" in out
    record = json.loads((path / C.PARITY_FILE).read_text())
    assert record["passed"] and record["measurements"]["decoder.log_probs"]["cases"]
    assert Package.load(path).manifest["parity"]["passed"]


def test_validate_checks_the_source_checkpoint(pkg, tmp_path):
    other = build_checkpoint(tmp_path / "other", seed=1)
    with pytest.raises(PackageError, match="not the one"):
        validate_package(pkg.path, checkpoint=other, write=False)
    path = copy_package(pkg, tmp_path / "nopath")
    manifest = json.loads((path / C.MANIFEST_FILE).read_text())
    del manifest["source_checkpoint"]["path"]
    (path / C.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="--checkpoint"):
        validate_package(path, write=False)


def test_moved_external_data_package_loads(ckpt, model, tmp_path, monkeypatch):
    """--external-data: weights beside each graph, hashed in the manifest; the package still
    loads and validates after a move, opened from another working directory."""
    first = export_package(ckpt, tmp_path / "a" / "pkg", external_data=True)
    for name in ("encoder", "decoder"):
        entry = first.manifest["graphs"][name]
        (data,) = entry["external_data"]
        assert data["file"] == entry["file"] + C.EXTERNAL_DATA_SUFFIX
        assert data["sha256"] == sha256_file(first.path / data["file"])
        assert (first.path / data["file"]).stat().st_size > 10_000
    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(str(first.path), moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    pkg = Package.load(Path("..") / "b" / "moved")
    assert pkg.path == moved.resolve()
    s = open_session(pkg.graph_path("encoder"))
    out = run(s, {"src_ids": sources(model, [5])})
    with torch.no_grad():
        ref = model.encode_for_step(sources(model, [5]))[0].numpy()
    assert np.abs(out["cross_k"] - ref).max() <= 1e-4
    assert validate_package(moved, write=False).passed
    (moved / "decoder.onnx.data").write_bytes(b"\0" * 10)
    with pytest.raises(PackageError, match="sha256"):
        Package.load(moved)


def test_truncated_graph_is_refused(pkg, tmp_path):
    path = copy_package(pkg, tmp_path / "t")
    data = (path / C.DECODER_FILE).read_bytes()
    (path / C.DECODER_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(PackageError, match=r"decoder\.onnx does not match its sha256"):
        Package.load(path)
    rehash(path, "decoder")  # even with a matching hash, the checker refuses it
    with pytest.raises(PackageError, match=r"decoder\.onnx fails onnx\.checker"):
        validate_package(path, write=False)


def test_hash_mismatch_is_refused(pkg, tmp_path):
    path = copy_package(pkg, tmp_path / "h")
    manifest = json.loads((path / C.MANIFEST_FILE).read_text())
    manifest["graphs"]["encoder"]["sha256"] = "0" * 64
    (path / C.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=r"encoder\.onnx does not match its sha256"):
        Package.load(path)


def test_unknown_manifest_version_is_refused(pkg, tmp_path):
    path = copy_package(pkg, tmp_path / "u")
    manifest = json.loads((path / C.MANIFEST_FILE).read_text())
    manifest["format_version"] = C.MANIFEST_VERSION + 1
    (path / C.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=f"format_version {C.MANIFEST_VERSION + 1}"):
        Package.load(path)


# ---- writing: refusal, atomicity ---------------------------------------------------------------


def test_existing_out_is_not_replaced_without_force(pkg, ckpt, capsys):
    before = sha256_file(pkg.path / C.MANIFEST_FILE)
    assert cli_main(["export", str(ckpt), "--out", str(pkg.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists; pass --force" in err
    assert "Traceback" not in err
    assert sha256_file(pkg.path / C.MANIFEST_FILE) == before


def test_force_never_replaces_a_non_package(ckpt, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not a model package"):
        export_package(ckpt, precious, force=True)
    with pytest.raises(ExportError, match="overwrite the checkpoint"):
        export_package(ckpt, ckpt, force=True)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_bad_input_is_one_line(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aiayn export: error:") and "not found" in err and "\n" not in err
    assert not (tmp_path / "p").exists()
    assert cli_main(["validate", str(tmp_path / "nothing")]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path), "--out", str(tmp_path / "p"), "--opset", "9"]) == 2
    assert "--opset 9 is not supported" in capsys.readouterr().err


def reuse_traced_graphs(pkg: Package, monkeypatch) -> None:
    """Stand-in for the (slow) torch.export step: copy the module's already traced graphs.
    Everything after it (manifest, ONNX Runtime validation, atomic write) runs for real."""
    import export.package

    def trace(model, directory, names, *args, **kwargs):
        paths = {}
        for name in names:
            src = pkg.graph_path(name)
            shutil.copyfile(src, directory / src.name)
            paths[name] = directory / src.name
        return paths

    monkeypatch.setattr(export.package, "_trace", trace)


def test_interrupted_export_leaves_nothing(pkg, ckpt, tmp_path, monkeypatch):
    """Ctrl-C in the middle (graphs and manifest written, validation running): no package,
    no temp folder."""
    import export.validate

    reuse_traced_graphs(pkg, monkeypatch)

    def interrupt(*args, **kwargs):
        assert len(list(tmp_path.glob(".pkg.tmp-*/*.onnx"))) == 2  # work was under way
        raise KeyboardInterrupt

    monkeypatch.setattr(export.validate, "validate_graphs", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export_package(ckpt, tmp_path / "pkg")
    assert list(tmp_path.iterdir()) == []


def test_failed_validation_writes_nothing(pkg, ckpt, tmp_path, monkeypatch):
    """An export whose graphs fail parity (here: an impossible tolerance) leaves no package."""
    import export.validate as V

    reuse_traced_graphs(pkg, monkeypatch)
    monkeypatch.setitem(V.TOLERANCES, "fp32", {k: V.Tolerance(-1.0) for k in V.TOLERANCES["fp32"]})
    with pytest.raises(ParityError, match=r"encoder\.cross_k max\|Δ\| .* at B="):
        export_package(ckpt, tmp_path / "pkg")
    assert list(tmp_path.iterdir()) == []


def test_replace_dir_swaps_complete_folders(tmp_path):
    new, dst = tmp_path / "new", tmp_path / "dst"
    new.mkdir()
    (new / "f").write_text("new")
    dst.mkdir()
    (dst / "f").write_text("old")
    replace_dir(new, dst)
    assert (dst / "f").read_text() == "new" and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]
