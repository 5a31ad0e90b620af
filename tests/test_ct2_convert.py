"""bench/ct2_convert.py: our weights in CTranslate2's TransformerSpec compute our model, and
CTranslate2's search, with the option mapping ``ct2_search_options`` documents, returns the
reference search's output (greedy; beam under ``lp_type="power"``).

Levels (STYLE.md): per-token log-probs (allclose 1e-4) of a tiny random model; token ids
(exact) of greedy and beam search on the tiny model and on the bundled model.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

ctranslate2 = pytest.importorskip(
    "ctranslate2", reason="ctranslate2 is not installed (pip install ctranslate2; aiayn[dev])")
torch = pytest.importorskip("torch")

from runtime.contract import BOS_ID, EOS_ID  # noqa: E402
from runtime.searchspec import max_output_length  # noqa: E402
from train.checkpoint import load_checkpoint  # noqa: E402
from train.search import beam_search  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "multi30k-en-de"


def _load_bench_module():
    spec = importlib.util.spec_from_file_location("ct2_convert", REPO / "bench" / "ct2_convert.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("ct2_convert", module)
    spec.loader.exec_module(module)
    return module


ct2c = _load_bench_module()


_WORDS = ["the", "a", "man", "woman", "dog", "cat", "child", "runs", "sits", "stands", "on",
          "in", "at", "near", "with", "red", "blue", "green", "big", "small", "old", "young",
          "park", "street", "house", "car", "ball", "water", "grass", "beach"]


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 10))).capitalize() + "."
            for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random 2+2-layer d_model=32 model over a 120-piece sentencepiece vocabulary, EOS's
    tied embedding enlarged so that hypotheses end at varied lengths."""
    from runtime.tokenizer import train_tokenizer
    from train.checkpoint import save_checkpoint
    from train.config import ModelConfig
    from train.model import Transformer

    root = tmp_path_factory.mktemp("ct2_tiny")
    tok = train_tokenizer(_sentences(400, 0), root / "spm.model", vocab_size=120, num_threads=1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=32, d_ff=64, h=4,
                                    encoder_layers=2, decoder_layers=2, dropout=0.0,
                                    max_positions=64)).eval()
    with torch.no_grad():
        model.embed.weight[EOS_ID] *= 3.0
    return save_checkpoint(root / "ckpt", model, root / "spm.model")


@pytest.fixture(scope="module")
def tiny(tiny_ckpt, tmp_path_factory):
    """(model, tokenizer, CT2Translator) of the tiny checkpoint."""
    out = ct2c.convert_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("ct2") / "tiny")
    model, tokenizer, _ = load_checkpoint(tiny_ckpt)
    return model, tokenizer, ct2c.CT2Translator.load(out, threads=1)


def _sources(tokenizer, n=12, seed=3):
    return [tokenizer.encode_source(s) for s in _sentences(n, seed)]


def test_tiny_log_probs_match(tiny):
    """CTranslate2's forced-decoding log-probs equal our model's (positions, scaling, fused
    q/k/v, post-LN, tied projection): the spec mapping is exact."""
    model, tokenizer, ct2 = tiny
    g = torch.Generator().manual_seed(0)
    srcs = _sources(tokenizer, 6)
    tgts = [torch.randint(4, model.cfg.vocab_size, (int(torch.randint(1, 20, (1,), generator=g)),),
                          generator=g).tolist() for _ in srcs]
    got = ct2.translator.score_batch([tokenizer.pieces(s) for s in srcs],
                                     [tokenizer.pieces(t) for t in tgts])
    for s, t, r in zip(srcs, tgts, got):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([s]), torch.tensor([[BOS_ID] + t])), -1)[0]
        ours = lp[torch.arange(len(t) + 1), torch.tensor(t + [EOS_ID])]
        torch.testing.assert_close(torch.tensor(r.log_probs), ours, atol=1e-4, rtol=0)


