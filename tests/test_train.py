"""Training: loss, schedule, data, checkpoints, resume, memorization, DDP (CPU)."""

import gzip
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from runtime.corpus import default_data_dir, read_parallel
from runtime.errors import CheckpointError, CorpusError
from train.checkpoint import list_checkpoints, load_checkpoint, load_train_state, save_checkpoint
from train.config import ModelConfig
from train.data import load_split, make_batches
from train.model import Transformer
from train.search import beam_search
from train.trainer import TrainConfig, Trainer, label_smoothed_loss, learning_rate

REPO = Path(__file__).resolve().parents[1]
DATA = default_data_dir()
needs_data = pytest.mark.skipif(not (DATA / "train.en.gz").is_file(),
                                reason=f"Multi30k not found at {DATA} (set AIAYN_DATA)")
TINY = dict(d_model=32, d_ff=64, h=4, encoder_layers=1, decoder_layers=1, dropout=0.1)


def write_corpus(folder: Path, pairs, split="train", gz=False):
    folder.mkdir(parents=True, exist_ok=True)
    for side, lang in ((0, "en"), (1, "de")):
        text = "".join(p[side] + "\n" for p in pairs)
        if gz:
            with gzip.open(folder / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write(text)
        else:
            (folder / f"{split}.{lang}").write_text(text, encoding="utf-8")


SYNTH = [(f"a {w} dog runs {i}", f"ein {w} hund läuft {i}") for i, w in
         enumerate(["big", "small", "red", "blue", "old", "young", "happy", "sad"] * 8)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_corpus(d, SYNTH, "train")
    write_corpus(d, SYNTH[:8], "val", gz=True)
    return d


def tiny_cfg(corpus, out, **kw):
    base = dict(data=str(corpus), out=str(out), vocab_size=60, epochs=3, max_tokens=64,
                warmup_steps=10, model_overrides=TINY, progress=False, valid_bleu=False,
                log_every=1, keep_last=3)
    return TrainConfig(**{**base, **kw})


# ---- loss and schedule ----------------------------------------------------------------------

def test_label_smoothed_loss_equals_a_hand_computed_value():
    logits = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.0, 2.0]]])
    target = torch.tensor([[2, 0]])  # second token is PAD: ignored
    eps, V = 0.1, 4
    z = [1.0, 2.0, 3.0, 4.0]
    logZ = math.log(sum(math.exp(x) for x in z))
    logp = [x - logZ for x in z]
    want = -(1 - eps) * logp[2] - eps / V * sum(logp)
    loss, nll = label_smoothed_loss(logits, target, eps)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert nll.item() == pytest.approx(-logp[2], rel=1e-6)


def test_schedule_equals_eq3():
    d, w = 512, 4000
    assert learning_rate(1, d, w) == pytest.approx(d ** -0.5 * 1 * w ** -1.5)
    assert learning_rate(w, d, w) == pytest.approx(d ** -0.5 * w ** -0.5)
    assert learning_rate(10 * w, d, w) == pytest.approx(d ** -0.5 * (10 * w) ** -0.5)
    assert learning_rate(w, d, w) > learning_rate(w - 100, d, w)  # peak at warmup
    assert learning_rate(w, d, w) > learning_rate(w + 100, d, w)


# ---- data -----------------------------------------------------------------------------------

def test_readers_plain_and_gzip_and_mismatched_counts(tmp_path):
    write_corpus(tmp_path, SYNTH[:5], "a")
    write_corpus(tmp_path, SYNTH[:5], "b", gz=True)
    assert read_parallel(tmp_path, "a", "en", "de") == read_parallel(tmp_path, "b", "en", "de")
    (tmp_path / "a.de").write_text("one\ntwo\n")
    with pytest.raises(CorpusError, match=r"a\.en has 5 lines.*a\.de has 2"):
        read_parallel(tmp_path, "a", "en", "de")
    with pytest.raises(CorpusError, match="expected .*c.en or .*c.en.gz"):
        read_parallel(tmp_path, "c", "en", "de")


def test_filtering_and_token_batches(tmp_path, corpus):
    from runtime.tokenizer import train_tokenizer

    tok = train_tokenizer([p[0] for p in SYNTH] + [p[1] for p in SYNTH], tmp_path / "spm.model", 60)
    pairs = SYNTH[:20] + [("", "leer"), ("x " * 40, "y")]
    write_corpus(tmp_path, pairs, "f")
    data, report = load_split(tmp_path, "f", "en", "de", tok, max_len=30)
    assert (report.total, report.kept, report.empty, report.too_long) == (22, 20, 1, 1)
    batches = make_batches(data, max_tokens=40, seed=3)
    assert sorted(i for b in batches for i in b) == list(range(20))  # each pair once
    for b in batches:
        longest = max(max(len(data.src[i]), len(data.tgt[i]) + 1) for i in b)
        assert len(b) == 1 or longest * len(b) <= 40
    assert batches == make_batches(data, 40, seed=3)  # seeded: reproducible
    assert batches != make_batches(data, 40, seed=4)  # a new order per epoch seed


# ---- checkpoints ----------------------------------------------------------------------------

