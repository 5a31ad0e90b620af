"""``aiayn parity``: the PyTorch reference vs a model package on the runtime, over a test split.

For each beam size (default: greedy and beam 4) both translate the same sentences in the same
token-count batches: the reference is ``train.search.beam_search`` on the checkpoint
(``TorchTranslator``), the runtime is ``runtime.translator.Translator`` on the package. Per
sentence the best hypotheses' token ids are compared (DESIGN.md "Search: one specification,
two implementations", parity rule):

- **identical**: the same tokens. Over these, the largest absolute difference of the
  cumulative log-prob and of any per-token log-prob is reported (the graphs' numeric drift).
- **near tie**: different tokens, and at the first step where the two searches diverge the
  reference's two competing cumulative scores are within ``NEAR_TIE`` (1e-4).
- **other**: anything else: a bug (or, for fp16/int8 packages, quantization error).

How a mismatch is classified (``classify_mismatch``): the sentence is searched again alone,
by the runtime and by the runtime's own numpy search driving the reference model's ``step``
(``TorchBackend``; tests hold it bit-identical to ``train.search.beam_search``), both with a
trace of every step's ranked candidates and picks. The first step whose picks differ is the
divergence; the competing candidates are the picks of one search and not the other, and
their *reference* cumulative scores (from the reference trace, or by teacher forcing when
the reference did not rank that candidate) give the gap. If the traces never diverge the
outputs differ in the final ranking, and the gap is between the two hypotheses' reference
normalized scores. When a lone re-run does not reproduce a batched result (batch shape
alone moved a near tie), the fallback scores the two outputs' prefixes up to their first
differing token by teacher forcing with the reference model (and their full normalized
scores); the smaller gap decides. Each mismatch reports its first differing token
``position``, the search ``step`` of divergence, the ``gap`` and the ``method`` used.

Also: corpus BLEU and chrF of both (sacreBLEU), and wall times. ``run_parity`` (in-memory
sentences) and ``parity`` (a package, a checkpoint and a split) are what tests call; ``main``
is the thin CLI. Exit status 1 when any "other" mismatch is found.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.backends.base import Backend, StepOutput
from runtime.checksums import sha256_file
from runtime.cli_common import default_model, run_cli
from runtime.contract import BOS_ID, CHECKPOINT_WEIGHTS, EOS_ID
from runtime.corpus import default_data_dir, read_parallel
from runtime.errors import AiaynError
from runtime.evaluate import positive_int
from runtime.search import beam_search as runtime_search
from runtime.searchspec import length_penalty as lp_fn
from runtime.translation import Translation, prepare_source
from train.search import topk_lower_index

NEAR_TIE = 1e-4  # DESIGN.md: competing cumulative scores within 1e-4 at the first divergence


class TorchBackend(Backend):
    """The reference model's ``encode_for_step`` / ``step`` behind the runtime's Backend
    interface, so the runtime's numpy search can drive the PyTorch model.

    With the same batch it computes exactly what ``train.search.beam_search`` computes (same
    calls, same tensors), which makes it the reference for search traces. Top-k uses
    ``train.search.topk_lower_index`` (ties toward the lower id, as ONNX TopK).
    """

    name = "torch-reference"

    def __init__(self, model):
        super().__init__(model.cfg.to_dict())
        self.model = model
        self.device = model.embed.weight.device

    @torch.no_grad()
    def encode(self, src_ids: np.ndarray):
        return self.model.encode_for_step(torch.from_numpy(np.asarray(src_ids, np.int64))
                                          .to(self.device))

    @torch.no_grad()
    def select(self, encoded, rows: np.ndarray):
        ck, cv, mask = encoded
        idx = torch.from_numpy(np.asarray(rows, np.int64)).to(self.device)
        return ck.index_select(1, idx), cv.index_select(1, idx), mask.index_select(0, idx)

    @torch.no_grad()
    def step(self, tokens, step, cache, beam_origin, cross, topk) -> StepOutput:
        N = len(tokens)
        past_k, past_v = cache if cache is not None else self.model.empty_cache(N)
        ck, cv, mask = cross
        log_probs, pk, pv, attn = self.model.step(
            torch.from_numpy(np.asarray(tokens, np.int64)).to(self.device), step, past_k, past_v,
            torch.from_numpy(np.asarray(beam_origin, np.int64)).to(self.device), ck, cv, mask)
        vals, ids = topk_lower_index(log_probs, topk)
        return StepOutput(vals.float().cpu().numpy(), ids.cpu().numpy(), (pk, pv),
                          _log_probs=lambda: log_probs.float().cpu().numpy(),
                          _cross_attn=lambda: attn.float().cpu().numpy())


# ------------------------------------------------------------------------------- scoring


@torch.no_grad()
def teacher_forced_log_probs(model, src_ids: list[int], tokens: list[int]) -> list[float]:
    """Per-token log-probs (natural log) of ``tokens`` given ``src_ids`` under ``model``, by
    teacher forcing (BOS + tokens[:-1] in, tokens out). float64 list of len(tokens)."""
    if not tokens:
        return []
    device = model.embed.weight.device
    src = torch.tensor([src_ids], dtype=torch.long, device=device)
    tgt_in = torch.tensor([[BOS_ID] + tokens[:-1]], dtype=torch.long, device=device)
    logp = torch.log_softmax(model(src, tgt_in).float(), dim=-1)[0]  # (T, V)
    idx = torch.tensor(tokens, device=device)
    return logp.gather(1, idx[:, None])[:, 0].double().tolist()


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two outputs (EOS appended) differ."""
    a, b = a + [EOS_ID], b + [EOS_ID]
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _trace_gap(model, src_ids, ref_trace, rt_trace) -> tuple[int, float] | None:
    """(step, gap) at the first step whose picks differ, or None if the traces agree."""
    for ref_step, rt_step in zip(ref_trace, rt_trace):
        ref_sel, rt_sel = set(ref_step["selected"]), set(rt_step["selected"])
        if ref_sel == rt_sel:
            continue
        ref_values = {(p, t): v for p, t, v in ref_step["candidates"]}
        competing = (ref_sel - rt_sel) | (rt_sel - ref_sel)
        values = []
        for prefix, token in competing:
            v = ref_values.get((prefix, token))
            if v is None:  # not ranked by the reference: score it directly
                v = float(np.float32(sum(teacher_forced_log_probs(model, src_ids,
                                                                  list(prefix) + [token]))))
            values.append(v)
        return ref_step["step"], max(values) - min(values)
    return None


