"""Training data: tokenized parallel pairs, filtering, and token-count batches (§5.1).

Batches are built like fairseq's: pairs sorted by length (ties broken by a per-epoch seeded
shuffle) are cut into batches whose padded size ``n_sentences * max(len)`` stays under
``max_tokens`` on each side, and the batch order is shuffled per epoch with the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.contract import BOS_ID, EOS_ID, PAD_ID
from runtime.corpus import read_parallel
from runtime.errors import CorpusError
from runtime.tokenizer import Tokenizer


@dataclass
class FilterReport:
    """How many pairs were read, kept, and dropped for being empty or too long."""

    total: int
    kept: int
    empty: int
    too_long: int

    def __str__(self) -> str:
        return (f"{self.kept}/{self.total} pairs kept ({self.empty} empty, "
                f"{self.too_long} longer than the limit dropped)")


@dataclass
class ParallelData:
    """Tokenized pairs: ``src[i]`` = ids + EOS, ``tgt[i]`` = ids (BOS/EOS added per batch)."""

    src: list[np.ndarray]
    tgt: list[np.ndarray]
    src_text: list[str]
    tgt_text: list[str]

    def __len__(self) -> int:
        return len(self.src)

    @property
    def num_target_tokens(self) -> int:
        """Target tokens per epoch, counting EOS (what the loss is computed over)."""
        return int(sum(len(t) + 1 for t in self.tgt))


def load_split(data_dir, split: str, src_lang: str, tgt_lang: str, tokenizer: Tokenizer,
               max_len: int | None, filter_pairs: bool = True) -> tuple[ParallelData, FilterReport]:
    """Read and tokenize a split.

    With ``filter_pairs`` (training), pairs with an empty side or more than ``max_len``
    tokens on a side (source with EOS, target with BOS) are dropped and counted. Without it
    (validation, test), every pair is kept and over-long sources are truncated to ``max_len``.
    Raises CorpusError if nothing is left.
    """
    src_lines, tgt_lines = read_parallel(data_dir, split, src_lang, tgt_lang)
    src, tgt, st, tt = [], [], [], []
    empty = too_long = 0
    for s_text, t_text in zip(src_lines, tgt_lines):
        s_ids, t_ids = tokenizer.encode(s_text), tokenizer.encode(t_text)
        if filter_pairs:
            if not s_ids or not t_ids:
                empty += 1
                continue
            if max_len is not None and (len(s_ids) + 1 > max_len or len(t_ids) + 1 > max_len):
                too_long += 1
                continue
        elif max_len is not None:
            s_ids, t_ids = s_ids[:max_len - 1], t_ids[:max_len - 1]
        src.append(np.array(s_ids + [EOS_ID], dtype=np.int64))
        tgt.append(np.array(t_ids, dtype=np.int64))
        st.append(s_text)
        tt.append(t_text)
    report = FilterReport(len(src_lines), len(src), empty, too_long)
    if not src:
        raise CorpusError(f"split {split!r} of {data_dir} has no usable sentence pairs ({report})")
    return ParallelData(src, tgt, st, tt), report


@dataclass
class Batch:
    """A padded batch. ``src`` (B, S) ids + EOS; ``tgt_in`` (B, T) BOS + ids; ``tgt_out``
    (B, T) ids + EOS; PAD elsewhere. ``ntokens`` counts non-pad target tokens."""

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    ntokens: int
    indices: list[int]

    def to(self, device) -> Batch:
        return Batch(self.src.to(device, non_blocking=True), self.tgt_in.to(device, non_blocking=True),
                     self.tgt_out.to(device, non_blocking=True), self.ntokens, self.indices)


def collate(data: ParallelData, indices: list[int]) -> Batch:
    """Pad the pairs at ``indices`` into a Batch."""
    B = len(indices)
    S = max(len(data.src[i]) for i in indices)
    T = max(len(data.tgt[i]) for i in indices) + 1
    src = np.full((B, S), PAD_ID, dtype=np.int64)
    tgt_in = np.full((B, T), PAD_ID, dtype=np.int64)
    tgt_out = np.full((B, T), PAD_ID, dtype=np.int64)
    for row, i in enumerate(indices):
        s, t = data.src[i], data.tgt[i]
        src[row, :len(s)] = s
        tgt_in[row, 0] = BOS_ID
        tgt_in[row, 1:len(t) + 1] = t
        tgt_out[row, :len(t)] = t
        tgt_out[row, len(t)] = EOS_ID
    ntokens = int(sum(len(data.tgt[i]) + 1 for i in indices))
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 ntokens, list(indices))


def make_batches(data: ParallelData, max_tokens: int, seed: int | None = None,
                 max_sentences: int | None = None) -> list[list[int]]:
    """Cut the pairs into batches of at most ``max_tokens`` padded tokens per side.

    Pairs are ordered by (source length, target length); with a ``seed``, ties are broken by a
    seeded shuffle and the batch order is shuffled too (pass ``seed + epoch`` for a new order
    every epoch); without one the order is deterministic (validation). A pair longer than
    ``max_tokens`` alone gets a batch of its own. Returns lists of pair indices.
    """
    n = len(data)
    src_len = np.array([len(s) for s in data.src])
    tgt_len = np.array([len(t) + 1 for t in data.tgt])
    rng = np.random.default_rng(seed) if seed is not None else None
    order = rng.permutation(n) if rng is not None else np.arange(n)
    order = order[np.lexsort((tgt_len[order], src_len[order]), axis=0)]
    batches, current, cur_max = [], [], 0
    for i in order:
        longest = max(cur_max, src_len[i], tgt_len[i])
        full = (max_sentences is not None and len(current) >= max_sentences)
        if current and (longest * (len(current) + 1) > max_tokens or full):
            batches.append(current)
            current, longest = [], max(src_len[i], tgt_len[i])
        current.append(int(i))
        cur_max = longest
    if current:
        batches.append(current)
    if rng is not None:
        batches = [batches[j] for j in rng.permutation(len(batches))]
    return batches
