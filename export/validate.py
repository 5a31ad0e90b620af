"""Parity validation: a package's graphs against the PyTorch model they were exported from.

DESIGN.md "The graph contract": validation runs at sizes other than the export-time dummies
(N 1/3/12, S 1/17/100+, P 0/1/7, fresh random inputs); fp32 ``log_probs`` must be within
1e-4 of PyTorch, any NaN fails, and a failure names the output and the shape. Three kinds of
check, all on ONNX Runtime's CPUExecutionProvider against ``train/model.py`` in fp32:

``grid``
    ``encoder.onnx`` at every B x S in (1, 3, 12) x (1, 17, 101); ``decoder.onnx`` at every
    N x P x S in (1, 3, 12) x (0, 1, 7) x (1, 17, 101), with random caches, a random
    ``beam_origin`` over N_prev = max(1, N // 3) past rows (the B -> B*K expansion), random
    padding and ``topk`` cycling through 10 (the runtime's 2K + 2 at K = 4), 1 and V;
    ``decoder_init.onnx`` (TensorRT variant) at every N x S. Every output is compared; the
    top-k ids must be a valid top-k of PyTorch's log-probs (an id may differ from PyTorch's
    only where their log-probs tie within the tolerance).
``sequence``
    End to end: the package's encoder on three sources of lengths 17, 5 and 1 in one padded
    batch, then 8 decoder steps chaining ``present`` into ``past`` (step 0 through
    ``decoder_init.onnx`` when the package has it), teacher-forced with random tokens; step t's
    ``log_probs`` must match PyTorch's full-sequence ``forward`` at position t, so positions
    and the cache are continued correctly across steps.
``optimize`` (``--optimize`` export only)
    The unoptimized graph under ORT_DISABLE_ALL against the saved ORT_ENABLE_ALL graph over
    the decoder grid: log-probs within ``OPTIMIZE_ATOL`` and the same argmax in every row.

Tolerances, per precision (``TOLERANCES``): every element must satisfy
|Δ| <= atol + rtol * max|reference|, the max taken over the whole output tensor (rounding
errors scale with a tensor's largest values, which LayerNorm and attention mix into every
element, so a per-element relative bound would be meaningless for small elements):

fp32
    1e-4 absolute on every float output (DESIGN.md's bar for log_probs, applied to all:
    the graphs do the same fp32 arithmetic as PyTorch in another order; measured ~1e-5).
fp16
    log-probs and top-k log-probs 5e-2 absolute; caches and cross K/V 1e-2 + 1e-2 * max|ref|;
    cross_attn 5e-3 absolute. Justification: float16 has a unit roundoff of 2^-11 = 4.9e-4,
    so storing a logit of magnitude ~20 (typical of a trained model's unlikely tokens) already
    costs up to 1e-2, and every layer adds its own rounding of activations of magnitude ~1-20
    (cross K/V pass through the whole encoder). Measured: the bundled model 1.1e-2 on
    log-probs, 3.5e-3 on cross K/V (max|ref| 2.9), 4e-3 on caches; the tests' tiny random
    model 1.3e-2 on log-probs and 2.4e-2 on cross K/V (max|ref| 5). The limits leave >= 3x
    headroom yet still catch a wrong op, a lost mask (errors of order 1) or an overflow
    (inf/NaN). Measured on CPU, where ONNX Runtime runs many fp16 ops through inserted casts
    to fp32; a GPU may round slightly differently.
int8
    float outputs are reported, not bounded (dynamic quantization moves log-probs by ~0.3);
    the gate is top-1 agreement with PyTorch over every grid and sequence row of at least
    ``INT8_MIN_TOP1_AGREEMENT`` (0.9: one row in ten may change its most likely token; the
    runtime issue measures the resulting BLEU change), and no NaN anywhere. Measured: 97.6%
    of 168 rows on the bundled model and on the tests' tiny model.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime import contract as C
from runtime.errors import CheckpointError, PackageError
from runtime.package import Package, write_manifest

from .errors import ParityError, require_modules

GRID_N = (1, 3, 12)
GRID_P = (0, 1, 7)
GRID_S = (1, 17, 101)
SEQUENCE_SOURCE_LENGTHS = (17, 5, 1)
SEQUENCE_STEPS = 8
DEFAULT_SEED = 1234
OPTIMIZE_ATOL = 1e-4
INT8_MIN_TOP1_AGREEMENT = 0.9

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Tolerance:
    """Bound on every element: |Δ| <= atol + rtol * max|reference| (max over the tensor)."""

    atol: float
    rtol: float = 0.0

    def limit(self, ref: np.ndarray) -> float:
        scale = float(np.abs(ref).max()) if self.rtol and ref.size else 0.0
        return self.atol + self.rtol * scale

    def __str__(self) -> str:
        return f"{self.atol:.0e}" + (f" + {self.rtol:.0e}·max|ref|" if self.rtol else "")


_FP32 = Tolerance(1e-4)
_FP16_LOGP, _FP16_CACHE, _FP16_ATTN = Tolerance(5e-2), Tolerance(1e-2, 1e-2), Tolerance(5e-3)
_FLOAT_OUTPUTS = ("cross_k", "cross_v", "log_probs", "topk_log_probs", "present_k", "present_v",
                  "cross_attn")

# precision -> output name -> bound (None: reported, not bounded)
TOLERANCES: dict[str, dict[str, Tolerance | None]] = {
    "fp32": {name: _FP32 for name in _FLOAT_OUTPUTS},
    "fp16": {"log_probs": _FP16_LOGP, "topk_log_probs": _FP16_LOGP, "cross_k": _FP16_CACHE,
             "cross_v": _FP16_CACHE, "present_k": _FP16_CACHE, "present_v": _FP16_CACHE,
             "cross_attn": _FP16_ATTN},
    "int8": {name: None for name in _FLOAT_OUTPUTS},
}


@dataclass
class Measurement:
    """The worst case of one output over the cases it was checked at."""

    name: str  # "decoder.log_probs"
    kind: str  # "max_abs_diff" | "mismatch" | "agreement"
    value: float = 0.0  # worst max|Δ| (or lowest agreement)
    case: str = ""  # the shape it occurred at
    limit: float | None = None  # the tolerance (atol) or the minimum agreement
    tolerance: str = ""
    passed: bool = True
    nan: bool = False
    failed_case: str = ""  # first failing case
    reference: str = "PyTorch"
    cases: list[dict[str, Any]] = field(default_factory=list)

    def add(self, case: str, value: float, passed: bool, nan: bool = False) -> None:
        first = not self.cases
        self.cases.append({"case": case, "value": _num(value), "passed": passed, "nan": nan})
        if self.kind == "agreement":
            worse = value < self.value
        else:
            worse = math.isnan(value) or value > self.value
        if first or worse:
            self.value, self.case = value, case
        if nan:
            self.nan = True
        if not passed and self.passed:
            self.passed, self.failed_case = False, case

    def line(self) -> str:
        status = "ok" if self.passed else "FAILED"
        if self.kind == "agreement":
            text = f"{self.name} {100 * self.value:.1f}%"
            if self.limit is not None:
                text += f" (min {100 * self.limit:.0f}%)"
            return f"{text} over {self.case} {status}"
        if self.kind == "mismatch":
            if self.passed:
                return f"{self.name} matches {self.reference} in all {len(self.cases)} cases ok"
            return f"{self.name} {int(self.value)} mismatches at {self.case} FAILED"
        text = f"{self.name} max|Δ| {self.value:.1e} at {self.case}"
        if self.nan:
            text += " (NaN)"
        text += f" (tol {self.tolerance})" if self.tolerance else " (reported)"
        return f"{text} {status}"

    def summary(self) -> dict[str, Any]:
        out = {"kind": self.kind, "value": _num(self.value), "at": self.case,
               "passed": self.passed, "cases": len(self.cases)}
        if self.tolerance:
            out["tolerance"] = self.tolerance
        if self.kind == "agreement" and self.limit is not None:
            out["limit"] = self.limit
        if self.nan:
            out["nan"] = True
        return out


@dataclass
class ParityReport:
    """Every measurement of one validation run; ``summary()`` goes into the manifest,
    ``record()`` into ``parity.json``."""

    precision: str
    variant: str
    seed: int
    measurements: dict[str, Measurement] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def measure(self, name: str, kind: str = "max_abs_diff", tolerance: Tolerance | None = None,
                limit: float | None = None, reference: str = "PyTorch") -> Measurement:
        if name not in self.measurements:
            self.measurements[name] = Measurement(
                name, kind, value=1.0 if kind == "agreement" else 0.0,
                limit=tolerance.atol if tolerance else limit,
                tolerance=str(tolerance) if tolerance else "", reference=reference)
        return self.measurements[name]

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.measurements.values())

    def lines(self) -> list[str]:
        return [m.line() for m in self.measurements.values()]

    def failures(self) -> list[Measurement]:
        return [m for m in self.measurements.values() if not m.passed]

    def summary(self) -> dict[str, Any]:
        return {"passed": self.passed, "file": C.PARITY_FILE, "precision": self.precision,
                "variant": self.variant, **self.info,
                "outputs": {n: m.summary() for n, m in self.measurements.items()}}

    def record(self) -> dict[str, Any]:
        return {**self.summary(), "seed": self.seed,
                "grid": {"N": list(GRID_N), "P": list(GRID_P), "S": list(GRID_S)},
                "tolerances": {k: (str(v) if v else "reported")
                               for k, v in TOLERANCES[self.precision].items()},
                "measurements": {n: asdict(m) for n, m in self.measurements.items()}}

    def raise_if_failed(self) -> None:
        """Raises ParityError naming the first failing output, its shape and its tolerance."""
        failed = self.failures()
        if not failed:
            return
        m = failed[0]
        case = next(c for c in m.cases if not c["passed"])
        if m.kind == "agreement":
            what = f"{m.name} {100 * m.value:.1f}% < {100 * (m.limit or 0):.0f}%"
        elif case["nan"]:
            what = f"{m.name} is NaN"
        elif m.kind == "mismatch":
            what = f"{m.name} differs from {m.reference} ({int(case['value'])} mismatches)"
        else:
            what = f"{m.name} max|Δ| {case['value']:.2e} > {m.tolerance}"
        others = ", ".join(f.name for f in failed[1:])
        raise ParityError(
            f"parity check failed ({self.precision}): {what} at {m.failed_case}"
            + (f"; also failed: {others}" if others else "")
            + " — the graph does not compute what the PyTorch model computes; re-export it "
              "(and report a bug if a fresh export fails too)",
            output=m.name, case=m.failed_case,
            value=float("nan") if case["value"] is None else float(case["value"]),
            limit=float(m.limit) if m.limit is not None else float("nan"))


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


# ---- ONNX Runtime ------------------------------------------------------------------------------

ORT_LEVELS = ("disable", "basic", "extended", "all")


def ort_level(level: str):
    """onnxruntime.GraphOptimizationLevel for "disable" | "basic" | "extended" | "all"."""
    import onnxruntime as ort

    G = ort.GraphOptimizationLevel
    return {"disable": G.ORT_DISABLE_ALL, "basic": G.ORT_ENABLE_BASIC,
            "extended": G.ORT_ENABLE_EXTENDED, "all": G.ORT_ENABLE_ALL}[level]


def open_session(path: str | os.PathLike, level: str = "all", threads: int | None = None):
    """An ONNX Runtime CPU session for one graph. Raises PackageError if ORT cannot load it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort_level(level)
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises several types; all mean "cannot load"
        raise PackageError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}") from None


