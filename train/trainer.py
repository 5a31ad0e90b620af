"""The training loop: the paper's recipe (§5) on token-count batches, one or many processes.

Label-smoothed cross entropy (ε_ls = 0.1, §5.4) over non-pad target tokens; Adam with
β1 = 0.9, β2 = 0.98, ε = 1e-9 and the learning rate of eq. 3; dropout per §5.4; gradient
accumulation (``update_freq``); bf16 autocast on CUDA; DDP through ``torchrun`` (gloo on CPU,
nccl on GPU) where every rank takes its share of the same global batch, and the loss is
normalized by the global target-token count so N processes follow one process's trajectory.
Each epoch ends with validation loss, perplexity and BLEU (sacreBLEU, with its signature)
from the reference search, a JSON-lines metrics record and an atomic checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from runtime.contract import PAD_ID
from runtime.errors import AiaynError, CheckpointError
from runtime.tokenizer import Tokenizer, train_tokenizer

from .checkpoint import (
    CHECKPOINTS_DIR,
    STEP_PREFIX,
    list_checkpoints,
    load_train_state,
    load_weights,
    save_checkpoint,
)
from .config import PRESET_TRAINING, ConfigError, atomic_write_text, preset
from .data import ParallelData, collate, load_split, make_batches
from .model import Transformer
from .search import beam_search

RUN_CONFIG = "train_config.json"
RUN_TOKENIZER = "spm.model"
METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    """Everything a training run needs besides the model dims; saved as train_config.json.

    Units: ``max_tokens`` padded tokens per side per micro-batch per process;
    ``warmup_steps``, ``max_steps``, ``save_every`` in optimizer updates.
    """

    data: str
    out: str
    src: str = "en"
    tgt: str = "de"
    preset: str = "multi30k"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    train_split: str = "train"
    valid_split: str = "val"
    vocab_size: int = 8000
    tokenizer_type: str = "bpe"
    tokenizer: str | None = None  # reuse this sentencepiece model instead of training one
    epochs: int = 30
    max_steps: int | None = None
    max_time: float | None = None  # stop (and checkpoint) after this many seconds of training
    max_tokens: int | None = None  # default: the preset's
    update_freq: int = 1
    warmup_steps: int | None = None  # default: the preset's
    lr_scale: float = 1.0  # multiplies eq. 3 (1.0 = the paper)
    label_smoothing: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    clip_norm: float = 0.0  # 0 = no clipping (the paper clips nothing)
    seed: int = 1
    keep_last: int = 5
    save_every: int = 0  # also checkpoint every N updates (0 = at epoch ends only)
    valid_bleu: bool = True
    valid_bleu_every: int = 1  # BLEU every N epochs (and at the last); loss every epoch
    valid_beam: int = 4
    valid_alpha: float = 0.6
    valid_max_sentences: int | None = None
    log_every: int = 50
    device: str = "auto"
    bf16: bool = True  # autocast to bf16 on CUDA
    progress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESET_TRAINING:
            preset(self.preset)  # raises ConfigError with the choices
        defaults = PRESET_TRAINING[self.preset]
        if self.max_tokens is None:
            self.max_tokens = defaults["max_tokens"]
        if self.warmup_steps is None:
            self.warmup_steps = defaults["warmup_steps"]
        self.adam_betas = tuple(self.adam_betas)
        for name in ("epochs", "max_tokens", "update_freq", "warmup_steps", "keep_last"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.max_time is not None and not self.max_time > 0:
            raise ConfigError(f"max_time must be > 0 seconds, got {self.max_time}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown training option(s) {', '.join(unknown)}")
        return cls(**data)


def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """Eq. 3: lr = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), step >= 1."""
    step = max(step, 1)
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Label-smoothed cross entropy (Szegedy et al. 2016; §5.4), summed over non-PAD tokens.

    ``logits`` (..., V), ``target`` int64 (...). The smoothed target puts 1 - ε on the gold
    token and ε / V on every token (torch's ``label_smoothing``). Returns (loss_sum, nll_sum),
    float32 scalars; nll is the unsmoothed negative log-likelihood, for perplexity.
    """
    logits = logits.reshape(-1, logits.shape[-1]).float()
    target = target.reshape(-1)
    loss = F.cross_entropy(logits, target, ignore_index=PAD_ID, label_smoothing=epsilon,
                           reduction="sum")
    with torch.no_grad():
        nll = F.cross_entropy(logits, target, ignore_index=PAD_ID, reduction="sum")
    return loss, nll


