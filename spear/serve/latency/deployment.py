"""What a latency table is valid for: one deployment's identity.

``Deployment`` names the checkpoint (its config and where its quantized layers and compensators
are), the device, the dtype, the kernel policy, the engine settings that change a step's kernels
(block size, CUDA graphs) and, under tensor parallelism, the rank count and the reduction;
``key()`` hashes what must match and names the table's cache file (spear/serve/latency/table.py).
``deployment_of`` computes it for an engine from the loader's tensors, before the model is built.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spear.errors import SpearError

_KEY_FIELDS = ("checkpoint_hash", "device", "dtype", "policy_hash", "block_size", "cuda_graphs")


@dataclass(frozen=True)
class Density:
    """Compensator density of a deployment (informative; the checkpoint hash already covers it)."""

    modules_with_ec: int = 0
    modules: int = 0              # quantized linears
    extra_memory_pct: float = 0.0  # compensator bytes / bytes of the quantized model, in %


@dataclass(frozen=True)
class Deployment:
    """What a latency table is valid for. ``key()`` covers every field but the path, the policy's
    integers (their hash is covered) and the density (the checkpoint hash covers it)."""

    checkpoint: str | None        # the folder it was loaded from (None: a model in memory)
    checkpoint_hash: str          # sha256 of its config file and its quantized layers' placement
    device: str                   # GPU name, or the CPU model and thread count
    dtype: str
    policy_hash: str              # sha256 of the kernel policy (policy_hash)
    block_size: int
    cuda_graphs: bool             # decode and mixed steps replay CUDA graphs
    density: Density = field(default_factory=Density)
    policy_op_args: tuple[int, ...] = ()
    tensor_parallel: int = 1      # ranks the model is split across
    tp_reduce: str = "allreduce"  # how the ranks sum (spear.parallel.comm.REDUCE_MODES)

    def _key_fields(self) -> tuple[str, ...]:
        # one rank keeps the keys (and cached tables) of deployments from before tensor parallelism
        return _KEY_FIELDS + (("tensor_parallel", "tp_reduce") if self.tensor_parallel != 1 else ())

    def key(self) -> str:
        text = json.dumps({k: getattr(self, k) for k in self._key_fields()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def mismatches(self, other: "Deployment") -> list[str]:
        return [f"{k} {getattr(self, k)!r} (this engine: {getattr(other, k)!r})"
                for k in _KEY_FIELDS + ("tensor_parallel", "tp_reduce") if getattr(self, k) != getattr(other, k)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["policy_op_args"] = list(self.policy_op_args)
        return d

    @classmethod
    def from_dict(cls, d, where: str) -> "Deployment":
        if not isinstance(d, dict):
            raise SpearError(f"{where}: 'deployment' must be an object, got {type(d).__name__}")
        try:
            dens = d.get("density") or {}
            density = Density(modules_with_ec=int(dens.get("modules_with_ec", 0)), modules=int(dens.get("modules", 0)),
                              extra_memory_pct=float(dens.get("extra_memory_pct", 0.0)))
            out = cls(**{k: d[k] for k in ("checkpoint", "checkpoint_hash", "device", "dtype", "policy_hash",
                                           "block_size", "cuda_graphs")},
                      density=density, policy_op_args=tuple(d.get("policy_op_args", ())),
                      tensor_parallel=d.get("tensor_parallel", 1), tp_reduce=d.get("tp_reduce", "allreduce"))
        except KeyError as exc:
            raise SpearError(f"{where}: 'deployment' lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise SpearError(f"{where}: malformed 'deployment': {exc}") from None
        for k in ("checkpoint_hash", "device", "dtype", "policy_hash"):
            if not isinstance(getattr(out, k), str):
                raise SpearError(f"{where}: deployment.{k} must be a string, got {getattr(out, k)!r}")
        if isinstance(out.block_size, bool) or not isinstance(out.block_size, int) or out.block_size < 1:
            raise SpearError(f"{where}: deployment.block_size must be a whole number >= 1, got {out.block_size!r}")
        if not isinstance(out.cuda_graphs, bool):
            raise SpearError(f"{where}: deployment.cuda_graphs must be true or false, got {out.cuda_graphs!r}")
        tp = out.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise SpearError(f"{where}: deployment.tensor_parallel must be a whole number >= 1, got {tp!r}")
        if out.tp_reduce not in ("allreduce", "peer"):
            raise SpearError(f"{where}: deployment.tp_reduce must be 'allreduce' or 'peer', got {out.tp_reduce!r}")
        return out


def device_name(device) -> str:
    """The GPU's name, or the CPU's model and torch's thread count (a CPU table is per machine)."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), model)
    except OSError:
        pass  # not Linux: platform's answer stands
    return f"cpu: {model}, {torch.get_num_threads()} threads"


def _ec_params(ec) -> int:
    return sum(t.numel() for t in (ec.a, ec.b, ec.w1, ec.b1, ec.w2, ec.b2) if t is not None)


def deployment_of(model_config, quantized: dict, tensors: dict, source: Path | None, device, dtype,
                  policy, block_size: int, cuda_graphs: bool, tensor_parallel: int = 1,
                  tp_reduce: str = "allreduce") -> Deployment:
    """The deployment an engine is: ``quantized`` / ``tensors`` as the loader gives them (before the
    model is built), ``source`` the folder they came from (None: a model in memory)."""
    from spear.quant.primitives import n_groups, packed_nbytes

    h = hashlib.sha256()
    if source is not None:
        from spear.models.checkpoint import CONFIG_NAME

        cfg = Path(source) / CONFIG_NAME
        h.update((cfg if cfg.is_file() else Path(source) / "config.json").read_bytes())
    else:
        h.update(model_config.to_json_string(use_diff=False).encode())
    layout, model_bytes, ec_bytes = [], 0, 0
    for name in sorted(quantized):
        m = quantized[name]
        q, ec = m.quant, m.ec
        layout.append([name, q.bits, q.group_size, q.symmetric, 0 if ec is None else ec.rank,
                       0 if ec is None else ec.hidden])
        n, k = q.codes.shape
        model_bytes += packed_nbytes(n, k, q.bits) + n * n_groups(k, q.group_size) * 2
        if not q.symmetric:
            model_bytes += (n * n_groups(k, q.group_size) * q.bits + 7) // 8
        if m.bias is not None:
            model_bytes += 2 * m.bias.numel()
        ec_bytes += 0 if ec is None else 2 * _ec_params(ec)
    h.update(json.dumps(layout).encode())
    model_bytes += 2 * sum(t.numel() for t in tensors.values())
    density = Density(modules_with_ec=sum(1 for m in quantized.values() if m.ec is not None), modules=len(quantized),
                      extra_memory_pct=100 * ec_bytes / model_bytes if model_bytes else 0.0)
    return Deployment(checkpoint=None if source is None else str(source), checkpoint_hash=h.hexdigest(),
                      device=device_name(device), dtype=str(dtype).removeprefix("torch."), policy_hash=policy_hash(policy),
                      block_size=block_size, cuda_graphs=cuda_graphs, density=density,
                      policy_op_args=tuple(policy.op_args), tensor_parallel=tensor_parallel, tp_reduce=tp_reduce)


def policy_hash(policy) -> str:
    """sha256 of every setting of a KernelPolicy: its op integers (the launch table among them) and
    the fields they leave out (PDL, the attention splits, rotary in attention)."""
    import dataclasses

    rest = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)
            if f.name not in ("launch_table", "_op_args")}
    text = json.dumps([list(policy.op_args), rest], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
