"""Checkpoints with compensators that matter, through spear's Python API.

Every Llama layer gets a different mix, so merged q/k/v and gate/up hold members with gated,
ungated and no ECs side by side, and both row-parallel layers carry gated ECs (the all-reduce of
u): q gated per rank, k ungated with alpha, v none; o gated with one γ per module; gate gated,
up the static low-rank kind; down gated. Factors are seeded random draws scaled so that ‖BA‖ is
a tenth of ‖Ŵ‖ and the gate moves γ well away from 1.
"""

from __future__ import annotations

import math

import torch

# module suffix -> (rank, gated, hidden, per_rank, kind); None: no compensator
PLAN = {
    "self_attn.q_proj": (4, True, 8, True, "spear-ec"),
    "self_attn.k_proj": (2, False, 0, True, "spear-ec"),
    "self_attn.v_proj": None,
    "self_attn.o_proj": (3, True, 4, False, "spear-ec"),
    "mlp.gate_proj": (2, True, 8, True, "spear-ec"),
    "mlp.up_proj": (3, False, 0, True, "lowrank"),
    "mlp.down_proj": (4, True, 8, True, "spear-ec"),
}
BOUND = 0.5


def _factors(w: torch.Tensor, rank: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    a = torch.randn(rank, inp, generator=gen) / math.sqrt(inp)
    b = torch.randn(out, rank, generator=gen)
    b *= 0.1 * w.norm() / (b @ a).norm()
    return a, b


@torch.no_grad()
def attach_compensators(model, tokenizer, seed: int = 0, gated: bool = True) -> int:
    """Attach PLAN's compensators to every QuantLinear of a loaded W4 model; ``gated`` False keeps
    only the ungated ones (as static low-rank terms everywhere PLAN has a rank). Returns how many."""
    from spear.compensate.ec import GatedCompensator
    from spear.compensate.lowrank import LowRankCompensator
    from spear.compensate.registry import as_stored
    from spear.quant.linear import QuantLinear

    gen = torch.Generator().manual_seed(seed)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    attached = {}
    for name, mod in mods.items():
        spec = next((v for k, v in PLAN.items() if name.endswith(k)), None)
        if spec is None:
            continue
        rank, is_gated, hidden, per_rank, kind = spec
        a, b = _factors(mod.dequantized_weight(torch.float32), rank, gen)
        a, b = as_stored(a, torch.float32), as_stored(b, torch.float32)
        if not gated or kind == "lowrank":
            mod.compensator = LowRankCompensator(a, b)
        else:
            comp = GatedCompensator(a, b, hidden=hidden or 8, gated=is_gated, bound=BOUND,
                                    alpha=0.75 + 0.5 * float(torch.rand(1, generator=gen)), per_rank=per_rank)
            if is_gated:
                comp.w1.copy_(torch.randn(comp.w1.shape, generator=gen) / math.sqrt(rank))
                comp.b1.copy_(0.3 * torch.randn(comp.b1.shape, generator=gen))
                comp.w2.copy_(torch.randn(comp.w2.shape, generator=gen) / math.sqrt(hidden))
                comp.b2.copy_(0.3 * torch.randn(comp.b2.shape, generator=gen))
            mod.compensator = comp
        attached[name] = mod
    # the gate's input scale: 1 / RMS of u = A x on a real prompt, as calibration sets it
    u_sq: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(
        lambda m, args, n=n: u_sq.setdefault(n, []).append((args[0] @ m.compensator.A.t()).pow(2).flatten(0, -2)))
        for n, m in attached.items() if isinstance(m.compensator, GatedCompensator) and m.compensator.gated]
    ids = tokenizer("The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
                    return_tensors="pt").input_ids
    model(ids)
    for h in hooks:
        h.remove()
    for n, sq in u_sq.items():
        attached[n].compensator.set_input_scale(torch.cat(sq).mean(0).sqrt())
    for m in attached.values():  # what the checkpoint stores (fp16), so live and saved models agree
        for p in m.compensator.parameters():
            p.requires_grad_(False)
            p.copy_(as_stored(p, p.dtype))
        for buf in m.compensator.buffers():
            buf.copy_(as_stored(buf, buf.dtype))
    return len(attached)


def write_compensated(w4_checkpoint, out, seed: int = 0, gated: bool = True):
    """A copy of the W4 checkpoint ``w4_checkpoint`` with :func:`attach_compensators`' ECs, at ``out``."""
    from spear.config import QuantConfig
    from spear.models.checkpoint import read_spear_config, save_checkpoint
    from spear.models.loading import load_model

    model, tok = load_model(w4_checkpoint)
    n = attach_compensators(model, tok, seed=seed, gated=gated)
    cfg = read_spear_config(w4_checkpoint)
    save_checkpoint(model, tok, out, QuantConfig.from_dict(cfg["quant"]), cfg["source_model"],
                    meta={"compensators": "seeded random (tests/vllm/_checkpoints.py)", "seed": seed})
    return out, n