def check_graph(path: str | os.PathLike) -> None:
    """onnx.checker on one graph file (path-based: handles external data and > 2 GB).

    Raises PackageError naming the file for a truncated, damaged or invalid graph.
    """
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # noqa: BLE001 - protobuf DecodeError, ValidationError, OSError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PackageError(f"{path} fails onnx.checker (truncated, damaged or invalid graph): "
                           f"{first}; re-export the package") from None


_ORT_FLOAT = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def run(session, feed: dict[str, Any]) -> dict[str, np.ndarray]:
    """Run ``session`` on ``feed`` (torch tensors or arrays), casting float inputs to the
    graph's declared float type; returns {output name: array}."""
    arrays = {}
    for i in session.get_inputs():
        x = feed[i.name]
        x = x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)
        if i.type in _ORT_FLOAT:
            x = x.astype(_ORT_FLOAT[i.type])
        arrays[i.name] = x
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, arrays)))


# ---- comparison --------------------------------------------------------------------------------


def _compare(m: Measurement, case: str, got: np.ndarray, ref: np.ndarray,
             tol: Tolerance | None) -> None:
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        m.add(f"{case} (shape {got.shape} != {ref.shape})", float("nan"), False, True)
        return
    nan = bool(np.isnan(got).any() or np.isnan(ref).any())
    diff = np.abs(got - ref)
    value = float(np.nanmax(diff)) if diff.size else 0.0
    if nan:
        m.add(case, value if not math.isnan(value) else float("nan"), False, True)
        return
    passed = True if tol is None else bool(value <= tol.limit(ref))
    if not np.isfinite(diff).all():
        passed = False
    m.add(case, value, passed)


