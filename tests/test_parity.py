"""Parity: the runtime on the exported graphs translates like the PyTorch reference (DESIGN.md
parity rule), on real Multi30k sentences with the bundled model; and the mismatch
classification of export/parity.py tells near ties from real differences."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import BUNDLED  # noqa: E402

from export.parity import NEAR_TIE, TorchBackend, classify_mismatch, first_difference, main, parity  # noqa: E402
from runtime.backends.base import Backend, StepOutput  # noqa: E402
from runtime.contract import EOS_ID  # noqa: E402
from runtime.search import beam_search  # noqa: E402


def test_parity_on_200_multi30k_sentences_greedy_and_beam_4(bundled_package, multi30k_dir):
    """The CI parity check: 200 sentences of test_2016_flickr, greedy and beam 4, the bundled
    model's fp32 package on ort-cpu vs the checkpoint on the PyTorch reference."""
    report = parity(bundled_package, BUNDLED, multi30k_dir, "test_2016_flickr", beams=(1, 4),
                    limit=200, backend="ort-cpu")
    assert report["sentences"] == 200 and report["backend"] == "ort-cpu"
    assert report["ok"], json.dumps([r["mismatches"] for r in report["runs"]], indent=1)
    for run in report["runs"]:
        assert run["other"] == 0
        assert run["identical"] + run["near_tie"] == 200
        assert run["identical"] >= 196  # near ties are rare
        for m in run["mismatches"]:
            assert m["kind"] == "near_tie" and m["gap"] <= NEAR_TIE
        assert run["max_abs_logprob_diff"] < 1e-3  # fp32 graphs: numeric drift only
        assert run["max_abs_token_logprob_diff"] < 1e-3
        assert abs(run["reference"]["bleu"] - run["runtime"]["bleu"]) <= 0.5
        assert abs(run["reference"]["chrf"] - run["runtime"]["chrf"]) <= 0.5
    greedy, beam = report["runs"]
    assert greedy["beam"] == 1 and beam["beam"] == 4
    assert beam["runtime"]["bleu"] > 35  # the model card's 39.1 is on all 1000 sentences


