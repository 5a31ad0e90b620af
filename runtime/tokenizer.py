"""The sentencepiece tokenizer shared by training, export and the runtime. Torch-free.

Special ids are fixed by the graph contract: pad 0, unk 1, bos 2, eos 3. A source sequence
is subword ids + EOS (no BOS); a target input is BOS + ids; a target output is ids + EOS.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

import sentencepiece as spm

from .contract import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from .errors import TokenizerError

# Zero-width and format characters that carry no meaning for translation.
_ZERO_WIDTH = re.compile("[\u200b\u200c\u200d\u2060\ufeff\u00ad]")
_WHITESPACE = re.compile(r"\s+")


def clean_text(text: str) -> str:
    """Normalize raw input: control characters become spaces, zero-width characters go,
    runs of whitespace collapse to one space, ends are stripped."""
    text = _ZERO_WIDTH.sub("", text)
    text = "".join(" " if unicodedata.category(c) in ("Cc", "Cs") else c for c in text)
    return _WHITESPACE.sub(" ", text).strip()


class Tokenizer:
    """A sentencepiece model with the contract's special ids.

    Raises TokenizerError if the file is missing or its special ids differ from the contract.
    """

    def __init__(self, model_file: str | os.PathLike):
        path = Path(model_file)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file {path} not found")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path} is not a sentencepiece model: {e}") from None
        self.path = path
        ids = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise TokenizerError(
                f"{path}: special ids pad/unk/bos/eos are {ids}, expected "
                f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; train it with aiayn's tokenizer trainer")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Subword ids of cleaned ``text`` (no BOS/EOS); [] for empty input."""
        text = clean_text(text)
        return self.sp.encode(text, out_type=int) if text else []

    def encode_source(self, text: str) -> list[int]:
        """Source ids: subword ids + EOS; [] for empty or whitespace-only input."""
        ids = self.encode(text)
        return ids + [EOS_ID] if ids else []

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special ids (pad, bos, eos) are dropped, unk renders as ' ⁇ '."""
        return self.sp.decode([int(i) for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)])

    def pieces(self, ids: list[int]) -> list[str]:
        """Subword strings of ``ids`` (special ids render as <pad>, <unk>, <s>, </s>)."""
        return [self.sp.id_to_piece(int(i)) for i in ids]

    def to_bytes(self) -> bytes:
        return self.sp.serialized_model_proto()


def train_tokenizer(sentences, out_file: str | os.PathLike, vocab_size: int = 8000,
                    model_type: str = "bpe", character_coverage: float = 1.0,
                    num_threads: int | None = None, max_sentences: int = 2_000_000) -> Tokenizer:
    """Train a joint sentencepiece model on ``sentences`` (both sides of the training split).

    ``model_type`` is "bpe" (default; the paper used BPE, §5.1) or "unigram". ``vocab_size``
    is an upper bound: a corpus too small for it yields a smaller vocabulary instead of an
    error. The model is written atomically to ``out_file``. Raises TokenizerError for an
    empty corpus or an unknown model type.
    """
    if model_type not in ("bpe", "unigram"):
        raise TokenizerError(f"unknown tokenizer model type {model_type!r}; use bpe or unigram")
    lines = [s for s in (clean_text(x) for x in sentences) if s]
    if not lines:
        raise TokenizerError("cannot train a tokenizer on an empty corpus")
    import io

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        pad_piece="<pad>", unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>",
        hard_vocab_limit=False, input_sentence_size=max_sentences,
        shuffle_input_sentence=True, num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2)
    out_file = Path(out_file)
    tmp = out_file.with_name(f".{out_file.name}.tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out_file)
    return Tokenizer(out_file)
