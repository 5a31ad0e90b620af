"""Translation benchmark: PyTorch reference vs our ONNX runtime vs CTranslate2, same weights.

One run, one machine, the same sentences (the first ``--limit`` of test_2016_flickr, default
1000), the same weights (the bundled model unless ``--model``), the same search (beam 4,
alpha 0.6, ``--lp-type power`` by default because CTranslate2 implements only that penalty),
the same thread count for every engine (``--threads``, default all cores):

    torch      train.translator.TorchTranslator (the reference search over Transformer.step)
    ort-fp32   runtime.translator.Translator on an fp32 package, backend ort-cpu
    ort-opt    ... on an ORT-offline-optimized fp32 package (``aiayn export --optimize``; extra)
    ort-int8   ... on an int8 package (``aiayn export --int8``)
    ct2-fp32   CTranslate2 on our weights converted by bench/ct2_convert.py, float32
    ct2-int8   ... loaded with compute_type int8 (extra information)

Every engine is text in, text out through ``runtime.translation.translate_batched`` (same
sentencepiece tokenization, length sorting and batching), and runs in its own subprocess so
its peak RSS is its own. Per engine and batch size (``--batch-sizes``, default 1 and 32, in
corpus order): sentences/s and target tokens/s (generated subwords without EOS, wall clock
over all batches), p50/p95 latency of one call in milliseconds (batch 1: one sentence),
CPU seconds / wall seconds (>threads means contention-free parallelism, <1 a busy machine),
peak RSS (``getrusage`` maxrss, MiB) and sacreBLEU against the references. A check worker
holds CTranslate2 to the reference: greedy and beam outputs token-identical, mismatches
classified by the parity rule of DESIGN.md (a near tie is two competing cumulative
reference scores within 1e-4 at the first diverging step).

    python bench/translate.py                       # everything, writes bench/results.json
    python bench/translate.py --limit 100 --engines torch ct2-fp32 --batch-sizes 1 32
    python bench/translate.py --results-md bench/RESULTS.md   # also update RESULTS.md
    python bench/translate.py --render a.json b.json --results-md bench/RESULTS.md
    python bench/translate.py --profile --engines ort-fp32 --limit 200   # cProfile top functions

A benchmark, not a test: numbers depend on the machine and its load (recorded with them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

ENGINES = ("torch", "ort-fp32", "ort-opt", "ort-int8", "ct2-fp32", "ct2-int8")
PACKAGE_VARIANTS = {"ort-fp32": [], "ort-opt": ["--optimize"], "ort-int8": ["--int8"]}
DEFAULT_MODEL = REPO / "models" / "multi30k-en-de"
NEAR_TIE = 1e-4  # DESIGN.md parity rule: competing cumulative scores within this are a tie
MARK_BEGIN = "<!-- bench/translate.py: begin -->"
MARK_END = "<!-- bench/translate.py: end -->"


# ---- machine --------------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("torch", "onnxruntime", "ctranslate2", "numpy", "sentencepiece", "sacrebleu"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


def source_state() -> dict[str, Any]:
    """The checkout measured: HEAD commit and the uncommitted files of the packages that run
    (runtime/, export/, train/, bench/), since results depend on them."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.rstrip("\n")
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = git("status", "--porcelain", "--", "runtime", "export", "train", "bench")
    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "uncommitted": [line[3:] for line in dirty.splitlines()]}