# ---- distributed helpers ------------------------------------------------------------------

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """Join the torchrun process group if WORLD_SIZE > 1 (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank, world, local)


def all_reduce_sum(values: list[float], d: Dist, device) -> list[float]:
    if d.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# ---- run folder ---------------------------------------------------------------------------

def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np.random.get_state()[0], np.random.get_state()[1].tolist(),
                       *np.random.get_state()[2:]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    """One training run in ``cfg.out``. Build with ``Trainer(cfg, resume=...)``, then ``train()``.

    Raises CorpusError / ConfigError / CheckpointError with a message for the user when the
    data, options or run folder are unusable (e.g. an existing run without ``resume``).
    """

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg = cfg
        self.device = self._pick_device(cfg.device)
        self.d = init_distributed(str(self.device))
        if self.d.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", self.d.local_rank)
            torch.cuda.set_device(self.device)
        self.out = Path(cfg.out)
        self._prepare_run_dir(resume)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)

        self.tokenizer = self._tokenizer()
        self.model_cfg = preset(cfg.preset, **{**cfg.model_overrides,
                                               "vocab_size": self.tokenizer.vocab_size})
        self.max_len = self.model_cfg.max_positions
        self.train_data, self.train_report = load_split(
            cfg.data, cfg.train_split, cfg.src, cfg.tgt, self.tokenizer, self.max_len)
        self.valid_data = None
        if cfg.valid_split:
            self.valid_data, _ = load_split(cfg.data, cfg.valid_split, cfg.src, cfg.tgt,
                                            self.tokenizer, self.max_len, filter_pairs=False)
        self.model = Transformer(self.model_cfg).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0,
                                          betas=cfg.adam_betas, eps=cfg.adam_eps)
        self.step, self.epoch, self.batch_in_epoch = 0, 1, 0
        self.last_valid: dict[str, Any] = {}
        if resume:
            self._resume()
        self.ddp = self.model
        if self.d.world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.autocast = self.device.type == "cuda" and cfg.bf16

    # -- setup ----------------------------------------------------------------------------

    @staticmethod
    def _pick_device(name: str) -> torch.device:
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise AiaynError("--device cuda was asked for but CUDA is not available here")
        return torch.device(name)

    def _prepare_run_dir(self, resume: bool) -> None:
        cfg_file = self.out / RUN_CONFIG
        if resume:
            if not cfg_file.is_file():
                raise CheckpointError(f"--resume: {self.out} is not a training run "
                                      f"(no {RUN_CONFIG})")
            return
        if list_checkpoints(self.out) or cfg_file.exists():
            raise CheckpointError(f"{self.out} already holds a training run; pass --resume to "
                                  "continue it or choose another --out")
        if self.d.main:
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cfg_file, json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        self._barrier()

    def _tokenizer(self) -> Tokenizer:
        path = self.out / RUN_TOKENIZER
        if not path.is_file():
            if self.d.main:
                if self.cfg.tokenizer:
                    shutil.copyfile(self.cfg.tokenizer, path)
                else:
                    from runtime.corpus import read_parallel

                    s, t = read_parallel(self.cfg.data, self.cfg.train_split, self.cfg.src,
                                         self.cfg.tgt)
                    if not any(x.strip() for x in s + t):
                        from runtime.errors import CorpusError

                        raise CorpusError(f"training split {self.cfg.train_split!r} of "
                                          f"{self.cfg.data} is empty")
                    self.log(f"training a {self.cfg.tokenizer_type} tokenizer "
                             f"(vocab {self.cfg.vocab_size}) on {len(s)} pairs")
                    train_tokenizer(s + t, path, self.cfg.vocab_size, self.cfg.tokenizer_type,
                                    num_threads=os.cpu_count())
            self._barrier()
        return Tokenizer(path)

    def _resume(self) -> None:
        ckpts = list_checkpoints(self.out)
        if not ckpts:
            raise CheckpointError(f"--resume: {self.out} has no checkpoint to resume from")
        ckpt = ckpts[-1]
        state = load_train_state(ckpt)
        self.model.load_state_dict({k: v.to(self.device) for k, v in load_weights(ckpt).items()})
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        _set_rng_state(state["rng"])
        self.log(f"resumed from {ckpt} (step {self.step}, epoch {self.epoch})")

    def _barrier(self) -> None:
        if self.d.world > 1:
            dist.barrier()

    def log(self, msg: str) -> None:
        if self.d.main:
            tqdm.write(f"[aiayn train] {msg}")

    def record(self, **fields_: Any) -> None:
        """Append one JSON line to the run's metrics log (rank 0 only)."""
        if self.d.main:
            fields_ = {"time": round(time.time(), 3), **fields_}
            with open(self.out / METRICS, "a", encoding="utf-8") as f:
                f.write(json.dumps(fields_) + "\n")

    # -- the loop -------------------------------------------------------------------------

    def epoch_batches(self, epoch: int) -> list[list[list[int]]]:
        """Update groups of epoch ``epoch``: each a list of micro-batches (pair indices)
        for this rank. Every rank builds the same shuffled list (seed + epoch) and takes
        every world-th micro-batch of each group of world * update_freq."""
        mb = make_batches(self.train_data, self.cfg.max_tokens, seed=self.cfg.seed + epoch)
        per = self.d.world * self.cfg.update_freq
        groups = [mb[i:i + per] for i in range(0, len(mb), per)]
        if self.d.world > 1 and groups and len(groups[-1]) < per:
            groups.pop()  # every rank needs its share
        return [g[self.d.rank::self.d.world] for g in groups]

    def train_step(self, micro: list[list[int]]) -> dict[str, float]:
        """One optimizer update over this rank's micro-batches. Returns loss, nll per token."""
        batches = [collate(self.train_data, idx) for idx in micro]
        local = [float(sum(b.ntokens for b in batches)), float(len(batches))]
        total_tokens = all_reduce_sum(local, self.d, self.device)[0]
        self.model.train()
        loss_sum = nll_sum = 0.0
        for i, b in enumerate(batches):
            b = b.to(self.device)
            sync = i == len(batches) - 1
            ctx = self.ddp.no_sync() if (self.d.world > 1 and not sync) else nullcontext()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                logits = self.ddp(b.src, b.tgt_in)
                loss, nll = label_smoothed_loss(logits, b.tgt_out, self.cfg.label_smoothing)
                (loss * (self.d.world / total_tokens)).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
        self.step += 1
        lr = learning_rate(self.step, self.model_cfg.d_model, self.cfg.warmup_steps,
                           self.cfg.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, nll_sum = all_reduce_sum([loss_sum, nll_sum], self.d, self.device)
        return {"loss": loss_sum / total_tokens, "nll": nll_sum / total_tokens, "lr": lr,
                "tokens": total_tokens}

    def train(self) -> dict[str, Any]:
        """Run until ``epochs`` (or ``max_steps``); returns the last validation record."""
        cfg = self.cfg
        self.log(f"data: {self.train_report}; model: {self.model.num_parameters():,} parameters "
                 f"on {self.device}" + (f" x {self.d.world} processes" if self.d.world > 1 else ""))
        last_valid: dict[str, Any] = {}
        done = False
        started = time.perf_counter()
        while self.epoch <= cfg.epochs and not done:
            groups = self.epoch_batches(self.epoch)
            bar = tqdm(total=len(groups), initial=self.batch_in_epoch, desc=f"epoch {self.epoch}",
                       disable=not (cfg.progress and self.d.main), unit="upd", dynamic_ncols=True)
            t0, tok_window = time.perf_counter(), 0.0
            for gi in range(self.batch_in_epoch, len(groups)):
                stats = self.train_step(groups[gi])
                self.batch_in_epoch = gi + 1
                tok_window += stats["tokens"]
                elapsed = time.perf_counter() - t0
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}",
                                tok_s=f"{tok_window / max(elapsed, 1e-9):,.0f}")
                if self.step % cfg.log_every == 0 or self.step == 1:
                    self.record(event="train", step=self.step, epoch=self.epoch, **stats,
                                tokens_per_s=round(tok_window / max(elapsed, 1e-9), 1))
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save()
                if (cfg.max_steps and self.step >= cfg.max_steps) or (
                        cfg.max_time and time.perf_counter() - started >= cfg.max_time):
                    done = True
                    break
            bar.close()
            if done and cfg.max_time:
                self.log(f"stopping at step {self.step}: --max-time {cfg.max_time:g} s reached")
            if not done:
                last_valid = self.validate(bleu=self.epoch % cfg.valid_bleu_every == 0
                                           or self.epoch == cfg.epochs)
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            self.save()
        return last_valid

    @torch.no_grad()
    def validate(self, bleu: bool = True) -> dict[str, Any]:
        """Validation loss, perplexity and (rank 0) BLEU/chrF of the reference search."""
        record: dict[str, Any] = {"event": "valid", "step": self.step, "epoch": self.epoch}
        if self.valid_data is None:
            return record
        self.model.eval()
        loss_sum = nll_sum = ntok = 0.0
        for idx in make_batches(self.valid_data, self.cfg.max_tokens):
            b = collate(self.valid_data, idx).to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                loss, nll = label_smoothed_loss(self.model(b.src, b.tgt_in), b.tgt_out,
                                                self.cfg.label_smoothing)
            loss_sum, nll_sum, ntok = loss_sum + loss.item(), nll_sum + nll.item(), ntok + b.ntokens
        record.update(loss=loss_sum / ntok, nll=nll_sum / ntok, ppl=math.exp(nll_sum / ntok))
        if self.cfg.valid_bleu and bleu and self.d.main:
            record.update(self.valid_bleu())
        self.log(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in record.items() if k not in ("event", "signature",
                                                                    "chrf_signature")))
        self.record(**record)
        self.last_valid = record
        self._barrier()
        return record

    def valid_bleu(self) -> dict[str, Any]:
        import sacrebleu

        data: ParallelData = self.valid_data
        n = len(data) if self.cfg.valid_max_sentences is None else min(
            len(data), self.cfg.valid_max_sentences)
        hyps = translate_ids(self.model, [data.src[i].tolist() for i in range(n)],
                             beam_size=self.cfg.valid_beam, length_penalty=self.cfg.valid_alpha)
        outputs = [self.tokenizer.decode(h) for h in hyps]
        refs = data.tgt_text[:n]
        bleu = sacrebleu.metrics.BLEU()
        chrf = sacrebleu.metrics.CHRF()
        b, c = bleu.corpus_score(outputs, [refs]), chrf.corpus_score(outputs, [refs])
        return {"bleu": b.score, "chrf": c.score, "signature": str(bleu.get_signature()),
                "chrf_signature": str(chrf.get_signature())}

    def save(self) -> Path | None:
        """Checkpoint ``checkpoints/step_<N>`` (rank 0) and keep the last ``keep_last``."""
        path = None
        if self.d.main:
            state = {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                     "optimizer": self.optimizer.state_dict(), "rng": _rng_state(),
                     "train_config": json.dumps(self.cfg.to_dict())}
            meta = {"languages": {"src": self.cfg.src, "tgt": self.cfg.tgt},
                    "data": str(self.cfg.data), "train_split": self.cfg.train_split,
                    "step": self.step, "epoch": self.epoch, "preset": self.cfg.preset}
            if self.last_valid:
                meta["valid"] = {k: v for k, v in self.last_valid.items() if k != "event"}
            path = save_checkpoint(self.out / CHECKPOINTS_DIR / f"{STEP_PREFIX}{self.step:08d}",
                                   self.model, self.out / RUN_TOKENIZER, state, meta=meta)
            for old in list_checkpoints(self.out)[:-self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        return path


def translate_ids(model: Transformer, sources: list[list[int]], beam_size: int = 4,
                  length_penalty: float = 0.6, max_tokens: int = 6000) -> list[list[int]]:
    """Best hypothesis token ids for each source, batched by token count (input order)."""
    from runtime.translation import inference_batches

    out: list[list[int]] = [[] for _ in sources]
    was_training = model.training
    model.eval()
    for batch in inference_batches([len(s) for s in sources], max_tokens):
        results = beam_search(model, [sources[i] for i in batch], beam_size=beam_size,
                              length_penalty=length_penalty)
        for i, r in zip(batch, results):
            out[i] = r[0].tokens
    model.train(was_training)
    return out
