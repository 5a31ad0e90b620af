"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), exactly.

Post-LN residual blocks (§3.1), sinusoidal positions (§3.5), embeddings scaled by
sqrt(d_model) and three-way tied with the pre-softmax projection (§3.4), scaled dot-product
multi-head attention (eq. 1, §3.2.2), the position-wise FFN (eq. 2), dropout on every
sub-layer output and on embeddings + positions (§5.4).

Shape legend: B batch, S source length, T target length, N decoder rows, P past length,
D d_model, H heads, Dh head dim (d_k), V vocab, L decoder layers.

Two methods map one-to-one onto the exported graphs (runtime/contract.py):
``encode_for_step`` -> ``encoder.onnx`` and ``step`` -> ``decoder.onnx``. The PyTorch reference
search (train/search.py) calls exactly these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import ModelConfig

# On CUDA, torch may pick cuDNN's fused attention, which builds a kernel plan per new input
# shape: on an H200 (torch 2.11) that cost 22-28 ms of CPU per call against 0.3 ms of GPU
# time, and token-count batches bring new (B, S, T) shapes all the time. Flash and
# memory-efficient attention have no per-shape setup.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH]

# Masked attention scores are replaced (never added) by a value finite in the graph's dtype.
MASK_VALUE_FP32 = -1e9
MASK_VALUE_FP16 = -3e4


def mask_value(dtype: torch.dtype) -> float:
    """The finite value masked scores are replaced with: -1e9 in fp32/bf16, -3e4 in fp16."""
    return MASK_VALUE_FP16 if dtype == torch.float16 else MASK_VALUE_FP32


def sinusoidal_positions(max_positions: int, d_model: int) -> Tensor:
    """The sinusoidal table of §3.5, float32 (max_positions, D).

    PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)):
    sin on even dims, cos on odd dims, so position 0 is [0, 1, 0, 1, ...].
    """
    pos = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (P, 1)
    i2 = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,) = 2i
    angle = pos / torch.pow(10000.0, i2 / d_model)  # (P, D/2)
    pe = torch.zeros(max_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle)
    return pe.float()


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention, eq. 1 and §3.2.2 (d_k = d_v = D / H)."""

    def __init__(self, d_model: int, h: int):
        super().__init__()
        self.h = h
        self.d_k = d_model // h
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, H, T, Dh)."""
        B, T, _ = x.shape
        return x.view(B, T, self.h, self.d_k).transpose(1, 2)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of ``x`` (B, S, D), each (B, H, S, Dh)."""
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def attend(self, q_in: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None,
               need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attention of queries ``q_in`` (B, T, D) over keys/values (B, H, S, Dh).

        ``allowed`` is a bool mask broadcastable to (B, H, T, S), true where a query may attend.
        Masked scores are replaced by a finite value (``mask_value``). Returns the output
        (B, T, D) and, if ``need_weights``, the attention weights (B, H, T, S).
        """
        q = self.split_heads(self.q_proj(q_in))  # (B, H, T, Dh)
        if not need_weights and not torch.jit.is_tracing() and not torch.onnx.is_in_onnx_export():
            # Fused kernel for training/inference; same math as below.
            if q.is_cuda:
                with sdpa_kernel(_CUDA_SDPA_BACKENDS):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            weights = None
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)  # (B, H, T, S)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, mask_value(scores.dtype))
            weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(weights, v)  # (B, H, T, Dh)
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, self.h * self.d_k)  # (B, T, D)
        return self.out_proj(out), weights


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2, eq. 2."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(torch.relu(self.w1(x)))


