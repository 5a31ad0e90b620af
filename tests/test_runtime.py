"""The torch-free runtime: backends, translator API, hard inputs, concurrency, the cached
bundled package. Real ONNX Runtime sessions on real exported packages throughout."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from runtime.contract import BOS_ID, EOS_ID, PAD_ID
from runtime.errors import BackendError, InputTooLongError, PackageError
from runtime.tokenizer import clean_text
from runtime.translator import Translator

REPO = Path(__file__).resolve().parents[1]

SENTENCES = [
    "A man in an orange hat starring at something.",
    "Two young children are playing in the sand.",
    "A dog runs through the grass.",
    "A woman with a large purse is walking by a gate.",
    "Three people sit in a cave.",
    "A group of men are loading cotton onto a truck.",
    "A little girl climbs into a wooden playhouse.",
    "A man sleeping in a green room on a couch.",
]


@pytest.fixture(scope="module")
def bundled(bundled_package) -> Translator:
    return Translator.load(bundled_package, backend="ort-cpu")


@pytest.fixture(scope="module")
def tiny(tiny_package) -> Translator:
    return Translator.load(tiny_package, backend="ort-cpu")


# ---------------------------------------------------------------------------- torch-free


def _run_python(code: str, env: dict | None = None, timeout: int = 120) -> str:
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_runtime_imports_and_translates_with_torch_unimportable(bundled_cache_home, tmp_path):
    """`import runtime` and a full translation (the default model's cached package, found
    through XDG_CACHE_HOME) with torch blocked: the runtime never needs it. tqdm (a train
    extra) is blocked too: `aiayn translate -i FILE` still shows progress."""
    (tmp_path / "in.en").write_text("A dog runs.\n\nTwo cats sleep.\n", encoding="utf-8")
    code = f"""
