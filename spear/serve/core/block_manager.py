"""Paged KV cache bookkeeping: which fixed-size blocks of the cache tensor each sequence owns.

The cache tensor (see model_runner.py) is ``num_blocks`` blocks of ``block_size``
token slots. Token ``i`` of a sequence lives in block ``block_table[i // block_size]``
at offset ``i % block_size``. Blocks come from a free list and go back to it when a
sequence finishes, is aborted or is preempted. Pure Python: no tensors here.
"""

from __future__ import annotations

from collections import deque

from spear.serve.core.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1; got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """Whether slots for ``num_tokens`` tokens (default: all of ``seq``'s tokens) fit now."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        return self.blocks_needed(seq, n) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Grow ``seq``'s block table to cover ``num_tokens`` tokens (default: all of them)."""
        n = seq.num_tokens if num_tokens is None else num_tokens
        need = self.blocks_needed(seq, n)
        if need > len(self._free):
            raise RuntimeError(f"KV cache exhausted: {seq.request_id} needs {need} blocks, "
                               f"{len(self._free)} free (callers must check can_allocate first)")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list (idempotent)."""
        self._free.extend(seq.block_table)
        seq.block_table = []
