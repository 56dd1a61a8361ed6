"""The plugin's weight placement and forward, without vLLM: simulated tensor-parallel ranks load
a spear module's checkpoint tensors through ``sharding.load``, run ``kernel_adapter.forward``
(spear's dense method in fp32 on the CPU), and the ranks' outputs, concatenated (column-parallel) or summed
(row-parallel, as vLLM's all-reduce does), must equal spear's own QuantLinear with its
compensator on the whole weight."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from spear.compensate.ec import GatedCompensator
from spear.compensate.lowrank import LowRankCompensator
from spear.compensate.registry import as_stored, compensator_spec
from spear.errors import SpearError
from spear.quant.linear import QuantLinear
from spear.quant.primitives import n_groups, pack_codes
from spear.vllm_plugin import kernel_adapter, sharding

HEAD_DIM = 16


def _module(out: int, inp: int, group: int, symmetric: bool, comp: str | None, gen: torch.Generator,
            rank: int = 3, hidden: int = 4, per_rank: bool = True) -> QuantLinear:
    """A QuantLinear with random codes and, per ``comp``, a compensator whose factors matter."""
    q = QuantLinear(inp, out, 4, group, symmetric)
    g = n_groups(inp, group)
    codes = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    scales = (0.01 + 0.02 * torch.rand(out, g, generator=gen)).half()
    zeros = torch.full((out, g), 8, dtype=torch.uint8) if symmetric else \
        torch.randint(0, 16, (out, g), generator=gen, dtype=torch.uint8)
    q.set_quantized(codes, scales, zeros)
    if comp is not None:
        a = torch.randn(rank, inp, generator=gen) / math.sqrt(inp)
        b = 0.05 * torch.randn(out, rank, generator=gen)
        if comp == "lowrank":
            q.compensator = LowRankCompensator(a, b)
        else:
            gated = comp == "gated"
            c = GatedCompensator(a, b, hidden=hidden, gated=gated, bound=0.6, alpha=0.8, per_rank=per_rank)
            if gated:
                with torch.no_grad():
                    for t in (c.w1, c.b1, c.w2, c.b2):
                        t.copy_(torch.randn(t.shape, generator=gen))
                c.set_input_scale(0.5 + torch.rand(rank, generator=gen))
            q.compensator = c
        with torch.no_grad():  # the values a checkpoint holds
            for t in list(q.compensator.parameters()) + list(q.compensator.buffers()):
                t.requires_grad_(False)
                t.copy_(as_stored(t, t.dtype))
    return q


def _member(name: str, q: QuantLinear) -> tuple[sharding.Member, dict[str, torch.Tensor]]:
    """The module's spear_config.json entry and checkpoint tensors, keyed by the plugin's parameter names."""
    entry = {"in_features": q.in_features, "out_features": q.out_features, "bits": 4, "group_size": q.group_size,
             "symmetric": q.symmetric, "bias": False,
             "compensator": None if q.compensator is None else compensator_spec(q.compensator)}
    tensors = {"qweight": pack_codes(q.codes, 4), "scales": q.scales.half()}
    if not q.symmetric:
        tensors["zeros"] = q.zeros
    if q.compensator is not None:
        by_suffix = {v: k for k, v in sharding.SUFFIXES.items()}
        for k, t in q.compensator.state_dict().items():
            tensors[by_suffix[f"compensator.{k}"]] = t.half()
    return sharding.Member.from_entry(name, entry), tensors


def _load(p: sharding.Partition, ckpt: list[dict[str, torch.Tensor]]) -> kernel_adapter.SpearLayer:
    shapes = p.param_shapes()
    params = {n: torch.full(s, fill, dtype=dt) for n, (s, dt, fill) in shapes.items()}
    loaded = set()
    for i, tensors in enumerate(ckpt):
        for name, t in tensors.items():
            sharding.load(p, name, params[name], i, t)
            loaded.add((name, i))
    assert loaded == p.expected_loads()
    return kernel_adapter.prepare(**sharding.merged_layer(p, params), dtype=torch.float32, reduces_u=p.reduces_u)


def _run_ranks(fn, n: int) -> list[torch.Tensor]:
    """``fn(rank, reduce)`` on ``n`` threads, ``reduce`` an all-reduce (sum) across them."""
    parts: list = [None] * n
    barrier = threading.Barrier(n)
    out: list = [None] * n
    errors: list = []

    def reducer(t):
        def reduce(u):
            parts[t] = u
            barrier.wait()
            total = torch.stack(parts).sum(0)
            barrier.wait()
            return total
        return reduce

    def run(t):
        try:
            out[t] = fn(t, reducer(t))
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def _qkv_rows(n_heads: int, n_kv: int, tp: int) -> tuple[list[int], int]:
    """vLLM's QKVParallelLinear shares: q heads split, kv heads split or, with fewer kv heads than
    ranks, each replicated on tp / n_kv ranks."""
    kv_per_rank, replicas = (1, tp // n_kv) if tp >= n_kv else (n_kv // tp, 1)
    return [n_heads // tp * HEAD_DIM, kv_per_rank * HEAD_DIM, kv_per_rank * HEAD_DIM], replicas


@pytest.mark.parametrize("group, symmetric", [(0, True), (32, False)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_qkv_column_parallel(tp, group, symmetric):
    gen = torch.Generator().manual_seed(100 * tp + group)
    n_heads, n_kv, k = 4, 2, 128
    mods = [_module(n_heads * HEAD_DIM, k, group, symmetric, "gated", gen),
            _module(n_kv * HEAD_DIM, k, group, symmetric, "ungated", gen, rank=2),
            _module(n_kv * HEAD_DIM, k, group, symmetric, None, gen)]
    members, ckpt = zip(*[_member(f"l.{s}_proj", q) for s, q in zip("qkv", mods)])
    x = torch.randn(5, k, generator=gen)
    with torch.no_grad():
        want = [q(x) for q in mods]
    rows, replicas = _qkv_rows(n_heads, n_kv, tp)
    got = [[None] * tp for _ in mods]
    for t in range(tp):
        p = sharding.column_partition(members, rows, [t, t // replicas, t // replicas], t, tp)
        assert not p.reduces_u and p.adds_ec  # u = A x is whole on every rank
        y = kernel_adapter.forward(_load(p, list(ckpt)), x)
        for i, part in enumerate(y.split(rows, dim=-1)):
            got[i][t] = part
    for i, q in enumerate(mods):
        shard = rows[i]
        for t in range(tp):
            start = (t if i == 0 else t // replicas) * shard
            torch.testing.assert_close(got[i][t], want[i][:, start:start + shard], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("comp, per_rank", [("gated", True), ("gated", False), ("ungated", True), ("lowrank", True)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_row_parallel_sums_to_the_whole_layer(tp, comp, per_rank):
    gen = torch.Generator().manual_seed(7 * tp + len(comp))
    k, n = 256, 96
    q = _module(n, k, 64, False, comp, gen, rank=5, hidden=6, per_rank=per_rank)
    member, tensors = _member("l.o_proj", q)
    x = torch.randn(3, 2, k, generator=gen)
    with torch.no_grad():
        want = q(x)
    parts = [sharding.row_partition(member, k // tp, t, tp) for t in range(tp)]
    # a gated EC's u is reduced before γ, and then only rank 0 adds the EC term
    assert all(p.reduces_u == (comp == "gated" and tp > 1) for p in parts)
    assert [p.adds_ec for p in parts] == [True] + [comp != "gated"] * (tp - 1)
    weights = [_load(p, [tensors]) for p in parts]
    xs = x.split(k // tp, dim=-1)

    def rank(t, reduce):
        return kernel_adapter.forward(weights[t], xs[t], reduce_u=reduce if parts[t].reduces_u else None,
                                      add_ec=parts[t].adds_ec)

    got = torch.stack(_run_ranks(rank, tp)).sum(0)  # vLLM's all-reduce of the output
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_merged_gate_up_with_bias():
    gen = torch.Generator().manual_seed(3)
    k = 64
    mods = [_module(48, k, 0, True, "gated", gen, per_rank=False), _module(48, k, 0, True, "lowrank", gen)]
    members, ckpt = zip(*[_member(f"l.{s}", q) for s, q in zip(("gate_proj", "up_proj"), mods)])
    bias = torch.randn(96, generator=gen)
    x = torch.randn(4, k, generator=gen)
    with torch.no_grad():
        want = torch.cat([q(x) for q in mods], dim=-1) + bias
    p = sharding.column_partition(members, [48, 48], [0, 0], 0, 1)
    torch.testing.assert_close(kernel_adapter.forward(_load(p, list(ckpt)), x, bias), want, rtol=1e-4, atol=1e-5)


def test_rejected_layouts():
    gen = torch.Generator().manual_seed(5)
    member, tensors = _member("l.o_proj", _module(32, 128, 64, True, None, gen))
    with pytest.raises(SpearError, match="multiple of its group size 64"):
        sharding.row_partition(member, 128 // 4, 1, 4)   # 32 inputs per rank cannot hold a group of 64
    p = sharding.row_partition(member, 64, 0, 2)
    dst = torch.zeros(p.param_shapes()["qweight"][0], dtype=torch.uint8)
    with pytest.raises(SpearError, match="shape"):
        sharding.load(p, "qweight", dst, 0, tensors["qweight"][:, :-1])
    with pytest.raises(SpearError, match="not part of its module"):
        sharding.load(p, "ec_A", dst, 0, torch.zeros(2, 128))
    a, b = (sharding.Member.from_entry(f"l.{s}", {"in_features": 64, "out_features": 32, "bits": 4, "group_size": 0,
                                                  "symmetric": True, "compensator": {"kind": "spear-ec", "rank": 2,
                                                                                     "hidden": 4, "gated": True,
                                                                                     "bound": bound}})
            for s, bound in (("gate_proj", 0.5), ("up_proj", 1.0)))
    with pytest.raises(SpearError, match="different bounds"):
        sharding.column_partition((a, b), [32, 32], [0, 0], 0, 1)
    with pytest.raises(SpearError, match="4-bit"):
        sharding.Member.from_entry("l.q", {"in_features": 64, "out_features": 32, "bits": 3, "group_size": 0,
                                           "symmetric": True, "compensator": None})
