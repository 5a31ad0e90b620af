"""The reference search in PyTorch: batched greedy and beam search over ``Transformer.step``.

This is the oracle the runtime is held to; it implements DESIGN.md's search specification:
step 0 expands one BOS hypothesis per sentence; each step takes, per sentence, the top
min(2K, #candidates) of (alive hypotheses x vocabulary) by cumulative log-prob (ties toward
the lower flat index) and walks them with ``runtime.searchspec.walk_candidates``; PAD and
BOS are never generated; at a sentence's last allowed step only EOS may be chosen; a sentence
is done with K finished hypotheses (or none alive); finished sentences leave the batch;
the final ranking divides by ``length_penalty`` (gnmt or power). K = 1 is greedy search.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.contract import BOS_ID, EOS_ID, PAD_ID
from runtime.searchspec import (
    Hypothesis,
    check_search_args,
    empty_result,
    length_penalty,
    max_output_length,
    next_rows,
    rank,
    walk_candidates,
)

from .model import Transformer

NEG_INF = float("-inf")


def topk_lower_index(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top ``k`` of each row of ``x`` (R, V), ties across the cut toward the lower index
    (ONNX TopK's rule; torch.topk does not promise one). Returns values and indices (R, k)."""
    k = min(k, x.shape[1])
    vals, idx = x.topk(k, dim=1)
    thr = vals[:, -1:]
    # Only the selected set matters (callers re-rank it); a tie across the cut at a finite
    # value is resolved exactly, toward the lower index.
    tied = ((x == thr).sum(1) > (vals == thr).sum(1)) & torch.isfinite(thr[:, 0])
    for r in tied.nonzero().flatten().tolist():
        order = torch.sort(x[r], descending=True, stable=True)
        vals[r], idx[r] = order.values[:k], order.indices[:k]
    return vals, idx