import sys
sys.modules['torch'] = None  # any `import torch` now raises ImportError
sys.modules['tqdm'] = None
import runtime, runtime.translator, runtime.search, runtime.cli, runtime.backends
import runtime.backends.ort_cpu, runtime.backends.ort_cuda, runtime.backends.ort_tensorrt
import runtime.backends.tensorrt
from runtime.translator import Translator
t = Translator.load()
r = t.translate(['A man rides a bike.', '', 'Two dogs play in the snow.'], beam_size=4)
assert r[0].text and r[1].text == '' and r[2].text, r
assert not [m for m in ('train', 'export') if m in sys.modules]
from runtime.dispatch import main
src, out = {str(tmp_path / "in.en")!r}, {str(tmp_path / "out.de")!r}
assert main(['translate', '-i', src, '-o', out]) == 0
print(t.backend, '|', r[0].text, '|', r[2].text)
"""
    out = _run_python(code, env={"XDG_CACHE_HOME": str(bundled_cache_home),
                                 "AIAYN_MODEL": ""})
    backend, first, third = [s.strip() for s in out.strip().split("|")]
    assert backend == "ort-cpu"
    assert "Mann" in first and "Hunde" in third
    lines = (tmp_path / "out.de").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and "Hund" in lines[0] and lines[1] == "" and lines[2]


# ---------------------------------------------------------------------------- backends


def test_auto_picks_ort_cpu_here_and_gpu_backends_say_what_to_install(tiny_package):
    from runtime.backends import auto_order, load_backend
    from runtime.package import Package

    pkg = Package.load(tiny_package)
    assert auto_order(pkg) == ["ort-cuda", "ort-cpu"]
    assert load_backend("auto", pkg).name == "ort-cpu"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(BackendError, match="onnxruntime-gpu"):
            load_backend("ort-cuda", pkg)
        with pytest.raises(BackendError, match="TensorrtExecutionProvider"):
            load_backend("ort-tensorrt", pkg)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(BackendError, match="tensorrt"):
            load_backend("tensorrt", pkg)
    with pytest.raises(ValueError, match="unknown backend"):
        load_backend("ort-quantum", pkg)


def test_threads_sets_intra_op_threads(tiny_package):
    t = Translator.load(tiny_package, backend="ort-cpu", threads=1)
    assert t.engine.decoder.get_session_options().intra_op_num_threads == 1
    assert t.engine.describe()["threads"] == 1
    with pytest.raises(ValueError, match="threads"):
        Translator.load(tiny_package, backend="ort-cpu", threads=0)


def test_gather_graph_selects_rows_like_numpy(tiny):
    """The hand-serialized Gather graph (cross K/V rows on the device) equals np.take."""
    eng = tiny.engine
    src = np.array([[5, 6, 7, EOS_ID], [8, 9, EOS_ID, PAD_ID], [10, EOS_ID, PAD_ID, PAD_ID]])
    enc = eng.encode(src)
    rows = np.array([2, 0, 0, 1, 2], dtype=np.int64)
    sel = eng.select(enc, rows)
    for name in ("cross_k", "cross_v"):
        np.testing.assert_array_equal(getattr(sel, name).numpy(),
                                      np.take(getattr(enc, name).numpy(), rows, axis=1))
    np.testing.assert_array_equal(sel.src_pad_mask.numpy(), enc.src_pad_mask.numpy()[rows])
    assert enc.src_pad_mask.numpy().tolist() == (src == PAD_ID).tolist()


def test_step_top_k_is_the_top_of_log_probs_and_cache_grows(tiny):
    eng = tiny.engine
    enc = eng.encode(np.array([[5, 6, 7, EOS_ID], [8, 9, EOS_ID, PAD_ID]]))
    cross = eng.select(enc, np.array([0, 0, 1]))
    out = eng.step(np.array([BOS_ID] * 3), 0, None, np.arange(3), cross, 6)
    lp = out.log_probs()
    assert lp.shape == (3, eng.vocab_size) and lp.dtype == np.float32
    np.testing.assert_allclose(np.exp(lp).sum(1), 1.0, rtol=1e-5)
    assert out.topk_ids.shape == (3, 6) and out.topk_log_probs.dtype == np.float32
    np.testing.assert_array_equal(out.topk_log_probs, np.take_along_axis(lp, out.topk_ids, 1))
    np.testing.assert_array_equal(out.topk_log_probs, -np.sort(-lp, axis=1)[:, :6])
    assert out.cache.k.shape() == [eng.L, 3, eng.H, 1, eng.Dh]
    # rows 0 and 1 continue the same sentence: identical inputs give identical rows
    np.testing.assert_array_equal(lp[0], lp[1])
    attn = out.cross_attn()
    assert attn.shape == (3, 4)
    np.testing.assert_allclose(attn.sum(1), 1.0, rtol=1e-5)
    assert attn[2, 3] == 0.0  # padding gets no attention
    out2 = eng.step(np.array([7, 9]), 1, out.cache, np.array([2, 0]), eng.select(enc, [1, 0]), 4)
    assert out2.cache.k.shape() == [eng.L, 2, eng.H, 2, eng.Dh]


@pytest.mark.gpu
def test_ort_cuda_matches_ort_cpu(bundled_package, multi30k_test):
    """GPU check (run with `pytest -m gpu`): ort-cuda keeps caches on the device and still
    translates exactly like ort-cpu (parity rule: near ties aside)."""
    cuda = Translator.load(bundled_package, backend="ort-cuda")
    cpu = Translator.load(bundled_package, backend="ort-cpu")
    src = multi30k_test[0][:100]
    a, b = cuda.translate(src), cpu.translate(src)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    assert same >= 98
    assert max(abs(x.score - y.score) for x, y in zip(a, b) if x.token_ids == y.token_ids) < 1e-3


def test_fp16_package_runs_on_the_cpu(tiny_checkpoint, tiny, tmp_path):
    """An fp16 variant (float16 caches and cross K/V, the gather graph in float16) runs on the
    same search and translates like the fp32 package (parity rule: fp16 may flip a close
    call, so most, not all, outputs must be identical)."""
    from export.package import export_package

    pkg = export_package(tiny_checkpoint, tmp_path / "fp16", variant="fp16")
    t = Translator.load(pkg.path, backend="ort-cpu")
    assert t.engine.float_dtype == np.float16
    texts = ["The dog runs.", "A man sits on a red car.", "", "Big green ball in the water."]
    a = t.translate(texts, beam_size=3, max_len_b=8, return_attention=True)
    b = tiny.translate(texts, beam_size=3, max_len_b=8)
    assert a[2].text == ""
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b)) >= 3
    assert all(len(r.attention) == len(r.tokens) + 1 for r in a if r.tokens)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None,
                    reason="TensorRT is not installed (pip install tensorrt / aiayn[gpu]): ONNX "
                           "Runtime's TensorRT provider cannot start without its libraries")
def test_ort_tensorrt_matches_ort_cpu(tiny_package, multi30k_test, tmp_path):
    """GPU check: ONNX Runtime's TensorRT provider (engines built into an engine cache on
    first use; step 0 on CUDA) translates like ort-cpu."""
    trt = Translator.load(tiny_package, backend="ort-tensorrt", engine_cache=tmp_path / "trt")
    cpu = Translator.load(tiny_package, backend="ort-cpu")
    texts = ["The dog runs.", "A man sits on a red car in the park.", "Big"]
    a, b = trt.translate(texts, max_len_b=8), cpu.translate(texts, max_len_b=8)
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b)) >= 2
    assert any((tmp_path / "trt").iterdir())  # the engine cache was written


@pytest.mark.gpu
def test_tensorrt_backend_runs_engines(tmp_path):
    """GPU check: the .plan runner needs a package of the tensorrt variant built on this GPU
    (set AIAYN_TRT_PACKAGE)."""
    path = os.environ.get("AIAYN_TRT_PACKAGE")
    if not path:
        pytest.skip("no TensorRT package: export one with `aiayn export --tensorrt` on this GPU "
                    "and set AIAYN_TRT_PACKAGE")
    trt = Translator.load(path, backend="tensorrt")
    cpu = Translator.load(path, backend="ort-cpu")
    a, b = trt.translate(SENTENCES), cpu.translate(SENTENCES)
    assert sum(x.token_ids == y.token_ids for x, y in zip(a, b)) >= len(SENTENCES) - 1


# ---------------------------------------------------------------------------- the API


def test_translate_returns_translations_in_input_order(bundled):
    out = bundled.translate(SENTENCES, beam_size=4, nbest=2, max_tokens=40)  # several batches
    assert len(out) == len(SENTENCES)
    for r in out:
        assert r.text and r.tokens and r.source_tokens[-1] == "</s>"
        assert r.nbest[0].text == r.text and r.score == r.nbest[0].score
        assert len(r.nbest) == 2 and r.nbest[0].score >= r.nbest[1].score
        assert r.nbest[0].log_prob == pytest.approx(sum(r.nbest[0].token_scores), abs=1e-4)
        assert not r.truncated
    alone = [bundled.translate([s])[0].text for s in SENTENCES[:3]]
    assert alone == [r.text for r in out[:3]]
    assert "Hund" in out[2].text


def test_batch_invariance(bundled, multi30k_test):
    """A sentence's translation does not depend on what else is in its batch."""
    src = multi30k_test[0][:24]
    together = bundled.translate(src)
    alone = [bundled.translate([s])[0] for s in src[:8]]
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(src))
    shuffled = bundled.translate([src[i] for i in perm], max_tokens=150)
    by_index = {int(i): r for i, r in zip(perm, shuffled)}
    for i, r in enumerate(together):
        assert by_index[i].token_ids == r.token_ids
        assert by_index[i].score == pytest.approx(r.score, abs=1e-4)
    for a, r in zip(alone, together):
        assert a.token_ids == r.token_ids
        assert a.score == pytest.approx(r.score, abs=1e-4)


