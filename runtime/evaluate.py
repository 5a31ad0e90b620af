"""``aiayn eval``: sacreBLEU BLEU and chrF of any translator on a split. Torch-free.

Scores are computed on detokenized, cased output against the raw references (the field's
convention), with sacreBLEU's signatures; ``--lowercase-bleu`` adds lowercased BLEU with the
13a tokenizer, the way most published Multi30k figures are computed.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .corpus import default_data_dir, read_parallel
from .errors import AiaynError


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=None,
                   help="corpus folder (default: $AIAYN_DATA, else ../shared/data/multi30k)")
    p.add_argument("--split", default="test_2016_flickr", help="split to score")
    p.add_argument("--src", default="en", help="source language (default en)")
    p.add_argument("--tgt", default="de", help="target language (default de)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="score only the first N sentences")
    p.add_argument("--output", default=None, help="also write the translations to this file")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.add_argument("--no-progress", action="store_true")


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """BLEU, chrF and lowercased-13a BLEU with signatures (sacreBLEU)."""
    try:
        import sacrebleu
    except ImportError:
        raise AiaynError("scoring needs sacrebleu: pip install sacrebleu") from None
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    lc = sacrebleu.metrics.BLEU(lowercase=True, tokenize="13a")
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    l_ = lc.corpus_score(hypotheses, [references])
    return {"bleu": round(b.score, 2), "bleu_signature": str(bleu.get_signature()),
            "chrf": round(c.score, 2), "chrf_signature": str(chrf.get_signature()),
            "bleu_lc": round(l_.score, 2), "bleu_lc_signature": str(lc.get_signature())}


def evaluate(translator, data_dir, split: str, src: str = "en", tgt: str = "de",
             limit: int | None = None, progress: bool = False, **search) -> dict[str, Any]:
    """Translate ``split`` with ``translator`` (anything with ``translate(texts, **search)``)
    and score it. Returns scores, signatures, sentence count, seconds and the outputs.
    Raises CorpusError for missing or mismatched files."""
    sources, references = read_parallel(data_dir, split, src, tgt)
    if limit is not None:
        sources, references = sources[:limit], references[:limit]
    bar = None
    if progress:
        from .translate_io import progress_bar

        bar = progress_bar(len(sources), f"translating {split}")
    t0 = time.perf_counter()
    results = translator.translate(sources, progress=bar.update if bar else None, **search)
    seconds = time.perf_counter() - t0
    if bar:
        bar.close()
    outputs = [r.text for r in results]
    return {"split": split, "sentences": len(sources), "seconds": round(seconds, 2),
            **score(outputs, references), "outputs": outputs}


def run_eval(translator, args: argparse.Namespace) -> None:
    from .cli_common import search_kwargs

    search = search_kwargs(args)
    search.pop("nbest")
    data = args.data or default_data_dir()
    result = evaluate(translator, data, args.split, args.src, args.tgt, args.limit,
                      progress=not args.no_progress and not args.json, **search)
    outputs = result.pop("outputs")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(o + "\n" for o in outputs)
    result.update(model=str(getattr(translator, "source", "") or ""),
                  backend=getattr(translator, "backend", None), beam=args.beam, alpha=args.alpha,
                  lp_type=args.lp_type)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.split} ({result['sentences']} sentences, {result['seconds']} s, "
              f"backend {result['backend']}, beam {args.beam}, alpha {args.alpha})")
        print(f"BLEU  {result['bleu']:6.2f}  {result['bleu_signature']}")
        print(f"chrF  {result['chrf']:6.2f}  {result['chrf_signature']}")
        print(f"BLEU  {result['bleu_lc']:6.2f}  {result['bleu_lc_signature']}  (lowercased)")
