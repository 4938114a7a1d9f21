"""Small models and a ZeRO config for the tests: each exercises one thing ZeRO-3 capture must get right."""
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class OddMLP(nn.Module):
    """Hidden size 37: no parameter divides by the world size, so every shard is padded."""

    def __init__(self, dim: int = 16, hidden: int = 37):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.head(h), y)


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


class TinyGPT(nn.Module):
    """GPT with tied input/output embeddings (one parameter used twice, once transposed)."""

    def __init__(self, vocab: int = 97, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class PartlyFrozen(nn.Module):
    """A frozen embedding and a frozen layer in front of trained ones."""

    def __init__(self, dim: int = 24):
        super().__init__()
        self.frozen = nn.Linear(dim, dim)
        self.trained = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.relu(self.trained(torch.relu(self.frozen(x))))).squeeze(-1), y)


class BranchyMLP(OddMLP):
    """A data-dependent branch in the middle of forward: dynamo breaks the graph there."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if h.mean() > 0:  # data-dependent: graph break
            h = h * 2
        h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.head(h), y)


MODELS = {"mlp": OddMLP, "gpt": TinyGPT, "frozen": PartlyFrozen, "branchy": BranchyMLP}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batch(name: str, step: int, rank: int, batch: int = 4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("mlp", "branchy"):
        return torch.randn(batch, 16, generator=g), torch.randn(batch, 16, generator=g)
    if name == "gpt":
        idx = torch.randint(0, 97, (batch, 16), generator=g)
        return idx, torch.roll(idx, -1, dims=1)
    if name == "frozen":
        return torch.randn(batch, 24, generator=g), torch.randn(batch, generator=g)
    raise ValueError(f"unknown model {name!r}")


def ds_config(stage: int = 3, compile_section: Optional[Dict[str, Any]] = None, dtype: str = "fp32",
              grad_accum: int = 1, batch: int = 4) -> Dict[str, Any]:
    """One ZeRO config for every test; bucket sizes fit the tiny models (DeepSpeed's defaults would
    pre-allocate gigabytes)."""
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
                              "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 20000,
                              "stage3_max_reuse_distance": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif dtype != "fp32":
        raise ValueError(f"dtype must be fp32, bf16 or autocast, got {dtype!r}")
    if compile_section is not None:
        config["compile"] = compile_section
    return config
