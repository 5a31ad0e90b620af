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

GPU engines (not in the default set; ``--engines torch-cuda ort-cuda-fp32 ort-cuda-fp16``):

    torch-cuda      TorchTranslator on device cuda (timing synchronizes CUDA after each call)
    ort-cuda-fp32   Translator on the fp32 package, backend ort-cuda (IO binding: caches stay
                    on the GPU; results are on the host when ``translate`` returns)
    ort-cuda-fp16   ... on the fp16 package (``aiayn export --fp16``)

``--package-fp32`` / ``--package-fp16`` name prebuilt packages (checked to be of ``--model``),
so nothing is exported on the GPU machine; without them they are exported into ``--work``.
With GPU engines the reference for "= ref" is ``torch-cuda`` (else ``torch``), and the target
is ort-cuda-fp16 >= 3x torch-cuda at the largest batch size. ``--batch1-limit N`` times batch
1 on the first N sentences only (other batch sizes: all ``--limit``).

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
    python bench/translate.py --engines torch-cuda ort-cuda-fp32 ort-cuda-fp16 --lp-type gnmt \
        --package-fp32 PKG32 --package-fp16 PKG16 --batch-sizes 1 64 --batch1-limit 200

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

CPU_ENGINES = ("torch", "ort-fp32", "ort-opt", "ort-int8", "ct2-fp32", "ct2-int8")
GPU_ENGINES = ("torch-cuda", "ort-cuda-fp32", "ort-cuda-fp16")
ENGINES = CPU_ENGINES + GPU_ENGINES
PACKAGE_VARIANTS = {"ort-fp32": [], "ort-opt": ["--optimize"], "ort-int8": ["--int8"],
                    "ort-cuda-fp32": [], "ort-cuda-fp16": ["--fp16"]}