@torch.no_grad()
def beam_search(model: Transformer, sources: list[list[int]], beam_size: int = 4,
                length_penalty: float = 0.6, lp_type: str = "gnmt", max_len_a: float = 1.0,
                max_len_b: int = 50, nbest: int = 1, return_attention: bool = False,
                return_token_scores: bool = False) -> list[list[Hypothesis]]:
    """Translate a batch of token-id sources.

    Args:
        model: a Transformer (its device and dtype are used; call ``model.eval()`` first).
        sources: per sentence, subword ids + EOS (length <= max_positions); ``[]`` for an empty
            source, which yields the empty translation without running the model.
        beam_size: K; 1 is greedy search.
        length_penalty: alpha of the final ranking.
        lp_type: "gnmt" ((5 + len) / 6) ** alpha or "power" len ** alpha.
        max_len_a, max_len_b: at most ``a * S_src + b`` output tokens with EOS.
        nbest: hypotheses returned per sentence (clipped to ``beam_size``).
        return_attention, return_token_scores: fill those fields of each Hypothesis.

    Returns:
        Per source, up to ``nbest`` Hypothesis sorted by normalized score.

    Raises:
        ValueError: a bad option or a source longer than ``max_positions``.
    """
    nbest = check_search_args(beam_size, length_penalty, lp_type, max_len_a, max_len_b, nbest)
    cfg = model.cfg
    K, V = beam_size, cfg.vocab_size
    results: list[list[Hypothesis]] = [empty_result() for _ in sources]
    todo = [i for i, s in enumerate(sources) if len(s) > 0]
    if not todo:
        return results
    for i in todo:
        if len(sources[i]) > cfg.max_positions:
            raise ValueError(f"source {i} has {len(sources[i])} tokens, more than max_positions "
                             f"{cfg.max_positions}; truncate it")
    device = model.embed.weight.device

    # ---- encoder: once per sentence -----------------------------------------------------
    S = max(len(sources[i]) for i in todo)
    src = torch.full((len(todo), S), PAD_ID, dtype=torch.long)
    for b, i in enumerate(todo):
        src[b, :len(sources[i])] = torch.tensor(sources[i])
    cross_k, cross_v, src_pad_mask = model.encode_for_step(src.to(device))  # (L, B, H, S, Dh)
    max_len = [max_output_length(len(sources[i]), max_len_a, max_len_b, cfg.max_positions)
               for i in todo]
    finished: list[list[Hypothesis]] = [[] for _ in todo]

    # ---- per-row state (rows of active sentences, R rows each) -----------------------------
    active = list(range(len(todo)))  # batch positions b of sentences still searching
    R = 1  # rows per sentence: 1 (BOS) at step 0, K after
    N = len(active)
    tokens = torch.full((N,), BOS_ID, dtype=torch.long, device=device)
    scores = torch.zeros(N, dtype=torch.float32, device=device)
    history = torch.zeros(N, 0, dtype=torch.long, device=device)  # (N, t)
    tok_scores = torch.zeros(N, 0, dtype=torch.float32, device=device)  # (N, t)
    attn_hist = torch.zeros(N, 0, S, dtype=torch.float32, device=device)  # (N, t, S)
    past_k, past_v = model.empty_cache(N)
    beam_origin = torch.arange(N, device=device)
    rows_changed = True
    ck = cv = mask = None

    for t in range(max(max_len)):
        if rows_changed:  # gather cross K/V only when the set of sentences changes
            sent_rows = torch.tensor(active, device=device).repeat_interleave(R)  # (N,)
            ck, cv = cross_k.index_select(1, sent_rows), cross_v.index_select(1, sent_rows)
            mask = src_pad_mask.index_select(0, sent_rows)
        log_probs, past_k, past_v, attn = model.step(tokens, t, past_k, past_v, beam_origin,
                                                     ck, cv, mask)  # (N, V) ...
        log_probs[:, PAD_ID] = NEG_INF
        log_probs[:, BOS_ID] = NEG_INF
        last = torch.tensor([t == max_len[b] - 1 for b in active], device=device)
        if last.any():
            last_rows = last.repeat_interleave(R)
            eos_col = log_probs[:, EOS_ID].clone()
            log_probs[last_rows] = NEG_INF
            log_probs[last_rows, EOS_ID] = eos_col[last_rows]
        cand = scores[:, None] + log_probs  # (N, V) cumulative
        # Per row top-2K (enough for the per-sentence top 2K), then per sentence rank the R*2K.
        row_vals, row_ids = topk_lower_index(cand, 2 * K)  # (N, 2K)
        k2 = row_vals.shape[1]
        flat = (torch.arange(R, device=device)[None, :, None] * V
                + row_ids.view(len(active), R, k2)).view(len(active), R * k2)
        vals = row_vals.view(len(active), R * k2)
        by_id = flat.argsort(dim=1)
        flat, vals = flat.gather(1, by_id), vals.gather(1, by_id)
        order = vals.argsort(dim=1, descending=True, stable=True)[:, :2 * K]
        vals, flat = vals.gather(1, order).tolist(), flat.gather(1, order).tolist()

        next_active, origin, next_tokens, next_scores = [], [], [], []
        for j, b in enumerate(active):
            valid = [v for v in vals[j] if v != NEG_INF]
            done_rows, alive = walk_candidates(valid, flat[j][:len(valid)], K, V, EOS_ID,
                                               len(finished[b]))
            for row, value in done_rows:
                g = j * R + row
                finished[b].append(_hypothesis(history[g], tok_scores[g], attn_hist[g], attn[g],
                                               value, float(scores[g]), length_penalty, lp_type,
                                               return_attention, return_token_scores, len(sources[todo[b]])))
            if len(finished[b]) >= K or not alive:
                continue
            next_active.append(b)
            for row, token, value in next_rows(alive, K, j * R, PAD_ID):
                origin.append(row)
                next_tokens.append(token)
                next_scores.append(value)
        if not next_active:
            break
        beam_origin = torch.tensor(origin, device=device)
        prev_scores = scores.index_select(0, beam_origin)
        tokens = torch.tensor(next_tokens, device=device)
        scores = torch.tensor(next_scores, dtype=torch.float32, device=device)
        history = torch.cat([history.index_select(0, beam_origin), tokens[:, None]], dim=1)
        step_lp = torch.where(torch.isinf(scores), 0.0, scores - prev_scores)
        tok_scores = torch.cat([tok_scores.index_select(0, beam_origin), step_lp[:, None]], 1)
        if return_attention:
            attn_hist = torch.cat([attn_hist.index_select(0, beam_origin),
                                   attn.index_select(0, beam_origin)[:, None]], dim=1)
        else:
            attn_hist = attn_hist.index_select(0, beam_origin)
        rows_changed = next_active != active or R != K
        active, R = next_active, K

    for b, i in enumerate(todo):
        results[i] = rank(finished[b], nbest)
    return results


def _hypothesis(history: Tensor, tok_scores: Tensor, attn_hist: Tensor, attn_now: Tensor,
                value: float, prev_score: float, alpha: float, lp_type: str,
                return_attention: bool, return_token_scores: bool, src_len: int) -> Hypothesis:
    """A finished hypothesis: the row's history + EOS with cumulative score ``value``."""
    tokens = history.tolist()
    hyp = Hypothesis(tokens=tokens, score=value,
                     normalized_score=value / length_penalty(len(tokens) + 1, alpha, lp_type))
    if return_token_scores:
        hyp.token_scores = tok_scores.tolist() + [value - prev_score]
    if return_attention:
        rows = torch.cat([attn_hist, attn_now[None]], dim=0)[:, :src_len]
        hyp.attention = rows.tolist()
    return hyp


def greedy_search(model: Transformer, sources: list[list[int]], **kwargs) -> list[list[Hypothesis]]:
    """Greedy search: beam search with K = 1 (exactly greedy under the specification)."""
    return beam_search(model, sources, beam_size=1, **kwargs)