def test_checkpoint_round_trip_is_bit_exact(tmp_path, corpus):
    tr = Trainer(tiny_cfg(corpus, tmp_path / "run", max_steps=2))
    tr.train()
    ckpt = list_checkpoints(tmp_path / "run")[-1]
    model, tok, _ = load_checkpoint(ckpt)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    state = load_train_state(ckpt)
    assert state["step"] == 2
    for a, b in zip(tr.optimizer.state_dict()["state"].values(), state["optimizer"]["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert tok.vocab_size == model.cfg.vocab_size


def _losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["event"] == "train":
            out[r["step"]] = r["loss"]
    return out


def test_resumed_run_gives_the_same_next_step_loss(tmp_path, corpus):
    Trainer(tiny_cfg(corpus, tmp_path / "full", max_steps=6)).train()
    Trainer(tiny_cfg(corpus, tmp_path / "cut", max_steps=3)).train()  # "interrupted" at step 3
    data, _ = load_split(corpus, "train", "en", "de", _tok(tmp_path / "cut"), 256)
    assert len(make_batches(data, 64, seed=2)) > 3  # step 3 is mid-epoch
    resumed = tiny_cfg(corpus, tmp_path / "cut", max_steps=6)
    Trainer(resumed, resume=True).train()
    full, cut = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
    assert cut[4] == full[4] and cut[6] == full[6]  # dropout RNG, batches, optimizer restored


def _tok(run):
    from runtime.tokenizer import Tokenizer

    return Tokenizer(run / "spm.model")


def test_checkpoint_write_killed_midway_leaves_the_previous_one_loadable(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(tiny_cfg(corpus, run, max_steps=1)).train()
    ckpt = list_checkpoints(run)[-1]
    before = load_checkpoint(ckpt)[0].state_dict()
    child = textwrap.dedent(f"""
        import sys, time
        import torch
        import train.checkpoint as C
        from train.model import Transformer
        model, tok, ckpt = C.load_checkpoint({str(ckpt)!r})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        def slow_save(state, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"partial")
                f.flush()
            print("WRITING", flush=True)
            time.sleep(120)
        C.save_file = slow_save
        # overwrite the same checkpoint and write a new one: both killed midway
        C.save_checkpoint(ckpt, model, tok.path)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    assert proc.stdout.readline().strip() == "WRITING"
    proc.kill()
    proc.wait(timeout=30)
    assert list_checkpoints(run) == [ckpt]
    model, _, _ = load_checkpoint(ckpt)  # checksums verified, weights intact
    for k, v in before.items():
        assert torch.equal(v, model.state_dict()[k])
    # the next save cleans up the abandoned temp folder
    save_checkpoint(ckpt, model, ckpt / "spm.model")
    assert not any(p.name.endswith(".tmp") for p in (run / "checkpoints").iterdir())


def test_tampered_checkpoint_is_refused(tmp_path, corpus):
    run = tmp_path / "run"
    Trainer(tiny_cfg(corpus, run, max_steps=1)).train()
    ckpt = list_checkpoints(run)[-1]
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="checksum mismatch.*model.safetensors"):
        load_checkpoint(ckpt)


def test_average_of_checkpoints(tmp_path, corpus):
    from train.checkpoint import average_checkpoints

    run = tmp_path / "run"
    Trainer(tiny_cfg(corpus, run, max_steps=3, save_every=1)).train()
    ckpts = list_checkpoints(run)
    assert len(ckpts) == 3
    avg, _, _ = load_checkpoint(average_checkpoints(ckpts, tmp_path / "avg"))
    models = [load_checkpoint(c)[0].state_dict() for c in ckpts]
    for k, v in avg.state_dict().items():
        assert torch.allclose(v, sum(m[k] for m in models) / 3, atol=1e-6)


# ---- learning -------------------------------------------------------------------------------

@needs_data
def test_small_model_memorizes_64_real_pairs(tmp_path):
    src, tgt = read_parallel(DATA, "train", "en", "de")
    write_corpus(tmp_path / "mem", list(zip(src[:64], tgt[:64])))
    cfg = TrainConfig(data=str(tmp_path / "mem"), out=str(tmp_path / "run"), valid_split="",
                      vocab_size=400, epochs=200, max_steps=400, max_tokens=600,
                      warmup_steps=60, lr_scale=0.5, progress=False, keep_last=1,
                      model_overrides=dict(d_model=64, d_ff=256, h=4, encoder_layers=2,
                                           decoder_layers=2, dropout=0.0))
    tr = Trainer(cfg)
    tr.train()
    data = tr.train_data
    hyps = beam_search(tr.model.eval(), [s.tolist() for s in data.src], beam_size=1)
    exact = sum(h[0].tokens == t.tolist() for h, t in zip(hyps, data.tgt))
    assert exact >= 48, f"only {exact}/64 reproduced exactly"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_follows_the_one_process_trajectory(tmp_path, corpus):
    common = ["train", "--data", str(corpus), "--vocab-size", "60", "--max-tokens", "48",
              "--max-steps", "5", "--log-every", "1", "--no-progress", "--valid-split", "",
              "--dropout", "0", "--warmup-steps", "4", "--set", "d_model=32", "--set", "d_ff=64",
              "--set", "h=4", "--set", "encoder_layers=1", "--set", "decoder_layers=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "runtime.dispatch", *common, "--out",
                          str(tmp_path / "one"), "--update-freq", "2"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(_free_port()), "-m", "runtime.dispatch", *common,
                          "--out", str(tmp_path / "two")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    assert a[5] < a[1]  # and it is learning


# ---- the paper's dims ------------------------------------------------------------------------

def test_multi30k_preset_is_small_enough_to_ship():
    m = Transformer(ModelConfig.from_dict({**ModelConfig().to_dict(), "d_model": 256,
                                           "d_ff": 1024, "h": 4, "encoder_layers": 3,
                                           "decoder_layers": 3}))
    assert m.num_parameters() * 2 < 20e6  # fp16 weights fit the 20 MB budget
