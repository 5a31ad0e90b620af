"""The reference search follows DESIGN.md's specification (an independent, naive
implementation of the spec over full-prefix decoding is the check)."""

import math

import pytest
import torch

from runtime.contract import BOS_ID, EOS_ID, PAD_ID
from runtime.searchspec import Hypothesis, length_penalty, max_output_length, rank
from train.config import ModelConfig
from train.model import Transformer
from train.search import beam_search, greedy_search


def tiny(seed=0, vocab=30, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**dict(vocab_size=vocab, d_model=32, d_ff=64, h=4, encoder_layers=2,
                                decoder_layers=2, dropout=0.0, max_positions=64), **kw})
    m = Transformer(cfg).eval()
    with torch.no_grad():  # make EOS likely enough that hypotheses end at varied lengths
        m.embed.weight[EOS_ID] *= 3
    return m


def sources(seed=0, n=5, vocab=30):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 9, (1,), generator=g))
        out.append(torch.randint(4, vocab, (length,), generator=g).tolist() + [EOS_ID])
    return out


@torch.no_grad()
def naive_search(model, src, K, alpha=0.6, lp_type="gnmt", a=1.0, b=50):
    """The specification, literally: one sentence, full-prefix decoding, Python lists."""
    max_len = max_output_length(len(src), a, b, model.cfg.max_positions)
    V = model.cfg.vocab_size
    s = torch.tensor([src])
    memory = model.encode(s)
    alive = [([], 0.0)]  # (tokens, cumulative log-prob)
    finished = []
    for t in range(max_len):
        cands = []
        for row, (toks, score) in enumerate(alive):
            tgt = torch.tensor([[BOS_ID] + toks])
            lp = torch.log_softmax(model.decode(tgt, memory, s)[0, -1].float(), -1)
            lp[PAD_ID] = lp[BOS_ID] = -math.inf
            if t == max_len - 1:
                keep = lp[EOS_ID].item()
                lp[:] = -math.inf
                lp[EOS_ID] = keep
            total = (torch.tensor(score, dtype=torch.float32) + lp).tolist()
            cands += [(v, row * V + tok) for tok, v in enumerate(total) if v != -math.inf]
        cands.sort(key=lambda c: (-c[0], c[1]))
        cands = cands[:2 * K]
        new_alive = []
        for r, (v, flat) in enumerate(cands):
            row, tok = divmod(flat, V)
            if tok == EOS_ID:
                if r < K and len(finished) < K:
                    finished.append((alive[row][0], v))
                if len(finished) >= K:
                    break
            elif len(new_alive) < K:
                new_alive.append((alive[row][0] + [tok], v))
        if len(finished) >= K or not new_alive:
            break
        alive = new_alive
    hyps = [Hypothesis(toks, v, v / length_penalty(len(toks) + 1, alpha, lp_type))
            for toks, v in finished]
    return rank(hyps, K)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_search_equals_the_naive_specification(K, seed):
    m = tiny(seed)
    srcs = sources(seed)
    got = beam_search(m, srcs, beam_size=K, nbest=K, max_len_a=1.0, max_len_b=6)
    for src, hyps in zip(srcs, got):
        want = naive_search(m, src, K, a=1.0, b=6)
        assert [h.tokens for h in hyps] == [h.tokens for h in want]
        for h, w in zip(hyps, want):
            assert h.score == pytest.approx(w.score, abs=1e-4)


def test_beam_one_is_greedy():
    m = tiny(3)
    srcs = sources(3, n=6)
    beam1 = beam_search(m, srcs, beam_size=1, max_len_b=10)
    greedy = greedy_search(m, srcs, max_len_b=10)
    for src, b1, g in zip(srcs, beam1, greedy):
        # argmax decoding by hand over full prefixes
        toks = []
        with torch.no_grad():
            s = torch.tensor([src])
            mem = m.encode(s)
            for _ in range(max_output_length(len(src), 1, 10, 64) - 1):  # then EOS is forced
                lp = torch.log_softmax(m.decode(torch.tensor([[BOS_ID] + toks]), mem, s)[0, -1], -1)
                lp[PAD_ID] = lp[BOS_ID] = -math.inf
                nxt = int(lp.argmax())
                if nxt == EOS_ID:
                    break
                toks.append(nxt)
        assert b1[0].tokens == g[0].tokens == toks


