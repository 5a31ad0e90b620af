"""The model is the paper's: positions (§3.5), causality, padding, and step == decode."""

import math

import pytest
import torch

from train.config import ConfigError, ModelConfig, preset
from train.model import Transformer, sinusoidal_positions

TOL = 1e-5


def tiny(seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**dict(vocab_size=40, d_model=32, d_ff=64, h=4, encoder_layers=2,
                                decoder_layers=2, dropout=0.0, max_positions=64), **kw})
    return Transformer(cfg).eval()


def test_positional_encoding_equals_the_formula():
    pe = sinusoidal_positions(50, 16)
    assert pe[0].tolist() == [0.0, 1.0] * 8  # position 0 is [0, 1, 0, 1, ...]
    for pos in (1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_embeddings_are_scaled_and_tied():
    m = tiny()
    assert m.embed_scale == pytest.approx(math.sqrt(32))
    x = torch.randn(3, 32)
    assert torch.equal(m.logits(x), x @ m.embed.weight.T)  # pre-softmax shares the embedding


def test_changing_a_future_target_token_changes_no_earlier_logit():
    m = tiny()
    src = torch.tensor([[5, 6, 7, 8, 3]])
    tgt = torch.tensor([[2, 9, 10, 11, 12, 13]])
    with torch.no_grad():
        a = m(src, tgt)
        for t in range(1, tgt.shape[1]):
            changed = tgt.clone()
            changed[0, t] = 20
            b = m(src, changed)
            assert torch.allclose(a[0, :t], b[0, :t], atol=1e-6), t  # positions < t unchanged
            assert not torch.allclose(a[0, t:], b[0, t:], atol=1e-6)  # and it does matter later


def test_padding_a_source_changes_no_output():
    m = tiny()
    src = torch.tensor([[5, 6, 7, 3]])
    padded = torch.tensor([[5, 6, 7, 3, 0, 0, 0]])
    tgt = torch.tensor([[2, 9, 10, 11]])
    with torch.no_grad():
        assert torch.allclose(m(src, tgt), m(padded, tgt), atol=TOL)
        # and in a batch with a longer sentence
        batch = torch.tensor([[5, 6, 7, 3, 0, 0, 0], [8, 9, 10, 11, 12, 13, 3]])
        out = m(batch, tgt.expand(2, -1))
        assert torch.allclose(out[0], m(src, tgt)[0], atol=TOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_step_one_token_at_a_time_reproduces_decode(seed):
    m = tiny(seed)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 40, (3, 9), generator=g)
    src[:, -1] = 3
    src[1, 5:] = 0
    src[1, 4] = 3
    tgt = torch.randint(4, 40, (3, 12), generator=g)
    tgt[:, 0] = 2
    with torch.no_grad():
        full = torch.log_softmax(m(src, tgt), dim=-1)  # (B, T, V)
        cross_k, cross_v, mask = m.encode_for_step(src)
        past_k, past_v = m.empty_cache(3)
        origin = torch.arange(3)
        for t in range(tgt.shape[1]):
            lp, past_k, past_v, attn = m.step(tgt[:, t], t, past_k, past_v, origin, cross_k,
                                              cross_v, mask)
            assert (lp - full[:, t]).abs().max().item() <= TOL, t
            assert past_k.shape == (2, 3, 4, t + 1, 8)
            assert torch.allclose(attn.sum(-1), torch.ones(3), atol=1e-5)
            assert attn[1, 5:].abs().max().item() == 0.0  # padding gets no attention


def test_step_reorders_the_cache_with_beam_origin():
    m = tiny()
    src = torch.tensor([[5, 6, 3], [7, 8, 3]])
    with torch.no_grad():
        ck, cv, mask = m.encode_for_step(src)
        pk, pv = m.empty_cache(2)
        _, pk, pv, _ = m.step(torch.tensor([2, 2]), 0, pk, pv, torch.arange(2), ck, cv, mask)
        swap = torch.tensor([1, 0])
        a = m.step(torch.tensor([9, 9]), 1, pk, pv, swap, ck, cv, mask)[0]
        b = m.step(torch.tensor([9, 9]), 1, pk[:, swap], pv[:, swap], torch.arange(2), ck, cv,
                   mask)[0]
        assert torch.equal(a, b)


def test_config_round_trip_and_errors(tmp_path):
    cfg = preset("base", vocab_size=37000)
    assert (cfg.d_model, cfg.d_ff, cfg.h, cfg.encoder_layers, cfg.d_k) == (512, 2048, 8, 6, 64)
    assert preset("big").d_model == 1024 and preset("big").h == 16
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    with pytest.raises(ConfigError, match="unknown config key.*d_modle"):
        ModelConfig.from_dict({**cfg.to_dict(), "d_modle": 3})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match="divisible"):
        ModelConfig(d_model=30, h=4)


def test_parameter_count_matches_the_paper():
    # Table 3: base ~65M parameters with a 37000-token shared vocabulary.
    m = Transformer(preset("base", vocab_size=37000))
    assert 60e6 < m.num_parameters() < 66e6