def load_average() -> list[float]:
    """1, 5 and 15-minute load averages (runnable processes; compare with the core count)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (Linux reports ru_maxrss in KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kib / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


def rss_mib() -> float | None:
    """Current resident set size in MiB (psutil, else /proc/self/statm), None if unknown."""
    try:
        import psutil

        return round(psutil.Process().memory_info().rss / (1 << 20), 1)
    except ImportError:
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            return round(pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)
        except (OSError, ValueError):
            return None


# ---- engines (built inside their worker) ------------------------------------------------------

def load_engine(engine: str, artifact: str, threads: int):
    """The translator of ``engine`` (anything with ``translate(texts, **search)``).

    ``artifact`` is the checkpoint (torch), the package (ort-*) or the CTranslate2 model
    directory (ct2-*). Raises ImportError naming what is missing.
    """
    if engine == "torch":
        from train.translator import TorchTranslator

        return TorchTranslator.load(artifact, device="cpu", threads=threads)
    if engine.startswith("ort-"):
        try:
            from runtime.translator import Translator
        except ImportError as e:
            raise ImportError(f"runtime.translator is not importable ({e}); the ONNX runtime "
                              "translator is not in this tree yet") from e
        return Translator.load(artifact, backend="ort-cpu", threads=threads)
    if engine.startswith("ct2-"):
        from ct2_convert import CT2Translator

        return CT2Translator.load(artifact, threads=threads,
                                  compute_type="int8" if engine == "ct2-int8" else "default")
    raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def timed_run(translator, texts: list[str], batch_size: int, search: dict[str, Any]
              ) -> dict[str, Any]:
    """Translate ``texts`` in consecutive calls of ``batch_size`` sentences; wall-clock timing.

    Returns sentences/s, target tokens/s (generated subwords, EOS excluded), call latencies
    p50/p95 in milliseconds, CPU/wall ratio, and the outputs (text and token ids).
    """
    latencies, results = [], []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), batch_size):
        s = time.perf_counter()
        results.extend(translator.translate(texts[i:i + batch_size], **search))
        latencies.append(time.perf_counter() - s)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(r.token_ids) for r in results)
    return {"batch_size": batch_size, "sentences": len(texts), "seconds": round(wall, 3),
            "sentences_per_s": round(len(texts) / wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "target_tokens": tokens,
            "latency_ms_p50": round(1000 * percentile(latencies, 50), 2),
            "latency_ms_p95": round(1000 * percentile(latencies, 95), 2),
            "latency_ms_mean": round(1000 * statistics.fmean(latencies), 2),
            "cpu_per_wall": round(cpu / wall, 2),
            "outputs": [r.text for r in results],
            "token_ids": [list(r.token_ids) for r in results]}


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one engine: load, warm up, time each batch size; returns the result record."""
    from runtime.corpus import read_parallel

    sources, _ = read_parallel(cfg["data"], cfg["split"], cfg["src"], cfg["tgt"])
    texts = sources[:cfg["limit"]]
    search = cfg["search"]
    t0 = time.perf_counter()
    translator = load_engine(cfg["engine"], cfg["artifact"], cfg["threads"])
    out: dict[str, Any] = {"engine": cfg["engine"], "artifact": cfg["artifact"],
                           "threads": cfg["threads"],
                           "load_seconds": round(time.perf_counter() - t0, 2),
                           "rss_after_load_mib": rss_mib(), "runs": {}}
    for bs in cfg["batch_sizes"]:  # warm-up, not timed: allocators, kernels, caches
        for i in range(0, max(bs, cfg["warmup"]) if bs == 1 else bs, bs):  # as timed below
            translator.translate(texts[i:i + bs], **search)
    profiler = None
    if cfg.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
    for bs in cfg["batch_sizes"]:
        if profiler:
            profiler.enable()
        # --repeat R: the fastest of R passes (the least disturbed by other processes).
        passes = [timed_run(translator, texts, bs, search) for _ in range(cfg.get("repeat", 1))]
        best = min(passes, key=lambda r: r["seconds"])
        best["seconds_all_passes"] = [r["seconds"] for r in passes]
        out["runs"][str(bs)] = best
        if profiler:
            profiler.disable()
            out["runs"][str(bs)]["profile"] = profile_summary(
                profiler, Path(cfg["profile"]) / f"{cfg['engine']}-bs{bs}.prof")
            profiler = type(profiler)()
    out["peak_rss_mib"] = peak_rss_mib()
    stats = getattr(translator, "stats", None)
    if stats is not None:
        out["engine_stats"] = dict(stats)
    return out


def profile_summary(profiler, path: Path, top: int = 25) -> list[str]:
    """Save cProfile stats to ``path`` and return the top functions by own time as text."""
    import io
    import pstats

    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(str(path))
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(top)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-top - 1:]


# ---- CTranslate2 vs the reference ------------------------------------------------------------