def classify_mismatch(model, engine: Backend, src_ids: list[int], ref_tokens: list[int],
                      rt_tokens: list[int], beam_size: int, length_penalty: float = 0.6,
                      lp_type: str = "gnmt", max_len_a: float = 1.0, max_len_b: int = 50
                      ) -> dict[str, Any]:
    """Why the reference output ``ref_tokens`` and the runtime's ``rt_tokens`` differ.

    Returns ``kind`` ("near_tie" or "other"), ``position`` (first differing token), ``step``
    (the search step where the two diverge), ``gap`` (the reference's competing scores'
    difference) and ``method`` ("trace", "ranking" or "teacher_forcing").
    """
    search = dict(beam_size=beam_size, length_penalty=length_penalty, lp_type=lp_type,
                  max_len_a=max_len_a, max_len_b=max_len_b, nbest=beam_size)
    position = first_difference(ref_tokens, rt_tokens)
    ref_trace, rt_trace = [], []
    ref_alone = runtime_search(TorchBackend(model), [src_ids], trace=ref_trace, **search)[0]
    rt_alone = runtime_search(engine, [src_ids], trace=rt_trace, **search)[0]
    step, gap, method = None, None, None
    if ref_alone[0].tokens == ref_tokens and rt_alone[0].tokens == rt_tokens:
        found = _trace_gap(model, src_ids, ref_trace, rt_trace)
        if found is not None:
            (step, gap), method = found, "trace"
        else:  # same finished hypotheses, ranked differently
            by_tokens = {tuple(h.tokens): h.normalized_score for h in ref_alone}
            if tuple(rt_tokens) in by_tokens:
                step, method = len(ref_trace) - 1, "ranking"
                gap = abs(by_tokens[tuple(ref_tokens)] - by_tokens[tuple(rt_tokens)])
    if gap is None:
        ref_lp = teacher_forced_log_probs(model, src_ids, ref_tokens + [EOS_ID])
        rt_lp = teacher_forced_log_probs(model, src_ids, rt_tokens + [EOS_ID])
        prefix_gap = abs(sum(ref_lp[:position + 1]) - sum(rt_lp[:position + 1]))
        final_gap = abs(sum(ref_lp) / lp_fn(len(ref_lp), length_penalty, lp_type)
                        - sum(rt_lp) / lp_fn(len(rt_lp), length_penalty, lp_type))
        step, gap, method = position, min(prefix_gap, final_gap), "teacher_forcing"
    return {"kind": "near_tie" if gap <= NEAR_TIE else "other", "position": position,
            "step": step, "gap": float(gap), "method": method}


# ------------------------------------------------------------------------------- parity


def _translate(translator, sources, progress_desc: str | None, **search
               ) -> tuple[list[Translation], float]:
    bar = None
    if progress_desc:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(sources), desc=progress_desc, unit="sent", file=sys.stderr)
    t0 = time.perf_counter()
    out = translator.translate(sources, progress=bar.update if bar else None, **search)
    seconds = time.perf_counter() - t0
    if bar:
        bar.close()
    return out, seconds