def test_a_sentence_is_the_same_alone_and_in_a_padded_batch():
    m = tiny(4)
    srcs = sources(4, n=8)
    batch = beam_search(m, srcs, beam_size=4, nbest=4)
    for src, hyps in zip(srcs, batch):
        alone = beam_search(m, [src], beam_size=4, nbest=4)[0]
        assert [h.tokens for h in hyps] == [h.tokens for h in alone]
        assert [h.score for h in hyps] == pytest.approx([h.score for h in alone], abs=1e-5)


def test_nbest_is_sorted_by_normalized_score_and_bounded_by_beam():
    m = tiny(5)
    for hyps in beam_search(m, sources(5), beam_size=4, nbest=10, lp_type="power"):
        assert 1 <= len(hyps) <= 4
        scores = [h.normalized_score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        for h in hyps:
            assert h.normalized_score == pytest.approx(h.score / (len(h.tokens) + 1) ** 0.6)


def test_length_penalties_as_specified_and_a_ranking_where_they_disagree():
    assert length_penalty(4, 0.6, "gnmt") == pytest.approx(((5 + 4) / 6) ** 0.6)
    assert length_penalty(4, 0.6, "power") == pytest.approx(4 ** 0.6)
    assert length_penalty(7, 0.0, "gnmt") == 1.0
    short = Hypothesis([], -1.0, 0.0)  # len 1 (EOS only)
    long = Hypothesis([5, 6, 7, 8], -2.5, 0.0)  # len 5
    for lp_type, winner in (("gnmt", short), ("power", long)):
        for h in (short, long):
            h.normalized_score = h.score / length_penalty(h.length, 1.0, lp_type)
        # gnmt: -1/1 = -1.0 vs -2.5/(10/6) = -1.5; power: -1/1 = -1.0 vs -2.5/5 = -0.5
        assert rank([short, long], 2)[0] is winner
    with pytest.raises(ValueError, match="unknown length penalty"):
        length_penalty(3, 0.6, "linear")


def test_max_length_is_respected():
    m = tiny(6)
    with torch.no_grad():
        m.embed.weight[EOS_ID] *= -5  # EOS now unlikely: hypotheses run to the limit
    srcs = sources(6)
    for src, hyps in zip(srcs, beam_search(m, srcs, beam_size=3, nbest=3, max_len_a=0.5,
                                           max_len_b=2)):
        limit = max_output_length(len(src), 0.5, 2, 64)
        assert all(h.length <= limit for h in hyps)
        assert max(h.length for h in hyps) == limit
    # max_positions caps it too
    assert max_output_length(100, 1.0, 50, 64) == 64


def test_empty_source_gives_empty_translation_without_the_model():
    m = tiny(7)
    out = beam_search(m, [[], sources(7, 1)[0], []], beam_size=2)
    assert out[0][0].tokens == [] and out[0][0].score == 0.0
    assert out[2][0].tokens == []
    assert len(out[1][0].tokens) >= 0


def test_beam_larger_than_the_vocabulary_and_pad_bos_never_generated():
    m = tiny(8, vocab=6)
    for hyps in beam_search(m, [[4, 5, 3], [5, 3]], beam_size=8, nbest=8, max_len_b=3):
        assert hyps
        for h in hyps:
            assert PAD_ID not in h.tokens and BOS_ID not in h.tokens and EOS_ID not in h.tokens


def test_token_scores_and_attention_are_consistent():
    m = tiny(9)
    srcs = sources(9, n=3)
    for src, hyps in zip(srcs, beam_search(m, srcs, beam_size=3, nbest=3, return_attention=True,
                                           return_token_scores=True)):
        for h in hyps:
            assert len(h.token_scores) == h.length
            assert sum(h.token_scores) == pytest.approx(h.score, abs=1e-4)
            assert len(h.attention) == h.length and all(len(r) == len(src) for r in h.attention)
            assert all(sum(r) == pytest.approx(1.0, abs=1e-4) for r in h.attention)


def test_bad_options_are_refused():
    m = tiny()
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(m, [[4, 3]], beam_size=0)
    with pytest.raises(ValueError, match="lp_type|length penalty"):
        beam_search(m, [[4, 3]], lp_type="x")
    with pytest.raises(ValueError, match="max_positions"):
        beam_search(m, [[4] * 80 + [3]])
