"""One tensor-parallel rank's share of a checkpoint's tensors: pure functions, no communication.

``TPRank(rank, size)`` names the share; ``share(total)`` is the rank's contiguous slice of an
evenly split dimension. A linear's member (spear/serve/model/layers/linear.py, ``MemberWeights``: a
dense or quantized weight, a bias, a compensator in runtime factors) is cut with

  column_share(w, rows)   the output rows ``rows`` of the weight, its scales and zero points, the
                          bias and the compensator's B; A, alpha and the gate stay whole
  row_share(w, cols)      the input columns ``cols`` of the weight and of A; the scales and zero
                          points of the groups those columns cover (per-channel: all of them);
                          the bias and B stay whole (the layer adds them once, after the sum)

so that concatenating the column shares' outputs, or summing the row shares' partial outputs
(with u = A x summed before the gate), gives the whole layer's output exactly in exact
arithmetic (tests/parallel/test_shard.py checks both against the unsplit layer in float64).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spear.errors import SpearError


@dataclass(frozen=True)
class TPRank:
    """This process's place among ``size`` tensor-parallel ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise SpearError(f"the tensor-parallel size must be a whole number >= 1, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise SpearError(f"tensor-parallel rank {self.rank!r} is not in 0..{self.size - 1}")

    def share(self, total: int, what: str = "dimension") -> slice:
        """This rank's contiguous slice of ``total`` entries split evenly across the ranks."""
        if total % self.size:
            raise SpearError(f"{what} of {total} does not split evenly across {self.size} tensor-parallel ranks")
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)


def column_share(w, rows: slice):
    """The member ``w`` (MemberWeights) restricted to output rows ``rows``."""
    q = w.quant
    if q is not None:
        q = replace(q, codes=q.codes[rows], scales=q.scales[rows], zeros=q.zeros[rows])
    ec = w.ec
    if ec is not None:
        ec = replace(ec, b=ec.b[rows])
    return replace(w, weight=None if w.weight is None else w.weight[rows], quant=q,
                   bias=None if w.bias is None else w.bias[rows], ec=ec)


def row_share(w, cols: slice):
    """The member ``w`` (MemberWeights) restricted to input columns ``cols``; a SpearError names it
    when the columns cut through a quantization group."""
    q = w.quant
    if q is not None:
        g = q.group_size
        if g:
            if cols.start % g or cols.stop % g:
                raise SpearError(f"{w.name}: a tensor-parallel rank's input columns {cols.start}..{cols.stop} cut "
                                 f"through its quantization groups of {g}")
            groups = slice(cols.start // g, cols.stop // g)
            q = replace(q, codes=q.codes[:, cols], scales=q.scales[:, groups], zeros=q.zeros[:, groups])
        else:
            q = replace(q, codes=q.codes[:, cols])
    ec = w.ec
    if ec is not None:
        ec = replace(ec, a=ec.a[:, cols])
    return replace(w, weight=None if w.weight is None else w.weight[:, cols], quant=q, ec=ec)


def check_splits(config, tp: TPRank) -> None:
    """Refuse, in one line, a model whose heads or MLP do not split evenly across ``tp.size`` ranks."""
    if tp.size == 1:
        return
    for what, n in (("attention heads", config.num_attention_heads),
                    ("key/value heads", config.num_key_value_heads),
                    ("MLP features (intermediate_size)", config.intermediate_size)):
        if n % tp.size:
            raise SpearError(f"the model's {n} {what} do not split evenly across {tp.size} tensor-parallel ranks")
