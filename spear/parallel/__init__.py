"""Tensor parallelism of the serving engine: one process per device, each holding a share of every layer.

The split is Megatron's, as vLLM and nano-vllm apply it to the Llama family:

  column-parallel   q/k/v, gate/up (and the vocabulary of the output head): each rank holds a
                    slice of the output features and sees the whole input. A compensator keeps A
                    and the gate whole (u = A x is complete on every rank) and splits B by rows.
  row-parallel      o_proj, down_proj: each rank holds a slice of the input features, its output
                    is a partial sum, summed across ranks. A compensator splits A by columns, so
                    u = A x is a partial sum too: the gate is nonlinear, so u is summed *before*
                    gamma is applied; an ungated term is linear and rides the layer's own sum.
  replicated        embeddings, norms (and a head whose vocabulary does not split evenly).

shard.py      which rows / columns of each checkpoint tensor a rank holds (pure functions)
comm.py       the collectives a rank's layers call: the row-parallel reduction with the
              compensator's second half after it, and the head's gather; an all-reduce path
              (gloo / NCCL) and a peer path over symmetric memory (CUDA)

The worker processes of ranks 1..N-1 live with the engine that drives them (spear/serve/model/workers.py;
every rank is built by spear/serve/model/rank.py): nothing here imports spear.serve.

The selection's communication cost (spear/select/allocate.py) reads ``ROW_PARALLEL`` from here,
the same names the engine's model splits by (``split_of``).
"""

from __future__ import annotations

# Module names (last component) of the linears whose input is split across ranks.
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "dense_4h_to_h", "fc2", "wo", "c_proj")


def split_of(module_name: str) -> str:
    """"row" for a row-parallel linear of this name, else "column"."""
    return "row" if module_name.rsplit(".", 1)[-1] in ROW_PARALLEL else "column"