def _check_topk(report: ParityReport, graph: str, case: str, out: dict[str, np.ndarray],
                ref_lp: np.ndarray, tol: Tolerance | None, counters: dict[str, int]) -> None:
    """topk_ids must be a valid top-k of PyTorch's log-probs: the reference log-probs of the
    ids the graph chose equal PyTorch's own top-k values within ``tol`` (ties may swap)."""
    ids = out["topk_ids"]
    k = ids.shape[1]
    ref_top = -np.sort(-ref_lp, axis=1)[:, :k]
    rows = np.arange(ids.shape[0])[:, None]
    chosen = ref_lp[rows, ids]
    exact = np.argsort(-ref_lp, axis=1, kind="stable")[:, :k]
    head = min(k, 10)  # exact order is only meaningful at the head (the tail is full of ties)
    counters["ids"] += ids[:, :head].size
    counters["same"] += int((ids[:, :head] == exact[:, :head]).sum())
    if tol is None:  # int8: judged by top-1 agreement instead
        return
    m = report.measure(f"{graph}.topk_ids", "mismatch")
    bad = np.abs(chosen - ref_top) > tol.limit(ref_top)
    m.add(case, float(bad.sum()), not bool(bad.any()))


def _top1(report: ParityReport, counters: dict[str, int], got_lp: np.ndarray,
          ref_lp: np.ndarray) -> None:
    counters["rows"] += got_lp.shape[0]
    counters["top1"] += int((got_lp.argmax(-1) == ref_lp.argmax(-1)).sum())


