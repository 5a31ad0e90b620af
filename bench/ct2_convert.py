"""Convert an aiayn checkpoint into a CTranslate2 ``TransformerSpec`` model directory.

CTranslate2 is one of the peers this project is measured against (DESIGN.md "Peers"): the
benchmark (``bench/translate.py``) runs it on exactly our weights. The converter follows the
layout of CTranslate2's own converters (``ctranslate2/converters/fairseq.py`` and
``opennmt_py.py``, CTranslate2 4.x) and fills the spec from our state dict:

==========================================  ===============================================
CTranslate2 spec variable                   ours (train/model.py)
==========================================  ===============================================
encoder.embeddings[0].weight                embed.weight (V, D)          } one tensor,
decoder.embeddings.weight                   embed.weight                 } three-way tied
decoder.projection.weight (no bias)         embed.weight                 } (§3.4)
{encoder,decoder}.scale_embeddings = True   embeddings * sqrt(d_model) (§3.4)
{encoder,decoder}.position_encodings        our sinusoid table (max_positions, D), GIVEN
  .encodings                                EXPLICITLY: ours interleaves sin (even dims) and
                                            cos (odd dims), §3.5; CTranslate2's built-in
                                            table concatenates [sin | cos]
layer[i].self_attention.linear[0]           concat(q_proj, k_proj, v_proj) (3D, D) + bias
layer[i].self_attention.linear[1]           self_attn.out_proj
layer[i].self_attention.layer_norm          self_attn_norm (post-LN: pre_norm=False applies
                                            it to x + sublayer(x), §3.1)
decoder layer[i].attention.linear[0]        cross_attn.q_proj
decoder layer[i].attention.linear[1]        concat(cross_attn.k_proj, v_proj) (2D, D) + bias
decoder layer[i].attention.linear[2]        cross_attn.out_proj
decoder layer[i].attention.layer_norm       cross_attn_norm
layer[i].ffn.linear_0 / linear_1            ffn.w1 / ffn.w2 (ReLU, eq. 2)
layer[i].ffn.layer_norm                     ffn_norm
(no final encoder/decoder layer norm)       post-LN has none
config.layer_norm_epsilon                   1e-5 (torch.nn.LayerNorm's default)
shared_vocabulary.txt                       the sentencepiece pieces in id order, so
                                            CTranslate2 ids == our ids
config unk/bos/eos/decoder_start_token      <unk> / <s> / </s> / <s> (ids 1, 2, 3; pad 0 is
                                            "<pad>", an ordinary vocabulary entry to it)
config add_source_eos = False               callers pass pieces + "</s>" themselves, as our
                                            Tokenizer.encode_source does
==========================================  ===============================================

Usage::

    python bench/ct2_convert.py models/multi30k-en-de --out /tmp/ct2-multi30k [--force]

The converted directory also holds ``aiayn_source.json`` (the checkpoint path and its
sha256) so a stale conversion can be detected.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from runtime.contract import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: E402
from runtime.searchspec import (  # noqa: E402
    Hypothesis,
    check_search_args,
    empty_result,
    max_output_length,
)

SOURCE_RECORD = "aiayn_source.json"  # checkpoint path, sha256, max_positions, quantization
TOKENIZER_FILE = "spm.model"  # our sentencepiece model, copied beside model.bin


def _ct2():
    """Import ctranslate2, or raise ImportError naming what to install."""
    try:
        import ctranslate2  # noqa: F401
        import ctranslate2.specs  # noqa: F401
    except ImportError as e:
        raise ImportError("the CTranslate2 converter needs the ctranslate2 package: "
                          "pip install ctranslate2 (part of aiayn[dev])") from e
    return ctranslate2


def _np(t) -> np.ndarray:
    """A float32 numpy copy of a torch tensor (weights are fp16 on disk, fp32 in memory)."""
    return t.detach().to("cpu").float().numpy().copy()


def _linear(spec, module) -> None:
    spec.weight = _np(module.weight)  # (out, in), the nn.Linear layout CTranslate2 uses
    spec.bias = _np(module.bias)


def _fused(spec, modules) -> None:
    """Several nn.Linear stacked along the output dim, as CTranslate2's ``fuse_linear``."""
    spec.weight = np.concatenate([_np(m.weight) for m in modules], axis=0)
    spec.bias = np.concatenate([_np(m.bias) for m in modules], axis=0)