def check_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """CTranslate2 fp32 against the PyTorch reference search on the same token ids.

    Greedy (K=1) and beam (K = --beam, lp power): token-identical counts; each mismatch gets
    the reference's gap at the first diverging step (|log p(a_t) - log p(b_t)| after the
    shared prefix, EOS standing for the end) and the gap between the two hypotheses' final
    reference scores (normalized). Kinds: ``max_length`` (the divergence is at the sentence's
    last allowed step, where our spec allows only EOS and CTranslate2 any token; see
    ``ct2_convert.ct2_search_options``), ``near_tie`` (step gap <= 1e-4, DESIGN.md's parity
    rule), ``final_ranking_tie`` (final scores within 1e-4), ``other``. Also the largest
    |score diff| on identical outputs and how many sentences reach the max length.
    """
    import torch
    from ct2_convert import CT2Translator

    from runtime.contract import BOS_ID, EOS_ID
    from runtime.corpus import read_parallel
    from runtime.searchspec import length_penalty, max_output_length
    from train.checkpoint import load_checkpoint
    from train.search import beam_search

    torch.set_num_threads(cfg["threads"])
    model, tokenizer, _ = load_checkpoint(cfg["checkpoint"])
    ct2 = CT2Translator.load(cfg["ct2_dir"], threads=cfg["threads"])
    sources, _ = read_parallel(cfg["data"], cfg["split"], cfg["src"], cfg["tgt"])
    src_ids = [tokenizer.encode_source(s)[:model.cfg.max_positions] for s in
               sources[:cfg["limit"]]]
    todo = [i for i, s in enumerate(src_ids) if s]
    s = cfg["search"]
    alpha, a, b = s["length_penalty"], s["max_len_a"], s["max_len_b"]

    def ref_logprobs(src: list[int], prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([src]), torch.tensor([[BOS_ID] + prefix]))
        return torch.log_softmax(logits[0].float(), dim=-1)  # (T, V)

    def ref_score(src: list[int], hyp: list[int]) -> float:
        lp = ref_logprobs(src, hyp)
        target = torch.tensor(hyp + [EOS_ID])
        total = float(lp[torch.arange(len(target)), target].sum())
        return total / length_penalty(len(target), alpha, "power")

    report: dict[str, Any] = {"sentences": len(todo), "search": s}
    for name, K in (("greedy", 1), ("beam", s["beam_size"])):
        ref, got = {}, {}
        for c in range(0, len(todo), 32):
            chunk = todo[c:c + 32]
            batch = [src_ids[i] for i in chunk]
            for i, h in zip(chunk, beam_search(model, batch, beam_size=K, length_penalty=alpha,
                                               lp_type="power", max_len_a=a, max_len_b=b)):
                ref[i] = h[0]
            for i, h in zip(chunk, ct2.search(batch, K, alpha, "power", a, b)):
                got[i] = h[0]
        identical, max_diff, mismatches, at_limit = 0, 0.0, [], 0
        for i in todo:
            r, g = ref[i], got[i]
            limit = max_output_length(len(src_ids[i]), a, b, model.cfg.max_positions)
            if len(r.tokens) + 1 >= limit or len(g.tokens) + 1 >= limit:
                at_limit += 1
            if r.tokens == g.tokens:
                identical += 1
                max_diff = max(max_diff, abs(r.normalized_score - g.normalized_score))
                continue
            ra, ga = r.tokens + [EOS_ID], g.tokens + [EOS_ID]
            t = next(k for k in range(min(len(ra), len(ga))) if ra[k] != ga[k])
            lp = ref_logprobs(src_ids[i], ra[:t])[-1]
            gap = abs(float(lp[ra[t]] - lp[ga[t]]))
            final_gap = abs(ref_score(src_ids[i], r.tokens) - ref_score(src_ids[i], g.tokens))
            kind = ("max_length" if t == limit - 1 else  # ours: only EOS; CT2: any token
                    "near_tie" if gap <= NEAR_TIE else
                    "final_ranking_tie" if final_gap <= NEAR_TIE else "other")
            mismatches.append({"index": i, "step": t, "kind": kind, "step_gap": gap,
                               "final_score_gap": final_gap,
                               "reference": tokenizer.decode(r.tokens),
                               "ctranslate2": tokenizer.decode(g.tokens)})
        report[name] = {
            "beam_size": K, "identical": identical, "n": len(todo),
            "near_tie": sum(m["kind"] == "near_tie" for m in mismatches),
            "final_ranking_tie": sum(m["kind"] == "final_ranking_tie" for m in mismatches),
            "max_length": sum(m["kind"] == "max_length" for m in mismatches),
            "other": sum(m["kind"] == "other" for m in mismatches),
            "max_abs_score_diff_identical": max_diff, "reached_max_length": at_limit,
            "mismatches": mismatches}
    report["ct2_stats"] = dict(ct2.stats)
    return report


