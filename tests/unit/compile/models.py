# SPDX-License-Identifier: Apache-2.0
"""Small models and a ZeRO config for the tests: each exercises one thing ZeRO-3 capture must get right.

The data is learnable (targets are a fixed function of the inputs, as in the benchmark's ``make_batch``), so
every test can also check that training makes the loss fall: a wrong gradient that happens to be applied the
same way by both engines would still show there.
"""
import math
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
    """GPT with tied input/output embeddings (one parameter used twice, once transposed) and a fused QKV weight
    split in forward: the benchmark's architecture at test size, defined here so that the tests stand alone."""

    def __init__(self, vocab: int = 97, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied output head: unit-variance rows would give huge logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class _CheckpointingGPT(TinyGPT):
    """TinyGPT's embedding and output head, for the variants that run the blocks their own way (TinyGPT's forward
    stays as it is: other tests replace parts of it)."""

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos[:idx.shape[1]]

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class CheckpointedGPT(_CheckpointingGPT):
    """TinyGPT with each block under DeepSpeed's activation checkpointing (``deepspeed.checkpointing.checkpoint``, as
    Megatron-DeepSpeed models call it), which DeepSpeed hides from dynamo."""
    checkpoint_function = "checkpoint"

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import deepspeed
        checkpoint = getattr(deepspeed.checkpointing, self.checkpoint_function)
        x = self.embed(idx)
        for i, block in enumerate(self.blocks):
            # the last block's function returns its output in a 1-tuple: DeepSpeed's functions hand back a lone output
            # by itself whatever container it came in
            x = checkpoint(block if i < len(self.blocks) - 1 else (lambda h, b=block: (b(h), )), x)
        return self.loss(x, targets)


class NonReentrantCheckpointedGPT(CheckpointedGPT):
    """The same with ``deepspeed.checkpointing.non_reentrant_checkpoint``."""
    checkpoint_function = "non_reentrant_checkpoint"


class MegatronStyleCheckpointedGPT(_CheckpointingGPT):
    """Checkpointing as Megatron-DeepSpeed calls it: one ``deepspeed.checkpointing.checkpoint`` over a range of blocks
    (a closure), with non-tensor arguments (a flag, ``None``), dropout inside (the recomputation must draw the same
    masks) and several outputs, one of them ``None``."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import deepspeed

        def blocks(start: int, end: int):
            def run(x, scale, scaled, nothing):
                for block in self.blocks[start:end]:
                    x = F.dropout(block(x * scale if scaled else x), 0.1, training=True)
                return x, None, x.mean()
            return run

        x, nothing, mean = deepspeed.checkpointing.checkpoint(blocks(0, len(self.blocks)), self.embed(idx),
                                                               torch.full((idx.shape[1], 1), 0.5), True, None)
        assert nothing is None
        return self.loss(x, targets) + 0.0 * mean


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


class DropoutMLP(OddMLP):
    """Dropout between the layers: random numbers in the training graphs, none in evaluation."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.head(h), y)


class BranchyMLP(OddMLP):
    """A data-dependent branch in the middle of forward: dynamo breaks the graph there."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if h.mean() > 0:  # data-dependent: graph break
            h = h * 2
        h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.head(h), y)


class WithBuffers(nn.Module):
    """Buffers and a shared parameter: a registered causal mask (a constant buffer read by forward), BatchNorm
    running statistics (buffers forward writes in training and reads in eval), and one weight registered in
    two modules (``enc.weight is dec.weight``: the same ZeRO-3 parameter reached through two module paths)."""

    def __init__(self, dim: int = 16, seq: int = 8):
        super().__init__()
        self.enc = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        self.mid = nn.Linear(dim, dim)
        self.dec = nn.Linear(dim, dim)
        self.dec.weight = self.enc.weight
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, d = x.shape[1], x.shape[2]
        h = self.enc(x)
        scores = (h @ h.transpose(1, 2) / math.sqrt(d)).masked_fill(self.mask[:s, :s], float("-inf"))
        h = h + torch.softmax(scores, dim=-1) @ h
        # over (batch * seq, dim): BatchNorm1d on (N, C, L) returns a layout that aot_eager's traced views
        # mis-predict on CPU (torch's problem, not the one under test)
        h = self.norm(h.reshape(-1, d)).view_as(h)
        return F.mse_loss(self.dec(torch.tanh(self.mid(h))), y)


class MoEBlock(nn.Module):
    """Top-k routing over a ``ModuleList`` of experts, each called only on the rows routed to it (as DeepSeek's and
    older `transformers` MoE blocks do): an expert that gets no rows on a rank is not called there. With ``top_k=2``
    the experts are called once per choice (first choices, then second ones), so an expert may run twice in a
    forward. Data-dependent shapes (``nonzero``) in a loop: dynamo runs this frame eagerly and compiles each expert's
    own frame."""

    def __init__(self, dim: int = 16, experts: int = 4, top_k: int = 1):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.gate(x), dim=-1)
        top = weights.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for k in range(self.top_k):
            for i, expert in enumerate(self.experts):
                rows = torch.nonzero(top.indices[:, k] == i).squeeze(-1)
                if rows.numel() == 0:
                    continue
                out.index_add_(0, rows, expert(x[rows]) * top.values[rows, k:k + 1])
        return out


class RoutedMoE(nn.Module):
    """An MoE block between two dense layers; ``deepspeed.utils.set_z3_leaf_modules(model, [MoEBlock])`` makes the
    block a ZeRO-3 leaf module, as DeepSpeed does by default for Mixtral's and Qwen-MoE's blocks."""

    def __init__(self, dim: int = 16, top_k: int = 1):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = MoEBlock(dim, top_k=top_k)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.moe(self.inp(x))), y)


class GatedBlock(nn.Module):
    """A block that hands its gate parameter back as it is, for its caller to apply."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.full((dim, ), 0.5))

    def forward(self, x: torch.Tensor):
        return torch.tanh(self.lin(x)), self.gate


class GatedBlocks(nn.Module):
    """Repeated blocks that each return their gate parameter to the model's frame, which applies it: under
    ``regions: "blocks"`` that frame runs as Python, and the parameter it gets back from a compiled block is the
    one dynamo returns as it is (``eager_access.gather_for_caller``)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList([GatedBlock(dim) for _ in range(2)])
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h, gate = block(x)
            x = x + h * gate
        return F.mse_loss(self.head(x), y)


class GatedBlocksWithBreak(GatedBlocks):
    """The same, with a graph break in the loop: dynamo runs the model's frame as Python at any ``regions``, and the
    block frames it compiles return their gates as they are."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h, gate = block(x)
            torch._dynamo.graph_break()
            x = x + h * gate
        return F.mse_loss(self.head(x), y)


class PatchConv(nn.Module):
    """A patch embedding (``Conv2d``, as ViT's) and a ``Conv1d`` over the patches (as Whisper's front end) before a
    linear head: a 4-D weight, which inductor's CPU layout optimization turns channels-last, and a 3-D one."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.mix = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2)  # (batch, dim, patches)
        h = F.gelu(self.mix(h)).mean(-1)
        return F.mse_loss(self.head(h), y)


MODELS = {"mlp": OddMLP, "gpt": TinyGPT, "gpt_checkpointed": CheckpointedGPT,
          "gpt_checkpointed_non_reentrant": NonReentrantCheckpointedGPT,
          "gpt_checkpointed_megatron": MegatronStyleCheckpointedGPT, "frozen": PartlyFrozen, "branchy": BranchyMLP,
          "buffers": WithBuffers, "moe": RoutedMoE, "moe_top2": lambda: RoutedMoE(top_k=2), "dropout": DropoutMLP,
          "gated": GatedBlocks,
          "gated_break": GatedBlocksWithBreak, "conv": PatchConv}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batch(name: str, step: int, rank: int, batch: int = 4):
    """A deterministic batch per (step, rank) whose targets are a fixed function of its inputs."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name in ("mlp", "branchy", "moe", "moe_top2", "dropout", "gated", "gated_break"):
        x = torch.randn(batch, 16, generator=g)
        return x, 0.5 * torch.roll(x, 1, dims=-1)
    if name.startswith("gpt"):
        idx = torch.randint(0, 97, (batch, 16), generator=g)
        # targets are the inputs: the tied embedding learns to copy within a few steps (the benchmark's fixed
        # permutation takes far longer at this size; a roll to the next token is unlearnable for a causal model)
        return idx, idx.clone()
    if name == "frozen":  # 4 rows of a scalar target would make the loss mostly batch noise
        x = torch.randn(4 * batch, 24, generator=g)
        return x, 0.5 * x[:, 0]
    if name == "buffers":
        x = torch.randn(batch, 8, 16, generator=g)
        return x, 0.5 * torch.roll(x, 1, dims=-1)
    if name == "conv":  # 8x8 RGB images; the target: half the first 16 pixel values
        x = torch.randn(batch, 3, 8, 8, generator=g)
        return x, 0.5 * x.flatten(1)[:, :16]
    raise ValueError(f"unknown model {name!r}")


OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              # SGD's update is lr * gradient: parameters show a gradient's scale, which AdamW's normalized
              # update hides
              "sgd": {"type": "SGD", "params": {"lr": 0.3}}}


