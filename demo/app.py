"""The Gradio page: translate English to German, inspect the search (n-best list, attention
alignment, latency), and compare the PyTorch reference with the ONNX runtime.

``build_app(backends, ...)`` lays out the page over an ``engine.Backends`` whose translators
are already loaded; ``launch(app, ...)`` serves it. Nothing here reaches the network: Gradio's
analytics are off, the theme uses fonts shipped with Gradio, and no share link is made unless
asked for.

API endpoints (stable names, for ``gradio_client``):

- ``/translate`` (text, backend, beam_size, length_penalty, lp_type, max_len_b, nbest) ->
  (translation, notice, stats, n-best table, alignment sentence, alignment plot)
- ``/compare`` (text, runtime_backend, beam_size, length_penalty, lp_type, max_len_b, nbest)
  -> (PyTorch translation, runtime translation, verdict, PyTorch tokens, runtime tokens,
  per-sentence table)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio reads it at import

import gradio as gr  # noqa: E402

from runtime.cli_common import default_model  # noqa: E402
from runtime.contract import MANIFEST_FILE  # noqa: E402

from .engine import (  # noqa: E402
    EMPTY_MESSAGE,
    Backends,
    CompareResult,
    Settings,
    compare_request,
    translate_request,
)
from .plots import attention_figure  # noqa: E402

# Written for this demo in the style of Multi30k's image captions (not taken from the corpus).
EXAMPLES = [
    "A little girl in a yellow raincoat is jumping into a puddle.",
    "Two men in orange vests are repairing a bicycle on the sidewalk.",
    "A brown dog carries a long stick through the tall grass.",
    "An old woman is selling fresh bread at a crowded market.",
    "A group of teenagers is playing volleyball on the beach at sunset.",
    "A man is playing the guitar on a small stage. A crowd of people is watching him. "
    "Some of them are dancing.",
]

NBEST_HEADERS = ["#", "rank", "translation", "score (normalized)", "log-prob", "tokens"]
COMPARE_HEADERS = ["#", "sentence", "identical", "first diff at", "PyTorch token",
                   "ONNX token", "near tie"]
DEFAULT_CONCURRENCY = 2  # model requests at once (one group for translate and compare)
MODEL_QUEUE = "model"

CSS = """
#notice:has(p) { border-left: 4px solid #f59e0b; padding: 0.25em 0.75em;
                 background: rgba(245, 158, 11, 0.08); }
#verdict:has(p) { border-left: 4px solid #3b82f6; padding: 0.25em 0.75em;
                  background: rgba(59, 130, 246, 0.06); }
