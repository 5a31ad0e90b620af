"""What both searches share (DESIGN.md "Search: one specification, two implementations").

The PyTorch reference (``train/search.py``) and the runtime (``runtime/search.py``) both
import these, so length limits, length penalties and result types cannot drift apart.
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LP_TYPES = ("gnmt", "power")


def max_output_length(src_len: int, max_len_a: float, max_len_b: int, max_positions: int) -> int:
    """Most tokens a hypothesis may hold, EOS included: ``a * S_src + b``, capped by
    ``max_positions`` (step t feeds position t), at least 1.

    ``src_len`` (S_src) counts source tokens including EOS. Defaults (1, 50) are the paper's
    "input length + 50" (§6.1).
    """
    return max(1, min(int(max_len_a * src_len + max_len_b), max_positions))


def length_penalty(length: int, alpha: float, lp_type: str = "gnmt") -> float:
    """lp(len) that final scores are divided by; ``length`` counts generated tokens with EOS.

    ``gnmt``: ((5 + len) / 6) ** alpha (Wu et al. 2016; the paper used alpha 0.6, §6.1).
    ``power``: len ** alpha (fairseq, CTranslate2, Hugging Face).
    Raises ValueError for another ``lp_type``.
    """
    if lp_type == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if lp_type == "power":
        return float(length) ** alpha
    raise ValueError(f"unknown length penalty type {lp_type!r}; use one of {', '.join(LP_TYPES)}")


def check_search_args(beam_size: int, length_penalty: float, lp_type: str, max_len_a: float,
                      max_len_b: int, nbest: int) -> int:
    """Validate search options; return the n-best size actually used (``min(nbest, beam)``).

    Raises ValueError naming the bad option.
    """
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive integer, got {beam_size!r}")
    if not isinstance(nbest, int) or nbest < 1:
        raise ValueError(f"nbest must be a positive integer, got {nbest!r}")
    if lp_type not in LP_TYPES:
        raise ValueError(f"unknown length penalty type {lp_type!r}; use one of {', '.join(LP_TYPES)}")
    if not math.isfinite(length_penalty) or length_penalty < 0:
        raise ValueError(f"length_penalty (alpha) must be a finite number >= 0, got {length_penalty}")
    if not (math.isfinite(max_len_a) and math.isfinite(max_len_b)):
        raise ValueError(f"max_len_a and max_len_b must be finite, got {max_len_a}, {max_len_b}")
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a and max_len_b must be >= 0, got {max_len_a}, {max_len_b}")
    return min(nbest, beam_size)


@dataclass
class Hypothesis:
    """One finished hypothesis.

    Attributes:
        tokens: generated subword ids without EOS.
        score: cumulative log-prob (natural log) of tokens + EOS.
        normalized_score: ``score / lp(len(tokens) + 1)``, the ranking key.
        token_scores: per-token log-probs, EOS included (len(tokens) + 1), if requested.
        attention: cross-attention rows (len(tokens) + 1, S_src), float32, if requested.
    """

    tokens: list[int]
    score: float
    normalized_score: float
    token_scores: list[float] | None = None
    attention: list[list[float]] | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        """Generated tokens including EOS (what the length penalty counts)."""
        return len(self.tokens) + 1


def rank(hyps: list[Hypothesis], nbest: int) -> list[Hypothesis]:
    """The ``nbest`` best by normalized score (stable: earlier-finished first on ties)."""
    return sorted(hyps, key=lambda h: -h.normalized_score)[:nbest]


def empty_result() -> list[Hypothesis]:
    """The result of an empty source: the empty translation, without running the model."""
    return [Hypothesis(tokens=[], score=0.0, normalized_score=0.0, token_scores=[],
                       attention=[])]


def walk_candidates(values: list[float], flat_ids: list[int], beam_size: int, vocab_size: int,
                    eos_id: int, n_finished: int
                    ) -> tuple[list[tuple[int, float]], list[tuple[int, int, float]]]:
    """Apply one step's selection rule to a sentence's ranked candidates.

    ``values`` are cumulative log-probs sorted descending (ties: lower flat index first) and
    ``flat_ids`` their flat indices ``row * V + token`` over the sentence's alive rows; invalid
    candidates (-inf) must already be removed. Walking in rank order: an EOS candidate of rank
    < K finishes its hypothesis until the sentence holds K finished; other EOS candidates are
    dropped; the first K non-EOS candidates become the next alive hypotheses.

    Returns ``finished`` as (row, score) and ``alive`` as (row, token, score), in rank order.
    """
    K = beam_size
    finished: list[tuple[int, float]] = []
    alive: list[tuple[int, int, float]] = []
    for r, (value, flat) in enumerate(zip(values, flat_ids)):
        row, token = divmod(flat, vocab_size)
        if token == eos_id:
            if r < K:
                finished.append((row, value))
                if n_finished + len(finished) >= K:
                    break
        elif len(alive) < K:
            alive.append((row, token, value))
        if len(alive) >= K and r >= K - 1:
            break
    return finished, alive


def next_rows(alive: list[tuple[int, int, float]], beam_size: int, row_offset: int, pad_id: int
              ) -> list[tuple[int, int, float]]:
    """The K rows a sentence continues with: its alive hypotheses as (origin row, token,
    score), ``row_offset`` added to each origin, padded with dead rows (score -inf, token
    ``pad_id``, origin the best row) when fewer than K are alive (tiny vocabularies)."""
    rows = [(row_offset + row, token, value) for row, token, value in alive]
    dead = (row_offset + alive[0][0], pad_id, float("-inf"))
    return rows + [dead] * (beam_size - len(alive))
