"""The backend interface: what the search needs from an inference engine. Torch-free.

A backend knows how to run the two graphs of the contract (runtime/contract.py) and nothing
of the search (STYLE.md "Small interfaces in the runtime"). The search (runtime/search.py)
calls, per batch:

1. ``encode(src_ids)`` once: the encoder graph; its outputs stay wherever the backend keeps
   them (host memory for ``ort-cpu``, device memory for the GPU backends).
2. ``select(encoded, rows)`` whenever the set of sentences changes (after step 0, and each
   time finished sentences leave the batch): one row of cross K/V and padding mask per
   decoder row, gathered where the encoder outputs live.
3. ``step(...)`` once per decoding step for all rows in lock-step: the decoder graph. Only
   the graph's top-k values and ids come back to the host each step; the self-attention
   cache stays in the backend (``StepOutput.cache``) and is reordered *inside* the graph
   with ``beam_origin``; the full ``log_probs`` and ``cross_attn`` are fetched only when the
   search asks for them.

Shape legend: B sentences, S source length, N decoder rows, P past length, V vocabulary,
k the top-k width requested.

A new backend is one file in this package: subclass ``Backend``, give it a ``name`` and add
it to ``runtime.backends.REGISTRY``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StepOutput:
    """What one decoder step returns to the search.

    Attributes:
        topk_log_probs: float32 (N, k), each row's k largest log-probs, descending.
        topk_ids: int64 (N, k), their token ids.
        cache: the new self-attention cache (present_k/present_v), opaque to the search; it
            is passed back as ``cache`` to the next ``step``.
    """

    topk_log_probs: np.ndarray
    topk_ids: np.ndarray
    cache: Any
    _log_probs: Callable[[], np.ndarray] = field(repr=False, default=None)
    _cross_attn: Callable[[], np.ndarray] = field(repr=False, default=None)
    _cached: dict = field(repr=False, default_factory=dict)

    def log_probs(self) -> np.ndarray:
        """The full next-token log-probs, float32 (N, V); fetched from the device on first
        use (the search needs them only at a sentence's last step and for rare rows whose
        top-k is not conclusive)."""
        if "lp" not in self._cached:
            self._cached["lp"] = np.asarray(self._log_probs(), dtype=np.float32)
        return self._cached["lp"]

    def cross_attn(self) -> np.ndarray:
        """The last decoder layer's cross-attention averaged over heads, float32 (N, S);
        fetched on first use (only when attention is requested)."""
        if "attn" not in self._cached:
            self._cached["attn"] = np.asarray(self._cross_attn(), dtype=np.float32)
        return self._cached["attn"]


class Backend(ABC):
    """Runs ``encoder.onnx`` and one step of ``decoder.onnx`` of a model package.

    Attributes:
        name: the backend's name as the CLI spells it ("ort-cpu", ...).
        vocab_size: V of the model.
        max_positions: the model's position table size (bounds source and output length).
        thread_safe: whether several threads may run searches on this backend at once; the
            translator serializes calls when it is False.
        max_rows: the most decoder rows (sentences x beam) one step may have, or None for no
            limit (TensorRT engines are built for a range of shapes); the translator sizes
            its batches to fit.
    """

    name: str = "?"
    thread_safe: bool = True
    max_rows: int | None = None

    def __init__(self, config: dict[str, Any]):
        self.config = dict(config)
        self.vocab_size = int(config["vocab_size"])
        self.max_positions = int(config["max_positions"])

    @abstractmethod
    def encode(self, src_ids: np.ndarray) -> Any:
        """Run the encoder on ``src_ids`` int64 (B, S) (subwords + EOS, PAD-padded on the
        right). Returns an opaque handle to ``cross_k``, ``cross_v`` (L, B, H, S, Dh) and
        ``src_pad_mask`` bool (B, S), kept where the backend computes."""

    @abstractmethod
    def select(self, encoded: Any, rows: np.ndarray) -> Any:
        """Cross K/V and padding mask for decoder rows: row n continues sentence ``rows[n]``
        (int64 (N,), indices into the encoded batch). Returns an opaque handle to
        ``cross_k``, ``cross_v`` (L, N, H, S, Dh) and ``src_pad_mask`` (N, S)."""

    @abstractmethod
    def step(self, tokens: np.ndarray, step: int, cache: Any, beam_origin: np.ndarray,
             cross: Any, topk: int) -> StepOutput:
        """One decoder step for N rows.

        Args:
            tokens: int64 (N,), the token at position ``step`` of each row (BOS at step 0).
            step: the position of ``tokens`` (0 for BOS).
            cache: the previous step's ``StepOutput.cache``, or None at step 0 (empty past,
                P = 0).
            beam_origin: int64 (N,), the row of the previous cache each row continues (at
                step 0, ``arange(N)``); the graph gathers the cache with it.
            cross: a ``select`` result with one row per decoder row.
            topk: how many top entries per row to return (<= V).

        Returns:
            A StepOutput (top-k float32/int64 (N, topk) on the host, the new cache).
        """

    def describe(self) -> dict[str, Any]:
        """What ``aiayn info``/the demo may show about this backend (providers, device)."""
        return {"backend": self.name}