#stats { color: var(--body-text-color-subdued); font-size: 0.9em; }
#translation textarea { font-size: 1.1em; }
"""


def model_summary(model: Path | None) -> str:
    """One Markdown line about the model: languages, data, scores (from the checkpoint's
    meta.json or the package's manifest; whatever is known)."""
    path = Path(model) if model is not None else default_model()
    meta: dict = {}
    for name in ("meta.json", MANIFEST_FILE):
        f = path / name
        if f.is_file():
            try:
                meta = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                meta = {}
            break
    langs = meta.get("languages") or {}
    pair = f"{langs.get('src', 'en')} → {langs.get('tgt', 'de')}"
    parts = [f"Model `{path.name}` ({pair})"]
    data = meta.get("data")
    if isinstance(data, str):
        parts.append(data.split(";")[0])
    scores = meta.get("scores") or {}
    test = scores.get("test_2016_flickr") if isinstance(scores, dict) else None
    if isinstance(test, dict) and "bleu" in test:
        parts.append(f"BLEU {test['bleu']:.1f} on test2016 (sacreBLEU, {scores.get('search', '')})"
                     .replace(", )", ")"))
    return " · ".join(parts)


def _notice(message: str, ok: bool) -> str:
    if not message:
        return ""
    return (f"**Error:** {message}" if not ok else message)


def build_app(backends: Backends, default_backend: str | None = None,
              on_long: str = "truncate", title: str = "aiayn: Attention Is All You Need"
              ) -> gr.Blocks:
    """The demo page over loaded ``backends`` (see ``Backends.probe``).

    ``default_backend`` is selected in the backend menu (default: the first offered);
    ``on_long`` is what happens to input over the model's length: "truncate" (with a
    notice) or "error" (refused with a message). Call ``.queue(...)`` and ``.launch(...)``
    on the result, or use ``launch()``.
    """
    offered = backends.available
    if not offered:
        raise ValueError("no backend is loaded; call backends.probe() first")
    default_backend = default_backend if default_backend in offered else offered[0]
    runtime_offered = backends.runtime_backends
    can_compare = "torch" in offered and bool(runtime_offered)

    def on_translate(text, backend, beam, alpha, lp_type, max_len_b, nbest):
        settings = Settings(int(beam), float(alpha), lp_type, int(max_len_b), int(nbest))
        r = translate_request(backends, backend, text, settings, on_long)
        choices = [(f"{i + 1}. {a.source[:60]}{'…' * (len(a.source) > 60)}", i)
                   for i, a in enumerate(r.alignments)]
        plot = (attention_figure(r.alignments[0].source_tokens, r.alignments[0].target_tokens,
                                 r.alignments[0].weights) if r.alignments else None)
        return (r.text, _notice(r.message, r.ok), r.stats(), r.nbest_rows,
                gr.update(choices=choices, value=0 if choices else None,
                          visible=len(choices) > 1),
                plot, r.alignments)

    def on_alignment(index, alignments):
        if alignments is None or index is None or not 0 <= int(index) < len(alignments):
            return None
        a = alignments[int(index)]
        return attention_figure(a.source_tokens, a.target_tokens, a.weights)

    def on_compare(text, runtime_backend, beam, alpha, lp_type, max_len_b, nbest):
        settings = Settings(int(beam), float(alpha), lp_type, int(max_len_b), int(nbest))
        r = compare_request(backends, runtime_backend, text, settings, on_long)
        return (r.reference_text, r.runtime_text, _verdict(r), *_token_views(r), r.table())

    with gr.Blocks(title=title, analytics_enabled=False) as app:
        gr.Markdown(f"# Attention Is All You Need: English → German\n"
                    f"The Transformer of Vaswani et al. (2017), trained with the paper's recipe "
                    f"and served by the torch-free ONNX runtime. {model_summary(backends.model)}.")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):  # noqa: SIM117 (a page layout reads better nested)
                with gr.Tabs():
                    with gr.Tab("Translate", id="translate"):
                        with gr.Row(equal_height=False):
                            with gr.Column():
                                src = gr.Textbox(
                                    label="English", lines=1, max_lines=12, autofocus=True,
                                    elem_id="source", max_length=None,
                                    placeholder="Describe a picture, then press Enter. "
                                                "A paragraph is split into sentences.")
                                with gr.Row():
                                    clear = gr.Button("Clear", variant="secondary")
                                    go = gr.Button("Translate", variant="primary",
                                                   elem_id="translate-btn")
                            with gr.Column():
                                out = gr.Textbox(label="German", lines=3, max_lines=12,
                                                 interactive=False, elem_id="translation",
                                                 buttons=["copy"])
                                notice = gr.Markdown(elem_id="notice")
                                stats = gr.Markdown(elem_id="stats")
                        gr.Examples([[e] for e in EXAMPLES], inputs=[src],
                                    label="Examples (written for this demo)")
                        nbest_table = gr.Dataframe(
                            headers=NBEST_HEADERS, label="n-best list (ranked by normalized "
                            "score = log-prob / length penalty)", interactive=False,
                            wrap=True, elem_id="nbest",
                            column_widths=["6%", "7%", "53%", "14%", "11%", "9%"])
                        align_pick = gr.Dropdown(label="Alignment of sentence", choices=[],
                                                 visible=False, type="value")
                        gr.Markdown("**Cross-attention alignment** (last decoder layer, mean "
                                    "over heads): which English subwords each German subword "
                                    "attended to.")
                        align_plot = gr.Plot(show_label=False, format="png",
                                             elem_id="alignment")
                        alignments = gr.State(None)
                    with gr.Tab("Compare PyTorch ↔ ONNX", id="compare"):
                        if can_compare:
                            gr.Markdown(
                                "The same input through the PyTorch reference search and the "
                                "ONNX runtime, with the settings on the right. Parity means "
                                "token-identical output, except where the reference itself had "
                                "a near tie (|Δ log-prob| ≤ 1e-4 at the first differing step).")
                        else:
                            gr.Markdown(
                                "**Not available here:** comparing needs both the PyTorch "
                                "reference (`torch`) and an ONNX backend. Offered: "
                                f"{', '.join(offered)}.")
                        cmp_src = gr.Textbox(label="English", lines=1, max_lines=12,
                                             value=EXAMPLES[0], elem_id="compare-source")
                        with gr.Row():
                            cmp_backend = gr.Dropdown(
                                choices=runtime_offered or ["(none)"],
                                value=(runtime_offered or ["(none)"])[0],
                                label="ONNX backend", interactive=bool(runtime_offered))
                            cmp_go = gr.Button("Compare", variant="primary",
                                               interactive=can_compare, elem_id="compare-btn")
                        verdict = gr.Markdown(elem_id="verdict")
                        with gr.Row():
                            ref_out = gr.Textbox(label="PyTorch reference", lines=2,
                                                 interactive=False)
                            rt_out = gr.Textbox(label="ONNX runtime", lines=2, interactive=False)
                        with gr.Row():
                            ref_tokens = gr.HighlightedText(
                                label="PyTorch subwords", color_map={"diverges": "red",
                                                                     "after": "orange"})
                            rt_tokens = gr.HighlightedText(
                                label="ONNX subwords", color_map={"diverges": "red",
                                                                  "after": "orange"})
                        cmp_table = gr.Dataframe(
                            headers=COMPARE_HEADERS, interactive=False, wrap=True,
                            label="Per sentence (positions count target subwords from 0)",
                            column_widths=["5%", "41%", "12%", "10%", "11%", "11%", "10%"])
            with gr.Column(scale=1, min_width=260):
                gr.Markdown("### Search settings")
                backend = gr.Dropdown(choices=offered, value=default_backend, label="Backend",
                                      info="only backends that loaded here")
                beam = gr.Slider(1, 8, value=4, step=1, label="Beam size",
                                 info="1 = greedy; the paper used 4")
                alpha = gr.Slider(0.0, 2.0, value=0.6, step=0.05, label="Length penalty α",
                                  info="0 = none; the paper used 0.6")
                lp_type = gr.Radio(["gnmt", "power"], value="gnmt", label="Length penalty type",
                                   info="gnmt: ((5+len)/6)^α · power: len^α")
                max_len_b = gr.Slider(1, 256, value=50, step=1, label="Maximum length (b)",
                                      info="output ≤ source tokens + b (the paper: + 50)")
                nbest = gr.Slider(1, 8, value=4, step=1, label="n-best size",
                                  info="hypotheses listed per sentence (≤ beam size)")
                with gr.Accordion("Backends", open=False):
                    gr.Markdown(backends.describe())

        settings = [beam, alpha, lp_type, max_len_b, nbest]
        outputs = [out, notice, stats, nbest_table, align_pick, align_plot, alignments]
        # Every event that runs a model shares one concurrency group: at most
        # `launch(concurrency=...)` of them run at once, whichever button started them.
        heavy = dict(concurrency_id=MODEL_QUEUE, concurrency_limit="default")
        go.click(on_translate, [src, backend, *settings], outputs, api_name="translate", **heavy)
        src.submit(on_translate, [src, backend, *settings], outputs, api_visibility="private",
                   **heavy)
        clear.click(lambda: ("", "", "", "", [], gr.update(choices=[], visible=False), None,
                             None), None, [src, out, notice, stats, nbest_table, align_pick,
                                           align_plot, alignments],
                    api_visibility="private", queue=False)
        beam.change(lambda k, n: gr.update(maximum=int(k), value=min(int(n), int(k))),
                    [beam, nbest], [nbest], api_visibility="private", queue=False)
        align_pick.change(on_alignment, [align_pick, alignments], [align_plot],
                          api_visibility="private")
        cmp_outputs = [ref_out, rt_out, verdict, ref_tokens, rt_tokens, cmp_table]
        cmp_go.click(on_compare, [cmp_src, cmp_backend, *settings], cmp_outputs,
                     api_name="compare", **heavy)
        cmp_src.submit(on_compare, [cmp_src, cmp_backend, *settings], cmp_outputs,
                       api_visibility="private", **heavy)
    return app