PACKAGE_VARIANT_NAME = {"ort-fp32": "fp32", "ort-opt": "optimized", "ort-int8": "int8",
                        "ort-cuda-fp32": "fp32", "ort-cuda-fp16": "fp16"}
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
    for dist in ("torch", "onnxruntime", "onnxruntime-gpu", "ctranslate2", "numpy",
                 "sentencepiece", "sacrebleu"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


def gpu_model() -> str | None:
    """The first GPU's name and memory from nvidia-smi, None without one."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


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


def peak_rss_source() -> str:
    """How ``peak_rss_mib`` measures here: "VmHWM" (Linux /proc) or "getrusage maxrss"."""
    try:
        return "VmHWM" if "VmHWM:" in Path("/proc/self/status").read_text() else \
            "getrusage maxrss"
    except OSError:
        return "getrusage maxrss"


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB: /proc/self/status VmHWM on Linux (the
    high-water mark of this program's own memory; ``ru_maxrss`` would include the parent's
    peak, inherited across fork + exec), else ``getrusage`` (Linux reports KiB, macOS bytes)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
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

def load_engine(engine: str, artifact: str, threads: int, cpu_stand_in: bool = False):
    """The translator of ``engine`` (anything with ``translate(texts, **search)``).

    ``artifact`` is the checkpoint (torch*), the package (ort-*) or the CTranslate2 model
    directory (ct2-*). ``cpu_stand_in`` runs the GPU engines on cpu / ort-cpu (dry runs of
    the GPU benchmark's plumbing on a machine without one). Raises ImportError naming what
    is missing.
    """
    if engine in ("torch", "torch-cuda"):
        from train.translator import TorchTranslator

        device = "cuda" if engine == "torch-cuda" and not cpu_stand_in else "cpu"
        return TorchTranslator.load(artifact, device=device, threads=threads)
    if engine.startswith("ort-"):
        from runtime.translator import Translator

        gpu = engine.startswith("ort-cuda-") and not cpu_stand_in
        return Translator.load(artifact, backend="ort-cuda" if gpu else "ort-cpu",
                               threads=threads)
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


def timed_run(translator, texts: list[str], batch_size: int, search: dict[str, Any],
              sync=None) -> dict[str, Any]:
    """Translate ``texts`` in consecutive calls of ``batch_size`` sentences; wall-clock timing.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called before the clock starts and at the
    end of every call, so asynchronous device work is inside the call it belongs to.
    Returns sentences/s, target tokens/s (generated subwords, EOS excluded), call latencies
    p50/p95 in milliseconds, CPU/wall ratio, and the outputs (text and token ids).
    """
    sync = sync or (lambda: None)
    latencies, results = [], []
    sync()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), batch_size):
        s = time.perf_counter()
        results.extend(translator.translate(texts[i:i + batch_size], **search))
        sync()
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
    stand_in = bool(cfg.get("cpu_stand_in"))
    t0 = time.perf_counter()
    translator = load_engine(cfg["engine"], cfg["artifact"], cfg["threads"], stand_in)
    out: dict[str, Any] = {"engine": cfg["engine"], "artifact": cfg["artifact"],
                           "threads": cfg["threads"],
                           "load_seconds": round(time.perf_counter() - t0, 2),
                           "rss_after_load_mib": rss_mib(), "runs": {}}
    sync = None
    if cfg["engine"] in GPU_ENGINES:
        out["device"] = device_info(translator)
        if stand_in:
            out["device"]["cpu_stand_in"] = True
        if cfg["engine"] == "torch-cuda" and not stand_in:
            import torch

            sync = torch.cuda.synchronize
    batch1 = cfg.get("batch1_limit")
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
        run_texts = texts[:batch1] if bs == 1 and batch1 else texts
        passes = [timed_run(translator, run_texts, bs, search, sync)
                  for _ in range(cfg.get("repeat", 1))]
        best = min(passes, key=lambda r: r["seconds"])
        best["seconds_all_passes"] = [r["seconds"] for r in passes]
        out["runs"][str(bs)] = best
        if profiler:
            profiler.disable()
            out["runs"][str(bs)]["profile"] = profile_summary(
                profiler, Path(cfg["profile"]) / f"{cfg['engine']}-bs{bs}.prof")
            profiler = type(profiler)()
    out["peak_rss_mib"], out["peak_rss_source"] = peak_rss_mib(), peak_rss_source()
    if sync is not None:
        import torch

        out["device"]["peak_allocated_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    stats = getattr(translator, "stats", None)
    if stats is not None:
        out["engine_stats"] = dict(stats)
    return out


def device_info(translator) -> dict[str, Any]:
    """Where a GPU engine runs: torch's device and GPU name, or the runtime's providers."""
    if hasattr(translator, "describe"):
        d = translator.describe()
        return {k: d[k] for k in ("backend", "providers", "device", "variant", "cache_dtype",
                                  "onnxruntime") if k in d}
    info: dict[str, Any] = {"device": str(translator.device)}
    if str(translator.device).startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name()
    return info


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


def prepare_artifacts(engines: list[str], ckpt: Path, work: Path, rebuild: bool,
                      prebuilt: dict[str, str] | None = None
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """Build what the engines need under ``work`` (reused while the checkpoint is the same).

    ``prebuilt`` maps package engines to ready packages (``--package-fp32/-fp16``), used
    instead of exporting once checked to be of ``ckpt`` and of the engine's variant.
    Returns ({engine: artifact path}, {engine: why it is unavailable}).
    """
    prebuilt = prebuilt or {}
    sha = checkpoint_id(ckpt)
    work = work / sha[:12]
    work.mkdir(parents=True, exist_ok=True)
    paths, errors = {}, {}
    for engine in engines:
        try:
            if engine in ("torch", "torch-cuda"):
                paths[engine] = str(ckpt)
            elif prebuilt.get(engine):
                paths[engine] = str(check_package(Path(prebuilt[engine]), sha,
                                                  PACKAGE_VARIANT_NAME[engine]))
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
                name = engine.rsplit("-", 1)[1]  # ort-cuda-fp32 shares ort-fp32's package
                paths[engine] = str(ensure_package(ckpt, work / f"pkg-{name}", sha,
                                                   PACKAGE_VARIANTS[engine], rebuild))
        except Exception as e:  # noqa: BLE001 - reported per engine, the others still run
            errors[engine] = f"{type(e).__name__}: {e}"
            log(f"{engine}: unavailable ({errors[engine]})")
    return paths, errors


def check_package(path: Path, sha: str, variant: str) -> Path:
    """``path`` if it is a package of the checkpoint with weights ``sha`` and of ``variant``
    (from its manifest; checksums are verified when the engine loads it), else ValueError."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise ValueError(f"{path} is not a model package (no manifest.json)")
    m = json.loads(manifest.read_text(encoding="utf-8"))
    got = m.get("source_checkpoint", {}).get("sha256")
    if got and got != sha:
        raise ValueError(f"{path} was exported from another checkpoint ({got[:12]}…, "
                         f"not {sha[:12]}…)")
    if m.get("variant") != variant:
        raise ValueError(f"{path} is a {m.get('variant')} package, not {variant}")
    return path


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

def write_report(report: dict[str, Any], out_path: Path, keep_outputs: bool
                 ) -> dict[str, Any]:
    """Write ``report`` as JSON (without translations and token ids unless ``keep_outputs``);
    returns what was written. ``report`` itself keeps them."""
    if not keep_outputs:
        report = {**report, "engines": {
            name: {**rec, "runs": {bs: {k: v for k, v in run.items()
                                        if k not in ("outputs", "token_ids")}
                                   for bs, run in rec["runs"].items()}} if "runs" in rec else rec
            for name, rec in report["engines"].items()}}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(out_path)
    return report


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
              ) -> str | None:
    """Add BLEU (of the largest batch size's outputs), batch invariance and agreement with
    the reference engine (``torch-cuda`` when it ran, else ``torch``) to each engine record,
    in place. Returns the reference engine's name (None without one)."""
    from runtime.evaluate import score

    ref_ids, ref_name = None, None
    for name in ("torch-cuda", "torch"):
        run = results.get(name, {}).get("runs", {}).get(str(batch_sizes[-1]))
        if run and "token_ids" in run:
            ref_ids, ref_name = run["token_ids"], name
            break
    for rec in results.values():
        if "runs" not in rec:
            continue
        runs = [rec["runs"][str(bs)] for bs in batch_sizes]
        main_run = runs[-1]
        if "token_ids" not in main_run:  # already summarized, outputs dropped
            continue
        s = score(main_run["outputs"], references[:len(main_run["outputs"])])
        rec["bleu"], rec["chrf"], rec["bleu_signature"] = s["bleu"], s["chrf"], s["bleu_signature"]
        # a batch-1 run over fewer sentences (--batch1-limit) is compared on those
        rec["batch_invariant"] = all(
            r["token_ids"] == main_run["token_ids"][:len(r["token_ids"])] for r in runs)
        if ref_ids is not None:
            rec["reference_engine"] = ref_name
            rec["identical_to_reference"] = sum(x == y for x, y in zip(main_run["token_ids"],
                                                                      ref_ids))
    return ref_name


def targets(results: dict[str, dict], batch_sizes: list[int]) -> list[dict[str, Any]]:
    """The targets (sentences/s), for the engines that were asked for: on the CPU ort-fp32 >=
    2x torch at the largest batch and ort-fp32 >= ct2-fp32 at every batch size; on the GPU
    ort-cuda-fp16 >= 3x torch-cuda at the largest batch."""

    def rate(engine: str, bs: int) -> float | None:
        rec = results.get(engine, {})
        run = rec.get("runs", {}).get(str(bs))
        return run["sentences_per_s"] if run else None

    out = []
    big = max(batch_sizes)
    checks = []
    if any(e in results for e in CPU_ENGINES):
        checks += [("ort-fp32", "torch", big, 2.0)] + [("ort-fp32", "ct2-fp32", bs, 1.0)
                                                       for bs in batch_sizes]
    if any(e in results for e in GPU_ENGINES):
        checks.append(("ort-cuda-fp16", "torch-cuda", big, 3.0))
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
    recs = [rec for r in reports for rec in r["engines"].values() if "runs" in rec]
    rss = ("VmHWM" if recs and all(rec.get("peak_rss_source") == "VmHWM" for rec in recs)
           else "getrusage maxrss")
    parts += ["Columns: sent/s and tok/s (generated target subwords without EOS per second) "
              "over all batches at batch size @N; p50/p95: latency of one single-sentence "
              f"call; peak RSS: the engine's process ({rss}); BLEU: sacreBLEU "
              f"({sig}) of the @{bss[-1]} outputs; = ref: outputs token-identical to the torch "
              "reference; CPU/wall: process CPU seconds per wall second at each batch size "
              "(up to the thread count when the engine keeps its threads busy); load 1m: the "
              "machine's 1-minute load average before → after the engine's process (its own "
              "threads included; above the thread count means other processes competed)."
              + (" GPU runs: = torch-cuda: token-identical to the PyTorch reference on CUDA; "
                 "p50 ms @N: latency of one N-sentence call; peak RSS is host memory."
                 if any(e in GPU_ENGINES for r in reports for e in r["engines"]) else ""), ""]
    return "\n".join(parts)


def markdown(report: dict[str, Any]) -> str:
    """One run's subsection: setup, table, targets, CTranslate2 check."""
    cfg, m = report["config"], report["machine"]
    bss = cfg["batch_sizes"]
    threads = cfg["threads"]
    gpu = any(e in GPU_ENGINES for e in report["engines"])
    where = m.get("gpu") or ("the CPU (dry run)" if cfg.get("cpu_stand_in") else "the GPU")
    lines = [
        (f"### GPU engines on {where} ({report['date'][:10]})"
         if gpu else f"### {threads} intra-op thread{'s' if threads != 1 else ''} per engine "
         f"({report['date'][:10]})"),
        "",
        f"- Date: {report['date']}",
        f"- Machine: {m['cpu_model']}, {m['cores']} cores"
        + (f", GPU {m['gpu']}" if m.get("gpu") else "")
        + f"; load average (1/5/15 min) {m['load_start']} at start, "
        f"{m.get('load_end', '?')} at end",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- Work: first {cfg['sentences']} sentences of {cfg['split']} "
        f"({cfg['src']}→{cfg['tgt']}), model `{cfg['model']}`, beam {cfg['search']['beam_size']}, "
        f"alpha {cfg['search']['length_penalty']}, lp {cfg['search']['lp_type']}, max length "
        f"{cfg['search']['max_len_a']:g}·S_src+{cfg['search']['max_len_b']}; "
        f"{cfg['threads']} intra-op threads for every engine; each engine in its own process; "
        "text in → text out (tokenization included); batches are consecutive corpus sentences; "
        f"{cfg.get('repeat', 1)} timed pass(es) per batch size after a warm-up, the fastest "
        "reported"
        + (f"; batch 1 timed on the first {cfg['batch1_limit']} sentences only"
           if cfg.get("batch1_limit") and cfg["batch1_limit"] < cfg["sentences"] else "")
        + ("; GPU engines DRY RUN on the CPU (cpu / ort-cpu stand-ins)"
           if cfg.get("cpu_stand_in") else ""),
        f"- Command: `{report['command']}` at commit {report['source']['commit']}"
        + (f" with uncommitted changes in {', '.join(report['source']['uncommitted'])}"
           if report["source"]["uncommitted"] else ""),
        "",
    ]
    head = ["engine"]
    for bs in bss:
        head += [f"sent/s @{bs}", f"tok/s @{bs}"]
    big = str(bss[-1])
    head += ["p50 ms @1", "p95 ms @1"] + ([f"p50 ms @{big}"] if gpu and big != "1" else []) + [
        "peak RSS MiB", "BLEU",
        f"= {report.get('reference_engine') or 'ref'}" if gpu else "= ref", "CPU/wall",
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
                f"{b1['latency_ms_p95']:.1f}" if b1 else "–"]
        if gpu and big != "1":
            row.append(f"{rec['runs'][big]['latency_ms_p50']:.1f}")
        row += [f"{rec['peak_rss_mib']:.0f}", f"{rec['bleu']:.2f}",
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
    p.add_argument("--engines", nargs="+", default=list(CPU_ENGINES), choices=ENGINES,
                   help=f"default: the CPU engines {' '.join(CPU_ENGINES)}; GPU engines: "
                        f"{' '.join(GPU_ENGINES)}")
    p.add_argument("--package-fp32", default=None,
                   help="prebuilt fp32 package of --model for ort-fp32 / ort-cuda-fp32 "
                        "(default: exported into --work)")
    p.add_argument("--package-fp16", default=None,
                   help="prebuilt fp16 package of --model for ort-cuda-fp16")
    p.add_argument("--batch1-limit", type=int, default=None,
                   help="time batch size 1 on the first N sentences only (default: all)")
    p.add_argument("--cpu-stand-in", action="store_true",
                   help="dry run: the GPU engines run on cpu / ort-cpu (tests the plumbing "
                        "on a machine without a GPU; the report says so)")
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

    batch1 = min(args.batch1_limit, n) if args.batch1_limit else None
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
                   "warmup": args.warmup, "repeat": max(1, args.repeat),
                   "batch1_limit": batch1, "cpu_stand_in": args.cpu_stand_in},
        "engines": {},
    }
    if any(e in GPU_ENGINES for e in engines) and not args.cpu_stand_in:
        report["machine"]["gpu"] = gpu_model()
    prebuilt = {e: args.package_fp32 for e in ("ort-fp32", "ort-cuda-fp32")}
    prebuilt["ort-cuda-fp16"] = args.package_fp16
    paths, errors = prepare_artifacts(engines, ckpt, work, args.rebuild, prebuilt)
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
               "warmup": args.warmup, "repeat": max(1, args.repeat), "batch1_limit": batch1,
               "cpu_stand_in": args.cpu_stand_in,
               "profile": str(out_path.with_suffix("")) + "-profile" if args.profile else None}
        rec = run_subprocess("worker", cfg, args.timeout)
        report["engines"][engine] = rec
        if "error" in rec:
            log(f"{engine}: FAILED {rec['error']}")
        else:
            log(f"{engine}: " + ", ".join(
                f"@{bs} {rec['runs'][str(bs)]['sentences_per_s']} sent/s"
                for bs in batch_sizes) + f", peak RSS {rec['peak_rss_mib']} MiB")
        # partial results after every engine (a run cut short still leaves them)
        report["reference_engine"] = summarize(report["engines"], references, batch_sizes)
        report["targets"] = targets(report["engines"], batch_sizes)
        report["partial"] = True
        write_report(report, out_path, args.keep_outputs)
    report.pop("partial", None)
    report["reference_engine"] = summarize(report["engines"], references, batch_sizes)
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

    report = write_report(report, out_path, args.keep_outputs)
    text = section([report])
    print(text)
    if args.results_md:
        update_results_md(Path(args.results_md), text)
        log(f"updated {args.results_md}")
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
