"""``aiayn train``, ``aiayn average`` and ``aiayn info CHECKPOINT``. (``aiayn eval`` and
``aiayn translate`` live in runtime/cli.py for every backend; with a checkpoint or
``--backend torch`` they load train/ lazily through ``runtime.translator.load_translator``.)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.cli_common import default_model, run_cli
from runtime.errors import AiaynError

from .config import PRESETS, ConfigError


def build_train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiayn train", description=(
        "Train the Transformer (Vaswani et al. 2017) on a parallel corpus DIR/{split}.{lang}[.gz] "
        "with the paper's recipe: joint BPE, label smoothing, Adam + eq. 3 warmup, token batches."))
    p.add_argument("--preset", default="multi30k", choices=sorted(PRESETS),
                   help="model size: base / big (Table 3) or multi30k (small; default)")
    p.add_argument("--data", required=True, help="corpus folder")
    p.add_argument("--src", default="en", help="source language suffix (default en)")
    p.add_argument("--tgt", default="de", help="target language suffix (default de)")
    p.add_argument("--out", required=True, help="run folder (checkpoints, metrics, tokenizer)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly "
                   "where its last checkpoint stopped")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default 30)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many updates")
    p.add_argument("--max-time", type=float, default=None,
                   help="stop after this many seconds of training (a checkpoint is saved)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="padded tokens per side per micro-batch per process (paper: ~25000; "
                        "preset default)")
    p.add_argument("--update-freq", type=int, default=None,
                   help="micro-batches accumulated per update (gradient accumulation)")
    p.add_argument("--warmup-steps", type=int, default=None, help="eq. 3 warmup (preset default)")
    p.add_argument("--lr-scale", type=float, default=None, help="multiplies eq. 3 (default 1)")
    p.add_argument("--label-smoothing", type=float, default=None, help="epsilon_ls (default 0.1)")
    p.add_argument("--dropout", type=float, default=None, help="P_drop (preset default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --set d_model=384 (repeatable)")
    p.add_argument("--vocab-size", type=int, default=None, help="sentencepiece vocabulary (8000)")
    p.add_argument("--tokenizer-type", choices=("bpe", "unigram"), default=None)
    p.add_argument("--tokenizer", default=None, help="reuse this spm.model")
    p.add_argument("--train-split", default=None, help="(default train)")
    p.add_argument("--valid-split", default=None, help="(default val; '' for none)")
    p.add_argument("--no-valid-bleu", action="store_true", help="skip validation BLEU")
    p.add_argument("--valid-beam", type=int, default=None, help="beam for validation BLEU (4)")
    p.add_argument("--valid-max-sentences", type=int, default=None)
    p.add_argument("--valid-bleu-every", type=int, default=None,
                   help="validation BLEU every N epochs (default 1; loss is every epoch)")
    p.add_argument("--keep-last", type=int, default=None, help="checkpoints kept (default 5)")
    p.add_argument("--save-every", type=int, default=None, help="also checkpoint every N updates")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--clip-norm", type=float, default=None)
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda")
    p.add_argument("--no-bf16", action="store_true", help="fp32 on CUDA instead of bf16 autocast")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-every", type=int, default=None)
    return p


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def train_main(argv: list[str]) -> int:
    args = build_train_parser().parse_args(argv)

    def body():
        from .trainer import RUN_CONFIG, TrainConfig, Trainer

        options = {
            "epochs": args.epochs, "max_steps": args.max_steps, "max_time": args.max_time,
            "valid_bleu_every": args.valid_bleu_every, "max_tokens": args.max_tokens,
            "update_freq": args.update_freq, "warmup_steps": args.warmup_steps,
            "lr_scale": args.lr_scale, "label_smoothing": args.label_smoothing,
            "vocab_size": args.vocab_size, "tokenizer_type": args.tokenizer_type,
            "tokenizer": args.tokenizer, "train_split": args.train_split,
            "valid_split": args.valid_split, "valid_beam": args.valid_beam,
            "valid_max_sentences": args.valid_max_sentences, "keep_last": args.keep_last,
            "save_every": args.save_every, "seed": args.seed, "clip_norm": args.clip_norm,
            "device": args.device, "log_every": args.log_every,
        }
        options = {k: v for k, v in options.items() if v is not None}
        if args.no_valid_bleu:
            options["valid_bleu"] = False
        if args.no_bf16:
            options["bf16"] = False
        if args.no_progress:
            options["progress"] = False
        overrides = {}
        for item in args.set:
            if "=" not in item:
                raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
            k, v = item.split("=", 1)
            overrides[k.strip()] = _parse_value(v)
        if args.dropout is not None:
            overrides["dropout"] = args.dropout
        run_cfg = Path(args.out) / RUN_CONFIG
        if args.resume and run_cfg.is_file():
            saved = json.loads(run_cfg.read_text())
            # A resumed run keeps its recipe; only how long/where it runs may change.
            for k in ("epochs", "max_steps", "max_time", "device", "progress", "log_every", "save_every",
                      "valid_bleu", "valid_max_sentences"):
                if k in options:
                    saved[k] = options[k]
            cfg = TrainConfig.from_dict(saved)
        else:
            from .config import preset

            preset(args.preset, **overrides)  # unknown preset/key: a clear error now
            cfg = TrainConfig(data=args.data, out=args.out, src=args.src, tgt=args.tgt,
                              preset=args.preset, model_overrides=overrides, **options)
        result = Trainer(cfg, resume=args.resume).train()
        if result.get("bleu") is not None:
            print(f"final validation BLEU {result['bleu']:.2f} ({result['signature']})")

    return run_cli(body, "train")


def average_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="aiayn average", description=(
        "Average the weights of a run's last N checkpoints (the paper: 5 for base, 20 for big; "
        "§6.1) into a new checkpoint."))
    p.add_argument("run", type=Path, help="training run folder")
    p.add_argument("--last", type=int, default=5, help="how many of the latest checkpoints")
    p.add_argument("--out", type=Path, required=True, help="folder for the averaged checkpoint")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)

    def body():
        from .checkpoint import average_checkpoints, list_checkpoints

        ckpts = list_checkpoints(args.run)
        if not ckpts:
            raise AiaynError(f"{args.run} holds no checkpoints (expected {args.run}/checkpoints/step_*)")
        if args.last < 1:
            raise AiaynError("--last must be >= 1")
        if len(ckpts) < args.last:
            raise AiaynError(f"{args.run} keeps only {len(ckpts)} checkpoints, fewer than "
                             f"--last {args.last}; train with a larger --keep-last")
        if args.out.exists() and not args.force:
            raise AiaynError(f"{args.out} exists; pass --force to replace it")
        chosen = ckpts[-args.last:]
        out = average_checkpoints(chosen, args.out)
        print(f"averaged {len(chosen)} checkpoints ({chosen[0].name} … {chosen[-1].name}) "
              f"into {out}")

    return run_cli(body, "average")


def info_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="aiayn info", description="Describe a checkpoint.")
    p.add_argument("path", nargs="?", type=Path, default=None)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    def body():
        from .checkpoint import checkpoint_info

        info = checkpoint_info(args.path or args.model or default_model())
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for k, v in info.items():
                if isinstance(v, dict):
                    print(f"{k}:")
                    for kk, vv in v.items():
                        print(f"  {kk}: {vv}")
                else:
                    print(f"{k}: {v}")

    return run_cli(body, "info")


COMMANDS = {"train": train_main, "average": average_main, "info": info_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"train.cli: expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
