"""Batched beam search in numpy over a backend's encoder and decoder step (DESIGN.md
"Search: one specification, two implementations"). Torch-free and ONNX-free: it talks only to
``runtime.backends.base.Backend``.

It implements exactly what the PyTorch reference (``train/search.py``) implements, and shares
with it ``runtime.searchspec`` (length limits, length penalties, ``walk_candidates``, result
types), so the two cannot drift apart:

- Step 0 expands one BOS row per sentence; after it every sentence has K rows. All rows of
  all sentences run in one decoder call.
- Each step, per row, the candidates are the top 2K of the cumulative scores
  ``score + log_prob`` (float32), PAD and BOS excluded, ties toward the lower token id; per
  sentence the R x 2K row candidates are ordered by flat index ``row * V + token`` and then
  stable-sorted by value, descending, and the first 2K are walked by ``walk_candidates``.
  Walking yields finished hypotheses (EOS of rank < K) and the next alive rows; a sentence
  with fewer than K alive candidates keeps "dead" rows (score -inf, token PAD) so each
  sentence always has K rows.
- At a sentence's last allowed step only EOS may be chosen (its log-prob is added).
- A sentence with K finished hypotheses (or no alive candidate) leaves the batch, so the
  decoder runs on fewer rows; the cross K/V rows are re-gathered (``Backend.select``) only
  when the set of sentences changes. The self-attention cache is reordered inside the graph
  (``beam_origin``).

Top-k from the graph: the decoder returns each row's top ``2K + 2`` log-probs (ONNX TopK),
so 2K remain after dropping PAD and BOS. Adding a row's score is monotone in float32 but may
round two distinct log-probs to one cumulative value, and the reference breaks such ties by
token id; so a row's top-k is used only when it is conclusive — when the cumulative value of
the smallest fetched log-prob is below the row's 2K-th candidate, no unfetched token can enter
— and the rare inconclusive row is recomputed from the full ``log_probs`` row. The result is
the reference's candidate list exactly.

Shape legend: B sentences, S source length, K beam, R rows per sentence (1 at step 0, K
after), N = active sentences x R rows, V vocabulary, t step (position).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backends.base import Backend
from .contract import BOS_ID, EOS_ID, PAD_ID
from .searchspec import (
    Hypothesis,
    check_search_args,
    empty_result,
    length_penalty,
    max_output_length,
    next_rows,
    rank,
    walk_candidates,
)

NEG_INF = float("-inf")
_F32_NEG_INF = np.float32(NEG_INF)


def beam_search(backend: Backend, sources: list[list[int]], beam_size: int = 4,
                length_penalty: float = 0.6, lp_type: str = "gnmt", max_len_a: float = 1.0,
                max_len_b: int = 50, nbest: int = 1, return_attention: bool = False,
                return_token_scores: bool = False, trace: list | None = None
                ) -> list[list[Hypothesis]]:
    """Translate a batch of token-id sources with ``backend``.

    Args:
        backend: a loaded Backend (runtime.backends).
        sources: per sentence, subword ids + EOS (length <= the model's max_positions);
            ``[]`` for an empty source, which yields the empty translation without running
            the model.
        beam_size: K; 1 is greedy search.
        length_penalty: alpha of the final ranking.
        lp_type: "gnmt" ((5 + len) / 6) ** alpha or "power" len ** alpha.
        max_len_a, max_len_b: at most ``a * S_src + b`` output tokens with EOS (also capped
            by max_positions).
        nbest: hypotheses returned per sentence (clipped to ``beam_size``).
        return_attention: fill ``Hypothesis.attention``: cross-attention rows float
            (len + 1, S_src) of the last decoder layer, averaged over heads.
        return_token_scores: fill ``Hypothesis.token_scores`` (natural-log, EOS included).
        trace: if a list, one dict per (step, sentence) is appended: ``step``, ``sentence``
            (index into ``sources``), ``candidates`` [(prefix tokens, token, cumulative
            score)] in rank order (every valid candidate the step considered), ``selected``
            [(prefix tokens, token)] of the finished and alive picks. Used by parity reports
            to find the first step where two searches diverge.

    Returns:
        Per source, up to ``nbest`` Hypothesis sorted by normalized score.

    Raises:
        ValueError: a bad option or a source longer than ``max_positions``.
    """
    nbest = check_search_args(beam_size, length_penalty, lp_type, max_len_a, max_len_b, nbest)
    K, V = beam_size, backend.vocab_size
    max_positions = backend.max_positions
    results: list[list[Hypothesis]] = [empty_result() for _ in sources]
    todo = [i for i, s in enumerate(sources) if len(s) > 0]
    if not todo:
        return results
    for i in todo:
        if len(sources[i]) > max_positions:
            raise ValueError(f"source {i} has {len(sources[i])} tokens, more than max_positions "
                             f"{max_positions}; truncate it")

    # ---- encoder: once per sentence -----------------------------------------------------
    B, S = len(todo), max(len(sources[i]) for i in todo)
    src = np.full((B, S), PAD_ID, dtype=np.int64)  # (B, S)
    for b, i in enumerate(todo):
        src[b, :len(sources[i])] = sources[i]
    encoded = backend.encode(src)
    src_lens = [len(sources[i]) for i in todo]
    max_len = [max_output_length(n, max_len_a, max_len_b, max_positions) for n in src_lens]
    last_step = np.array(max_len, dtype=np.int64) - 1  # (B,) each sentence's last step
    finished: list[list[Hypothesis]] = [[] for _ in todo]

    # ---- per-row state --------------------------------------------------------------------
    active = list(range(B))  # batch positions b of the sentences still searching
    R = 1  # rows per sentence
    N = B
    tokens = np.full(N, BOS_ID, dtype=np.int64)  # (N,)
    scores = np.zeros(N, dtype=np.float32)  # (N,) cumulative log-prob
    history = np.zeros((N, 0), dtype=np.int64)  # (N, t)
    tok_scores = np.zeros((N, 0), dtype=np.float32)  # (N, t)
    attn_hist = np.zeros((N, 0, S), dtype=np.float32) if return_attention else None  # (N, t, S)
    beam_origin = np.arange(N, dtype=np.int64)
    cache: Any = None
    cross: Any = None
    rows_changed = True
    C = 2 * K  # candidates kept per row and per sentence
    k_fetch = min(C + 2, V)  # + PAD and BOS, which are never generated

    for t in range(max(max_len)):
        if rows_changed:  # gather cross K/V only when the set of sentences changes
            cross = backend.select(encoded, np.repeat(np.asarray(active, dtype=np.int64), R))
        out = backend.step(tokens, t, cache, beam_origin, cross, k_fetch)
        cache = out.cache
        last = last_step[active] == t  # (n,)
        cand_vals, cand_ids = _row_candidates(out, scores, last, R, C, V, k_fetch)  # (N, C)

        # Per sentence: order the R*C candidates by flat index, then stably by value (desc).
        n = len(active)
        flat = (np.arange(R, dtype=np.int64)[None, :, None] * V
                + cand_ids.reshape(n, R, C)).reshape(n, R * C)  # (n, R*C)
        vals = cand_vals.reshape(n, R * C)
        order = np.lexsort((flat, -vals), axis=-1)[:, :C]  # value desc, then flat asc
        rows = np.arange(n)[:, None]
        vals, flat = vals[rows, order], flat[rows, order]  # (n, C)
        n_valid = (vals != _F32_NEG_INF).sum(axis=1)
        vals_l, flat_l = vals.tolist(), flat.tolist()

        next_active, origin, next_tokens, next_scores = [], [], [], []
        attn_now = out.cross_attn() if return_attention else None  # (N, S)
        for j, b in enumerate(active):
            nv = int(n_valid[j])
            done_rows, alive = walk_candidates(vals_l[j][:nv], flat_l[j][:nv], K, V, EOS_ID,
                                               len(finished[b]))
            if trace is not None:
                _trace(trace, t, todo[b], history, j * R, R, done_rows, alive, cand_vals,
                       cand_ids)
            for row, value in done_rows:
                g = j * R + row
                finished[b].append(_hypothesis(
                    history[g], tok_scores[g], attn_hist[g] if return_attention else None,
                    attn_now[g] if return_attention else None, value, float(scores[g]),
                    length_penalty, lp_type, return_attention, return_token_scores, src_lens[b]))
            if len(finished[b]) >= K or not alive:
                continue
            next_active.append(b)
            for row, token, value in next_rows(alive, K, j * R, PAD_ID):
                origin.append(row)
                next_tokens.append(token)
                next_scores.append(value)
        if not next_active:
            break
        beam_origin = np.array(origin, dtype=np.int64)  # (N',)
        prev_scores = scores[beam_origin]
        tokens = np.array(next_tokens, dtype=np.int64)
        scores = np.array(next_scores, dtype=np.float32)
        history = np.concatenate([history[beam_origin], tokens[:, None]], axis=1)
        with np.errstate(invalid="ignore"):
            step_lp = np.where(np.isinf(scores), np.float32(0.0), scores - prev_scores)
        tok_scores = np.concatenate([tok_scores[beam_origin], step_lp[:, None]], axis=1)
        if return_attention:
            attn_hist = np.concatenate([attn_hist[beam_origin], attn_now[beam_origin][:, None]],
                                       axis=1)
        rows_changed = next_active != active or R != K
        active, R = next_active, K

    for b, i in enumerate(todo):
        results[i] = rank(finished[b], nbest)
    return results


def _row_candidates(out, scores: np.ndarray, last: np.ndarray, R: int, C: int, V: int,
                    k_fetch: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top C candidates by (cumulative score desc, token id asc), PAD/BOS excluded.

    ``out`` is the step's StepOutput, ``scores`` float32 (N,), ``last`` bool (n,) marks
    sentences at their last allowed step (their rows may only choose EOS). Returns values
    float32 (N, C) (-inf where a row has fewer valid candidates) and token ids int64 (N, C).
    """
    lp_k = np.asarray(out.topk_log_probs, dtype=np.float32)  # (N, k)
    ids_k = np.asarray(out.topk_ids, dtype=np.int64)
    N = lp_k.shape[0]
    s = scores[:, None]  # (N, 1)
    special = (ids_k == PAD_ID) | (ids_k == BOS_ID)
    with np.errstate(invalid="ignore"):
        cand = np.where(special, _F32_NEG_INF, s + lp_k)  # (N, k) float32
    order = np.lexsort((ids_k, -cand), axis=-1)
    rows = np.arange(N)[:, None]
    cand, ids = cand[rows, order], ids_k[rows, order]
    if cand.shape[1] < C:  # V < C: every token was fetched; pad
        pad = C - cand.shape[1]
        cand = np.concatenate([cand, np.full((N, pad), _F32_NEG_INF, np.float32)], axis=1)
        ids = np.concatenate([ids, np.zeros((N, pad), np.int64)], axis=1)
    cand, ids = cand[:, :C].copy(), ids[:, :C].copy()

    if k_fetch < V:
        # Conclusive iff no unfetched token can reach the C-th candidate: an unfetched token
        # has log-prob <= the smallest fetched one, so its cumulative value is <= ``floor``.
        floor = (s[:, 0] + lp_k.min(axis=1)).astype(np.float32)
        cut = cand[:, C - 1]
        redo = np.nonzero(np.isfinite(cut) & (floor >= cut))[0]
        if len(redo):
            full = out.log_probs()[redo]  # (r, V)
            full_cand = scores[redo][:, None] + full
            full_cand[:, PAD_ID] = _F32_NEG_INF
            full_cand[:, BOS_ID] = _F32_NEG_INF
            top = np.argsort(-full_cand, axis=1, kind="stable")[:, :C]  # desc, lower id first
            cand[redo] = full_cand[np.arange(len(redo))[:, None], top]
            ids[redo] = top

    if last.any():  # only EOS at a sentence's last step
        rows = np.nonzero(np.repeat(last, R))[0]
        eos = scores[rows] + out.log_probs()[rows, EOS_ID]
        cand[rows] = _F32_NEG_INF
        ids[rows] = 0
        cand[rows, 0] = eos
        ids[rows, 0] = EOS_ID
    return cand, ids


def _hypothesis(history: np.ndarray, tok_scores: np.ndarray, attn_hist: np.ndarray | None,
                attn_now: np.ndarray | None, value: float, prev_score: float, alpha: float,
                lp_type: str, return_attention: bool, return_token_scores: bool,
                src_len: int) -> Hypothesis:
    """A finished hypothesis: the row's history + EOS with cumulative score ``value``."""
    tokens = history.tolist()
    hyp = Hypothesis(tokens=tokens, score=value,
                     normalized_score=value / length_penalty(len(tokens) + 1, alpha, lp_type))
    if return_token_scores:
        hyp.token_scores = tok_scores.tolist() + [value - prev_score]
    if return_attention:
        rows = np.concatenate([attn_hist, attn_now[None]], axis=0)[:, :src_len]
        hyp.attention = rows.tolist()
    return hyp


def _trace(trace: list, t: int, sentence: int, history: np.ndarray, g0: int, R: int,
           done_rows: list, alive: list, cand_vals: np.ndarray, cand_ids: np.ndarray) -> None:
    """Record one sentence's step for parity reports (see ``beam_search``'s ``trace``): its
    rows are ``g0 .. g0 + R - 1``; ``cand_vals``/``cand_ids`` (N, C) are every row's
    candidates, ``done_rows``/``alive`` the walk's picks."""
    prefixes = [tuple(history[g0 + r].tolist()) for r in range(R)]
    cands = []
    for r in range(R):  # every valid row candidate, not only the sentence's top 2K
        for v, tok in zip(cand_vals[g0 + r].tolist(), cand_ids[g0 + r].tolist()):
            if v != NEG_INF:
                cands.append((prefixes[r], int(tok), float(v)))
    cands.sort(key=lambda c: (-c[2], c[0], c[1]))
    selected = [(prefixes[row], EOS_ID) for row, _ in done_rows]
    selected += [(prefixes[row], int(tok)) for row, tok, _ in alive]
    trace.append({"step": t, "sentence": sentence, "candidates": cands,
                  "selected": selected})


def greedy_search(backend: Backend, sources: list[list[int]], **kwargs) -> list[list[Hypothesis]]:
    """Greedy search: beam search with K = 1 (exactly greedy under the specification)."""
    return beam_search(backend, sources, beam_size=1, **kwargs)