class EncoderLayer(nn.Module):
    """Self-attention and FFN sub-layers, each LayerNorm(x + Dropout(Sublayer(x))) (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h)
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        k, v = self.self_attn.project_kv(x)
        a, _ = self.self_attn.attend(x, k, v, allowed)
        x = self.self_attn_norm(x + self.dropout(a))
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention and FFN sub-layers, post-LN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.h)
        self.self_attn_norm = nn.LayerNorm(cfg.d_model)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.h)
        self.cross_attn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, self_k: Tensor, self_v: Tensor, self_allowed: Tensor | None,
                cross_k: Tensor, cross_v: Tensor, cross_allowed: Tensor,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """``x`` (B, T, D) against self K/V (B, H, T', Dh) and cross K/V (B, H, S, Dh).

        Returns the output (B, T, D) and, if ``need_weights``, cross-attention weights
        (B, H, T, S).
        """
        a, _ = self.self_attn.attend(x, self_k, self_v, self_allowed)
        x = self.self_attn_norm(x + self.dropout(a))
        c, w = self.cross_attn.attend(x, cross_k, cross_v, cross_allowed, need_weights)
        x = self.cross_attn_norm(x + self.dropout(c))
        return self.ffn_norm(x + self.dropout(self.ffn(x))), w


class Transformer(nn.Module):
    """Encoder-decoder Transformer with one shared embedding (source, target, softmax; §3.4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.embed_scale = math.sqrt(cfg.d_model)
        self.register_buffer("positions", sinusoidal_positions(cfg.max_positions, cfg.d_model),
                             persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform linear weights, zero biases; embeddings N(0, D^-0.5) so that
        ``embed * sqrt(D)`` has unit scale; the PAD row is zero."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[self.cfg.pad_id].zero_()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- embeddings ---------------------------------------------------------------------

    def embed_tokens(self, ids: Tensor, start: Tensor | int = 0) -> Tensor:
        """Embeddings * sqrt(D) + PE for ``ids`` (B, T) at positions start..start+T-1 (B, T, D)."""
        T = ids.shape[1]
        if isinstance(start, int):
            pe = self.positions[start:start + T]  # (T, D)
        else:
            pe = self.positions[start + torch.arange(T, device=ids.device)]  # (T, D)
        return self.dropout(self.embed(ids) * self.embed_scale + pe)

    def logits(self, x: Tensor) -> Tensor:
        """Pre-softmax projection tied to the embedding: (.., D) -> (.., V)."""
        return F.linear(x, self.embed.weight)

    def _check_length(self, T: int, what: str) -> None:
        if T > self.cfg.max_positions:
            raise ValueError(f"{what} length {T} exceeds max_positions {self.cfg.max_positions}; "
                             "truncate the input")

    # ---- full-sequence paths (training, validation) ---------------------------------------

    def encode(self, src_ids: Tensor) -> Tensor:
        """Encoder stack. ``src_ids`` int64 (B, S) padded with PAD -> memory (B, S, D)."""
        self._check_length(src_ids.shape[1], "source")
        allowed = (src_ids != self.cfg.pad_id)[:, None, None, :]  # (B, 1, 1, S)
        x = self.embed_tokens(src_ids)
        for layer in self.encoder:
            x = layer(x, allowed)
        return x

    def decode(self, tgt_in: Tensor, memory: Tensor, src_ids: Tensor) -> Tensor:
        """Decoder stack over the whole target prefix (teacher forcing).

        ``tgt_in`` int64 (B, T) = BOS + ids (padded), ``memory`` (B, S, D), ``src_ids`` (B, S).
        Returns logits float (B, T, V). Position t sees target positions <= t only.
        """
        T = tgt_in.shape[1]
        self._check_length(T, "target")
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).tril()  # (T, T)
        cross_allowed = (src_ids != self.cfg.pad_id)[:, None, None, :]  # (B, 1, 1, S)
        x = self.embed_tokens(tgt_in)
        for layer in self.decoder:
            k, v = layer.self_attn.project_kv(x)
            ck, cv = layer.cross_attn.project_kv(memory)
            x, _ = layer(x, k, v, causal, ck, cv, cross_allowed)
        return self.logits(x)

    def forward(self, src_ids: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits (B, T, V) of ``tgt_in`` (B, T) given ``src_ids`` (B, S)."""
        return self.decode(tgt_in, self.encode(src_ids), src_ids)

    # ---- incremental paths (search, export) -----------------------------------------------

    def encode_for_step(self, src_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What ``encoder.onnx`` computes: run the encoder once and project every decoder
        layer's cross-attention keys and values.

        ``src_ids`` int64 (B, S). Returns ``cross_k``, ``cross_v`` (L, B, H, S, Dh) and
        ``src_pad_mask`` bool (B, S), true at padding.
        """
        memory = self.encode(src_ids)
        ks, vs = zip(*(layer.cross_attn.project_kv(memory) for layer in self.decoder))
        return torch.stack(ks), torch.stack(vs), src_ids == self.cfg.pad_id

    def step(self, tokens: Tensor, step: Tensor | int, past_k: Tensor, past_v: Tensor,
             beam_origin: Tensor, cross_k: Tensor, cross_v: Tensor, src_pad_mask: Tensor
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One incremental decoder step for N rows in lock-step: what ``decoder.onnx`` computes.

        Args:
            tokens: int64 (N,), the token at position ``step`` (BOS at step 0).
            step: int64 scalar, the position of ``tokens``.
            past_k, past_v: (L, N_prev, H, P, Dh) self-attention cache of positions 0..P-1;
                P may be 0.
            beam_origin: int64 (N,), row of the past each new row continues; the cache is
                gathered with it here, so the caller never reorders it.
            cross_k, cross_v: (L, N, H, S, Dh), one row per decoder row.
            src_pad_mask: bool (N, S), true at source padding.

        Returns:
            log_probs float32 (N, V); present_k, present_v (L, N, H, P+1, Dh);
            cross_attn float32 (N, S), the last layer's cross-attention averaged over heads.
        """
        past_k = past_k.index_select(1, beam_origin)  # (L, N, H, P, Dh)
        past_v = past_v.index_select(1, beam_origin)
        x = self.embed_tokens(tokens[:, None], step)  # (N, 1, D)
        cross_allowed = ~src_pad_mask[:, None, None, :]  # (N, 1, 1, S)
        present_k, present_v = [], []
        weights = None
        last = len(self.decoder) - 1
        for i, layer in enumerate(self.decoder):
            k_new, v_new = layer.self_attn.project_kv(x)  # (N, H, 1, Dh)
            k = torch.cat([past_k[i], k_new], dim=2)  # (N, H, P+1, Dh)
            v = torch.cat([past_v[i], v_new], dim=2)
            present_k.append(k)
            present_v.append(v)
            x, w = layer(x, k, v, None, cross_k[i], cross_v[i], cross_allowed,
                         need_weights=i == last)
            if i == last:
                weights = w
        log_probs = torch.log_softmax(self.logits(x[:, 0]).float(), dim=-1)  # (N, V)
        cross_attn = weights[:, :, 0, :].float().mean(dim=1)  # (N, S)
        return log_probs, torch.stack(present_k), torch.stack(present_v), cross_attn

    def empty_cache(self, n: int, device=None, dtype=None) -> tuple[Tensor, Tensor]:
        """A zero-length self-attention cache (L, n, H, 0, Dh) for step 0."""
        cfg = self.cfg
        shape = (cfg.decoder_layers, n, cfg.h, 0, cfg.d_k)
        device = device or self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        return torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device,
                                                                           dtype=dtype)
