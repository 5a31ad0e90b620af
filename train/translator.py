"""The ``torch`` backend: translate text with a checkpoint and the PyTorch reference search.

Same API as ``runtime.translator.Translator`` (``translate(texts, ...) -> list[Translation]``),
so the CLI, ``aiayn eval`` and the demo can use either.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from runtime.translation import Translation, translate_batched

from .checkpoint import load_checkpoint
from .search import beam_search


class TorchTranslator:
    """A checkpoint on the PyTorch reference search.

    ``device`` is "cpu", "cuda" or "auto" (CUDA when available); ``threads`` sets torch's
    intra-op threads. Raises CheckpointError for a missing or damaged checkpoint.
    """

    backend = "torch"

    def __init__(self, model, tokenizer, checkpoint: Path | None = None, device: str = "cpu"):
        self.model = model
        self.tokenizer = tokenizer
        self.checkpoint = checkpoint
        self.device = device
        self.source = str(checkpoint) if checkpoint is not None else ""
        self.max_positions = model.cfg.max_positions
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike, device: str = "auto", threads: int | None = None
             ) -> TorchTranslator:
        if threads:
            torch.set_num_threads(threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer, ckpt = load_checkpoint(path, device=device)
        return cls(model, tokenizer, ckpt, device)

    def translate(self, texts: Sequence[str], beam_size: int = 4, length_penalty: float = 0.6,
                  lp_type: str = "gnmt", max_len_a: float = 1.0, max_len_b: int = 50,
                  nbest: int = 1, return_attention: bool = False, max_tokens: int = 4096,
                  on_long: str = "truncate", progress: Callable[[int], None] | None = None
                  ) -> list[Translation]:
        """Translate ``texts``; results in input order (see runtime.translation.Translation).

        Batches by token count (``max_tokens`` padded source tokens) from length-sorted
        inputs. Empty or whitespace-only texts give "". Raises ValueError for a bad option
        and InputTooLongError for an over-long input with ``on_long="error"``.
        """

        def search(sources):
            with self._lock:  # one search at a time on a model
                return beam_search(self.model, sources, beam_size=beam_size,
                                   length_penalty=length_penalty, lp_type=lp_type,
                                   max_len_a=max_len_a, max_len_b=max_len_b, nbest=nbest,
                                   return_attention=return_attention, return_token_scores=True)

        return translate_batched(self.tokenizer, texts, self.max_positions, search,
                                 max_tokens=max_tokens, on_long=on_long, progress=progress)
