"""Training throughput per preset: target tokens/s of the paper's training step.

One optimizer update = forward, label-smoothed loss, backward, Adam step (train/trainer.py's
math) on real Multi30k batches tokenized with the bundled model's sentencepiece model
(random tokens if the corpus is absent). Reports target (non-pad) tokens/s, step time, and
model FLOPs utilization against a matmul rate measured in the same run (``--mfu``).

    python bench/train_throughput.py --presets multi30k base big --max-tokens 4096 --steps 5
    python bench/train_throughput.py --device cuda --bf16 --presets base multi30k --mfu --json out.json

A benchmark, not a test: results go to bench/RESULTS.md with machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.corpus import default_data_dir  # noqa: E402
from runtime.tokenizer import Tokenizer  # noqa: E402
from train.config import preset  # noqa: E402
from train.data import ParallelData, collate, load_split, make_batches  # noqa: E402
from train.model import Transformer  # noqa: E402
from train.trainer import label_smoothed_loss, learning_rate  # noqa: E402


def training_flops_per_token(model: Transformer, src_len: float, tgt_len: float) -> float:
    """Approximate training FLOPs per target token (forward + backward = 3 x forward):
    6 x matmul parameters used per token, plus the attention score/context matmuls, for
    sentences of mean length ``src_len`` / ``tgt_len`` (Kaplan et al. 2020 style accounting)."""
    cfg = model.cfg
    d, f = cfg.d_model, cfg.d_ff
    enc_layer = 4 * d * d + 2 * d * f
    dec_layer = 8 * d * d + 2 * d * f
    ratio = src_len / tgt_len  # encoder work per target token
    dense = enc_layer * cfg.encoder_layers * ratio + dec_layer * cfg.decoder_layers \
        + d * cfg.vocab_size  # output projection
    attn = 2 * d * (cfg.encoder_layers * src_len * ratio + cfg.decoder_layers * (tgt_len + src_len))
    return 6 * dense + 3 * 2 * attn


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 20) -> float:
    """Measured dense matmul rate (TFLOP/s) on ``device`` in ``dtype``."""
    if device.type == "cpu":
        n, iters = 1024, 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def synthetic_data(vocab: int, n: int = 4000, seed: int = 0) -> ParallelData:
    rng = np.random.default_rng(seed)
    src, tgt = [], []
    for _ in range(n):
        s, t = rng.integers(8, 30), rng.integers(8, 30)
        src.append(np.append(rng.integers(4, vocab, s), 3).astype(np.int64))
        tgt.append(rng.integers(4, vocab, t).astype(np.int64))
    return ParallelData(src, tgt, [""] * n, [""] * n)


def bench_preset(name: str, data: ParallelData, vocab: int, device: torch.device, bf16: bool,
                 max_tokens: int, steps: int, warmup: int, profile: bool = False) -> dict:
    torch.manual_seed(0)
    model = Transformer(preset(name, vocab_size=vocab)).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    batches = make_batches(data, max_tokens, seed=1)
    autocast = device.type == "cuda" and bf16
    tokens = 0
    src_tok = tgt_tok = sentences = 0
    t0 = None
    prof = None
    for i in range(warmup + steps):
        b = collate(data, batches[i % len(batches)]).to(device)
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
            if profile:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(activities=acts)
                prof.__enter__()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = label_smoothed_loss(model(b.src, b.tgt_in), b.tgt_out, 0.1)
        (loss / b.ntokens).backward()
        for g in opt.param_groups:
            g["lr"] = learning_rate(i + 1, model.cfg.d_model, 4000)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            tokens += b.ntokens
            src_tok += int((b.src != 0).sum())
            tgt_tok += b.ntokens
            sentences += b.src.shape[0]
    sync(device)
    seconds = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=18), flush=True)
    flops_tok = training_flops_per_token(model, src_tok / sentences, tgt_tok / sentences)
    return {"preset": name, "parameters": model.num_parameters(), "max_tokens": max_tokens,
            "steps": steps, "seconds": round(seconds, 3),
            "step_ms": round(1000 * seconds / steps, 1),
            "target_tokens_per_s": round(tokens / seconds, 1),
            "model_tflops": round(tokens / seconds * flops_tok / 1e12, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["multi30k", "base", "big"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA)")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--mfu", action="store_true", help="measure the matmul rate for MFU")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--profile", action="store_true",
                   help="print torch.profiler's top operators for the timed steps")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tok_file = REPO / "models" / "multi30k-en-de" / "spm.model"
    data_dir = default_data_dir()
    if tok_file.is_file() and (data_dir / "train.en.gz").is_file():
        tok = Tokenizer(tok_file)
        data, _ = load_split(data_dir, "train", "en", "de", tok, 256)
        vocab, source = tok.vocab_size, f"Multi30k train ({len(data)} pairs)"
    else:
        vocab = 8000
        data, source = synthetic_data(vocab), "synthetic random tokens"
    info = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch": torch.__version__, "device": str(device), "data": source,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "bf16": bool(args.bf16 and device.type == "cuda")}
    if args.mfu:
        dtype = torch.bfloat16 if info["bf16"] else torch.float32
        info["matmul_tflops"] = round(matmul_tflops(device, dtype), 2)
    results = []
    for name in args.presets:
        r = bench_preset(name, data, vocab, device, args.bf16, args.max_tokens, args.steps,
                         args.warmup, args.profile)
        if "matmul_tflops" in info:
            r["mfu"] = round(r["model_tflops"] / info["matmul_tflops"], 4)
        results.append(r)
        print(json.dumps(r), flush=True)
    out = {"info": info, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print("\n| preset | params | max_tokens | step ms | target tok/s | model TFLOP/s |" +
          (" MFU |" if args.mfu else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.mfu else ""))
    for r in results:
        print(f"| {r['preset']} | {r['parameters'] / 1e6:.1f}M | {r['max_tokens']} | {r['step_ms']} "
              f"| {r['target_tokens_per_s']:,.0f} | {r['model_tflops']} |" +
              (f" {100 * r['mfu']:.1f}% |" if args.mfu else ""))
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
