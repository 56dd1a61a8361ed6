"""A picture of a selection: damage per module (by layer and module type), the ranks chosen."""

from __future__ import annotations

from pathlib import Path


def plot_selection(selection, path: str | Path) -> Path:
    """Two panels sharing the layer axis: 1 − CKA damage per module type, and the planned rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = selection.to_dict()
    damage = data.get("damage") or {}
    plan = data["plan"]
    names = list(damage) or list(plan)

    def layer_kind(name):
        parts = name.split(".")
        idx = next((int(p) for p in parts if p.isdigit()), -1)
        return idx, parts[-1]

    kinds = sorted({layer_kind(n)[1] for n in names})
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for k in kinds:
        pts = sorted(layer_kind(n)[0] for n in names if layer_kind(n)[1] == k)
        by_layer = {layer_kind(n)[0]: n for n in names if layer_kind(n)[1] == k}
        if damage:
            axes[0].plot(pts, [damage[by_layer[i]] for i in pts], marker="o", ms=3, label=k)
        axes[1].plot(pts, [plan.get(by_layer[i], 0) for i in pts], marker="s", ms=3, drawstyle="steps-mid",
                     label=k)
    if damage:
        axes[0].set_yscale("log")
    axes[0].set_ylabel("damage (1 − CKA), one module quantized")
    axes[1].set_ylabel("EC rank")
    axes[1].set_xlabel("decoder layer")
    axes[0].legend(ncol=min(len(kinds), 7), fontsize=8)
    ent = data.get("entropy")
    title = (f"{data['placement']}: {data['modules']} modules, {data['memory_pct']:.2f}% of the quantized model "
             f"(budget {data['budget_pct']:.2f}%)")
    if ent is not None:
        title += f"\ndamage entropy H = {ent:.2f} nats, N_eff = exp(H) = {data['effective_modules']:.0f} " \
                 f"of {len(names)}, evenness {data['evenness']:.2f}"
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