# ---- the checks --------------------------------------------------------------------------------


def _grid_sizes(cfg) -> tuple[list[int], list[int]]:
    S = sorted({min(s, cfg.max_positions) for s in GRID_S})
    P = sorted({min(p, cfg.max_positions - 1) for p in GRID_P})
    return S, P


Runner = Callable[[dict[str, Any]], dict[str, np.ndarray]]


def ort_runner(session) -> Runner:
    """A Runner over one ONNX Runtime session (see ``run``)."""
    return lambda feed: run(session, feed)


def validate_graphs(model, graphs: dict[str, str | os.PathLike], precision: str = "fp32",
                    variant: str = "fp32", seed: int = DEFAULT_SEED, level: str = "all",
                    baseline: dict[str, str | os.PathLike] | None = None,
                    progress: Progress | None = None) -> ParityReport:
    """Validate ONNX graphs against ``model`` (train.model.Transformer, fp32, eval mode).

    ``graphs`` maps "encoder" / "decoder" / "decoder_init" to files; ``precision`` picks the
    tolerances (``TOLERANCES``); ``level`` is the ORT optimization level the sessions use
    ("disable" for already-optimized graphs); ``baseline`` (the unoptimized graphs) adds the
    ``optimize`` check. Returns the ParityReport without raising; call ``raise_if_failed``.
    Raises PackageError if a graph fails onnx.checker or cannot be loaded.
    """
    if precision not in TOLERANCES:
        raise PackageError(f"unknown precision {precision!r}; expected one of {C.PRECISIONS}")
    for path in graphs.values():
        check_graph(path)
    runners = {name: ort_runner(open_session(path, level)) for name, path in graphs.items()}
    base = {name: ort_runner(open_session(path, "disable"))
            for name, path in (baseline or {}).items()}
    report = validate_runners(model, runners, precision, variant, seed, baseline=base,
                              progress=progress)
    report.info.update({"runtime": "onnxruntime CPUExecutionProvider", "ort_level": level})
    return report


