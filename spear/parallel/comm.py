"""The collectives of one tensor-parallel rank's layers.

A row-parallel linear hands ``reduce`` its partial output y_t (M, N) and, for a gated
compensator, its partial u_t = A_t x_t (M, R), with a :class:`RowPost` that says what follows the
sum (the bias; the gate and alpha · B for a gated compensator). Two implementations:

  AllReduceComm   one ``torch.distributed.all_reduce`` of [y_t | u_t] (gloo on the CPU, NCCL on
                  CUDA: u rides the layer's own collective, one call), then the post step on the
                  sum (``tp_reduce_ec`` with one buffer on CUDA, the torch reference elsewhere);
  PeerComm        CUDA, no collective on the decode path: each rank copies [y_t | u_t] into its
                  buffer of symmetric memory, one barrier, then ``tp_reduce_ec`` reads every
                  rank's buffer over NVLink, sums, applies the gate and B in one launch. Two
                  buffers alternate (a rank writes buffer b again only after the barrier of the
                  reduction in between, which every rank reaches after reading b; a step that
                  starts after a reduction on buffer 0 fences first), and steps larger than the
                  buffers take the all-reduce path. NVLink multicast is never
                  used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0).

``gather`` concatenates the ranks' slices of the vocabulary-parallel output head along the last
dimension (all-gather).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from spear.errors import SpearError
from spear.parallel.shard import TPRank

REDUCE_MODES = ("allreduce", "peer")
# Values in each peer staging buffer: a decode step's partial output and u (64 tokens x 16k
# features, 2 MiB in fp16); larger steps take the all-reduce.
PEER_ELEMS = 64 * 16384
# Environment of every rank: never NVLink multicast (NVLS), in NCCL or in symmetric memory.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass
class RowPost:
    """What a row-parallel layer adds after the sum of its partials: ``bias`` and, for a gated
    compensator, alpha · B (gamma(u) ⊙ u) from the summed u. ``packed``: the compensator in the
    kernels' layout (CUDA); ``dense``: in torch form (B with alpha folded; ``gate`` its four
    tensors), run by the reference. Neither: an ungated term already rode in the partials."""

    n: int
    bias: torch.Tensor | None = None
    packed: object | None = None   # spear.kernels.layout.PackedEC
    dense: object | None = None    # spear.serve.model.layers.quant_method.DenseEC

    @property
    def ec(self):
        """The compensator whose second half follows the sum (its A gives each rank's partial u)."""
        return self.packed if self.packed is not None else self.dense

    def __call__(self, staging: list[torch.Tensor]) -> torch.Tensor:
        s0 = staging[0]
        if s0.is_cuda and self.dense is None and s0.dtype in (torch.float16, torch.bfloat16):
            from spear.kernels.tp_reduce import tp_reduce_ec

            return tp_reduce_ec(staging, self.n, self.bias, self.packed)
        from spear.kernels import reference

        if self.packed is not None:
            e = self.packed
            gate = (e.w1, e.b1, e.w2, e.b2) if e.gated else (None,) * 4
            y = reference.tp_reduce_ec(staging, self.n, self.bias, e.b, e.alpha, *gate, e.bound)
        elif self.dense is not None:
            e = self.dense
            y = reference.tp_reduce_ec(staging, self.n, self.bias, e.b, 1.0, *(e.gate or (None,) * 4), e.bound)
        else:
            y = reference.tp_reduce_ec(staging, self.n, self.bias)
        return y.to(s0.dtype)


class AllReduceComm:
    """Collectives through torch.distributed's process group ``group`` (gloo or NCCL)."""

    def __init__(self, tp: TPRank, group=None):
        self.tp, self.group = tp, group

    def begin_step(self) -> None:
        """Called at the start of every forward, on every rank."""

    def reduce(self, y: torch.Tensor, u: torch.Tensor | None, post: RowPost) -> torch.Tensor:
        buf = y if u is None else torch.cat([y, u], dim=-1)
        buf = buf.contiguous()
        dist.all_reduce(buf, group=self.group)
        return post([buf])

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        pass


class PeerComm(AllReduceComm):
    """The peer path (module docstring) over two symmetric-memory buffers of ``max_elems`` values.
    A barrier that waits longer than ``timeout_s`` (a peer gone) traps on the GPU instead of spinning."""

    def __init__(self, tp: TPRank, group, device: torch.device, dtype: torch.dtype, max_elems: int,
                 timeout_s: float = 300.0):
        super().__init__(tp, group)
        import torch.distributed._symmetric_memory as symm_mem

        self.max_elems, self.timeout_ms = max_elems, int(1000 * timeout_s)
        self.bufs, self.handles, self.peers = [], [], []
        for _ in range(2):
            buf = symm_mem.empty(max_elems, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, group if group is not None else dist.group.WORLD)
            self.bufs.append(buf)
            self.handles.append(handle)
            self.peers.append([handle.get_buffer(r, (max_elems,), dtype) for r in range(tp.size)])
        self._next = 0
        self._last: int | None = None  # the buffer of the last reduction (None: an all-reduce came after)

    def begin_step(self) -> None:
        # Buffer 0 is written first at every step. If the last reduction read it, a peer may still be
        # reading it: fence. A captured graph always fences, since it may replay after any step.
        if self._last == 0 or torch.cuda.is_current_stream_capturing():
            self.handles[1].barrier(channel=1, timeout_ms=self.timeout_ms)
        self._last = None
        self._next = 0

    def reduce(self, y: torch.Tensor, u: torch.Tensor | None, post: RowPost) -> torch.Tensor:
        m, n = y.shape
        width = n + (0 if u is None else u.shape[1])
        if m * width > self.max_elems:
            self._last = None  # a collective with data: every rank is past its earlier reads
            return super().reduce(y, u, post)
        i, self._next = self._next, self._next ^ 1
        local = self.bufs[i][:m * width].view(m, width)
        local[:, :n].copy_(y)
        if u is not None:
            local[:, n:].copy_(u)
        self.handles[i].barrier(channel=0, timeout_ms=self.timeout_ms)
        self._last = i
        return post([p[:m * width].view(m, width) for p in self.peers[i]])

    def close(self) -> None:
        self.peers, self.handles, self.bufs = [], [], []


def init_group(tp: TPRank, address: str, device: torch.device, timeout_s: float):
    """Join the ranks' default process group (NCCL on CUDA, gloo on the CPU)."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if dist.is_initialized():
        raise SpearError("this process already belongs to a torch.distributed process group; a tensor-parallel "
                         "engine makes its own (one per process)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=address, rank=tp.rank, world_size=tp.size,
                            timeout=timedelta(seconds=timeout_s), **kw)
    return dist.group.WORLD


def make_comm(tp: TPRank, mode: str, device: torch.device, dtype: torch.dtype, timeout_s: float = 300.0,
              max_elems: int = PEER_ELEMS):
    """The rank's collectives: ``mode`` "peer" takes the symmetric-memory path on CUDA."""
    if mode not in REDUCE_MODES:
        raise SpearError(f"tensor-parallel reduction must be one of {', '.join(REDUCE_MODES)}, got {mode!r}")
    if mode == "peer" and device.type == "cuda":
        return PeerComm(tp, dist.group.WORLD, device, dtype, max_elems, timeout_s)
    return AllReduceComm(tp, dist.group.WORLD)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