def test_tiny_greedy_matches(tiny):
    """Greedy: token-identical, except that at the max length CTranslate2 stops without EOS
    where our spec forces EOS (documented in ct2_search_options); then ours is CTranslate2's
    output minus its last token. One call per sentence, so both use the same limit."""
    model, tokenizer, _ = tiny
    ct2 = ct2c.CT2Translator(tiny[2].translator, tokenizer, model.cfg.max_positions,
                             suppress_special=True)  # exact for greedy: argmax unchanged
    ended = 0
    for src in _sources(tokenizer, 12):
        ref = beam_search(model, [src], beam_size=1, max_len_b=12)[0][0]
        got = ct2.search([src], beam_size=1, length_penalty=0.6, max_len_b=12)[0][0]
        limit = max_output_length(len(src), 1.0, 12, model.cfg.max_positions)
        if len(ref.tokens) + 1 < limit:
            ended += 1
            assert got.tokens == ref.tokens  # (scores differ: masking before the softmax
        else:                                 # renormalizes, ours masks after it)
            assert got.tokens[:len(ref.tokens)] == ref.tokens and len(got.tokens) == limit
    assert ended >= 3, "too few hypotheses ended before the limit for the test to mean much"


def test_tiny_beam_power_matches(tiny):
    """Beam 4 with lp power: token-identical with the same normalized scores."""
    model, tokenizer, ct2 = tiny
    srcs = _sources(tokenizer, 10, seed=5)
    refs = beam_search(model, srcs, beam_size=4, length_penalty=0.6, lp_type="power")
    for src, ref in zip(srcs, refs):
        got = ct2.search([src], beam_size=4, length_penalty=0.6, lp_type="power")[0][0]
        assert got.tokens == ref[0].tokens
        assert got.normalized_score == pytest.approx(ref[0].normalized_score, abs=1e-4)
    assert ct2.stats == {"no_eos": 0, "special": 0}


@pytest.mark.skipif(not (BUNDLED / "model.safetensors").is_file(),
                    reason=f"the bundled model is absent ({BUNDLED})")
def test_bundled_greedy_and_beam_match(tmp_path):
    """The bundled model on real sentences (batched, as the benchmark runs it)."""
    out = ct2c.convert_checkpoint(BUNDLED, tmp_path / "ct2")
    model, tokenizer, _ = load_checkpoint(BUNDLED)
    ct2 = ct2c.CT2Translator.load(out, threads=1)
    texts = ["A man in an orange hat starring at something.",
             "A Boston Terrier is running on lush green grass in front of a white fence.",
             "A girl in karate uniform breaking a stick with a front kick.",
             "Five people wearing winter jackets and helmets stand in the snow.",
             "People are fixing the roof of a house.", ""]
    srcs = [tokenizer.encode_source(t) for t in texts]
    for K in (1, 4):
        refs = beam_search(model, srcs, beam_size=K, length_penalty=0.6, lp_type="power")
        gots = ct2.search(srcs, beam_size=K, length_penalty=0.6, lp_type="power")
        for ref, got in zip(refs, gots):
            assert got[0].tokens == ref[0].tokens
            assert got[0].normalized_score == pytest.approx(ref[0].normalized_score, abs=1e-4)
    assert ct2.translate(texts[:2])[0].text == tokenizer.decode(refs[0][0].tokens)
    assert ct2.translate(texts)[-1].text == ""


def test_search_options_mapping():
    opts = ct2c.ct2_search_options(4, 0.6, "power", max_len=30)
    assert opts["min_decoding_length"] == 0  # our spec allows EOS at step 0
    assert opts["return_end_token"] is True  # len counts EOS, as ours does
    assert opts["max_decoding_length"] == 30 and opts["patience"] == 1.0
    assert opts["max_input_length"] == 0 and "suppress_sequences" not in opts
    with pytest.raises(ValueError, match="power"):
        ct2c.ct2_search_options(4, 0.6, "gnmt", max_len=30)


def test_convert_refuses_to_overwrite(tiny_ckpt, tmp_path):
    out = tmp_path / "ct2"
    out.mkdir()
    with pytest.raises(FileExistsError, match="force"):
        ct2c.convert_checkpoint(tiny_ckpt, out)
    ct2c.convert_checkpoint(tiny_ckpt, out, force=True)
    assert (out / "model.bin").is_file() and (out / ct2c.TOKENIZER_FILE).is_file()