def _naive_greedy(engine, src_ids: list[int], max_len: int) -> tuple[list[int], float]:
    """Greedy decoding spelled out over the backend: argmax (PAD/BOS excluded) until EOS."""
    enc = engine.encode(np.array([src_ids]))
    cross = engine.select(enc, np.array([0]))
    cache, tokens, score = None, [], 0.0
    token = BOS_ID
    for t in range(max_len):
        out = engine.step(np.array([token]), t, cache, np.array([0]), cross, 8)
        cache = out.cache
        lp = out.log_probs()[0].astype(np.float64)
        lp[[PAD_ID, BOS_ID]] = -np.inf
        token = EOS_ID if t == max_len - 1 else int(np.argmax(lp))
        score += lp[token]
        if token == EOS_ID:
            break
        tokens.append(token)
    return tokens, score


def test_beam_1_is_greedy(bundled, multi30k_test):
    from runtime.searchspec import max_output_length

    for text in multi30k_test[0][:12]:
        r = bundled.translate([text], beam_size=1)[0]
        ids = bundled.tokenizer.encode_source(text)
        tokens, score = _naive_greedy(bundled.engine, ids, max_output_length(len(ids), 1, 50, 256))
        assert r.token_ids == tokens
        assert r.nbest[0].log_prob == pytest.approx(score, abs=1e-4)