def _verdict(r: CompareResult) -> str:
    if not r.comparisons:
        return _notice(r.message or EMPTY_MESSAGE, r.ok)
    return r.verdict()


def _token_views(r: CompareResult) -> tuple[list, list]:
    """HighlightedText values: each side's subwords, the first differing one marked
    "diverges" and the rest "after"; sentences separated by " ‖ "."""
    views: tuple[list, list] = ([], [])
    for i, c in enumerate(r.comparisons):
        for view, t in zip(views, (c.reference, c.runtime)):
            if i:
                view.append((" ‖ ", None))
            for j, tok in enumerate([*t.tokens, "</s>"]):
                label = (None if c.diverge_at is None or j < c.diverge_at else
                         "diverges" if j == c.diverge_at else "after")
                view.append((tok + " ", label))
    return views


def launch(app: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, share: bool = False,
           concurrency: int = DEFAULT_CONCURRENCY, queue_size: int = 64,
           prevent_thread_lock: bool = False, quiet: bool = False) -> gr.Blocks:
    """Serve ``app`` on ``host:port`` through Gradio's queue: at most ``concurrency``
    translate/compare requests run at once (one group, MODEL_QUEUE), up to ``queue_size``
    wait (more are turned away with a message).
    A public share link only with ``share=True``. Raises OSError if the port is taken."""
    app.queue(default_concurrency_limit=concurrency, max_size=queue_size)
    app.launch(server_name=host, server_port=port, share=share, show_error=False,
               prevent_thread_lock=prevent_thread_lock, quiet=quiet, css=CSS,
               theme=gr.themes.Default(), enable_monitoring=False,
               mcp_server=False, ssr_mode=False, pwa=False)
    return app
