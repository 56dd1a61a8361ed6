"""Where the rotary inside the paged attention kernel (``rope=``) and ``fused.rope_write_kv``
disagree on a GPU: per cache slot that differs, whether it is a new token's slot, whether the
kernel left it unwritten (NaN) and by how much it differs; for several split counts.

    python benchmarks/diag_rope_attention.py [--heads 16/4] [--head-dim 64] [--dtype float16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.kernels.attention import paged_decode_attention  # noqa: E402
from spear.kernels.fused import rope_write_kv  # noqa: E402
from tests.kernels.test_attention import GPU_CONTEXTS, _rope_tables, make_batch  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", default="16/4", help="query heads / kv heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    args = p.parse_args()
    h, hkv = map(int, args.heads.split("/"))
    d, dtype, bs = args.head_dim, getattr(torch, args.dtype), 16
    q, kp0, vp0, _, _, tables, lens = make_batch(GPU_CONTEXTS, h, hkv, d, bs, dtype, seed=d + h)
    b = q.shape[0]
    g = torch.Generator().manual_seed(d + h + 1)
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=g).to(dtype).to(q.device)
    q_raw, k_new, v_new = qkv.split([h * d, hkv * d, hkv * d], -1)
    q_raw, k_new, v_new = q_raw.view(b, h, d), k_new.view(b, hkv, d), v_new.view(b, hkv, d)
    cos, sin = _rope_tables(max(GPU_CONTEXTS) + 1, d, dtype)
    pos = lens - 1
    slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
    new_slots = set(slots.tolist())
    for splits in (None, 1, 2, 8):
        kp, vp = kp0.clone(), vp0.clone()
        blk, off = slots // bs, slots % bs
        kp[blk, off] = float("nan")
        vp[blk, off] = float("nan")
        k_sep, v_sep = kp.clone(), vp.clone()
        q_rot = rope_write_kv(q_raw, k_new, v_new, cos, sin, k_sep, v_sep, slots, positions=pos)
        expect = paged_decode_attention(q_rot, k_sep, v_sep, tables, lens, d ** -0.5, splits=splits)
        out = paged_decode_attention(q_raw, kp, vp, tables, lens, d ** -0.5, splits=splits,
                                     rope=(k_new, v_new, cos, sin))
        if out.is_cuda:
            torch.cuda.synchronize()
        print(f"== splits {splits}: output equal {torch.equal(out, expect)}, max |diff| "
              f"{(out.float() - expect.float()).abs().nan_to_num(99).max().item():.3g}")
        for name, got, want in (("k", kp, k_sep), ("v", vp, v_sep)):
            differs = ~((got == want) | (got.isnan() & want.isnan()))  # [blocks, bs, hkv, d]
            where = differs.any(-1).nonzero().tolist()
            print(f"  {name} cache: {len(where)} (block, offset, head) rows differ")
            for blk_i, off_i, hh in where[:12]:
                slot = blk_i * bs + off_i
                row_g, row_w = got[blk_i, off_i, hh].float(), want[blk_i, off_i, hh].float()
                seqs = (slots == slot).nonzero().flatten().tolist()
                print(f"    slot {slot} head {hh}: new-token slot of seq {seqs} (len {lens[seqs].tolist()})"
                      if seqs else f"    slot {slot} head {hh}: NOT a new-token slot",
                      f"got NaN {row_g.isnan().sum().item()}/{d}, want NaN {row_w.isnan().sum().item()}/{d}, "
                      f"max |diff| {(row_g - row_w).abs().nan_to_num(99).max().item():.3g}, "
                      f"got[:4] {row_g[:4].tolist()}, want[:4] {row_w[:4].tolist()}")
    print("new-token slots:", sorted(new_slots))


if __name__ == "__main__":
    main()