def test_eight_threads_get_what_sequential_calls_get(bundled, multi30k_test):
    src = multi30k_test[0][100:164]
    chunks = [src[i::8] for i in range(8)]  # 8 different 8-sentence lists
    sequential = [bundled.translate(c) for c in chunks]
    results: list = [None] * 8
    errors: list = []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            results[i] = bundled.translate(chunks[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for seq, conc in zip(sequential, results):
        assert [r.token_ids for r in conc] == [r.token_ids for r in seq]
        assert [r.score for r in conc] == pytest.approx([r.score for r in seq], abs=1e-6)


# ---------------------------------------------------------------------------- hard inputs


def test_empty_and_whitespace_inputs_do_not_run_the_model(tiny, monkeypatch):
    calls = []
    real = tiny.engine.encode
    monkeypatch.setattr(tiny.engine, "encode", lambda src: calls.append(src.shape) or real(src))
    out = tiny.translate(["", "   ", "\t\n", "\u200b"])
    assert [r.text for r in out] == ["", "", "", ""]
    assert all(r.tokens == [] and r.score == 0.0 and r.attention is None for r in out)
    assert calls == []
    assert tiny.translate([]) == []


def test_a_batch_mixing_empty_and_real_sentences(bundled):
    mixed = bundled.translate(["", SENTENCES[2], "  ", SENTENCES[4], ""])
    assert [r.text for r in mixed][::2] == ["", "", ""]
    assert mixed[1].token_ids == bundled.translate([SENTENCES[2]])[0].token_ids
    assert mixed[3].token_ids == bundled.translate([SENTENCES[4]])[0].token_ids


def test_control_and_zero_width_characters(bundled):
    dirty = "A dog\x00 runs\u200b through\x07 the\u200d grass.\x1b\ufeff"
    r = bundled.translate([dirty])[0]
    assert r.text == bundled.translate([clean_text(dirty)])[0].text
    assert "Hund" in r.text
    assert not any(c in "".join(r.source_tokens) for c in "\x00\u200b\x07\u200d\x1b\ufeff")


def test_emoji_and_characters_outside_the_vocabulary(bundled):
    texts = ["A dog 🐕 runs 😀 through the grass ✈ 漢字.", "😀😀😀", "ꙮ"]
    out = bundled.translate(texts, return_attention=True)
    assert all(isinstance(r.text, str) for r in out)
    assert "<unk>" in out[1].source_tokens or "▁" in out[1].source_tokens
    assert "Hund" in out[0].text
    for r in out:
        assert len(r.attention) == len(r.tokens) + 1
        assert all(len(row) == len(r.source_tokens) for row in r.attention)


def test_input_longer_than_max_positions(tiny):
    long_text = " ".join(["the big dog runs"] * 40)  # far more than 64 tokens
    with pytest.warns(UserWarning, match="truncated"):
        r = tiny.translate([long_text, "A dog."])
    assert r[0].truncated and not r[1].truncated
    assert len(r[0].source_tokens) == tiny.max_positions and r[0].source_tokens[-1] == "</s>"
    assert len(r[0].tokens) < tiny.max_positions
    with pytest.raises(InputTooLongError, match="max_positions"):
        tiny.translate([long_text], on_long="error")


def test_nbest_larger_than_beam_is_clipped(bundled):
    r = bundled.translate([SENTENCES[0]], beam_size=2, nbest=5)[0]
    assert len(r.nbest) == 2
    assert r.nbest[0].score >= r.nbest[1].score


def test_beam_larger_than_the_vocabulary(tiny, tiny_checkpoint):
    """K = 130 > V = 120: candidates run out before 2K; the runtime still equals the
    reference (same tokens, n-best lists and scores)."""
    from train.checkpoint import load_checkpoint
    from train.search import beam_search as reference

    V = tiny.engine.vocab_size
    K = V + 10
    texts = ["The dog runs.", "A man sits on a red car in the park.", "Big"]
    out = tiny.translate(texts, beam_size=K, nbest=K, max_len_b=6)
    model, tok, _ = load_checkpoint(tiny_checkpoint)
    ref = reference(model, [tok.encode_source(s) for s in texts], beam_size=K, nbest=K,
                    max_len_b=6)
    for r, hyps in zip(out, ref):
        assert len(r.nbest) == len(hyps) >= 1
        assert [n.token_ids for n in r.nbest] == [h.tokens for h in hyps]
        assert [n.score for n in r.nbest] == pytest.approx([h.normalized_score for h in hyps],
                                                            abs=1e-4)


def test_bad_options_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="beam_size"):
        tiny.translate(["a"], beam_size=0)
    with pytest.raises(ValueError, match="length penalty type"):
        tiny.translate(["a"], lp_type="linear")
    with pytest.raises(TypeError, match="list of strings"):
        tiny.translate("A dog.")
    with pytest.raises(ValueError, match="on_long"):
        tiny.translate(["a"], on_long="ignore")


# ---------------------------------------------------------------------------- packages


def test_load_refuses_what_is_not_a_package(tmp_path, tiny_package):
    with pytest.raises(PackageError, match="not found"):
        Translator.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackageError, match="neither"):
        Translator.load(tmp_path / "empty")
    with pytest.raises(ValueError, match="torch"):
        Translator.load(tiny_package, backend="torch")