def run_parity(reference, runtime, sources: list[str], references: list[str] | None = None,
               beam_size: int = 4, length_penalty: float = 0.6, lp_type: str = "gnmt",
               max_len_a: float = 1.0, max_len_b: int = 50, max_tokens: int = 4096,
               progress: bool = False) -> dict[str, Any]:
    """Reference vs runtime on ``sources`` at one beam size.

    Args:
        reference: a ``train.translator.TorchTranslator`` (its ``model`` is used to classify
            mismatches).
        runtime: a ``runtime.translator.Translator``.
        sources: input sentences; ``references``: their reference translations (for BLEU and
            chrF; optional).

    Returns a dict: ``beam``, ``sentences``, ``identical``, ``near_tie``, ``other``,
    ``max_abs_logprob_diff`` (cumulative, best hypothesis, over identical outputs),
    ``max_abs_token_logprob_diff``, ``reference`` / ``runtime`` ({seconds, bleu, chrf, ...}),
    ``mismatches`` (one dict per differing sentence: index, kind, position, step, gap,
    method, both texts).
    """
    search = dict(beam_size=beam_size, length_penalty=length_penalty, lp_type=lp_type,
                  max_len_a=max_len_a, max_len_b=max_len_b)
    ref_out, ref_s = _translate(reference, sources, f"reference beam {beam_size}" if progress
                                else None, max_tokens=max_tokens, **search)
    rt_out, rt_s = _translate(runtime, sources, f"runtime beam {beam_size}" if progress
                              else None, max_tokens=max_tokens, **search)
    identical, mismatches = 0, []
    max_lp = max_tok = 0.0
    for i, (a, b) in enumerate(zip(ref_out, rt_out)):
        if a.token_ids == b.token_ids:
            identical += 1
            if a.nbest and b.nbest:
                max_lp = max(max_lp, abs(a.nbest[0].log_prob - b.nbest[0].log_prob))
                ta, tb = a.nbest[0].token_scores or [], b.nbest[0].token_scores or []
                if ta and tb:
                    max_tok = max(max_tok, float(np.max(np.abs(np.subtract(ta, tb)))))
            continue
        src_ids, _ = prepare_source(runtime.tokenizer, sources[i], runtime.max_positions)
        info = classify_mismatch(reference.model, runtime.engine, src_ids, a.token_ids,
                                 b.token_ids, **search)
        mismatches.append({"index": i, **info, "reference": a.text, "runtime": b.text})
    near = sum(m["kind"] == "near_tie" for m in mismatches)
    report: dict[str, Any] = {
        "beam": beam_size, "sentences": len(sources), "identical": identical,
        "near_tie": near, "other": len(mismatches) - near,
        "max_abs_logprob_diff": max_lp, "max_abs_token_logprob_diff": max_tok,
        "reference": {"seconds": round(ref_s, 2)}, "runtime": {"seconds": round(rt_s, 2)},
        "mismatches": mismatches,
    }
    if references is not None:
        from runtime.evaluate import score

        for key, out in (("reference", ref_out), ("runtime", rt_out)):
            s = score([r.text for r in out], references)
            report[key].update(bleu=s["bleu"], chrf=s["chrf"], bleu_signature=s["bleu_signature"],
                               chrf_signature=s["chrf_signature"])
    return report


def parity(package: str | Path | None, checkpoint: str | Path | None, data_dir=None,
           split: str = "test_2016_flickr", beams: tuple[int, ...] = (1, 4),
           limit: int | None = None, backend: str = "auto", threads: int | None = None,
           src: str = "en", tgt: str = "de", progress: bool = False,
           reference_device: str = "cpu", **search) -> dict[str, Any]:
    """Load the package (None: the default model's) on ``backend`` and the checkpoint (None:
    the package's source checkpoint if it still exists, else the default model) on torch's
    ``reference_device`` ("cpu", "cuda", or "auto": CUDA when available), and run
    ``run_parity`` on ``split`` for each beam size in ``beams``.

    Raises AiaynError if the package was exported from another checkpoint or CUDA is asked for
    and absent, CorpusError for missing data, PackageError/BackendError/CheckpointError for
    what does not load.
    """
    from runtime.translator import Translator
    from train.translator import TorchTranslator

    if reference_device == "cuda" and not torch.cuda.is_available():
        raise AiaynError("the reference device cuda is not available (this torch sees no CUDA "
                         "GPU); use --reference-device cpu or auto")
    runtime = Translator.load(package, backend=backend, threads=threads)
    source = runtime.package.manifest.get("source_checkpoint", {})
    if checkpoint is None:
        recorded = Path(source.get("path", ""))
        checkpoint = recorded if source.get("path") and recorded.exists() else default_model()
    reference = TorchTranslator.load(checkpoint, device=reference_device, threads=threads)
    sha = sha256_file(Path(reference.checkpoint) / CHECKPOINT_WEIGHTS)
    if source.get("sha256") and source["sha256"] != sha:
        raise AiaynError(f"package {runtime.package.path} was exported from a checkpoint with "
                         f"sha256 {source['sha256'][:12]}…, not {reference.checkpoint} "
                         f"({sha[:12]}…); compare a package with its own checkpoint")
    data_dir = data_dir or default_data_dir()
    sources, refs = read_parallel(data_dir, split, src, tgt)
    if limit is not None:
        sources, refs = sources[:limit], refs[:limit]
    runs = [run_parity(reference, runtime, sources, refs, beam_size=k, progress=progress,
                       **search) for k in beams]
    return {"package": str(runtime.package.path), "variant": runtime.package.variant,
            "checkpoint": str(reference.checkpoint), "backend": runtime.backend,
            "reference_device": reference.device,
            "data": str(data_dir), "split": split, "sentences": len(sources),
            "near_tie_threshold": NEAR_TIE, "runs": runs,
            "ok": all(r["other"] == 0 for r in runs)}


