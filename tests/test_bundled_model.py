"""The bundled default model: checksums verified on load, tampering refused, and real BLEU."""

import json
import shutil
from pathlib import Path

import pytest

from runtime.cli_common import BUNDLED_MODEL, default_model
from runtime.corpus import default_data_dir, read_parallel
from runtime.errors import CheckpointError
from train.checkpoint import checkpoint_info, load_checkpoint
from train.translator import TorchTranslator

DATA = default_data_dir()
CARD_BLEU = 39.1  # MODEL_CARD.md: test_2016_flickr, beam 4, alpha 0.6
FLOOR = CARD_BLEU - 4.0  # the first 100 sentences score 36.6 (a harder-than-average slice)


def test_bundled_model_is_the_default_and_small(monkeypatch):
    monkeypatch.delenv("AIAYN_MODEL", raising=False)
    assert default_model() == BUNDLED_MODEL
    monkeypatch.setenv("AIAYN_MODEL", "/somewhere/else")
    assert default_model() == Path("/somewhere/else")
    size = sum(p.stat().st_size for p in BUNDLED_MODEL.iterdir())
    assert size < 20e6
    card = (BUNDLED_MODEL / "MODEL_CARD.md").read_text()
    assert f"{CARD_BLEU}" in card and "nrefs:1|case:mixed|eff:no|tok:13a" in card


def test_loads_with_checksums_verified():
    info = checkpoint_info(BUNDLED_MODEL)
    assert info["checksums"] == "verified"
    assert info["config"]["d_model"] == 256 and info["dtype"] == "float16"
    listed = json.loads((BUNDLED_MODEL / "checksums.json").read_text())["sha256"]
    assert {"model.safetensors", "config.json", "spm.model"} <= set(listed)


@pytest.mark.parametrize("victim", ["model.safetensors", "spm.model", "config.json"])
def test_a_tampered_file_is_refused(tmp_path, victim):
    copy = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, copy)
    data = bytearray((copy / victim).read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / victim).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checksum mismatch for .*{victim}"):
        load_checkpoint(copy)


@pytest.mark.skipif(not (DATA / "test_2016_flickr.en.gz").is_file(),
                    reason=f"Multi30k not found at {DATA} (set AIAYN_DATA)")
def test_bleu_on_the_first_100_test_sentences_is_above_the_floor():
    import sacrebleu

    src, ref = read_parallel(DATA, "test_2016_flickr", "en", "de")
    translator = TorchTranslator.load(BUNDLED_MODEL, device="cpu")
    out = [t.text for t in translator.translate(src[:100], beam_size=4, length_penalty=0.6)]
    bleu = sacrebleu.corpus_bleu(out, [ref[:100]]).score
    assert bleu > FLOOR, f"BLEU {bleu:.2f} <= floor {FLOOR}"
    assert out[0] and all(isinstance(o, str) for o in out)