def test_parity_cli_json(bundled_package, multi30k_dir, capsys):
    code = main(["parity", "--model", str(bundled_package), "--checkpoint", str(BUNDLED),
                 "--data", str(multi30k_dir), "--split", "test_2016_flickr", "--beam", "2",
                 "--limit", "12", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["beam"] for r in report["runs"]] == [2]
    assert report["runs"][0]["identical"] + report["runs"][0]["near_tie"] == 12
    assert report["reference_device"] == "cpu"  # the default


def test_parity_reference_device_auto_and_cuda(bundled_package, multi30k_dir, capsys):
    """--reference-device auto runs the reference on CUDA when there is one (else the CPU);
    asking for cuda without one is a one-line error (exit 2)."""
    args = ["parity", "--model", str(bundled_package), "--checkpoint", str(BUNDLED),
            "--data", str(multi30k_dir), "--beam", "1", "--limit", "3", "--json",
            "--backend", "ort-cpu"]
    assert main(args + ["--reference-device", "auto"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["reference_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert main(args + ["--reference-device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "reference device cuda is not available" in err and "Traceback" not in err


def test_parity_refuses_a_package_of_another_checkpoint(bundled_package, tiny_checkpoint,
                                                        multi30k_dir, capsys):
    code = main(["parity", "--model", str(bundled_package), "--checkpoint", str(tiny_checkpoint),
                 "--data", str(multi30k_dir), "--limit", "2"])
    assert code == 2
    assert "was exported from a checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------- classification


class Nudged(Backend):
    """A stand-in for a second implementation: the reference's step with ``delta`` added to
    token ``token``'s log-prob (top-k recomputed from the nudged row)."""

    name = "nudged"

    def __init__(self, inner: Backend, token: int, delta: float):
        super().__init__(inner.config)
        self.inner, self.token, self.delta = inner, token, np.float32(delta)

    def encode(self, src_ids):
        return self.inner.encode(src_ids)

    def select(self, encoded, rows):
        return self.inner.select(encoded, rows)

    def step(self, tokens, step, cache, beam_origin, cross, topk):
        out = self.inner.step(tokens, step, cache, beam_origin, cross, topk)
        lp = out.log_probs().copy()
        lp[:, self.token] += self.delta
        ids = np.argsort(-lp, axis=1, kind="stable")[:, :topk]
        return StepOutput(np.take_along_axis(lp, ids, 1), ids, out.cache,
                          _log_probs=lambda: lp, _cross_attn=out.cross_attn)


def _tie_model():
    from train.config import ModelConfig
    from train.model import Transformer

    torch.manual_seed(8)
    cfg = ModelConfig(vocab_size=40, d_model=32, d_ff=64, h=4, encoder_layers=2,
                      decoder_layers=2, dropout=0.0, max_positions=64)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        m.embed.weight[EOS_ID] *= 3
    return m


def _first_token_pair(m, src, K):
    """(x, y) with y > x such that x is in the reference output; after tying y to x the
    two are exact ties everywhere (the reference keeps x: lower id)."""
    out = beam_search(TorchBackend(m), [src], beam_size=K, max_len_b=8)[0][0].tokens
    x = out[0]
    y = next(t for t in range(39, x, -1) if t not in src and t not in out)
    with torch.no_grad():
        m.embed.weight[y] = m.embed.weight[x]
    return x, y


@pytest.mark.parametrize("K", [1, 3])
def test_a_flipped_exact_tie_is_a_near_tie_found_by_the_trace(K):
    m = _tie_model()
    src = [5, 9, 12, 20, EOS_ID]
    x, y = _first_token_pair(m, src, K)
    ref = beam_search(TorchBackend(m), [src], beam_size=K, max_len_b=8)[0][0].tokens
    rt_engine = Nudged(TorchBackend(m), y, 1e-6)  # prefers y where the reference took x
    rt = beam_search(rt_engine, [src], beam_size=K, max_len_b=8)[0][0].tokens
    assert ref != rt and x in ref and y in rt
    info = classify_mismatch(m, rt_engine, src, ref, rt, beam_size=K, max_len_b=8)
    assert info["kind"] == "near_tie" and info["method"] == "trace"
    assert info["gap"] == 0.0
    assert info["position"] == first_difference(ref, rt) == ref.index(x)
    if K == 1:  # greedy: the searches diverge where the outputs do
        assert info["step"] == info["position"]
    else:  # both x and y fit in the beam at first; their extensions compete a step later
        assert info["step"] >= info["position"]


def test_a_real_difference_is_another_mismatch():
    m = _tie_model()
    src = [5, 9, 12, 20, EOS_ID]
    ref = beam_search(TorchBackend(m), [src], beam_size=2, max_len_b=8)[0][0].tokens
    z = next(t for t in range(4, 40) if t not in ref)
    rt_engine = Nudged(TorchBackend(m), z, 3.0)  # a bug: z boosted by 3 nats
    rt = beam_search(rt_engine, [src], beam_size=2, max_len_b=8)[0][0].tokens
    assert rt != ref
    info = classify_mismatch(m, rt_engine, src, ref, rt, beam_size=2, max_len_b=8)
    assert info["kind"] == "other" and info["method"] == "trace" and info["gap"] > 0.01
    assert info["step"] == 0


def test_when_a_rerun_does_not_reproduce_teacher_forcing_decides():
    m = _tie_model()
    src = [5, 9, 12, 20, EOS_ID]
    x, y = _first_token_pair(m, src, 1)
    ref = beam_search(TorchBackend(m), [src], beam_size=1, max_len_b=8)[0][0].tokens
    swapped = [y if t == x else t for t in ref]  # as if the runtime broke the tie the other way
    info = classify_mismatch(m, TorchBackend(m), src, ref, swapped, beam_size=1, max_len_b=8)
    assert info["method"] == "teacher_forcing" and info["kind"] == "near_tie"
    assert info["gap"] < 1e-5
    other = classify_mismatch(m, TorchBackend(m), src, ref, ref[:1] + [4] + ref[1:],
                              beam_size=1, max_len_b=8)
    assert other["kind"] == "other" and other["position"] == 1
