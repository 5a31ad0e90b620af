"""GPU checks of the PyTorch side (run with `pytest -m gpu` on a CUDA machine)."""

import pytest
import torch

from runtime.cli_common import BUNDLED_MODEL
from runtime.corpus import default_data_dir, read_parallel
from train.checkpoint import list_checkpoints, load_checkpoint
from train.trainer import TrainConfig, Trainer
from train.translator import TorchTranslator

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")]
DATA = default_data_dir()
needs_data = pytest.mark.skipif(not (DATA / "test_2016_flickr.en.gz").is_file(),
                                reason=f"Multi30k not found at {DATA} (set AIAYN_DATA)")


@needs_data
def test_bf16_training_on_cuda_learns_and_checkpoints_load_on_cpu(tmp_path):
    cfg = TrainConfig(data=str(DATA), out=str(tmp_path / "run"), device="cuda", bf16=True,
                      max_steps=60, warmup_steps=30, valid_split="", progress=False,
                      log_every=1, keep_last=1)
    tr = Trainer(cfg)
    assert tr.autocast and next(tr.model.parameters()).is_cuda
    tr.train()
    import json

    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text()
              .splitlines() if '"train"' in x]
    assert losses[-1] < losses[0] - 1.0
    model, _, _ = load_checkpoint(list_checkpoints(tmp_path / "run")[-1], device="cpu")
    assert not next(model.parameters()).is_cuda


@needs_data
def test_reference_search_on_cuda_matches_cpu():
    src, _ = read_parallel(DATA, "test_2016_flickr", "en", "de")
    gpu = TorchTranslator.load(BUNDLED_MODEL, device="cuda").translate(src[:200])
    cpu = TorchTranslator.load(BUNDLED_MODEL, device="cpu").translate(src[:200])
    same = sum(a.token_ids == b.token_ids for a, b in zip(gpu, cpu))
    assert same >= 196, f"{same}/200 identical"
