"""``SpearLinearMethod``: a vLLM linear method over spear's packed W4 codes and compensators.

vLLM builds each linear layer (merged q/k/v and gate/up included) with the share of one
tensor-parallel rank and asks the method for its parameters (:meth:`create_weights`); the
checkpoint's per-module tensors then load through each parameter's ``weight_loader`` into that
share (the slicing is :mod:`spear.vllm_plugin.sharding`'s); :meth:`process_weights_after_loading`
builds spear's own quant-method object once (the kernel adapter: the members' compensators merged
by spear's one merge, the weight packed for the kernels) and drops the loaded tensors;
:meth:`apply` is one call of it, plus the all-reduce of u for a gated compensator on a
row-parallel layer.
"""

from __future__ import annotations

import torch
from torch.nn import Parameter
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearMethodBase,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from spear.errors import SpearError
from spear.vllm_plugin import kernel_adapter, sharding

_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def _partition(layer: torch.nn.Module, members: tuple[sharding.Member, ...], input_size_per_partition: int,
               output_partition_sizes: list[int], input_size: int, output_size: int) -> sharding.Partition:
    t, n = layer.tp_rank, layer.tp_size
    if isinstance(layer, QKVParallelLinear):  # its output_sizes count replicated kv heads once per rank
        whole = [layer.total_num_heads * layer.head_size, layer.total_num_kv_heads * layer.head_size,
                 layer.total_num_kv_heads * layer.v_head_size]
    else:
        whole = list(getattr(layer, "output_sizes", [output_size]))
    if (input_size, whole) != (members[0].in_features, [m.out_features for m in members]):
        raise SpearError(f"{layer.prefix}: vLLM's layer is {input_size} -> {whole}, spear_config.json records "
                         + ", ".join(f"{m.name} {m.in_features} -> {m.out_features}" for m in members))
    if isinstance(layer, RowParallelLinear):
        return sharding.row_partition(members[0], input_size_per_partition, t, n)
    if isinstance(layer, QKVParallelLinear):
        # with fewer kv heads than ranks, vLLM replicates each kv head on tp_size / kv_heads ranks
        rep = layer.num_kv_head_replicas
        return sharding.column_partition(members, output_partition_sizes, [t, t // rep, t // rep], t, n)
    if isinstance(layer, ColumnParallelLinear):
        return sharding.column_partition(members, output_partition_sizes, [t] * len(members), t, n)
    if isinstance(layer, ReplicatedLinear):
        return sharding.column_partition(members, output_partition_sizes, [0] * len(members), 0, 1)
    raise SpearError(f"{members[0].name}: the vLLM plugin does not know the layer type {type(layer).__name__}")


def _member_index(layer: torch.nn.Module, p: sharding.Partition, shard_id) -> int:
    if shard_id is None and len(p.members) == 1:
        return 0
    if isinstance(shard_id, str) and shard_id in _QKV_SHARDS and len(p.members) == 3:
        return _QKV_SHARDS[shard_id]
    if isinstance(shard_id, int) and 0 <= shard_id < len(p.members):
        return shard_id
    raise SpearError(f"{layer.prefix}: cannot place checkpoint shard {shard_id!r} among its modules "
                     f"{', '.join(m.name for m in p.members)} (spear checkpoints store each module apart)")


class SpearLinearMethod(LinearMethodBase):
    """Serves the spear modules ``members`` (several for a merged layer, in vLLM's shard order)."""

    def __init__(self, members: tuple[sharding.Member, ...]):
        self.members = members

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        if any(m.bias for m in self.members) != layer.has_bias or len({m.bias for m in self.members}) > 1:
            raise SpearError(f"{layer.prefix}: the spear modules' biases "
                             f"({', '.join(f'{m.name}={m.bias}' for m in self.members)}) do not match vLLM's "
                             f"layer (bias={layer.has_bias})")
        p = _partition(layer, self.members, input_size_per_partition, output_partition_sizes, input_size,
                       output_size)
        layer.spear_partition = p
        layer.spear_loaded = set()
        for name, (shape, dtype, fill) in p.param_shapes().items():
            param = Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False)
            # vLLM calls (param, tensor) for a single module and (param, tensor, shard_id) for a
            # member of a merged one; every split is sharding.load's, so vLLM's own loader is unused
            param.weight_loader = self._loader(layer, name)
            layer.register_parameter(name, param)

    @staticmethod
    def _loader(layer: torch.nn.Module, name: str):
        def weight_loader(param: Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            p = layer.spear_partition
            member = _member_index(layer, p, shard_id)
            sharding.load(p, name, param.data, member, loaded)
            layer.spear_loaded.add((name, member))
        return weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        p: sharding.Partition = layer.spear_partition
        missing = sorted(p.expected_loads() - layer.spear_loaded)
        if missing:
            name, i = missing[0]
            raise SpearError(f"the checkpoint did not provide {p.members[i].name}.{sharding.SUFFIXES[name]}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        names = list(p.param_shapes())
        merged = sharding.merged_layer(p, {n: getattr(layer, n).data for n in names})
        layer.spear = kernel_adapter.prepare(**merged, dtype=layer.params_dtype, reduces_u=p.reduces_u)
        for n in names:  # the kernel layouts replace the checkpoint's
            delattr(layer, n)
        del layer.spear_loaded

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        p: sharding.Partition = layer.spear_partition
        return kernel_adapter.forward(layer.spear, x, bias,
                                      reduce_u=tensor_model_parallel_all_reduce if p.reduces_u else None,
                                      add_ec=p.adds_ec)