_SLOW_COPYING_EXPORT = """
import os, shutil, sys, time
sys.modules['torch'] = None
import types
fake = types.ModuleType('export.package')
def export_package(checkpoint, out, force=False):  # stands in for the real (slow) exporter
    print('EXPORTED', flush=True)
    tmp = out.with_name('.' + out.name + '.tmp-' + str(os.getpid()))
    shutil.copytree({package!r}, tmp)
    time.sleep(1.0)
    os.replace(tmp, out)
fake.export_package = export_package
sys.modules['export.package'] = fake
from runtime.translator import cached_package, Translator
p = cached_package({checkpoint!r})
t = Translator.load({checkpoint!r}, backend='ort-cpu')
print('PATH', p, t.package.path)
"""


def test_cached_export_is_made_once_under_concurrency(tiny_checkpoint, tiny_package, tmp_path):
    """Two processes asking for the same checkpoint's package at once: one exports (under
    the lock file), the other waits, re-checks and reuses it; both load the same verified
    package. (The exporter is replaced by a slow copy of a real export: what is tested is
    the cache's locking; the real export path runs in the bundled_cache_home fixture.)"""
    code = _SLOW_COPYING_EXPORT.format(package=str(tiny_package), checkpoint=str(tiny_checkpoint))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    stdout = "".join(o for o, _ in outs)
    assert stdout.count("EXPORTED") == 1
    packages = tmp_path / "aiayn" / "packages"
    made = [d for d in packages.iterdir() if not d.name.startswith(".")]
    assert len(made) == 1 and len(made[0].name) == 12
    assert not [d for d in packages.iterdir() if ".tmp" in d.name]
    paths = {w for line in stdout.splitlines() if line.startswith("PATH") for w in line.split()[1:]}
    assert paths == {str(made[0])}


def test_damaged_cached_package_is_re_exported(tiny_checkpoint, tiny_package, tmp_path,
                                               monkeypatch):
    from conftest import seed_package_cache

    import export.package as ep
    from runtime.package import Package
    from runtime.translator import cached_package

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached = seed_package_cache(tmp_path, tiny_checkpoint, tiny_package)
    calls = []

    def copying_export(checkpoint, out, force=False):
        calls.append(force)
        assert not out.exists()  # the damaged entry was removed first
        shutil.copytree(tiny_package, out)

    monkeypatch.setattr(ep, "export_package", copying_export)
    assert cached_package(tiny_checkpoint) == cached and calls == []  # intact: reused
    (cached / "decoder.onnx").write_bytes(b"damaged")
    assert cached_package(tiny_checkpoint) == cached
    assert calls == [False]  # damaged: our own cache entry is removed and exported again
    Package.load(cached)  # verifies every sha256


def test_missing_export_extra_is_a_clear_message(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "export.package", None)
    from runtime.translator import cached_package

    with pytest.raises(PackageError, match=r"aiayn\[train,export\]"):
        cached_package(tiny_checkpoint)


def test_unwritable_cache_is_a_clear_message(tiny_checkpoint, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    from runtime.translator import cached_package

    with pytest.raises(PackageError, match="XDG_CACHE_HOME"):
        cached_package(tiny_checkpoint)


def test_load_translator_picks_torch_for_checkpoints(tiny_checkpoint, tiny_package, tmp_path,
                                                     monkeypatch):
    from conftest import seed_package_cache

    from runtime.translator import load_translator

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seed_package_cache(tmp_path, tiny_checkpoint, tiny_package)
    assert load_translator(tiny_checkpoint, "auto").backend == "torch"
    assert load_translator(tiny_package, "auto").backend == "ort-cpu"
    rt = load_translator(tiny_checkpoint, "ort-cpu")  # a checkpoint on a runtime backend
    assert rt.backend == "ort-cpu" and str(rt.package.path).startswith(str(tmp_path))
    with pytest.raises(BackendError, match="checkpoint"):
        load_translator(tiny_package, "torch")
    with pytest.raises(ValueError, match="unknown backend"):
        load_translator(tiny_package, "onnx")


def test_package_manifest_describes_the_backend(tiny):
    d = tiny.describe()
    assert d["backend"] == "ort-cpu" and d["providers"] == ["CPUExecutionProvider"]
    assert d["cache_dtype"] == "float32"
    json.dumps(d)

