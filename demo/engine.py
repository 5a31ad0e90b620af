"""What the demo computes, without Gradio: backends loaded once and shared, a paragraph split
into sentences and translated as one batch, the n-best table, the alignment, and the
PyTorch-vs-ONNX comparison. ``demo/app.py`` only lays these out on a page; tests call them
directly.

Every request function returns a result object whose ``message`` holds what went wrong in
words a user can act on (empty input, input too long, a backend that failed); they never
raise for a bad request, and never hand a stack trace to the page (unexpected errors are
logged with their traceback on the server and summarized in one line).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime.cli_common import default_model
from runtime.contract import MANIFEST_FILE
from runtime.errors import AiaynError, BackendError, InputTooLongError
from runtime.translation import Translation

log = logging.getLogger("aiayn.demo")

# The order ``--backend auto`` prefers among the backends that load: the deployable runtime
# first (fastest first), the PyTorch reference last.
PREFERENCE = ("tensorrt", "ort-tensorrt", "ort-cuda", "ort-cpu", "torch")
RUNTIME_BACKENDS = ("ort-cpu", "ort-cuda", "ort-tensorrt", "tensorrt")

MAX_CHARS = 5000  # characters of input one request may hold; longer input follows --on-long
EOS_PIECE = "</s>"


# ----------------------------------------------------------------------------- backends


def is_package(model: Path | None) -> bool:
    """Whether ``model`` is an ONNX model package (a folder with manifest.json)."""
    return model is not None and (Path(model) / MANIFEST_FILE).is_file()


def load_backend(model: Path | None, backend: str, threads: int | None = None):
    """One translator through the runtime's ``load_translator``: ``torch`` runs a checkpoint
    on the PyTorch reference search (``train.translator.TorchTranslator``), the other
    backends a package on the ONNX runtime (``runtime.translator.Translator``). ``model``
    None means the default model. Both translators are safe for concurrent callers.

    Raises BackendError (or another AiaynError) when the backend cannot run here.
    """
    from runtime.translator import load_translator

    return load_translator(model, backend, threads)


@dataclass
class BackendStatus:
    """How loading one backend went: ``ok``, the load time in seconds, facts about it
    (``Translator.describe()``), or the reason it is not offered."""

    name: str
    ok: bool
    seconds: float = 0.0
    reason: str = ""
    facts: dict = field(default_factory=dict)


class Backends:
    """The translators this demo offers, each loaded once and shared by every request.

    ``probe()`` decides what is offered by actually loading each candidate backend: the
    PyTorch reference when ``model`` is a checkpoint and torch is installed, and the ONNX
    backends the runtime would try for the model's package (``runtime.backends.auto_order``:
    ``ort-cpu`` everywhere, ``ort-cuda`` and TensorRT where they run). For a checkpoint
    (the bundled model by default) the package is exported into the cache on first use,
    with a progress message. ``get(name)`` returns a loaded translator; ``translate(name,
    ...)`` runs and times a request. The translators are thread-safe (ONNX Runtime sessions
    run concurrently; the torch search holds its model's lock), so concurrent requests need
    no lock here; loading is serialized.
    """

    def __init__(self, model: str | os.PathLike | None = None, threads: int | None = None,
                 say: Callable[[str], None] = print):
        self.model = Path(model) if model is not None else None
        self.threads = threads
        self.package: Path | None = None
        self._say = say
        self._translators: dict[str, object] = {}
        self._load_lock = threading.Lock()
        self.status: dict[str, BackendStatus] = {}

    @property
    def available(self) -> list[str]:
        """Loaded backends in PREFERENCE order."""
        return [b for b in PREFERENCE if b in self._translators]

    @property
    def runtime_backends(self) -> list[str]:
        """Loaded ONNX backends (everything but torch)."""
        return [b for b in self.available if b in RUNTIME_BACKENDS]

    def _resolve_package(self) -> Path:
        """The model's package folder; for a checkpoint, exported into the cache on first
        use (saying so, as this takes a while). Raises AiaynError if it cannot be made."""
        from runtime.translator import package_cache_dir, resolve_package

        model = self.model or default_model()
        if not is_package(model) and model.exists():
            try:
                target = package_cache_dir(model)
            except AiaynError:
                target = None
            if target is not None and not is_package(target):
                self._say(f"aiayn demo: building the ONNX package of {model} into {target} "
                          f"(first use only; about a minute) ...")
                t0 = time.perf_counter()
                path = resolve_package(model)
                self._say(f"aiayn demo: package built in {time.perf_counter() - t0:.0f} s")
                return path
        return resolve_package(model)

    def load(self, name: str):
        """Load backend ``name`` once (later calls return the same translator). Raises
        AiaynError when it cannot run here."""
        with self._load_lock:
            if name in self._translators:
                return self._translators[name]
            self._say(f"aiayn demo: loading backend {name} ...")
            t0 = time.perf_counter()
            try:
                if name == "torch":
                    if is_package(self.model):
                        raise BackendError("the torch backend runs a checkpoint, and --model "
                                           "is an ONNX package")
                    translator = load_backend(self.model, "torch", self.threads)
                else:
                    if self.package is None:
                        self.package = self._resolve_package()
                    translator = load_backend(self.package, name, self.threads)
            except AiaynError as e:
                self.status[name] = BackendStatus(name, False, time.perf_counter() - t0, str(e))
                raise
            except Exception as e:  # a library failing in its own way: not offered, say why
                log.debug("loading %s failed", name, exc_info=True)
                self.status[name] = BackendStatus(name, False, time.perf_counter() - t0,
                                                  f"{type(e).__name__}: {e}")
                raise BackendError(f"backend {name} does not load here: "
                                   f"{type(e).__name__}: {e}") from None
            translator.translate(["A dog runs."], beam_size=2)  # warm up: no slow 1st request
            seconds = time.perf_counter() - t0
            describe = getattr(translator, "describe", None)
            facts = describe() if callable(describe) else {"backend": name}
            if getattr(translator, "device", None) is not None:
                facts.setdefault("device", translator.device)
            self._translators[name] = translator
            self.status[name] = BackendStatus(name, True, seconds, facts=facts)
            self._say(f"aiayn demo: backend {name} ready ({seconds:.1f} s)")
            return translator

    def candidates(self) -> tuple[list[str], dict[str, str]]:
        """(backends to try, in PREFERENCE order; {backend: why it is not tried}). Cheap
        checks only (is the library there; which backends the runtime would try for the
        package); loading settles the rest."""
        skipped: dict[str, str] = {}
        tried: set[str] = set()
        if is_package(self.model):
            skipped["torch"] = "runs a checkpoint, and --model is an ONNX package"
        elif importlib.util.find_spec("torch") is None:
            skipped["torch"] = "torch is not installed (pip install 'aiayn[train]')"
        else:
            tried.add("torch")
        if importlib.util.find_spec("onnxruntime") is None:
            for b in RUNTIME_BACKENDS:
                skipped[b] = "onnxruntime is not installed (pip install 'aiayn[cpu]')"
        else:
            try:
                if self.package is None:
                    self.package = self._resolve_package()
                from runtime.backends import auto_order
                from runtime.package import Package

                order = auto_order(Package.load(self.package, verify_hashes=False))
                tried.update(order)
                why = {"tensorrt": "the package has no prebuilt TensorRT engines",
                       "ort-tensorrt": "the package is not a TensorRT variant (its first run "
                                       "would spend minutes building engines)",
                       "ort-cuda": "int8 packages run on the CPU"}
                for b in RUNTIME_BACKENDS:
                    if b not in order:
                        skipped[b] = f"not tried: {why.get(b, 'not for this package')}"
            except (AiaynError, ImportError) as e:
                for b in RUNTIME_BACKENDS:
                    skipped[b] = str(e)
        return [b for b in PREFERENCE if b in tried], skipped

    def probe(self, first: str = "auto") -> str:
        """Load every candidate backend; return the default backend for the page.

        ``first`` "auto" makes the default the first loaded backend in PREFERENCE order (the
        fastest ONNX backend, else torch); another name is loaded first and must load (its
        error is raised otherwise). Backends that fail are left out, with the reason kept in
        ``status``. Raises BackendError if nothing loads.
        """
        if self.model is not None and not self.model.exists():
            raise BackendError(f"model {self.model} not found (a checkpoint folder, a training "
                               f"run or an ONNX package)")
        if first != "auto":
            self.load(first)  # the backend asked for: its failure is the user's error
        candidates, skipped = self.candidates()
        for name, reason in skipped.items():
            if name not in self._translators:
                self.status.setdefault(name, BackendStatus(name, False, reason=reason))
        for name in candidates:
            if name in self._translators:
                continue
            try:
                self.load(name)
            except AiaynError as e:
                self._say(f"aiayn demo: backend {name} is not offered: {e}")
        if not self._translators:
            reasons = "; ".join(f"{s.name}: {s.reason}" for s in self.status.values())
            raise BackendError(f"no backend loads here ({reasons})")
        return first if first != "auto" else self.available[0]

    def get(self, name: str):
        """The loaded translator of backend ``name``; BackendError if it is not offered."""
        if name not in self._translators:
            offered = ", ".join(self.available) or "none"
            raise BackendError(f"backend {name!r} is not available here (offered: {offered})")
        return self._translators[name]

    def translate(self, name: str, texts: Sequence[str], **kwargs
                  ) -> tuple[list[Translation], float]:
        """``get(name).translate(texts, **kwargs)``; returns the translations and the wall
        time of the call in seconds (Gradio's queue wait is not included)."""
        translator = self.get(name)
        t0 = time.perf_counter()
        out = translator.translate(list(texts), **kwargs)
        return out, time.perf_counter() - t0

    def describe(self) -> str:
        """Markdown, one line per backend: offered (load time, device) or why not."""
        lines = []
        if self.package is not None:
            lines.append(f"ONNX package: `{self.package}`")
        for name in PREFERENCE:
            s = self.status.get(name)
            if s is None:
                continue
            if s.ok:
                extra = ", ".join(f"{k} {v}" for k, v in s.facts.items()
                                  if k in ("device", "variant", "threads") and v is not None)
                lines.append(f"- **{name}**: ready (loaded in {s.seconds:.1f} s"
                             + (f"; {extra}" if extra else "") + ")")
            else:
                lines.append(f"- {name}: not offered: {s.reason}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- requests


@dataclass
class Settings:
    """Search options of one request (DESIGN.md "Search"). ``nbest`` is capped at
    ``beam_size``; ``max_len_a`` stays at the paper's 1 (output <= source length + b)."""

    beam_size: int = 4
    length_penalty: float = 0.6
    lp_type: str = "gnmt"
    max_len_b: int = 50
    nbest: int = 4
    max_len_a: float = 1.0

    def kwargs(self) -> dict:
        return dict(beam_size=int(self.beam_size), length_penalty=float(self.length_penalty),
                    lp_type=self.lp_type, max_len_a=float(self.max_len_a),
                    max_len_b=int(self.max_len_b),
                    nbest=max(1, min(int(self.nbest), int(self.beam_size))))


@dataclass
class Segment:
    """One sentence of the input: its text and the line of the input it came from."""

    text: str
    line: int


_segmenter_lock = threading.Lock()
_segmenter = None


def split_sentences(text: str) -> list[Segment]:
    """Split ``text`` into sentences: each non-empty line is split with pysbd (a
    rule-based sentence boundary detector that keeps abbreviations like "e.g." and "Mr."
    together). Returns [] for empty or whitespace-only text."""
    global _segmenter
    import pysbd

    with _segmenter_lock:  # build once; pysbd.Segmenter keeps no state between calls
        if _segmenter is None:
            _segmenter = pysbd.Segmenter(language="en", clean=False)
        segmenter = _segmenter
    out: list[Segment] = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        for s in segmenter.segment(line):
            if s.strip():
                out.append(Segment(s.strip(), i))
    return out


def join_lines(segments: Sequence[Segment], texts: Sequence[str]) -> str:
    """Put per-sentence ``texts`` back into the input's line structure: sentences of one line
    joined by a space, lines by newlines."""
    lines: dict[int, list[str]] = {}
    for seg, t in zip(segments, texts):
        lines.setdefault(seg.line, []).append(t)
    return "\n".join(" ".join(parts) for _, parts in sorted(lines.items()))


@dataclass
class Alignment:
    """Cross-attention of one sentence's best hypothesis: rows are target subwords (EOS
    last), columns source subwords (EOS last); ``weights`` (T+1, S) sum to 1 per row."""

    source: str
    source_tokens: list[str]
    target_tokens: list[str]
    weights: list[list[float]]


@dataclass
class TranslateResult:
    """What one Translate request shows.

    Attributes:
        text: the German output, in the input's line layout ("" on failure or empty input).
        message: a notice for the user (empty input, truncation, errors); "" when all is well.
        ok: False when nothing was translated because of an error.
        sentences: the source sentences, in order.
        translations: one Translation per sentence.
        nbest_rows: [sentence #, rank, translation, normalized score, log-prob, tokens].
        alignments: one per sentence.
        seconds: wall time of the translation itself (queue wait excluded).
        tokens: generated target tokens, EOS included, over all sentences.
        backend: the backend that ran.
    """

    text: str = ""
    message: str = ""
    ok: bool = True
    sentences: list[str] = field(default_factory=list)
    translations: list[Translation] = field(default_factory=list)
    nbest_rows: list[list] = field(default_factory=list)
    alignments: list[Alignment] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    backend: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def stats(self) -> str:
        """"Latency 123 ms · 45 tokens · 366 tokens/s · 2 sentences · ort-cpu", or ""."""
        if not self.translations:
            return ""
        n = len(self.sentences)
        return (f"Latency **{self.seconds * 1000:.0f} ms** · {self.tokens} tokens · "
                f"**{self.tokens_per_second:.0f} tokens/s** · {n} sentence{'s' * (n != 1)} · "
                f"backend {self.backend}")


EMPTY_MESSAGE = "Type or paste an English sentence (or a paragraph), then press Translate."


def _prepare(text: str | None, on_long: str) -> tuple[str, list[str], str | None]:
    """Cap the input at MAX_CHARS per ``on_long``: returns (text, notices, refusal)."""
    text = text or ""
    notices: list[str] = []
    if len(text) > MAX_CHARS:
        if on_long == "error":
            return "", notices, (f"The input has {len(text):,} characters; this demo takes at "
                                 f"most {MAX_CHARS:,}. Shorten it and try again.")
        text = text[:MAX_CHARS]
        notices.append(f"The input was longer than {MAX_CHARS:,} characters; only the first "
                       f"{MAX_CHARS:,} were translated.")
    return text, notices, None


def _truncation_notices(translations: Sequence[Translation], max_positions: int | None
                        ) -> list[str]:
    limit = f"{max_positions} subword tokens" if max_positions else "its length limit"
    return [f"Sentence {i + 1} is longer than the model's limit of {limit}; only its "
            f"first {len(t.source_tokens) - 1} were translated."
            for i, t in enumerate(translations) if t.truncated]


def error_message(e: BaseException, on_long: str = "truncate") -> str:
    """A user-facing line for an exception (no traceback); unexpected ones are logged."""
    if isinstance(e, InputTooLongError):
        return (f"This input is too long for the model: {e}. (The demo was started with "
                f"--on-long {on_long}.)")
    if isinstance(e, (AiaynError, ValueError)):
        return f"Could not translate: {e}"
    log.error("request failed", exc_info=e)
    return (f"Something went wrong while translating ({type(e).__name__}: {e}). "
            f"The server log has the details.")


def translate_request(backends: Backends, backend: str, text: str | None, settings: Settings,
                      on_long: str = "truncate") -> TranslateResult:
    """Translate ``text`` (a sentence or a paragraph, split into sentences and translated as
    one batch) on ``backend`` with ``settings``; never raises for a bad request."""
    result = TranslateResult(backend=backend)
    try:
        text, notices, refusal = _prepare(text, on_long)
        if refusal:
            return TranslateResult(message=refusal, ok=False, backend=backend)
        segments = split_sentences(text)
        if not segments:
            return TranslateResult(message=EMPTY_MESSAGE, backend=backend)
        kwargs = settings.kwargs()
        translations, seconds = backends.translate(
            backend, [s.text for s in segments], return_attention=True, on_long=on_long,
            **kwargs)
        if int(settings.nbest) > kwargs["nbest"]:
            notices.append(f"The n-best list holds at most beam size ({kwargs['beam_size']}) "
                           f"hypotheses; showing {kwargs['nbest']}.")
        translator = backends.get(backend)
        notices += _truncation_notices(translations, getattr(translator, "max_positions", None))
        result.sentences = [s.text for s in segments]
        result.translations = translations
        result.text = join_lines(segments, [t.text for t in translations])
        result.seconds = seconds
        result.tokens = sum(len(t.tokens) + 1 for t in translations)
        result.message = "\n\n".join(notices)
        for i, t in enumerate(translations):
            for r, nb in enumerate(t.nbest):
                result.nbest_rows.append([i + 1, r + 1, nb.text, round(nb.score, 4),
                                          round(nb.log_prob, 4), len(nb.tokens) + 1])
            if t.attention is not None:
                result.alignments.append(Alignment(segments[i].text, list(t.source_tokens),
                                                   list(t.tokens) + [EOS_PIECE], t.attention))
        return result
    except Exception as e:  # every failure becomes a line on the page
        return TranslateResult(message=error_message(e, on_long), ok=False, backend=backend)


# ----------------------------------------------------------------------------- compare


@dataclass
class SentenceComparison:
    """PyTorch reference vs ONNX runtime on one sentence.

    ``diverge_at`` is the first target position (0-based, counting generated subwords, EOS
    at len(tokens)) where the two best hypotheses differ, None when token-identical.
    ``near_tie`` is set when, at that position, the two prefixes' cumulative log-probs are
    within ``NEAR_TIE`` (DESIGN.md: a near tie in the reference is allowed to diverge).
    """

    source: str
    reference: Translation
    runtime: Translation
    diverge_at: int | None
    reference_token: str = ""
    runtime_token: str = ""
    near_tie: bool = False
    gap: float | None = None

    @property
    def identical(self) -> bool:
        return self.diverge_at is None


NEAR_TIE = 1e-4


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where token lists ``a`` and ``b`` differ, counting the EOS that ends
    each (so a prefix diverges at its length); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_sentence(source: str, ref: Translation, rt: Translation) -> SentenceComparison:
    """Compare the best hypotheses of one sentence (see SentenceComparison)."""
    a, b = ref.token_ids, rt.token_ids
    pos = first_divergence(a, b)
    c = SentenceComparison(source, ref, rt, pos)
    if pos is None:
        return c
    c.reference_token = ref.tokens[pos] if pos < len(ref.tokens) else EOS_PIECE
    c.runtime_token = rt.tokens[pos] if pos < len(rt.tokens) else EOS_PIECE
    sa = ref.nbest[0].token_scores if ref.nbest else None
    sb = rt.nbest[0].token_scores if rt.nbest else None
    if sa and sb and len(sa) > pos and len(sb) > pos:
        c.gap = abs(sum(sa[:pos + 1]) - sum(sb[:pos + 1]))
        c.near_tie = c.gap <= NEAR_TIE
    return c


@dataclass
class CompareResult:
    """What one Compare request shows: both outputs, both latencies, per-sentence verdicts."""

    reference_text: str = ""
    runtime_text: str = ""
    runtime_backend: str = ""
    message: str = ""
    ok: bool = True
    comparisons: list[SentenceComparison] = field(default_factory=list)
    reference_seconds: float = 0.0
    runtime_seconds: float = 0.0

    @property
    def identical(self) -> bool:
        return bool(self.comparisons) and all(c.identical for c in self.comparisons)

    def verdict(self) -> str:
        """Markdown: token-identical or not, and where each differing sentence diverges."""
        if not self.comparisons:
            return self.message
        n = len(self.comparisons)
        same = sum(c.identical for c in self.comparisons)
        tokens = sum(len(c.reference.tokens) + 1 for c in self.comparisons)
        if same == n:
            head = (f"**Token-identical**: PyTorch and {self.runtime_backend} produced the "
                    f"same {tokens} target tokens over {n} sentence{'s' * (n != 1)}.")
        else:
            head = f"**Not token-identical**: {same} of {n} sentences match."
        lines = [head]
        for i, c in enumerate(self.comparisons):
            if c.identical:
                continue
            tie = (f" near tie (|Δ log-prob| {c.gap:.1e} ≤ {NEAR_TIE:g}), which the parity "
                   f"rule allows" if c.near_tie else
                   (f" |Δ log-prob| {c.gap:.1e}" if c.gap is not None else ""))
            lines.append(f"- Sentence {i + 1} diverges at target position {c.diverge_at}: "
                         f"PyTorch `{c.reference_token}` vs {self.runtime_backend} "
                         f"`{c.runtime_token}`;{tie}")
        speed = ""
        if self.reference_seconds > 0 and self.runtime_seconds > 0:
            speed = (f"\n\nLatency: PyTorch {self.reference_seconds * 1000:.0f} ms · "
                     f"{self.runtime_backend} {self.runtime_seconds * 1000:.0f} ms "
                     f"({self.reference_seconds / self.runtime_seconds:.1f}× PyTorch's speed)")
        notice = f"\n\n{self.message}" if self.message else ""
        return "\n".join(lines) + speed + notice

    def table(self) -> list[list]:
        """[sentence #, source, identical, first diff position, PyTorch token, runtime
        token, near tie] per sentence."""
        return [[i + 1, c.source, "yes" if c.identical else "no",
                 "" if c.identical else c.diverge_at, c.reference_token, c.runtime_token,
                 "" if c.identical else ("yes" if c.near_tie else "no")]
                for i, c in enumerate(self.comparisons)]


def compare_request(backends: Backends, runtime_backend: str, text: str | None,
                    settings: Settings, on_long: str = "truncate") -> CompareResult:
    """Translate ``text`` with the PyTorch reference (``torch``) and ``runtime_backend`` with
    the same settings, and compare their best hypotheses token by token. Never raises for a
    bad request."""
    result = CompareResult(runtime_backend=runtime_backend)
    try:
        if "torch" not in backends.available:
            reason = backends.status.get("torch")
            return CompareResult(runtime_backend=runtime_backend, ok=False, message=(
                "The compare view needs the PyTorch reference (backend torch), which is not "
                "available here" + (f": {reason.reason}" if reason and reason.reason else ".")))
        if runtime_backend not in backends.runtime_backends:
            offered = ", ".join(backends.runtime_backends) or "none"
            return CompareResult(runtime_backend=runtime_backend, ok=False, message=(
                f"ONNX backend {runtime_backend!r} is not available here (offered: {offered})."))
        text, notices, refusal = _prepare(text, on_long)
        if refusal:
            return CompareResult(runtime_backend=runtime_backend, ok=False, message=refusal)
        segments = split_sentences(text)
        if not segments:
            return CompareResult(runtime_backend=runtime_backend, message=EMPTY_MESSAGE)
        texts = [s.text for s in segments]
        kwargs = dict(settings.kwargs(), on_long=on_long)
        ref, result.reference_seconds = backends.translate("torch", texts, **kwargs)
        rt, result.runtime_seconds = backends.translate(runtime_backend, texts, **kwargs)
        result.comparisons = [compare_sentence(s, a, b) for s, a, b in zip(texts, ref, rt)]
        result.reference_text = join_lines(segments, [t.text for t in ref])
        result.runtime_text = join_lines(segments, [t.text for t in rt])
        max_positions = getattr(backends.get("torch"), "max_positions", None)
        result.message = "\n\n".join(notices + _truncation_notices(ref, max_positions))
        return result
    except Exception as e:
        return CompareResult(runtime_backend=runtime_backend, ok=False,
                             message=error_message(e, on_long))