def format_report(report: dict[str, Any]) -> str:
    """The human-readable summary ``aiayn parity`` prints."""
    lines = [f"parity: {report['package']} ({report['variant']}, backend {report['backend']}) "
             f"vs {report['checkpoint']} (PyTorch reference on "
             f"{report.get('reference_device', 'cpu')})",
             f"{report['split']}: {report['sentences']} sentences"]
    for r in report["runs"]:
        name = "greedy" if r["beam"] == 1 else f"beam {r['beam']}"
        n = max(r["sentences"], 1)
        lines.append(f"\n{name}: identical {r['identical']}/{r['sentences']} "
                     f"({100 * r['identical'] / n:.1f}%), near ties {r['near_tie']}, "
                     f"other mismatches {r['other']}")
        lines.append(f"  max |Δ log-prob| over identical outputs: {r['max_abs_logprob_diff']:.2e} "
                     f"(sentence), {r['max_abs_token_logprob_diff']:.2e} (token)")
        for key in ("reference", "runtime"):
            s = r[key]
            scores = (f"BLEU {s['bleu']:.2f}  chrF {s['chrf']:.2f}  " if "bleu" in s else "")
            lines.append(f"  {key:9s} {scores}{s['seconds']:.1f} s")
        for m in r["mismatches"]:
            lines.append(f"  [{m['kind']}] #{m['index']} step {m['step']} token {m['position']} "
                         f"gap {m['gap']:.2e} ({m['method']})")
            lines.append(f"      ref: {m['reference']}")
            lines.append(f"      rt:  {m['runtime']}")
    lines.append("\nOK: no mismatch beyond near ties" if report["ok"]
                 else "\nFAILED: mismatches that are not near ties")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "parity":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="aiayn parity", description=(
        "Translate a test split with the PyTorch reference (checkpoint) and with the runtime "
        "(package), greedy and beam search, and compare them token by token: identical, near "
        "ties (reference scores within 1e-4 where the searches diverge) and other mismatches."))
    p.add_argument("--model", type=Path, default=None,
                   help="model package (default: the default model's package)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="reference checkpoint (default: the package's source checkpoint)")
    p.add_argument("--backend", default="auto",
                   choices=("auto", "ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt"))
    p.add_argument("--reference-device", choices=("cpu", "cuda", "auto"), default="cpu",
                   help="where the PyTorch reference runs (default cpu; auto: CUDA when "
                        "available)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", default=None, help="corpus folder (default: $AIAYN_DATA, else "
                   "../shared/data/multi30k)")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--beam", type=int, nargs="+", default=[1, 4],
                   help="beam sizes to compare (default: 1 4, greedy and beam 4)")
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--lp-type", choices=("gnmt", "power"), default="gnmt")
    p.add_argument("--max-len-a", type=float, default=1.0)
    p.add_argument("--max-len-b", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--limit", type=positive_int, default=None, help="only the first N sentences")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    status = {"code": 0}

    def body():
        report = parity(args.model, args.checkpoint, args.data, args.split, tuple(args.beam),
                        args.limit, args.backend, args.threads, args.src, args.tgt,
                        progress=not args.no_progress and not args.json,
                        length_penalty=args.alpha, lp_type=args.lp_type,
                        max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                        max_tokens=args.max_tokens, reference_device=args.reference_device)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        status["code"] = 0 if report["ok"] else 1

    code = run_cli(body, "parity")
    return code or status["code"]


if __name__ == "__main__":
    sys.exit(main())
