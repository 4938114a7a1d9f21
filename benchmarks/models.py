# SPDX-License-Identifier: Apache-2.0
"""Benchmark models: a small GPT of our own and two randomly initialised ``transformers`` models (no download), a
Llama and a GPT-2 (tied embeddings, fused QKV ``Conv1D``, learned positions, GELU).

Every model takes ``(idx, targets)`` and returns the mean cross-entropy loss, so DeepSpeed and FSDP2 drive
them the same way; ``blocks(model)`` lists the repeated layers that FSDP2 shards one by one.
"""
import argparse
import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    dim: int
    heads: int
    layers: int
    seq: int
    batch: int
    positions: int = 0  # GPT-2's learned positions (its n_positions); 0: the sequence length

    @property
    def max_positions(self) -> int:
        return self.positions or self.seq


SIZES: Dict[str, ModelSize] = {
    "small": ModelSize(vocab=512, dim=128, heads=4, layers=4, seq=64, batch=2),
    "large": ModelSize(vocab=2048, dim=256, heads=8, layers=8, seq=128, batch=4),
    # the published GPT-2 configs (124M: "gpt2", 355M: "gpt2-medium"), randomly initialised, on sequences of 128
    # tokens; the Llama and Qwen2 of these sizes have the same width, depth, heads and vocabulary (Llama's untied head
    # makes it larger: 155M and 380M)
    "124m": ModelSize(vocab=50257, dim=768, heads=12, layers=12, seq=128, batch=2, positions=1024),
    "355m": ModelSize(vocab=50257, dim=1024, heads=16, layers=24, seq=128, batch=2, positions=1024),
}


def size_of(spec: str) -> ModelSize:
    """A size by name, or ``NAME:LAYERS``: that size with another number of its blocks (``124m:24``), for the
    compile time against depth."""
    name, _, layers = spec.partition(":")
    if name not in SIZES or (layers and (not layers.isdigit() or int(layers) < 1)):
        raise ValueError(f"size must be one of {sorted(SIZES)}, optionally :LAYERS (a positive number), got {spec!r}")
    return dataclasses.replace(SIZES[name], layers=int(layers)) if layers else SIZES[name]


def size_arg(spec: str) -> str:
    """``argparse`` type of a ``--size``: checked by :func:`size_of`, kept as written."""
    try:
        size_of(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


class Block(nn.Module):
    """Pre-norm transformer block with one fused QKV weight that is split in forward."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """GPT with tied input/output embeddings (one parameter used twice, once transposed)."""

    def __init__(self, size: ModelSize):
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.dim)
        self.pos = nn.Parameter(torch.randn(size.seq, size.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(size.dim, size.heads) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.dim)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied output head: unit-variance rows would give huge logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class CausalLM(nn.Module):
    """A ``transformers`` causal LM with random weights, returning the loss of (idx, targets). By default the loss is
    computed here, on the logits; with ``labels`` the model computes it from ``labels=targets`` as Hugging Face's
    Trainer has it do (its loss function: the targets shifted by one token, the logits upcast to fp32)."""

    labels = False

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.labels:
            return self.model(input_ids=idx, labels=targets, use_cache=False).loss
        logits = self.model(input_ids=idx, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _decoder_config(size: ModelSize, **extra) -> dict:
    """The config of a Llama-style decoder of this size: SwiGLU MLP, grouped-query attention (half the heads)."""
    return dict(vocab_size=size.vocab, hidden_size=size.dim, intermediate_size=(8 * size.dim) // 3,
                num_hidden_layers=size.layers, num_attention_heads=size.heads,
                num_key_value_heads=max(1, size.heads // 2), max_position_embeddings=size.seq, use_cache=False,
                attn_implementation="sdpa", **extra)


class Llama(CausalLM):
    """``transformers.LlamaForCausalLM``: untied head, grouped-query attention, SwiGLU MLP."""

    def __init__(self, size: ModelSize):
        from transformers import LlamaConfig, LlamaForCausalLM
        super().__init__(LlamaForCausalLM(LlamaConfig(**_decoder_config(size, tie_word_embeddings=False))))


class GPT2(CausalLM):
    """``transformers.GPT2LMHeadModel``: its head tied to the token embedding, as GPT-2's is; ``Conv1D`` layers."""

    def __init__(self, size: ModelSize):
        from transformers import GPT2Config, GPT2LMHeadModel
        # no dropout: configurations are compared by their losses
        config = GPT2Config(vocab_size=size.vocab, n_positions=size.max_positions, n_embd=size.dim,
                            n_layer=size.layers, n_head=size.heads, use_cache=False, attn_implementation="sdpa",
                            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        super().__init__(GPT2LMHeadModel(config))


class Qwen2(CausalLM):
    """``transformers.Qwen2ForCausalLM`` as the small Qwen2 models are: head tied to the embedding, biases on the
    query, key and value projections only, grouped-query attention."""

    def __init__(self, size: ModelSize):
        from transformers import Qwen2Config, Qwen2ForCausalLM
        super().__init__(Qwen2ForCausalLM(Qwen2Config(**_decoder_config(size, tie_word_embeddings=True))))


MODELS = {"gpt": GPT, "llama": Llama, "gpt2": GPT2, "qwen2": Qwen2}


def make_model(name: str, size: str = "small", seed: int = 0, labels: bool = False) -> nn.Module:
    """``labels``: a ``transformers`` model computes its own loss from ``labels`` (``CausalLM``)."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    if labels and not issubclass(MODELS[name], CausalLM):
        raise ValueError(f"labels: model {name!r} is not a transformers model; use one of "
                         f"{sorted(n for n, cls in MODELS.items() if issubclass(cls, CausalLM))}")
    torch.manual_seed(seed)
    model = MODELS[name](size_of(size))
    if labels:
        model.labels = True
    return model


def blocks(model: nn.Module) -> List[nn.Module]:
    """The repeated layers (FSDP2 shards each one, then the root)."""
    if isinstance(model, GPT):
        return list(model.blocks)
    if isinstance(model, (Llama, Qwen2)):
        return list(model.model.model.layers)
    if isinstance(model, GPT2):
        return list(model.model.transformer.h)
    raise TypeError(f"no block list for {type(model).__name__}")


def make_batch(size: str, step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch per (step, rank). Targets are a fixed permutation of the inputs, so the loss falls
    quickly and a numerical divergence between configurations shows in the final loss."""
    s = size_of(size)
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, s.vocab, (s.batch, s.seq), generator=g)
    return idx, (idx * 7 + 3) % s.vocab


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
