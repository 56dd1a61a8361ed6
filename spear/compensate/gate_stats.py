"""How much the gate actually varies across tokens, and whether it tracks the error.

For every gated EC, on held-out tokens: the spread of γ across tokens (mean, std,
min, max over all token × rank entries, plus the std across tokens of the
per-token mean γ), and the per-token relative quantization error
‖(W − Wq)x‖ / ‖Wx‖ of the module. A PNG scatters, for the most damaged modules,
that error against the per-token gate magnitude.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spear.compensate.calibrate import ec_modules


@torch.no_grad()
def gate_statistics(model: nn.Module, ids: torch.Tensor, fp_weights: dict[str, torch.Tensor],
                    max_tokens: int = 4096) -> dict[str, dict]:
    """Per-module gate spread and per-token (error, gate) pairs on ``ids`` (n, L)."""
    ecs = {n: e for n, e in ec_modules(model).items() if getattr(e, "gated", False)}
    captured: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in ecs}
    parents = {n: model.get_submodule(n) for n in ecs}

    def hook(name):
        def fn(mod, args):
            x = args[0].detach().reshape(-1, mod.in_features)
            ec = mod.compensator
            g = ec.gate(nn.functional.linear(x, ec.A.to(x.dtype)))
            w = fp_weights[name].to(x.device, x.dtype)
            ref = nn.functional.linear(x, w)
            err = (nn.functional.linear(x, w - mod.dequantized_weight(x.dtype)).norm(dim=-1)
                   / ref.norm(dim=-1).clamp(min=1e-12))
            captured[name].append((err.cpu(), g.float().cpu()))
        return fn

    handles = [parents[n].register_forward_pre_hook(hook(n)) for n in ecs]
    device = next(model.parameters()).device
    try:
        seen = 0
        for i in range(ids.shape[0]):
            if seen >= max_tokens:
                break
            model(input_ids=ids[i:i + 1].to(device), use_cache=False)
            seen += ids.shape[1]
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n, parts in captured.items():
        err = torch.cat([p[0] for p in parts])
        g = torch.cat([p[1] for p in parts])
        tok = g.mean(-1)
        out[n] = {"gamma_mean": g.mean().item(), "gamma_std": g.std().item(), "gamma_min": g.min().item(),
                  "gamma_max": g.max().item(), "token_gamma_std": tok.std().item(),
                  "error_mean": err.mean().item(), "error_std": err.std().item(),
                  "corr_error_gamma": torch.corrcoef(torch.stack([err, tok]))[0, 1].item(),
                  "_err": err, "_gamma": tok}
    return out


def plot_gate_vs_error(stats: dict[str, dict], path: str | Path, top: int = 6) -> Path:
    """Scatter per-token error vs per-token mean γ for the ``top`` most damaged modules."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(stats, key=lambda n: -stats[n]["error_mean"])[:top]
    cols = min(3, max(1, len(names)))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, n in zip(axes.flat, names):
        s = stats[n]
        ax.scatter(s["_err"].numpy(), s["_gamma"].numpy(), s=3, alpha=0.4)
        ax.set_title(f"{n.replace('model.layers.', 'L')}\ncorr {s['corr_error_gamma']:+.2f}", fontsize=8)
        ax.set_xlabel("relative quantization error ‖(W−Wq)x‖/‖Wx‖", fontsize=7)
        ax.set_ylabel("mean gate γ", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary_rows(stats: dict[str, dict]) -> dict[str, dict]:
    """The JSON-serialisable part of :func:`gate_statistics`."""
    return {n: {k: v for k, v in s.items() if not k.startswith("_")} for n, s in stats.items()}
