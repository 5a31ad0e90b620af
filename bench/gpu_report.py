"""The JSON report of ``bench/gpu_check.sh``: each step merges its results into one file as it
finishes (so a run cut short still returns what it measured), and ``summary`` checks the
GPU targets of issue 7.

    python bench/gpu_report.py env REPORT --package PKG          # versions, GPU, providers
    python bench/gpu_report.py ortcheck REPORT --package PKG     # prints plain|preload|torch|none
    python bench/gpu_report.py step REPORT NAME RC SECONDS CAP   # a step's exit status
    python bench/gpu_report.py pytest REPORT JUNIT_XML
    python bench/gpu_report.py train REPORT TRAIN_JSON
    python bench/gpu_report.py parity REPORT fp16 PARITY_JSON
    python bench/gpu_report.py translate REPORT TRANSLATE_JSON
    python bench/gpu_report.py summary REPORT                     # targets: met / missed

Merges take an exclusive lock (steps may run concurrently) on ``$GPU_REPORT_LOCK`` (default
REPORT.lock). Nothing here imports torch or
onnxruntime except ``env``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# issue 7's targets
FP16_AGREEMENT = 0.98   # identical + near ties, share of sentences (beam 4)
FP16_BLEU_DELTA = 0.3   # |BLEU(ort-cuda fp16) - BLEU(reference)|
FP16_SPEEDUP = 3.0      # ort-cuda-fp16 sentences/s over torch-cuda at batch 64


@contextlib.contextmanager
def _locked(report: Path):
    report.parent.mkdir(parents=True, exist_ok=True)
    lock_path = os.environ.get("GPU_REPORT_LOCK") or report.with_name(report.name + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(report: Path) -> dict[str, Any]:
    try:
        return json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def merge(report: Path, path: list[str], value: Any) -> None:
    """Set ``report[path[0]][path[1]]... = value`` atomically under the lock."""
    with _locked(report):
        data = load(report)
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        tmp = report.with_name(report.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(report)


def _read_json(path: str) -> dict[str, Any]:
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("{")  # tolerate anything printed before the JSON
    return json.loads(text[start:])


# ---------------------------------------------------------------------------------- steps


def env_info(package: str | None) -> dict[str, Any]:
    """Python, torch (CUDA, GPU), onnxruntime (where from, providers) and whether the
    ort-cuda / ort-tensorrt backends start on ``package`` (a session, not the provider list,
    decides: ../shared/tools/GPU.md)."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                           "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                              "compute_cap,clocks.max.sm,power.limit", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"] = f"unavailable: {e}"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        out["commit"] = commit or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["commit"] = "unknown"
    try:
        import torch

        t: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                             "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            t["gpu"] = torch.cuda.get_device_name()
            t["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
            t["cudnn"] = torch.backends.cudnn.version()
            t["bf16_supported"] = torch.cuda.is_bf16_supported()
        out["torch"] = t
    except Exception as e:  # noqa: BLE001 - reported
        out["torch"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        import onnxruntime as ort

        out["onnxruntime"] = {"version": ort.__version__, "file": ort.__file__,
                              "device": ort.get_device(),
                              "available_providers": ort.get_available_providers()}
    except Exception as e:  # noqa: BLE001
        out["onnxruntime"] = {"error": f"{type(e).__name__}: {e}"}
    if package:
        out["backends"] = {}
        for backend in ("ort-cuda", "ort-tensorrt"):
            try:
                from runtime.backends import load_backend
                from runtime.package import Package

                engine = load_backend(backend, Package.load(package))
                out["backends"][backend] = {"ok": True,
                                            "providers": engine.describe().get("providers")}
            except Exception as e:  # noqa: BLE001 - a backend that does not start is a result
                out["backends"][backend] = {"ok": False,
                                            "error": f"{type(e).__name__}: {e}"[:400]}
    return out


_ORT_CHECK = """
import sys
{prelude}
from runtime.backends import load_backend
from runtime.package import Package
print(load_backend("ort-cuda", Package.load(sys.argv[1])).describe()["providers"])
"""
_PRELUDES = {
    "plain": "",  # as the torch-free runtime runs (bench/translate.py's ort workers)
    "preload": "import onnxruntime\nonnxruntime.preload_dlls()",  # ORT >= 1.21 helper
    "torch": "import torch",  # torch's bundled CUDA libraries loaded first
}


def ort_cuda_check(package: str) -> tuple[str, dict[str, Any]]:
    """Whether the ort-cuda backend starts in a fresh torch-free process ("plain"); if not,
    whether it does after ``onnxruntime.preload_dlls()`` ("preload") or after ``import
    torch`` ("torch"); else "none". Returns (mode, {mode: outcome})."""
    results: dict[str, Any] = {}
    for mode, prelude in _PRELUDES.items():
        try:
            proc = subprocess.run([sys.executable, "-c", _ORT_CHECK.format(prelude=prelude),
                                   package], capture_output=True, text=True, timeout=120)
            ok = proc.returncode == 0
            text = (proc.stdout if ok else proc.stderr).strip().splitlines()
        except (OSError, subprocess.SubprocessError) as e:
            ok, text = False, [f"{type(e).__name__}: {e}"]
        results[mode] = {"ok": ok, "output": (text[-1] if text else "")[:400]}
        if ok:
            return mode, results
    return "none", results


def pytest_summary(junit: str) -> dict[str, Any]:
    """Counts and the failed / skipped tests (with messages) of a JUnit XML file."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out: dict[str, Any] = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0,
                           "seconds": 0.0, "passed": [], "failed": [], "skipped_tests": []}
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            out[key] += int(s.get(key, 0))
        out["seconds"] += float(s.get("time", 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                text = (bad.get("message") or "") + "\n" + (bad.text or "")
                out["failed"].append({"test": name, "seconds": float(case.get("time", 0)),
                                      "message": text.strip()[-1500:]})
            elif skip is not None:
                out["skipped_tests"].append({"test": name, "reason": (skip.get("message")
                                                                      or "")[:300]})
            else:
                out["passed"].append({"test": name, "seconds": float(case.get("time", 0))})
    out["seconds"] = round(out["seconds"], 1)
    out["ok"] = out["failures"] == 0 and out["errors"] == 0 and out["tests"] > 0
    return out


def parity_summary(rep: dict[str, Any]) -> dict[str, Any]:
    """Per beam: identical / near tie / other, agreement share, both BLEUs and their delta,
    numeric drift, times, and the first mismatches (texts shortened)."""
    runs = []
    for r in rep["runs"]:
        n = max(r["sentences"], 1)
        ref_bleu, rt_bleu = r["reference"].get("bleu"), r["runtime"].get("bleu")
        runs.append({
            "beam": r["beam"], "sentences": r["sentences"], "identical": r["identical"],
            "near_tie": r["near_tie"], "other": r["other"],
            "agreement": round((r["identical"] + r["near_tie"]) / n, 4),
            "identical_share": round(r["identical"] / n, 4),
            "bleu_reference": ref_bleu, "bleu_runtime": rt_bleu,
            "bleu_delta": None if ref_bleu is None else round(rt_bleu - ref_bleu, 2),
            "chrf_reference": r["reference"].get("chrf"),
            "chrf_runtime": r["runtime"].get("chrf"),
            "max_abs_logprob_diff": r["max_abs_logprob_diff"],
            "max_abs_token_logprob_diff": r["max_abs_token_logprob_diff"],
            "seconds_reference": r["reference"]["seconds"],
            "seconds_runtime": r["runtime"]["seconds"],
            "mismatch_gaps": sorted(round(m["gap"], 6) for m in r["mismatches"]),
            "mismatches": [{k: (v[:120] if isinstance(v, str) else v) for k, v in m.items()}
                           for m in r["mismatches"][:25]],
        })
    return {k: rep.get(k) for k in ("package", "variant", "backend", "reference_device",
                                    "split", "sentences", "ok")} | {"runs": runs}


def train_summary(rep: dict[str, Any]) -> dict[str, Any]:
    return {"info": rep.get("info"), "results": rep.get("results")}


def translate_summary(rep: dict[str, Any]) -> dict[str, Any]:
    """Per engine and batch size: sentences/s, target tokens/s, p50/p95 latency; BLEU and
    token identity with the reference engine; the targets."""
    engines = {}
    for name, rec in rep.get("engines", {}).items():
        if "runs" not in rec:
            engines[name] = {"error": rec.get("error")}
            continue
        engines[name] = {
            "device": rec.get("device"), "load_seconds": rec.get("load_seconds"),
            "bleu": rec.get("bleu"), "identical_to_reference": rec.get("identical_to_reference"),
            "reference_engine": rec.get("reference_engine"),
            "batch_invariant": rec.get("batch_invariant"), "peak_rss_mib": rec.get("peak_rss_mib"),
            "runs": {bs: {k: r.get(k) for k in ("sentences", "seconds", "sentences_per_s",
                                               "tokens_per_s", "latency_ms_p50",
                                               "latency_ms_p95", "cpu_per_wall")}
                     for bs, r in rec["runs"].items()}}
    return {"config": rep.get("config"), "machine": rep.get("machine"),
            "versions": rep.get("versions"), "partial": rep.get("partial", False),
            "reference_engine": rep.get("reference_engine"), "engines": engines,
            "targets": rep.get("targets")}


# -------------------------------------------------------------------------------- summary


def _beam(report: dict[str, Any], variant: str, beam: int = 4) -> dict[str, Any] | None:
    for r in report.get("parity", {}).get(variant, {}).get("runs", []):
        if r["beam"] == beam:
            return r
    return None


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each check: name, met (True / False / None = not measured), the numbers."""
    out = []
    p = report.get("pytest")
    out.append({"target": "GPU tests (pytest -m gpu) pass",
                "met": None if not p else p["ok"],
                "value": None if not p else
                f"{len(p['passed'])} passed, {p['failures'] + p['errors']} failed, "
                f"{p['skipped']} skipped" + (": " + ", ".join(f["test"].split("::")[-1]
                                                               for f in p["failed"])
                                             if p["failed"] else "")})
    for variant in ("fp16", "fp32"):
        r = _beam(report, variant)
        name = f"ort-cuda {variant} vs PyTorch reference on CUDA, beam 4"
        if variant == "fp16":
            out.append({"target": f"{name}: identical or near tie >= {FP16_AGREEMENT:.0%}",
                        "met": None if not r else r["agreement"] >= FP16_AGREEMENT,
                        "value": None if not r else
                        f"{r['identical']} identical + {r['near_tie']} near ties of "
                        f"{r['sentences']} ({r['agreement']:.1%}); other {r['other']}"})
            out.append({"target": f"{name}: |BLEU delta| <= {FP16_BLEU_DELTA}",
                        "met": None if not r or r["bleu_delta"] is None
                        else abs(r["bleu_delta"]) <= FP16_BLEU_DELTA,
                        "value": None if not r else
                        f"BLEU {r['bleu_runtime']} vs {r['bleu_reference']} "
                        f"(delta {r['bleu_delta']:+.2f})"})
        else:
            out.append({"target": f"{name}: no mismatch beyond near ties (parity rule)",
                        "met": None if not r else r["other"] == 0,
                        "value": None if not r else
                        f"{r['identical']} identical + {r['near_tie']} near ties of "
                        f"{r['sentences']}; other {r['other']}; BLEU {r['bleu_runtime']} vs "
                        f"{r['bleu_reference']}"})
    t = report.get("translate", {}).get("engines", {})
    bs = str(max(report.get("translate", {}).get("config", {}).get("batch_sizes") or [64]))

    def rate(engine: str) -> float | None:
        return t.get(engine, {}).get("runs", {}).get(bs, {}).get("sentences_per_s")

    a, b = rate("ort-cuda-fp16"), rate("torch-cuda")
    out.append({"target": f"ort-cuda fp16 >= {FP16_SPEEDUP:g}x torch-cuda at batch {bs} "
                          "(sentences/s)",
                "met": None if not (a and b) else a / b >= FP16_SPEEDUP,
                "value": None if not (a and b) else
                f"{a:.1f} vs {b:.1f} sent/s = {a / b:.2f}x"})
    return out


def summary_text(report: dict[str, Any]) -> str:
    lines = ["", "=" * 78, "GPU CHECK SUMMARY" + (" (DRY RUN on the CPU: stand-ins, small "
                                                 "limits; numbers mean nothing)"
                                                 if report.get("dry_run") else ""), "=" * 78]
    env = report.get("env", {})
    lines.append(f"GPU: {env.get('nvidia_smi', '?')}")
    lines.append(f"torch {env.get('torch', {}).get('version', '?')}, onnxruntime "
                 f"{env.get('onnxruntime', {}).get('version', '?')} "
                 f"({env.get('onnxruntime', {}).get('file', '?')}); backends: "
                 + ", ".join(f"{k} {'ok' if v.get('ok') else 'NO'}"
                             for k, v in env.get("backends", {}).items()))
    start = report.get("ort_cuda_start", {}).get("mode")
    used = report.get("ort_mode_used", start)
    if start and start != "plain":
        lines.append(f"WARNING: ort-cuda does not start in a fresh torch-free process (check: "
                     f"{start!r})" + (f"; the translation benchmark ran with the {used!r} "
                                      "prelude (the runtime needs a fix)"
                                      if used in ("preload", "torch") else ""))
    lines.append("steps: " + ", ".join(
        f"{k} {v['status']} {v['seconds']}s" for k, v in report.get("steps", {}).items()))
    lines.append("")
    for t in report["summary"]["targets"]:
        met = {True: "MET", False: "MISSED", None: "NOT MEASURED"}[t["met"]]
        lines.append(f"[{met:>12}] {t['target']}: {t['value'] or '-'}")
    tr = report.get("train_throughput", {})
    if tr.get("results"):
        info = tr.get("info", {})
        lines.append("")
        lines.append(f"training ({info.get('device')}, bf16 {info.get('bf16')}, data "
                     f"{info.get('data')}; matmul {info.get('matmul_tflops')} TFLOP/s measured):")
        for r in tr["results"]:
            mfu = f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
            lines.append(f"  {r['preset']}: {r['target_tokens_per_s']:,.0f} target tok/s, "
                         f"{r['step_ms']} ms/step at {r['max_tokens']} tokens, "
                         f"{r['model_tflops']} model TFLOP/s{mfu}")
    t = report.get("translate", {})
    if t.get("engines"):
        lines.append("")
        lines.append("translation (" + ("PARTIAL, " if t.get("partial") else "")
                     + f"{t.get('config', {}).get('sentences')} sentences; batch 1 on "
                     f"{t.get('config', {}).get('batch1_limit') or 'all'}):")
        for name, e in t["engines"].items():
            if "runs" not in e:
                lines.append(f"  {name}: {e.get('error')}")
                continue
            runs = ", ".join(f"@{bs} {r['sentences_per_s']} sent/s {r['tokens_per_s']:.0f} "
                             f"tok/s p50 {r['latency_ms_p50']} ms" for bs, r in e["runs"].items())
            lines.append(f"  {name}: {runs}; BLEU {e.get('bleu')}, = "
                         f"{e.get('reference_engine')} {e.get('identical_to_reference')}")
    for variant in ("fp16", "fp32"):
        for r in report.get("parity", {}).get(variant, {}).get("runs", []):
            lines.append(f"parity {variant} beam {r['beam']}: {r['identical']}/{r['sentences']} "
                         f"identical, {r['near_tie']} near ties, {r['other']} other; BLEU "
                         f"{r['bleu_runtime']} vs ref {r['bleu_reference']}; max |dlogp| "
                         f"{r['max_abs_logprob_diff']:.1e}; {r['seconds_reference']}s ref, "
                         f"{r['seconds_runtime']}s runtime")
    lines.append("=" * 78)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("report", type=Path)
    e.add_argument("--package", default=None)
    s = sub.add_parser("step")
    s.add_argument("report", type=Path)
    s.add_argument("name")
    s.add_argument("rc", type=int)
    s.add_argument("seconds", type=float)
    s.add_argument("cap", type=float)
    s.add_argument("--ok-codes", default="0", help="exit codes that mean success (e.g. 0,1)")
    for name in ("pytest", "train", "translate"):
        q = sub.add_parser(name)
        q.add_argument("report", type=Path)
        q.add_argument("file")
    q = sub.add_parser("parity")
    q.add_argument("report", type=Path)
    q.add_argument("variant")
    q.add_argument("file")
    q = sub.add_parser("set")
    q.add_argument("report", type=Path)
    q.add_argument("key")
    q.add_argument("value", help="JSON")
    q = sub.add_parser("ortcheck")
    q.add_argument("report", type=Path)
    q.add_argument("--package", required=True)
    q = sub.add_parser("summary")
    q.add_argument("report", type=Path)
    args = p.parse_args(argv)

    if args.cmd == "env":
        info = env_info(args.package)
        merge(args.report, ["env"], info)
        print(json.dumps(info, indent=1))
    elif args.cmd == "ortcheck":
        mode, results = ort_cuda_check(args.package)
        merge(args.report, ["ort_cuda_start"], {"mode": mode, "attempts": results})
        for k, v in results.items():
            print(f"ort-cuda in a fresh process ({k}): {'ok' if v['ok'] else 'FAILED'}: "
                  f"{v['output']}", file=sys.stderr)
        print(mode)
    elif args.cmd == "step":
        ok = {int(c) for c in args.ok_codes.split(",")}
        status = ("ok" if args.rc in ok else "timeout" if args.rc in (124, 137) else
                  "skipped (budget spent)" if args.rc == -1 else
                  f"exit {args.rc}")
        merge(args.report, ["steps", args.name], {"status": status, "rc": args.rc,
                                                  "seconds": round(args.seconds),
                                                  "cap_s": round(args.cap)})
    elif args.cmd == "pytest":
        summ = pytest_summary(args.file)
        merge(args.report, ["pytest"], summ)
        print(json.dumps({k: summ[k] for k in ("tests", "failures", "errors", "skipped", "ok")}))
    elif args.cmd == "train":
        merge(args.report, ["train_throughput"], train_summary(_read_json(args.file)))
    elif args.cmd == "parity":
        summ = parity_summary(_read_json(args.file))
        merge(args.report, ["parity", args.variant], summ)
        for r in summ["runs"]:
            print(f"parity {args.variant} beam {r['beam']}: {r['identical']} identical, "
                  f"{r['near_tie']} near ties, {r['other']} other of {r['sentences']}; BLEU "
                  f"{r['bleu_runtime']} vs {r['bleu_reference']}")
    elif args.cmd == "translate":
        merge(args.report, ["translate"], translate_summary(_read_json(args.file)))
    elif args.cmd == "set":
        merge(args.report, [args.key], json.loads(args.value))
    elif args.cmd == "summary":
        report = load(args.report)
        result = {"targets": targets(report)}
        merge(args.report, ["summary"], result)
        report["summary"] = result
        print(summary_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