# ---- artifacts --------------------------------------------------------------------------------

def checkpoint_id(ckpt: Path) -> str:
    from runtime.checksums import sha256_file

    return sha256_file(ckpt / "model.safetensors")


def prepare_artifacts(engines: list[str], ckpt: Path, work: Path, rebuild: bool
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """Build what the engines need under ``work`` (reused while the checkpoint is the same).

    Returns ({engine: artifact path}, {engine: why it is unavailable}).
    """
    sha = checkpoint_id(ckpt)
    work = work / sha[:12]
    work.mkdir(parents=True, exist_ok=True)
    paths, errors = {}, {}
    for engine in engines:
        try:
            if engine == "torch":
                paths[engine] = str(ckpt)
            elif engine.startswith("ct2-"):
                from ct2_convert import SOURCE_RECORD, convert_checkpoint

                out = work / "ct2-fp32"  # int8 quantizes at load (compute_type)
                record = out / SOURCE_RECORD
                fresh = record.is_file() and json.loads(record.read_text()).get(
                    "checkpoint_sha256") == sha
                if rebuild or not fresh:
                    log(f"converting {ckpt} to CTranslate2 -> {out}")
                    convert_checkpoint(ckpt, out, force=True)
                paths[engine] = str(out)
            elif engine in PACKAGE_VARIANTS:
                paths[engine] = str(ensure_package(ckpt, work / f"pkg-{engine[4:]}", sha,
                                                   PACKAGE_VARIANTS[engine], rebuild))
        except Exception as e:  # noqa: BLE001 - reported per engine, the others still run
            errors[engine] = f"{type(e).__name__}: {e}"
            log(f"{engine}: unavailable ({errors[engine]})")
    return paths, errors


def ensure_package(ckpt: Path, out: Path, sha: str, variant_args: list[str], rebuild: bool
                   ) -> Path:
    """An ONNX package of ``ckpt`` at ``out`` (``aiayn export``), rebuilt when stale."""
    manifest = out / "manifest.json"
    if manifest.is_file() and not rebuild and sha in manifest.read_text():
        return out
    log(f"exporting {ckpt} -> {out} {' '.join(variant_args)}".rstrip())
    cmd = [sys.executable, "-c", "import sys; from runtime.dispatch import main; "
           "sys.exit(main())", "export", str(ckpt), "--out", str(out), "--force", *variant_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not manifest.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`aiayn export {' '.join(variant_args)}` failed: {' | '.join(tail)}")
    return out


# ---- orchestration ------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_subprocess(kind: str, cfg: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """Run ``worker`` or ``check_worker`` in a fresh interpreter; returns its JSON record or
    {"error": ...} with the tail of its stderr."""
    with tempfile.TemporaryDirectory(prefix="aiayn-bench-") as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "out.json"
        cfg_path.write_text(json.dumps(cfg))
        cmd = [sys.executable, str(Path(__file__).resolve()), f"--{kind}", str(cfg_path),
               "--worker-out", str(out_path)]
        load_before = load_average()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s", "load_before": load_before}
        if proc.returncode != 0 or not out_path.is_file():
            tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
            return {"error": f"exit {proc.returncode}: {tail}", "load_before": load_before}
        rec = json.loads(out_path.read_text())
        rec["load_before"], rec["load_after"] = load_before, load_average()
        return rec


def summarize(results: dict[str, dict], references: list[str], batch_sizes: list[int]
              ) -> None:
    """Add BLEU (of the largest batch size's outputs), batch invariance and agreement with
    the torch reference to each engine record, in place."""
    from runtime.evaluate import score

    ref_ids = None
    if "torch" in results and "runs" in results["torch"]:
        ref_ids = results["torch"]["runs"][str(batch_sizes[-1])]["token_ids"]
    for rec in results.values():
        if "runs" not in rec:
            continue
        runs = [rec["runs"][str(bs)] for bs in batch_sizes]
        main_run = runs[-1]
        s = score(main_run["outputs"], references[:len(main_run["outputs"])])
        rec["bleu"], rec["chrf"], rec["bleu_signature"] = s["bleu"], s["chrf"], s["bleu_signature"]
        rec["batch_invariant"] = all(r["token_ids"] == main_run["token_ids"] for r in runs)
        if ref_ids is not None:
            rec["identical_to_reference"] = sum(x == y for x, y in zip(main_run["token_ids"],
                                                                      ref_ids))


def targets(results: dict[str, dict], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """The issue's targets: ort-fp32 >= 2x torch at the largest batch; ort-fp32 >= ct2-fp32 at
    every batch size (sentences/s)."""

    def rate(engine: str, bs: int) -> float | None:
        rec = results.get(engine, {})
        run = rec.get("runs", {}).get(str(bs))
        return run["sentences_per_s"] if run else None

    out = []
    big = max(batch_sizes)
    checks = [("ort-fp32", "torch", big, 2.0)] + [("ort-fp32", "ct2-fp32", bs, 1.0)
                                                  for bs in batch_sizes]
    for engine, peer, bs, factor in checks:
        x, y = rate(engine, bs), rate(peer, bs)
        ratio = round(x / y, 2) if x and y else None
        out.append({"target": f"{engine} >= {factor:g}x {peer} at batch {bs}",
                    "ratio": ratio, "met": None if ratio is None else ratio >= factor})
    return out


SECTION_TITLE = "## Translation: PyTorch reference vs ONNX runtime vs CTranslate2"


def section(reports: list[dict[str, Any]]) -> str:
    """The bench/RESULTS.md section for one or more runs (e.g. 2 threads and 1 thread)."""
    parts = [SECTION_TITLE, "",
             "Generated by `bench/translate.py` (re-render saved runs with `--render A.json "
             "B.json --results-md bench/RESULTS.md`).", ""]
    parts += [markdown(r) for r in reports]
    bss = reports[0]["config"]["batch_sizes"] if reports else [1]
    sig = next((r.get("bleu_signature") for r in reports if r.get("bleu_signature")), "")
    parts += ["Columns: sent/s and tok/s (generated target subwords without EOS per second) "
              "over all batches at batch size @N; p50/p95: latency of one single-sentence "
              "call; peak RSS: the engine's process (getrusage maxrss); BLEU: sacreBLEU "
              f"({sig}) of the @{bss[-1]} outputs; = ref: outputs token-identical to the torch "
              "reference; CPU/wall: process CPU seconds per wall second at each batch size "
              "(up to the thread count when the engine keeps its threads busy); load 1m: the "
              "machine's 1-minute load average before → after the engine's process (its own "
              "threads included; above the thread count means other processes competed).", ""]
    return "\n".join(parts)


def markdown(report: dict[str, Any]) -> str:
    """One run's subsection: setup, table, targets, CTranslate2 check."""
    cfg, m = report["config"], report["machine"]
    bss = cfg["batch_sizes"]
    threads = cfg["threads"]
    lines = [
        f"### {threads} intra-op thread{'s' if threads != 1 else ''} per engine "
        f"({report['date'][:10]})",
        "",
        f"- Date: {report['date']}",
        f"- Machine: {m['cpu_model']}, {m['cores']} cores; load average (1/5/15 min) "
        f"{m['load_start']} at start, {m['load_end']} at end",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- Work: first {cfg['sentences']} sentences of {cfg['split']} "
        f"({cfg['src']}→{cfg['tgt']}), model `{cfg['model']}`, beam {cfg['search']['beam_size']}, "
        f"alpha {cfg['search']['length_penalty']}, lp {cfg['search']['lp_type']}, max length "
        f"{cfg['search']['max_len_a']:g}·S_src+{cfg['search']['max_len_b']}; "
        f"{cfg['threads']} intra-op threads for every engine; each engine in its own process; "
        "text in → text out (tokenization included); batches are consecutive corpus sentences; "
        f"{cfg.get('repeat', 1)} timed pass(es) per batch size after a warm-up, the fastest "
        "reported",
        f"- Command: `{report['command']}` at commit {report['source']['commit']}"
        + (f" with uncommitted changes in {', '.join(report['source']['uncommitted'])}"
           if report["source"]["uncommitted"] else ""),
        "",
    ]
    head = ["engine"]
    for bs in bss:
        head += [f"sent/s @{bs}", f"tok/s @{bs}"]
    head += ["p50 ms @1", "p95 ms @1", "peak RSS MiB", "BLEU", "= ref", "CPU/wall",
             "load 1m"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, rec in report["engines"].items():
        if "runs" not in rec:
            lines.append(f"| {engine} | unavailable: {rec.get('error', '?')} |")
            continue
        row = [engine]
        for bs in bss:
            r = rec["runs"][str(bs)]
            row += [f"{r['sentences_per_s']:.1f}", f"{r['tokens_per_s']:.0f}"]
        b1 = rec["runs"].get("1")
        row += [f"{b1['latency_ms_p50']:.1f}" if b1 else "–",
                f"{b1['latency_ms_p95']:.1f}" if b1 else "–",
                f"{rec['peak_rss_mib']:.0f}", f"{rec['bleu']:.2f}",
                f"{rec['identical_to_reference']}/{cfg['sentences']}"
                if "identical_to_reference" in rec else "–",
                "/".join(f"{rec['runs'][str(bs)]['cpu_per_wall']:.2f}" for bs in bss),
                "→".join(f"{x[0]:.1f}" for x in (rec.get("load_before"), rec.get("load_after"))
                         if x)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Targets (sentences/s ratios):", ""]
    for t in report["targets"]:
        met = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"- {t['target']}: {t['ratio'] if t['ratio'] is not None else '–'} ({met})")
    chk = report.get("ct2_check")
    if chk and "greedy" in chk:
        lines += ["", "CTranslate2 fp32 vs the PyTorch reference (same token ids, lp power):", ""]
        for name in ("greedy", "beam"):
            c = chk[name]
            lines.append(
                f"- {name} (K={c['beam_size']}): {c['identical']}/{c['n']} token-identical; "
                f"mismatches by kind: near tie {c['near_tie']} (reference gap ≤ {NEAR_TIE:g} "
                f"at the first diverging step), final-ranking tie {c['final_ranking_tie']}, "
                f"max length {c['max_length']} (there our spec allows only EOS, CTranslate2 "
                f"any token), other {c['other']}; max |normalized score diff| on identical "
                f"outputs {c['max_abs_score_diff_identical']:.1e}; sentences reaching the max "
                f"length: {c['reached_max_length']}")
    elif chk:
        lines += ["", f"CTranslate2 check: {chk.get('error')}"]
    return "\n".join(lines + [""])


def update_results_md(path: Path, section: str) -> None:
    """Write ``section`` between this benchmark's markers in ``path``, keeping other sections."""
    block = f"{MARK_BEGIN}\n{section.rstrip()}\n{MARK_END}\n"
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmark results\n\n"
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        tail = rest.split(MARK_END, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="aiayn checkpoint (default: the bundled model)")
    p.add_argument("--data", default=None,
                   help="corpus folder (default: $AIAYN_DATA or ../shared/data/multi30k)")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--limit", type=int, default=1000, help="first N sentences (default 1000)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads for every engine (default: all cores)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--lp-type", default="power", choices=("power", "gnmt"),
                   help="power (default; the only penalty CTranslate2 has) or gnmt (CTranslate2 "
                        "engines are then skipped)")
    p.add_argument("--max-len-a", type=float, default=1.0)
    p.add_argument("--max-len-b", type=int, default=50)
    p.add_argument("--warmup", type=int, default=8,
                   help="single-sentence calls before timing batch 1 (larger batch sizes "
                        "warm up with one call of their size)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed passes per batch size; the fastest is reported (default 1)")
    p.add_argument("--check-n", type=int, default=None,
                   help="sentences for the CTranslate2-vs-reference check "
                        "(default: --limit; 0 skips it)")
    p.add_argument("--work", default=None,
                   help="folder for converted models and packages "
                        "(default: ${XDG_CACHE_HOME:-~/.cache}/aiayn/bench)")
    p.add_argument("--rebuild", action="store_true", help="re-convert / re-export artifacts")
    p.add_argument("--out", default=None,
                   help="JSON result file (default: results.json in the --work folder)")
    p.add_argument("--keep-outputs", action="store_true",
                   help="keep every engine's translations and token ids in the JSON")
    p.add_argument("--results-md", default=None, help="update this RESULTS.md section")
    p.add_argument("--profile", action="store_true",
                   help="cProfile each timed run (slower; .prof files beside --out)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per engine process")
    p.add_argument("--render", nargs="+", metavar="JSON",
                   help="only render saved result files (one subsection each) as markdown")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--check", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.render:
        text = section([json.loads(Path(f).read_text(encoding="utf-8")) for f in args.render])
        print(text)
        if args.results_md:
            update_results_md(Path(args.results_md), text)
            log(f"updated {args.results_md}")
        return 0
    if args.worker or args.check:
        cfg = json.loads(Path(args.worker or args.check).read_text())
        rec = worker(cfg) if args.worker else check_worker(cfg)
        Path(args.worker_out).write_text(json.dumps(rec))
        return 0

    from runtime.corpus import default_data_dir, read_parallel

    if any(bs < 1 for bs in args.batch_sizes):
        p.error("--batch-sizes must be positive")
    batch_sizes = sorted(set(args.batch_sizes))
    threads = args.threads or os.cpu_count() or 1
    data = Path(args.data) if args.data else default_data_dir()
    sources, references = read_parallel(data, args.split, args.src, args.tgt)
    n = min(args.limit, len(sources))
    ckpt = Path(args.model).resolve()
    work = Path(args.work) if args.work else Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "aiayn" / "bench"
    search = {"beam_size": args.beam, "length_penalty": args.alpha, "lp_type": args.lp_type,
              "max_len_a": args.max_len_a, "max_len_b": args.max_len_b}
    engines = list(dict.fromkeys(args.engines))
    skipped = {}
    if args.lp_type != "power":
        skipped = {e: "CTranslate2 implements only lp_type power" for e in engines
                   if e.startswith("ct2-")}
        engines = [e for e in engines if e not in skipped]

    report: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python bench/translate.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:]),
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(),
                    "platform": platform.platform(), "load_start": load_average()},
        "versions": library_versions(),
        "source": source_state(),
        "config": {"model": os.path.relpath(ckpt, REPO) if ckpt.is_relative_to(REPO) else str(ckpt),
                   "split": args.split, "src": args.src, "tgt": args.tgt, "sentences": n,
                   "threads": threads, "batch_sizes": batch_sizes, "search": search,
                   "warmup": args.warmup, "repeat": max(1, args.repeat)},
        "engines": {},
    }
    paths, errors = prepare_artifacts(engines, ckpt, work, args.rebuild)
    errors.update(skipped)
    out_path = Path(args.out) if args.out else work / "results.json"
    for engine in args.engines:
        if engine in errors:
            report["engines"][engine] = {"error": errors[engine]}
            continue
        log(f"{engine}: {n} sentences, batch sizes {batch_sizes}, {threads} threads "
            f"(load average {load_average()})")
        cfg = {"engine": engine, "artifact": paths[engine], "threads": threads,
               "batch_sizes": batch_sizes, "search": search, "data": str(data),
               "split": args.split, "src": args.src, "tgt": args.tgt, "limit": n,
               "warmup": args.warmup, "repeat": max(1, args.repeat),
               "profile": str(out_path.with_suffix("")) + "-profile" if args.profile else None}
        rec = run_subprocess("worker", cfg, args.timeout)
        report["engines"][engine] = rec
        if "error" in rec:
            log(f"{engine}: FAILED {rec['error']}")
        else:
            log(f"{engine}: " + ", ".join(
                f"@{bs} {rec['runs'][str(bs)]['sentences_per_s']} sent/s"
                for bs in batch_sizes) + f", peak RSS {rec['peak_rss_mib']} MiB")
    summarize(report["engines"], references, batch_sizes)
    report["targets"] = targets(report["engines"], batch_sizes)
    sigs = [r["bleu_signature"] for r in report["engines"].values() if "bleu_signature" in r]
    report["bleu_signature"] = sigs[0] if sigs else ""

    check_n = n if args.check_n is None else min(args.check_n, n)
    ct2_dir = paths.get("ct2-fp32") or paths.get("ct2-int8")
    if check_n > 0 and ct2_dir:
        log(f"checking CTranslate2 against the reference on {check_n} sentences")
        report["ct2_check"] = run_subprocess("check", {
            "checkpoint": str(ckpt), "ct2_dir": ct2_dir, "threads": threads,
            "search": search, "data": str(data), "split": args.split, "src": args.src,
            "tgt": args.tgt, "limit": check_n}, args.timeout)
    report["machine"]["load_end"] = load_average()

    if not args.keep_outputs:
        for rec in report["engines"].values():
            for run in rec.get("runs", {}).values():
                run.pop("outputs", None)
                run.pop("token_ids", None)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    text = section([report])
    print(text)
    if args.results_md:
        update_results_md(Path(args.results_md), text)
        log(f"updated {args.results_md}")
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
