"""Text in, Translation out: what every backend's translator shares. Torch-free.

The PyTorch reference translator (``train/translator.py``) and the ONNX runtime translator
(``runtime/translator.py``) both prepare sources and build results here, so tokenization,
truncation and result layout are identical whichever backend runs the search.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .contract import EOS_ID
from .errors import InputTooLongError
from .searchspec import Hypothesis, empty_result
from .tokenizer import Tokenizer

ON_LONG = ("truncate", "error")


@dataclass
class NBest:
    """One entry of an n-best list.

    ``score`` is the normalized score (cumulative log-prob / lp(len)), the ranking key;
    ``log_prob`` the cumulative natural-log probability of tokens + EOS; ``token_scores``
    per-token log-probs (EOS included) when requested.
    """

    text: str
    tokens: list[str]
    token_ids: list[int]
    score: float
    log_prob: float
    token_scores: list[float] | None = None


@dataclass
class Translation:
    """The result for one input.

    Attributes:
        text: the best hypothesis, detokenized ("" for empty input).
        tokens: its target subwords, without EOS.
        score: its normalized score (log-prob / length penalty; 0.0 for empty input).
        nbest: up to ``nbest`` entries, best first.
        source_tokens: source subwords as the model saw them, EOS included.
        attention: if requested, cross-attention (len(tokens) + 1, len(source_tokens)) of the
            best hypothesis (last decoder layer, averaged over heads; the last row is EOS's).
        truncated: the input was longer than the model's max_positions and was cut.
    """

    text: str
    tokens: list[str]
    score: float
    nbest: list[NBest] = field(default_factory=list)
    source_tokens: list[str] = field(default_factory=list)
    attention: list[list[float]] | None = None
    truncated: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.nbest[0].token_ids if self.nbest else []


def prepare_source(tokenizer: Tokenizer, text: str, max_positions: int,
                   on_long: str = "truncate", index: int | None = None) -> tuple[list[int], bool]:
    """Source ids (subwords + EOS) of ``text`` and whether it was truncated.

    Empty or whitespace-only text gives []. A source longer than ``max_positions`` is cut to
    fit (EOS kept) with a warning when ``on_long`` is "truncate", or raises
    InputTooLongError when it is "error". ``index`` (0-based input number) names the input in
    those messages.
    """
    if on_long not in ON_LONG:
        raise ValueError(f"on_long must be one of {', '.join(ON_LONG)}, got {on_long!r}")
    ids = tokenizer.encode_source(text)
    if len(ids) <= max_positions:
        return ids, False
    which = "input" if index is None else f"input {index} (0-based)"
    if on_long == "error":
        raise InputTooLongError(
            f"{which} has {len(ids)} tokens, more than the model's max_positions "
            f"({max_positions}); shorten it, or let it be truncated (--on-long truncate; on_long='truncate')")
    warnings.warn(f"{which}: {len(ids)} tokens truncated to the model's max_positions "
                  f"({max_positions})", stacklevel=3)
    return ids[:max_positions - 1] + [EOS_ID], True


def inference_batches(lengths: Sequence[int], max_tokens: int, max_sentences: int | None = None
                      ) -> list[list[int]]:
    """Group input indices into batches by token count, from length-sorted inputs.

    Longest first, so memory peaks early; a batch's padded size ``len * max(length)`` stays
    under ``max_tokens`` (an input longer than that gets a batch of its own). Empty inputs
    (length 0) are not batched. Returns lists of indices into ``lengths``.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches:
            cur = batches[-1]
            longest = lengths[cur[0]]
            if (len(cur) + 1) * longest <= max_tokens and (max_sentences is None
                                                          or len(cur) < max_sentences):
                cur.append(i)
                continue
        batches.append([i])
    return batches


def make_translation(tokenizer: Tokenizer, src_ids: list[int], hyps: list[Hypothesis],
                     truncated: bool = False) -> Translation:
    """Build a Translation from a sentence's ranked hypotheses."""
    nbest = [NBest(text=tokenizer.decode(h.tokens), tokens=tokenizer.pieces(h.tokens),
                   token_ids=list(h.tokens), score=h.normalized_score, log_prob=h.score,
                   token_scores=h.token_scores) for h in hyps]
    if not src_ids:
        return Translation(text="", tokens=[], score=0.0, nbest=nbest, attention=None,
                           truncated=truncated)
    best, best_hyp = nbest[0], hyps[0]
    return Translation(text=best.text, tokens=best.tokens, score=best.score, nbest=nbest,
                       source_tokens=tokenizer.pieces(src_ids), attention=best_hyp.attention,
                       truncated=truncated)


def translate_batched(tokenizer: Tokenizer, texts: Sequence[str], max_positions: int,
                      search: Callable[[list[list[int]]], list[list[Hypothesis]]],
                      max_tokens: int = 4096, on_long: str = "truncate",
                      progress: Callable[[int], None] | None = None,
                      max_sentences: int | None = None) -> list[Translation]:
    """Tokenize ``texts``, run ``search`` over token-count batches of length-sorted sources,
    and return Translations in input order. ``progress(n)`` is called after each batch with
    the number of sentences it held; ``max_sentences`` caps a batch's sentences (for
    backends whose engines have a largest batch)."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not a single string")
    prepared = [prepare_source(tokenizer, t, max_positions, on_long, i) for i, t in enumerate(texts)]
    sources = [ids for ids, _ in prepared]
    hyps: list[list[Hypothesis] | None] = [None] * len(texts)
    for batch in inference_batches([len(s) for s in sources], max_tokens, max_sentences):
        for i, h in zip(batch, search([sources[i] for i in batch])):
            hyps[i] = h
        if progress is not None:
            progress(len(batch))
    return [make_translation(tokenizer, sources[i], hyps[i] if hyps[i] is not None else
                             empty_result(), prepared[i][1]) for i in range(len(texts))]
