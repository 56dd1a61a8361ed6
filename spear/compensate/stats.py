"""Input-activation statistics of linear modules, collected with forward hooks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass
class ActivationStats:
    """Running sums over the tokens seen by one linear's input (all fp64)."""

    count: int
    abs_sum: torch.Tensor  # (in,)  sum |x|
    sq_sum: torch.Tensor  # (in,)  sum x^2
    outer_sum: torch.Tensor | None  # (in, in) sum x x^T, when requested

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.count

    @property
    def mean_sq(self) -> torch.Tensor:
        return self.sq_sum / self.count

    @property
    def second_moment(self) -> torch.Tensor:
        if self.outer_sum is None:
            raise ValueError("second moment E[xx^T] was not collected (pass outer=True)")
        return self.outer_sum / self.count


@torch.no_grad()
def collect_activation_stats(model: nn.Module, modules: dict[str, nn.Module], windows: torch.Tensor,
                             outer: bool = False, progress: bool = True) -> dict[str, ActivationStats]:
    """Run ``windows`` (n, L) through ``model`` and accumulate input stats of ``modules``."""
    stats: dict[str, ActivationStats] = {}
    # Modules fed the very same tensor (q/k/v, gate/up) share one stats object, so
    # each distinct input is accumulated once.
    seen_inputs: dict[int, tuple[torch.Tensor, ActivationStats]] = {}

    def make_hook(name, in_features):
        def hook(_mod, args):
            raw = args[0]
            shared = seen_inputs.get(id(raw))
            if shared is not None and shared[0] is raw:
                if name not in stats:
                    stats[name] = shared[1]
                return
            s = stats.get(name)
            x = raw.detach().reshape(-1, in_features).double()
            if s is None:
                s = stats[name] = ActivationStats(
                    0, torch.zeros(in_features, dtype=torch.float64, device=x.device),
                    torch.zeros(in_features, dtype=torch.float64, device=x.device),
                    torch.zeros(in_features, in_features, dtype=torch.float64, device=x.device) if outer else None)
            seen_inputs[id(raw)] = (raw, s)
            s.count += x.shape[0]
            s.abs_sum += x.abs().sum(0)
            s.sq_sum += (x * x).sum(0)
            if outer:
                s.outer_sum += x.T @ x
        return hook

    handles = [m.register_forward_pre_hook(make_hook(n, m.in_features)) for n, m in modules.items()]
    device = next(model.parameters()).device
    try:
        for i in tqdm(range(windows.shape[0]), desc="activation stats", unit="win", disable=not progress, leave=False):
            model(input_ids=windows[i:i + 1].to(device), use_cache=False)
            seen_inputs.clear()
    finally:
        for h in handles:
            h.remove()
    return stats