def validate_runners(model, runners: dict[str, Runner], precision: str, variant: str,
                     seed: int = DEFAULT_SEED, baseline: dict[str, Runner] | None = None,
                     min_past: int = 0, fixed_topk: int | None = None,
                     progress: Progress | None = None) -> ParityReport:
    """The checks of this module (grid, sequence, optimize) over any implementation of the
    graphs: ``runners`` maps a graph name to a function from a feed (torch tensors, float
    inputs in the precision's dtype) to {output name: numpy array}. ``min_past`` = 1 skips
    the P = 0 cases (TensorRT engines: no zero-length dimensions); ``fixed_topk`` uses one
    ``topk`` everywhere (engines built with a constant K). Returns the ParityReport.
    """
    import torch

    from .graphs import dummy_decoder_inputs, dummy_src_ids

    say = progress or (lambda _msg: None)
    tols = TOLERANCES[precision]
    report = ParityReport(precision, variant, seed)
    cfg = model.cfg
    S_sizes, P_sizes = _grid_sizes(cfg)
    P_sizes = [p for p in P_sizes if p >= min_past]
    counters = {"ids": 0, "same": 0, "rows": 0, "top1": 0}
    n_cases = 0
    model = model.float().eval()
    base = baseline or {}
    in_dtype = torch.float16 if precision == "fp16" else torch.float32

    with torch.no_grad():
        if "encoder" in runners:
            say(f"validating encoder at B x S in {list(GRID_N)} x {S_sizes}")
            for i, (B, S) in enumerate((B, S) for B in GRID_N for S in S_sizes):
                case = f"B={B}, S={S}"
                src = dummy_src_ids(model, B, S, seed=seed + 1000 + i)
                out = runners["encoder"]({"src_ids": src})
                ref = dict(zip(C.names(C.ENCODER_OUTPUTS), model.encode_for_step(src)))
                for o in ("cross_k", "cross_v"):
                    _compare(report.measure(f"encoder.{o}", tolerance=tols[o]), case, out[o],
                             ref[o].numpy(), tols[o])
                same = np.array_equal(out["src_pad_mask"], ref["src_pad_mask"].numpy())
                report.measure("encoder.src_pad_mask", "mismatch").add(case, 0.0 if same else 1.0,
                                                                       same)
                n_cases += 1

        for graph in ("decoder", "decoder_init"):
            if graph not in runners:
                continue
            pasts = P_sizes if graph == "decoder" else [0]
            grid = [(N, P, S) for N in GRID_N for P in pasts for S in S_sizes]
            say(f"validating {graph} at {len(grid)} shapes (N x P x S in {list(GRID_N)} x "
                f"{pasts} x {S_sizes})")
            for i, (N, P, S) in enumerate(grid):
                N_prev = N if graph == "decoder_init" else max(1, N // 3)
                topk = min(fixed_topk or (10, 1, cfg.vocab_size)[i % 3], cfg.vocab_size)
                inp = dummy_decoder_inputs(model, N, N_prev, P, S, topk=topk, dtype=in_dtype,
                                           seed=seed + 2000 + i)
                case = f"N={N}, P={P}, S={S}, topk={topk}"
                ref_in = {k: (v.float() if v.is_floating_point() else v) for k, v in inp.items()}
                if graph == "decoder_init":
                    ref_in["past_k"], ref_in["past_v"] = model.empty_cache(N)
                    ref_in["beam_origin"] = torch.arange(N)
                    inp = {n: inp[n] for n in C.names(C.DECODER_INIT_INPUTS)}
                lp, pk, pv, ca = model.step(*(ref_in[n] for n in C.names(C.DECODER_INPUTS)[:8]))
                ref = {"log_probs": lp, "present_k": pk, "present_v": pv, "cross_attn": ca,
                       "topk_log_probs": torch.topk(lp, topk, dim=-1).values}
                ref = {k: v.numpy() for k, v in ref.items()}
                out = runners[graph](inp)
                for o in ("log_probs", "topk_log_probs", "present_k", "present_v", "cross_attn"):
                    _compare(report.measure(f"{graph}.{o}", tolerance=tols[o]), case, out[o],
                             ref[o], tols[o])
                _check_topk(report, graph, case, out, ref["log_probs"], tols["log_probs"],
                            counters)
                _top1(report, counters, out["log_probs"], ref["log_probs"])
                if graph in base:
                    b = base[graph](inp)
                    tol = Tolerance(OPTIMIZE_ATOL)
                    ref_name = "the unoptimized graph (ORT_DISABLE_ALL)"
                    _compare(report.measure(f"optimize.{graph}.log_probs", tolerance=tol,
                                            reference=ref_name),
                             case, out["log_probs"], b["log_probs"], tol)
                    differ = int((out["log_probs"].argmax(-1) != b["log_probs"].argmax(-1)).sum())
                    report.measure(f"optimize.{graph}.argmax", "mismatch", reference=ref_name
                                   ).add(case, float(differ), differ == 0)
                n_cases += 1

        if "encoder" in runners and "decoder" in runners and (
                min_past == 0 or "decoder_init" in runners):
            say(f"validating a decoded sequence (B={len(SEQUENCE_SOURCE_LENGTHS)}, "
                f"{SEQUENCE_STEPS} steps)")
            _sequence(report, model, runners, tols["log_probs"], seed, counters)
            n_cases += 1

    report.info = {
        "reference": "train/model.py (PyTorch, fp32, CPU)", "cases": n_cases,
        # share of the first <= 10 top-k ids equal to PyTorch's, in order (information only)
        "top10_ids_exact_agreement": (counters["same"] / counters["ids"] if counters["ids"]
                                      else None),
        "validated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if counters["rows"]:
        limit = INT8_MIN_TOP1_AGREEMENT if precision == "int8" else None
        m = report.measure("top1_agreement", "agreement", limit=limit)
        rate = counters["top1"] / counters["rows"]
        m.add(f"{counters['rows']} rows", rate, limit is None or rate >= limit)
    return report


def _sequence(report: ParityReport, model, runners: dict[str, Runner], tol: Tolerance | None,
              seed: int, counters: dict[str, int]) -> None:
    """End to end: encoder -> ``SEQUENCE_STEPS`` chained decoder steps vs ``model.forward``."""
    import torch

    cfg = model.cfg
    g = torch.Generator().manual_seed(seed + 3000)
    lengths = [min(n, cfg.max_positions) for n in SEQUENCE_SOURCE_LENGTHS]
    B, S, T = len(lengths), max(lengths), min(SEQUENCE_STEPS, cfg.max_positions)
    src = torch.full((B, S), C.PAD_ID, dtype=torch.long)
    for b, n in enumerate(lengths):
        src[b, :n - 1] = torch.randint(C.EOS_ID + 1, cfg.vocab_size, (n - 1,), generator=g)
        src[b, n - 1] = C.EOS_ID
    tgt = torch.randint(C.EOS_ID + 1, cfg.vocab_size, (B, T), generator=g)
    tgt[:, 0] = C.BOS_ID
    ref = torch.log_softmax(model(src, tgt).float(), dim=-1).numpy()  # (B, T, V)
    enc = runners["encoder"]({"src_ids": src})
    L, H, Dh = cfg.decoder_layers, cfg.h, cfg.d_k
    past_k = past_v = np.zeros((L, B, H, 0, Dh), dtype=np.float32)  # (L, N, H, P=0, Dh)
    m = report.measure("sequence.log_probs", tolerance=tol)
    for t in range(T):
        feed = {"tokens": tgt[:, t].numpy(), "step": np.array(t, dtype=np.int64),
                "past_k": past_k, "past_v": past_v, "beam_origin": np.arange(B, dtype=np.int64),
                "cross_k": enc["cross_k"], "cross_v": enc["cross_v"],
                "src_pad_mask": enc["src_pad_mask"], "topk": np.array(1, dtype=np.int64)}
        graph = "decoder_init" if t == 0 and "decoder_init" in runners else "decoder"
        if graph == "decoder_init":
            feed = {n: feed[n] for n in C.names(C.DECODER_INIT_INPUTS)}
        out = runners[graph](feed)
        _compare(m, f"B={B}, S={S}, step={t} ({graph})", out["log_probs"], ref[:, t], tol)
        _top1(report, counters, out["log_probs"], ref[:, t])
        past_k, past_v = out["present_k"], out["present_v"]


# ---- packages ----------------------------------------------------------------------------------


def source_checkpoint(package: Package, checkpoint: str | os.PathLike | None = None) -> Path:
    """The checkpoint ``package`` was exported from: ``checkpoint`` if given, else the path
    the manifest records. Its weights' sha256 must equal the manifest's source_checkpoint.

    Raises PackageError if no checkpoint is given and none is recorded (or it is gone), or if
    the sha256 differs.
    """
    from train.checkpoint import checkpoint_sha256, resolve_checkpoint

    source = package.manifest.get("source_checkpoint") or {}
    if checkpoint is None:
        recorded = source.get("path")
        if not recorded:
            raise PackageError(f"{package.path} does not record the checkpoint it was exported "
                               "from; pass it with --checkpoint CKPT")
        if not Path(recorded).exists():
            raise PackageError(f"{package.path} was exported from {recorded}, which no longer "
                               "exists; pass the checkpoint with --checkpoint CKPT")
        checkpoint = recorded
    try:
        ckpt = resolve_checkpoint(checkpoint)
    except CheckpointError as e:
        raise PackageError(f"--checkpoint: {e}") from None
    expected = source.get("sha256")
    actual = checkpoint_sha256(ckpt)
    if expected and actual != expected:
        raise PackageError(
            f"checkpoint {ckpt} (weights sha256 {actual[:12]}…) is not the one {package.path} "
            f"was exported from (sha256 {expected[:12]}…); pass that one with --checkpoint")
    return ckpt


def package_graphs(package: Package) -> dict[str, Path]:
    """{graph name: absolute file} of the graphs a package holds, in contract order."""
    return {n: package.graph_path(n) for n in ("encoder", "decoder", "decoder_init")
            if package.has_graph(n)}


def package_precision(package: Package) -> str:
    precisions = {package.precision(n) for n in package_graphs(package)}
    if len(precisions) != 1:
        raise PackageError(f"{package.path}: graphs of mixed precision {sorted(precisions)}")
    return precisions.pop()


def write_parity(directory: str | os.PathLike, manifest: dict[str, Any],
                 report: ParityReport) -> dict[str, Any]:
    """Write ``parity.json`` and the manifest's ``parity`` summary (each atomically).
    Returns the updated manifest."""
    directory = Path(directory)
    path = directory / C.PARITY_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report.record(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    manifest = {**manifest, "parity": report.summary()}
    write_manifest(directory, manifest)
    return manifest


def _check_package_engines(pkg: Package, model, seed: int, say: Progress) -> None:
    """Re-check a tensorrt package's engines where TensorRT and a CUDA torch are available."""
    try:
        import tensorrt as trt
    except ImportError:
        say("TensorRT engines not checked: TensorRT is not installed here (pip install tensorrt)")
        return
    from .tensorrt import check_engines

    check_engines(trt, pkg.path, pkg.manifest["engines"], model, seed=seed, progress=say)


def validate_package(package: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                     seed: int = DEFAULT_SEED, write: bool = True,
                     progress: Progress | None = None,
                     results: Progress | None = None) -> ParityReport:
    """``aiayn validate``: re-run a package's parity validation against its source checkpoint.

    The package is loaded (format, version, every sha256), the checkpoint found and matched
    against the manifest's ``source_checkpoint`` sha256 (``source_checkpoint``), the graphs
    validated (``validate_graphs``; a tensorrt package's engines too where TensorRT and a GPU
    are present) and, if ``write``, the record written to ``parity.json``
    and the manifest's ``parity`` (also when it fails). Phases go to ``progress``, one line
    per output to ``results`` (default: ``progress``). Raises PackageError for an unusable
    package or checkpoint, ParityError if a check fails.
    """
    require_modules("torch", "onnx", "onnxruntime")
    from train.checkpoint import load_checkpoint

    say = progress or (lambda _msg: None)
    pkg = Package.load(package)
    ckpt = source_checkpoint(pkg, checkpoint)
    say(f"loading checkpoint {ckpt}")
    model, _tokenizer, _ = load_checkpoint(ckpt)
    level = pkg.manifest.get("optimization", {}).get("load_level", "all")
    report = validate_graphs(model, package_graphs(pkg), package_precision(pkg), pkg.variant,
                             seed=seed, level=level, progress=say)
    for line in report.lines():
        (results or say)(line)
    if pkg.manifest.get("engines"):
        _check_package_engines(pkg, model, seed, say)
    write_error = None
    if write:
        try:
            write_parity(pkg.path, pkg.manifest, report)
        except OSError as e:
            write_error = e
    report.raise_if_failed()
    if write_error is not None:
        raise PackageError(f"parity passed, but the record could not be written into {pkg.path} "
                           f"({write_error.strerror or write_error}); run with --no-write for a "
                           "read-only package")
    return report
