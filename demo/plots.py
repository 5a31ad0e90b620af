"""The cross-attention alignment as a matplotlib heat map.

Figures are built with the object-oriented API (``matplotlib.figure.Figure`` on the Agg
canvas), never through pyplot's global state, so concurrent requests can draw at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MAX_LABELS = 60  # beyond this many tokens on an axis, label every n-th one


def _ticks(n: int) -> list[int]:
    step = max(1, -(-n // MAX_LABELS))
    return list(range(0, n, step))


def attention_figure(source_tokens: Sequence[str], target_tokens: Sequence[str],
                     weights: Sequence[Sequence[float]], title: str | None = None) -> Figure:
    """A heat map of cross-attention ``weights`` (T rows = ``target_tokens`` incl. EOS,
    S columns = ``source_tokens`` incl. EOS); darker = more attention. Raises ValueError if
    the shapes disagree."""
    T, S = len(target_tokens), len(source_tokens)
    if len(weights) != T or any(len(r) != S for r in weights):
        raise ValueError(f"attention is {len(weights)}x{len(weights[0]) if weights else 0}, "
                         f"expected {T}x{S} (target x source tokens)")
    width = min(16.0, max(4.5, 1.6 + 0.36 * S))
    height = min(16.0, max(3.0, 1.3 + 0.30 * T))
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(weights, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto",
                   interpolation="nearest")
    xs, ys = _ticks(S), _ticks(T)
    src, tgt = list(source_tokens), list(target_tokens)  # sentencepiece pieces, ▁ = word start
    ax.set_xticks(xs, [src[i] for i in xs], rotation=60, ha="right", rotation_mode="anchor",
                  fontsize=9)
    ax.set_yticks(ys, [tgt[i] for i in ys], fontsize=9)
    ax.set_xlabel("English source subwords")
    ax.set_ylabel("German target subwords")
    ax.tick_params(top=False, labeltop=False)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    return fig
