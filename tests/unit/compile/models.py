"""Small models and a ZeRO config for the tests: each exercises one thing ZeRO-3 capture must get right."""
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.models import GPT, ModelSize


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


class TinyGPT(GPT):
    """The benchmark GPT (tied input/output embeddings, fused QKV split in forward), at test size."""

    def __init__(self, vocab: int = 97, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16):
        super().__init__(ModelSize(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq, batch=4))


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
              grad_accum: int = 1, batch: int = 4, persistence_threshold: int = 0) -> Dict[str, Any]:
    """One ZeRO config for every test; bucket sizes fit the tiny models (DeepSpeed's defaults would
    pre-allocate gigabytes)."""
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence_threshold,
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
