# SPDX-License-Identifier: Apache-2.0
"""Models on which dynamo runs part of the forward eagerly, and variable-length data (test_eager_access.py).

Each one makes a different piece of code run outside the compiled graphs while it reads ZeRO-3 parameters:
a frame dynamo cannot resume (a graph break in a forward pre-hook of each block of a ``transformers`` GPT-2), a
graph break inside a Python loop over layers, a ``torch.compiler.disable``d submodule, and a data-dependent
``.item()`` branch.
"""
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 96


def gpt2(seed: int = 0, break_in_block_hooks: bool = False) -> nn.Module:
    """``transformers`` GPT-2 with one block: what these tests exercise is in GPT-2's own code around and inside a
    block (absolute positions, the tied head, a hook's graph break); a second block only lengthened every compile."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                        eos_token_id=0, attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    if break_in_block_hooks:
        for block in model.transformer.h:
            block.register_forward_pre_hook(_graph_break_hook)
    return model


def llama(seed: int = 0) -> nn.Module:
    """``transformers`` Llama (2 layers, grouped-query attention), trained without a KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="eager", use_cache=False)
    return LlamaForCausalLM(config)


def _graph_break_hook(module, args):
    torch._dynamo.graph_break()


class _Block(nn.Module):

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.norm(h)))


class _Disabled(nn.Module):
    """A submodule dynamo must not compile: it always runs eagerly."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    @torch.compiler.disable
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.gelu(self.proj(h))


class EagerPieces(nn.Module):
    """Token model with tied embeddings whose forward has the eager piece named by ``kind``:
    ``loop_break`` (graph break inside the loop over layers), ``disabled`` (a disabled submodule between layers),
    ``item_branch`` (a data-dependent ``.item()`` branch)."""

    def __init__(self, kind: str, dim: int = 32, layers: int = 3):
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(layers))
        self.disabled = _Disabled(dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.kind == "loop_break":
                torch._dynamo.graph_break()
            elif self.kind == "disabled" and i == 0:
                h = self.disabled(h)
            elif self.kind == "item_branch" and i == 0 and h.mean().item() > 0:
                h = h * 0.5
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), targets.flatten())


def make(name: str, seed: int = 0) -> nn.Module:
    if name == "gpt2":
        return gpt2(seed)
    if name == "gpt2_hooks":
        return gpt2(seed, break_in_block_hooks=True)
    if name == "llama":
        return llama(seed)
    torch.manual_seed(seed)
    return EagerPieces(name)


def batch(step: int, rank: int, seq: int, size: int = 2) -> Tuple[torch.Tensor, torch.Tensor]:
    """Learnable tokens: each sequence counts up from a random start, the target is the next token."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    idx = (start + torch.arange(seq + 1)) % VOCAB
    return idx[:, :-1], idx[:, 1:]