def _layer_norm(spec, module) -> None:
    spec.gamma = _np(module.weight)
    spec.beta = _np(module.bias)


def vocabulary(tokenizer) -> list[str]:
    """The sentencepiece pieces in id order (so CTranslate2's ids are ours).

    Raises ValueError if the special pieces are not <pad> <unk> <s> </s> at ids 0-3 or a piece
    cannot be one line of CTranslate2's vocabulary file (duplicates, newlines).
    """
    pieces = tokenizer.pieces(list(range(tokenizer.vocab_size)))
    expected = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}
    for i, piece in expected.items():
        if pieces[i] != piece:
            raise ValueError(f"tokenizer piece {i} is {pieces[i]!r}, expected {piece!r}; "
                             "the CTranslate2 config maps special tokens by these names")
    if len(set(pieces)) != len(pieces):
        raise ValueError("tokenizer has duplicate pieces; CTranslate2 maps tokens by string")
    bad = [p for p in pieces if "\n" in p or "\r" in p]
    if bad:
        raise ValueError(f"pieces with line breaks cannot go into a vocabulary file: {bad[:3]}")
    return pieces


def build_spec(model, tokenizer):
    """A ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights (fp32).

    ``model`` is a ``train.model.Transformer`` (post-LN, ReLU, biases, one tied embedding),
    ``tokenizer`` its ``runtime.tokenizer.Tokenizer``. The mapping is the table in this
    module's docstring. Raises ImportError without ctranslate2, ValueError for a model this
    mapping does not describe.
    """
    _ct2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.h, pre_norm=False,
        activation=common_spec.Activation.RELU)
    embed = _np(model.embed.weight)  # (V, D)
    positions = _np(model.positions)  # (max_positions, D), sin on even dims, cos on odd (§3.5)
    if positions.shape != (cfg.max_positions, cfg.d_model):
        raise ValueError(f"position table shape {positions.shape} != "
                         f"({cfg.max_positions}, {cfg.d_model})")

    # Encoder.
    enc = spec.encoder
    enc.embeddings[0].weight = embed
    enc.scale_embeddings = True  # x sqrt(depth): CTranslate2's meaning of True
    enc.position_encodings.encodings = positions
    for layer_spec, layer in zip(enc.layer, model.encoder, strict=True):
        att = layer.self_attn
        _fused(layer_spec.self_attention.linear[0], [att.q_proj, att.k_proj, att.v_proj])
        _linear(layer_spec.self_attention.linear[1], att.out_proj)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.w1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.w2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.ffn_norm)

    # Decoder.
    dec = spec.decoder
    dec.embeddings.weight = embed
    dec.scale_embeddings = True
    dec.position_encodings.encodings = positions
    dec.projection.weight = embed  # tied pre-softmax projection, no bias (§3.4)
    for layer_spec, layer in zip(dec.layer, model.decoder, strict=True):
        att = layer.self_attn
        _fused(layer_spec.self_attention.linear[0], [att.q_proj, att.k_proj, att.v_proj])
        _linear(layer_spec.self_attention.linear[1], att.out_proj)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_attn_norm)
        cross = layer.cross_attn
        _linear(layer_spec.attention.linear[0], cross.q_proj)
        _fused(layer_spec.attention.linear[1], [cross.k_proj, cross.v_proj])
        _linear(layer_spec.attention.linear[2], cross.out_proj)
        _layer_norm(layer_spec.attention.layer_norm, layer.cross_attn_norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.w1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.w2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.ffn_norm)

    spec.config.layer_norm_epsilon = 1e-5
    spec.config.unk_token = "<unk>"
    spec.config.bos_token = "<s>"
    spec.config.eos_token = "</s>"
    spec.config.decoder_start_token = "<s>"
    spec.config.add_source_bos = False
    spec.config.add_source_eos = False
    vocab = vocabulary(tokenizer)
    if len(vocab) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(vocab)} pieces, model vocab_size {cfg.vocab_size}")
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    return spec


