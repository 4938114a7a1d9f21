"""Rank-side comparison of a compiled ZeRO-3 engine against eager ZeRO-3 in the same process."""
from typing import Any, Dict, List, Optional

import deepspeed
import torch

from models import ds_config
from training import make_engine, train


def full_params(engine) -> Dict[str, torch.Tensor]:
    """Every parameter gathered to full size, as fp32 copies."""
    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            out[name] = param.detach().float().clone()
    return out


def run_pair(model: str, steps: int, dtype: str = "fp32", compile_section: Optional[Dict[str, Any]] = None,
             backend: str = "eager", grad_accum: int = 1, persistence_threshold: int = 0) -> Dict[str, Any]:
    """Train eager ZeRO-3 and the compiled engine on the same data; return both losses and final params,
    the runtime's counters and saved-for-backward report, and the live gathered bytes after every step."""
    eager = make_engine(model, ds_config(3, None, dtype, grad_accum, persistence_threshold=persistence_threshold))
    eager_losses = train(eager, model, steps)
    eager_params = full_params(eager)
    eager.destroy()
    section = {"deepcompile": True, **(compile_section or {})}
    compiled = make_engine(model, ds_config(3, section, dtype, grad_accum, persistence_threshold=persistence_threshold))
    live_after_step: List[int] = []
    losses = train(compiled, model, steps, compile_kwargs={"backend": backend},
                   after_step=lambda e: live_after_step.append(e._deepspeed_compile_runtime.counters.live_gathered_bytes))
    runtime = compiled._deepspeed_compile_runtime
    return {"eager_losses": eager_losses, "losses": losses, "eager_params": eager_params,
            "params": full_params(compiled), "active": compiled.is_deepcompile_active(),
            "counters": vars(runtime.counters).copy(), "saved": vars(runtime.saved).copy(),
            "live_after_step": live_after_step, "graphs": runtime.graphs_compiled}


def max_rel_diff(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def max_param_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
