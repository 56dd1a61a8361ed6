"""The decode step's block tables, kept on the host between steps (``ModelRunner._decode_inputs``)."""

from __future__ import annotations

import numpy as np


class BlockTables:
    """The decode step's block tables, kept on the host between steps so that a step copies only
    the entries that changed instead of every sequence's whole table.

    Each sequence the step decodes has a row of ``width`` entries: its block ids, then
    ``scratch`` to the end. A row is rewritten when the sequence's ``block_table`` is another
    list than the one it was built from (the block manager replaces the list when it frees the
    blocks, e.g. on preemption), and otherwise only extended (blocks are only ever appended).
    Rows of sequences the step does not decode are reused for new ones. At 64 sequences of 4k
    tokens (250 blocks each) this took the step's inputs from 1.4 ms to 0.13 ms on a 2-core CPU
    (``benchmarks/bench_decode_inputs.py``). The rows are a numpy array: plain host memory, which
    torch's inference mode does not mark (a torch table grown while a CUDA graph was captured under
    ``torch.inference_mode`` refused every later in-place update outside it)."""

    def __init__(self, width: int, scratch: int):
        self.width, self.scratch = width, scratch
        self._table = np.full((1, width), scratch, dtype=np.int64)  # row 0: padding rows
        self._rows: dict[str, list] = {}  # request id -> [row, the block_table list, entries written]
        self._free: list[int] = []

    def _row_for(self, rid: str, live: set[str]) -> int:
        if not self._free:
            stale = [r for r in self._rows if r not in live]
            if stale:
                self._free.extend(self._rows.pop(r)[0] for r in stale)
            else:
                n = self._table.shape[0]
                grown = np.full((2 * n, self.width), self.scratch, dtype=np.int64)
                grown[:n] = self._table
                self._table = grown
                self._free.extend(range(n, 2 * n))
        return self._free.pop()

    def gather(self, seqs, batch: int) -> tuple[np.ndarray, list[int]]:
        """(tables (batch, width) int64 with padding rows of ``scratch``, blocks in use per row)."""
        live = {s.request_id for s in seqs}
        rows, used = [], []
        for seq in seqs:
            table, n = seq.block_table, len(seq.block_table)
            if n > self.width:
                raise ValueError(f"{seq.request_id} has {n} blocks; the tables hold {self.width}")
            entry = self._rows.get(seq.request_id)
            if entry is None:
                entry = self._rows[seq.request_id] = [self._row_for(seq.request_id, live), None, 0]
            row, built_from, written = entry
            if built_from is not table or written > n:
                self._table[row] = self.scratch
                written = 0
            if n > written:
                self._table[row, written:n] = table[written:n]
            entry[1], entry[2] = table, n
            rows.append(row)
            used.append(n)
        rows += [0] * (batch - len(rows))
        # numpy's take: torch's CPU advanced indexing took 0.4 ms here on the H200's host (20 ms on a
        # loaded 2-core CPU)
        return self._table.take(rows, axis=0), used