def convert_model(model, tokenizer, out_dir: str | os.PathLike, quantization: str | None = None,
                  force: bool = False, source: dict | None = None) -> Path:
    """Write ``model`` as a CTranslate2 model directory ``out_dir`` and return its path.

    ``quantization`` is CTranslate2's weight type at save time (None keeps fp32; "int8",
    "int8_float32", "float16", ...); the compute type can still be chosen at load time.
    Raises FileExistsError if ``out_dir`` exists and ``force`` is false.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        if not force:
            raise FileExistsError(f"{out_dir} exists; pass force=True (--force) to replace it")
        shutil.rmtree(out_dir)
    spec = build_spec(model, tokenizer)
    spec.validate()
    spec.optimize(quantization=quantization)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        spec.save(str(tmp))
        shutil.copyfile(tokenizer.path, tmp / TOKENIZER_FILE)
        record = {"quantization": quantization or "float32",
                  "max_positions": model.cfg.max_positions, **(source or {})}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def convert_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                       quantization: str | None = None, force: bool = False) -> Path:
    """Convert an aiayn checkpoint folder (or a run's latest checkpoint) to CTranslate2.

    Raises CheckpointError for a missing or damaged checkpoint, FileExistsError without
    ``force`` if ``out_dir`` exists, ImportError without ctranslate2.
    """
    from train.checkpoint import checkpoint_sha256, load_checkpoint

    model, tokenizer, ckpt = load_checkpoint(checkpoint)
    source = {"checkpoint": str(Path(ckpt).resolve()), "checkpoint_sha256": checkpoint_sha256(ckpt)}
    return convert_model(model, tokenizer, out_dir, quantization, force, source)


# ---- our search options -> CTranslate2's --------------------------------------------------

def ct2_search_options(beam_size: int, length_penalty: float, lp_type: str, max_len: int,
                       suppress_special: bool = False) -> dict:
    """``Translator.translate_batch`` keyword arguments that run DESIGN.md's search.

    How each rule maps (CTranslate2 4.x ``src/decoding.cc``, ``BeamSearch::search``):

    - Candidates: CTranslate2 also takes the top 2K of (alive beams x V) per sentence; an EOS
      among the first K finishes a hypothesis and its slot is refilled with the next non-EOS
      candidate of rank >= K. The alive *set* equals ours (first K non-EOS in rank order);
      only the slot order differs, which can matter for exact ties only. A sentence is done
      with K finished (``patience=1``); EOS candidates finished in the same step beyond K are
      kept by CTranslate2 but have the same length and lower scores, so never rank first.
    - Length penalty: CTranslate2 divides by ``len ** alpha`` (our ``power``) with len =
      the hypothesis' token count; ``return_end_token=True`` keeps EOS in the hypothesis, so
      len counts EOS as ours does (the caller strips it). ``gnmt`` has no CTranslate2
      equivalent: ValueError.
    - ``min_decoding_length=0``: CTranslate2's default 1 masks EOS at step 0; our spec allows
      the empty translation.
    - ``max_decoding_length=max_len``: at most max_len tokens, EOS included, like ours. Two
      differences remain, both only for a hypothesis that reaches the limit: CTranslate2
      takes one limit per call (the caller passes the batch's largest a*S_src+b) and at the
      last step it finishes the K best candidates *without* EOS, where our spec allows only
      EOS there (its log-prob added).
    - PAD and BOS: our spec removes them after the log-softmax (normalization unchanged);
      CTranslate2 can only mask logits before the softmax (``suppress_sequences``), which
      renormalizes. By default nothing is masked, so scores match ours exactly; a trained
      model never ranks PAD/BOS high, and ``CT2Translator`` counts any that appear.
      ``suppress_special=True`` masks them (exact for greedy, whose argmax is unchanged).
    - ``max_input_length=0``: no truncation there; inputs are already cut to max_positions.
    """
    check_search_args(beam_size, length_penalty, lp_type, 0.0, 0, 1)
    if lp_type != "power":
        raise ValueError(f"CTranslate2 implements only the power length penalty (len ** alpha); "
                         f"got lp_type={lp_type!r}: use lp_type='power'")
    opts = dict(beam_size=beam_size, patience=1.0, num_hypotheses=1,
                length_penalty=length_penalty, max_decoding_length=max_len,
                min_decoding_length=0, return_end_token=True, return_scores=True,
                max_input_length=0, max_batch_size=0)
    if suppress_special:
        opts["suppress_sequences"] = [["<pad>"], ["<s>"]]
    return opts


class CT2Translator:
    """A converted model on CTranslate2 behind our ``translate()`` API.

    Tokenization, truncation, batching by token count and results (``Translation``) go
    through ``runtime.translation`` exactly as for ``TorchTranslator`` and the ONNX runtime,
    so only the engine differs. ``stats`` counts hypotheses that hit CTranslate2's length
    limit without EOS (``no_eos``) and outputs holding PAD or BOS (``special``).
    """

    backend = "ctranslate2"

    def __init__(self, translator, tokenizer, max_positions: int, suppress_special: bool = False):
        self.translator = translator
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self.suppress_special = suppress_special
        self.stats = {"no_eos": 0, "special": 0}
        self._piece_to_id = {p: i for i, p in enumerate(vocabulary(tokenizer))}

    @classmethod
    def load(cls, model_dir: str | os.PathLike, threads: int | None = None,
             compute_type: str = "default", suppress_special: bool = False) -> CT2Translator:
        """Load a directory written by ``convert_checkpoint``.

        ``threads`` is CTranslate2's ``intra_threads`` (None: all cores, ``os.cpu_count()``);
        ``inter_threads`` is 1 (one batch at a time, like our translators). ``compute_type``
        is CTranslate2's ("default" keeps the saved type, "int8" quantizes at load).
        Raises FileNotFoundError if the directory lacks model.bin or our spm.model.
        """
        ctranslate2 = _ct2()
        from runtime.tokenizer import Tokenizer

        model_dir = Path(model_dir)
        for name in ("model.bin", TOKENIZER_FILE, SOURCE_RECORD):
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"{model_dir / name} not found; convert the checkpoint "
                                        "with bench/ct2_convert.py first")
        record = json.loads((model_dir / SOURCE_RECORD).read_text(encoding="utf-8"))
        translator = ctranslate2.Translator(str(model_dir), device="cpu",
                                            compute_type=compute_type, inter_threads=1,
                                            intra_threads=threads or os.cpu_count() or 1)
        return cls(translator, Tokenizer(model_dir / TOKENIZER_FILE), record["max_positions"],
                   suppress_special)

    def search(self, sources: list[list[int]], beam_size: int = 4, length_penalty: float = 0.6,
               lp_type: str = "power", max_len_a: float = 1.0, max_len_b: int = 50
               ) -> list[list[Hypothesis]]:
        """Like ``train.search.beam_search``: per source (subword ids + EOS; [] = empty), the
        best Hypothesis (tokens without EOS, cumulative and normalized score)."""
        results: list[list[Hypothesis]] = [empty_result() for _ in sources]
        todo = [i for i, s in enumerate(sources) if s]
        if not todo:
            return results
        limits = {i: max_output_length(len(sources[i]), max_len_a, max_len_b, self.max_positions)
                  for i in todo}
        opts = ct2_search_options(beam_size, length_penalty, lp_type, max(limits.values()),
                                  self.suppress_special)
        pieces = [self.tokenizer.pieces(sources[i]) for i in todo]
        out = self.translator.translate_batch(pieces, **opts)
        for i, r in zip(todo, out):
            ids = [self._piece_to_id[p] for p in r.hypotheses[0]]
            if ids and ids[-1] == EOS_ID:
                ids = ids[:-1]
                length = len(ids) + 1
            else:  # stopped by max_decoding_length without EOS
                self.stats["no_eos"] += 1
                length = len(ids)
            if PAD_ID in ids or BOS_ID in ids:
                self.stats["special"] += 1
            norm = float(r.scores[0])
            results[i] = [Hypothesis(tokens=ids, score=norm * max(length, 1) ** length_penalty,
                                     normalized_score=norm)]
        return results

    def translate(self, texts, beam_size: int = 4, length_penalty: float = 0.6,
                  lp_type: str = "power", max_len_a: float = 1.0, max_len_b: int = 50,
                  max_tokens: int = 4096, on_long: str = "truncate", progress=None):
        """Translate ``texts``; results (``runtime.translation.Translation``) in input order.

        Same batching as our translators (length-sorted, ``max_tokens`` padded source
        tokens a batch). Raises ValueError for ``lp_type`` other than "power".
        """
        from runtime.translation import translate_batched

        return translate_batched(
            self.tokenizer, texts, self.max_positions,
            lambda sources: self.search(sources, beam_size, length_penalty, lp_type, max_len_a,
                                        max_len_b),
            max_tokens=max_tokens, on_long=on_long, progress=progress)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="aiayn checkpoint folder (e.g. models/multi30k-en-de)")
    p.add_argument("--out", required=True, help="CTranslate2 model directory to write")
    p.add_argument("--quantization", default=None,
                   help="CTranslate2 weight type at save time (default: keep float32)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    out = convert_checkpoint(args.checkpoint, args.out, args.quantization, args.force)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