def ds_config(stage: int = 3, compile_section: Optional[Dict[str, Any]] = None, dtype: str = "fp32",
              grad_accum: int = 1, batch: int = 4, persistence_threshold: int = 0, optimizer: str = "adamw",
              gradient_clipping: float = 0.0, fp16_initial_scale_power: int = 16,
              fp16_auto_cast: bool = False, zero_overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One ZeRO config for every test; bucket sizes fit the tiny models (DeepSpeed's defaults would
    pre-allocate gigabytes)."""
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": OPTIMIZERS[optimizer],
        "gradient_clipping": gradient_clipping,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persistence_threshold,
                              "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
                              "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 20000,
                              "stage3_max_reuse_distance": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    config["zero_optimization"].update(zero_overrides or {})
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif dtype == "fp16":  # dynamic loss scaling: halve the scale at every overflow (hysteresis 1)
        config["fp16"] = {"enabled": True, "auto_cast": fp16_auto_cast, "loss_scale": 0,
                          "initial_scale_power": fp16_initial_scale_power, "loss_scale_window": 1000,
                          "hysteresis": 1, "min_loss_scale": 1}
    elif dtype != "fp32":
        raise ValueError(f"dtype must be fp32, bf16, fp16 or autocast, got {dtype!r}")
    if compile_section is not None:
        config["compile"] = compile_section
    return config


def tiny_llama(use_cache: bool = False):
    """A 2-layer `transformers` Llama (hidden size 64, SDPA attention, vocabulary 256), as the Trainer-style tests
    use it; the caller seeds torch first."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", use_cache=use_cache))
