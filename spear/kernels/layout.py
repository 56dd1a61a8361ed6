"""Packed layouts the kernels consume, produced once at load by :func:`pack` and :func:`pack_ec`.

One W4 layout serves every token count: the fragment layout (``Layout.FRAGMENT``, below), for
out_features a multiple of 16 and in_features of 64, which every Llama-family layer meets. The
N-major layout (``Layout.NMAJOR``) is the fallback for the shapes it refuses (e.g. 40 output
features, or 96 inputs: a tensor-parallel share of a small model); ``layout_for`` says which a shape
takes. Checkpoints store codes, not a layout, so a model is packed anew at every load.

N-major W4 weight (from spear's ``(codes, scales, zeros)`` layout, see :mod:`spear.quant.primitives`):

  qweight (N, K/8) int32   row n holds the 4-bit codes of output n along K. Word j covers
                           k = 8j .. 8j+7; nibble i (bits 4i .. 4i+3) holds k = 8j + NIBBLE_K[i].
                           A program streams BN rows x BK/8 words per step: each row is BK/2
                           contiguous bytes, so loads are 16 bytes wide and coalesced.
                           The nibble order pairs nibble i with nibble i+4 (same bit position
                           in the two 16-bit halves), so one mask ``0x000F000F`` extracts two
                           codes per 32-bit operation; NIBBLE_K undoes the order in which the
                           kernel re-assembles them (see ``_unpack_w4`` in ``_common.py``).
  scales  (G, N) fp16      transposed from (N, G): the BN scales of one group are contiguous.
  zeros   (G, N) uint8     integer zero points, same transposition.
  locks   (LOCK_SLOTS,) int32, zero: scratch counters for split-K and the fused compensator;
                           every kernel leaves it zero again, so it is allocated once per layer
                           and is safe to reuse across calls and CUDA-graph replays.

  G = 1 for per-channel (group_size 0), else K / group_size.

  Storage at group 128: 4 + 16/128 + 8/128 = 4.19 bits per weight (the locks are per layer,
  not per weight). Per-channel: 4 + 24/K bits.

Fragment layout (``Layout.FRAGMENT``, N a multiple of 16, K of 64): the tensor-core GEMM's own
layout (_fragment.py, gluon_w4.py), pre-shuffled once here so that each lane's 16-byte load holds
exactly the codes of its MMA fragments and nothing changes place on chip.

  qweight (N/16, 2K) int32 row t holds output features 16t .. 16t + 15; per 64 inputs (kb),
                           128 words: lane l = 4g + q (g = 0..7, q = 0..3) has words
                           4l .. 4l + 3, one per k16 chunk c. Nibbles (j, j + 4) of a word are
                           the pair j: feature 16t + g + 8 (j % 2), inputs
                           64 kb + 16 c + 8 (j // 2) + 2q + (0, 1) (_FRAGMENT_NIBBLE below).
  Scales, zeros, locks as above (the kernel loads the scales of rows g and g + 8).

Error compensator (EC) y += alpha * B (gamma(u) * u), u = A x, gamma = 1 + bound * tanh(W2 silu(W1 u + b1) + b2):

  a  (R, K)      A padded with zero rows to R = max(16, next_pow2(r)) (tensor-core tiles
                 need 16 along every dot dimension; zero ranks contribute exactly 0)
  b  (N, R)      B padded with zero columns
  w1 (H, R), b1 (H,), w2 (R, H), b2 (R,)   gate MLP, hidden padded to H = max(16, next_pow2(h));
                 padded hidden units see 0 input and 0 bias, so silu gives 0 and they add nothing;
                 padded ranks get gamma = 1 but u = 0 there. A gated EC pads rank and hidden to
                 the same R = H = max of the two: the gate's products are then square in them,
                 the only shapes seen clean on Hopper (a [64, 16] shared-memory operand of a
                 wgmma was read out of bounds by Triton 3.6: _common._gate_apply).
  All EC tensors are stored in the activation dtype (fp16 or bf16).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# nibble i of an N-major word holds k-offset NIBBLE_K[i]; the inverse of the order _unpack_w4 produces.
NIBBLE_K = (0, 2, 1, 3, 4, 6, 5, 7)
FRAGMENT_N, FRAGMENT_K = 16, 64  # the fragment layout's tile: 16 output features x 64 inputs
LOCK_SLOTS = 4096
MAX_RANK = 128


class Layout(enum.Enum):
    """A packed W4 weight's layout (module docstring); the registered op takes its ``id``."""

    FRAGMENT = "fragment"
    NMAJOR = "nmajor"

    @property
    def id(self) -> int:
        return _LAYOUT_IDS.index(self)

    @staticmethod
    def of_id(i: int) -> "Layout":
        if not 0 <= i < len(_LAYOUT_IDS):
            raise ValueError(f"a layout id is 0..{len(_LAYOUT_IDS) - 1}; got {i}")
        return _LAYOUT_IDS[i]


_LAYOUT_IDS = tuple(Layout)


def layout_for(n: int, k: int) -> Layout:
    """The fragment layout where (out_features, in_features) = (n, k) allows it, else N-major."""
    return Layout.FRAGMENT if n % FRAGMENT_N == 0 and k % FRAGMENT_K == 0 else Layout.NMAJOR


@dataclass(frozen=True)
class WeightFormat:
    """What the kernel planner reads of a packed weight (``PackedW4.format``)."""

    layout: Layout
    group_size: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_dim(n: int) -> int:
    """Tile size for a low-rank dimension: a power of two, at least 16 (tensor-core minimum)."""
    return max(16, _next_pow2(n))


@dataclass
class PackedW4:
    qweight: torch.Tensor  # (N, K/8) int32 N-major, (N/16, 2K) fragment layout
    scales: torch.Tensor   # (G, N) fp16
    zeros: torch.Tensor    # (G, N) uint8
    locks: torch.Tensor    # (LOCK_SLOTS,) int32 zeros
    group_size: int
    symmetric: bool
    layout: Layout

    @property
    def layout_id(self) -> int:
        return self.layout.id

    @property
    def format(self) -> WeightFormat:
        return WeightFormat(self.layout, self.group_size)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0] * (FRAGMENT_N if self.layout is Layout.FRAGMENT else 1)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] // 2 if self.layout is Layout.FRAGMENT else self.qweight.shape[1] * 8


@dataclass
class PackedEC:
    a: torch.Tensor
    b: torch.Tensor
    w1: torch.Tensor | None
    b1: torch.Tensor | None
    w2: torch.Tensor | None
    b2: torch.Tensor | None
    alpha: float
    bound: float
    rank: int

    @property
    def gated(self) -> bool:
        return self.w1 is not None

    @property
    def kernel_rank(self) -> int:
        """The rank the kernels see: A's rows, padded (``padded_dim``)."""
        return self.a.shape[0]


def check_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                symmetric: bool) -> tuple[int, int]:
    """Validate spear's (codes, scales, zeros) for packing; returns (out_features, in_features)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D uint8 tensor (out, in); got {codes.dtype} of shape {tuple(codes.shape)}")
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"in_features must be a multiple of 32 (the smallest K tile); got {k}")
    if int(codes.max()) > 15:
        raise ValueError(f"the kernels take 4-bit codes (0..15); max code seen {int(codes.max())}")
    g = 1 if group_size == 0 else k // group_size
    if group_size not in (0, 32, 64, 128, 256) or (group_size and k % group_size):
        raise ValueError(f"group_size must be 0 (per-channel) or one of 32/64/128/256 dividing in_features={k}; "
                         f"got {group_size}")
    if scales.shape != (n, g) or zeros.shape != (n, g):
        raise ValueError(f"scales and zeros must be (out, n_groups) = {(n, g)}; got {tuple(scales.shape)} "
                         f"and {tuple(zeros.shape)}")
    if symmetric and bool((zeros != 8).any()):
        raise ValueError("symmetric=True requires every zero point to be 8; "
                         f"saw values {sorted(set(zeros.unique().tolist()))[:8]}")
    return n, k


def _fragment_view(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """(N, K) -> the fragment order's axes (t, kb, g, q, c, j1, j0, h) as a view's permutation."""
    return t.reshape(n // 16, 2, 8, k // 64, 4, 2, 4, 2).permute(0, 3, 2, 6, 4, 5, 1, 7)


# nibble of (j1, j0, h) in a fragment word: pair j = 2 j1 + j0 takes nibbles j (h = 0) and j + 4
_FRAGMENT_NIBBLE = [(j1, j0, h, 2 * j1 + j0 + 4 * h) for j1 in (0, 1) for j0 in (0, 1) for h in (0, 1)]


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
         symmetric: bool = False, layout: Layout | None = None) -> PackedW4:
    """Re-pack spear's (codes, scales, zeros) into a kernel layout (module docstring): ``layout``,
    by default the one the shape takes (``layout_for``).

    ``symmetric`` lets the kernels skip the zero-point loads; it requires every zero to be 8.
    """
    n, k = check_codes(codes, scales, zeros, group_size, symmetric)
    layout = layout_for(n, k) if layout is None else layout
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a Layout ({', '.join(x.name for x in Layout)}); got {layout!r}")
    if layout is Layout.FRAGMENT and layout_for(n, k) is not Layout.FRAGMENT:
        raise ValueError(f"the fragment layout needs out_features a multiple of {FRAGMENT_N} and in_features "
                         f"of {FRAGMENT_K}; got ({n}, {k})")
    if layout is Layout.FRAGMENT:
        c = _fragment_view(codes, n, k).to(torch.int64)
        word = torch.zeros(c.shape[:5], dtype=torch.int64, device=codes.device)
        for j1, j0, h, nib in _FRAGMENT_NIBBLE:
            word |= c[..., j1, j0, h] << (4 * nib)
        word = word.reshape(n // 16, 2 * k)
    else:
        c = codes.reshape(n, k // 8, 8).to(torch.int64)
        word = torch.zeros(n, k // 8, dtype=torch.int64, device=codes.device)
        for nib, koff in enumerate(NIBBLE_K):
            word |= c[..., koff] << (4 * nib)
    # int32 two's-complement view of the unsigned 32-bit word
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return PackedW4(qweight=word.contiguous(), scales=scales.to(torch.float16).t().contiguous(),
                    zeros=zeros.to(torch.uint8).t().contiguous(),
                    locks=torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=codes.device),
                    group_size=group_size, symmetric=symmetric, layout=layout)


def unpack(packed: PackedW4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: ``(codes (N, K) uint8, scales (N, G) fp16, zeros (N, G) uint8)``."""
    scales, zeros = packed.scales.t().contiguous(), packed.zeros.t().contiguous()
    if packed.layout is Layout.FRAGMENT:
        n, k = packed.out_features, packed.in_features
        qw = (packed.qweight.to(torch.int64) & 0xFFFFFFFF).reshape(n // 16, k // 64, 8, 4, 4)
        codes = torch.empty(n, k, dtype=torch.uint8, device=qw.device)
        view = _fragment_view(codes, n, k)
        for j1, j0, h, nib in _FRAGMENT_NIBBLE:
            view[..., j1, j0, h] = ((qw >> (4 * nib)) & 0xF).to(torch.uint8)
        return codes, scales, zeros
    qw = packed.qweight.to(torch.int64) & 0xFFFFFFFF
    n, kw = qw.shape
    codes = torch.empty(n, kw, 8, dtype=torch.uint8, device=qw.device)
    for nib, koff in enumerate(NIBBLE_K):
        codes[..., koff] = ((qw >> (4 * nib)) & 0xF).to(torch.uint8)
    return codes.reshape(n, kw * 8), scales, zeros


def pack_ec(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype: torch.dtype,
            w1: torch.Tensor | None = None, b1: torch.Tensor | None = None,
            w2: torch.Tensor | None = None, b2: torch.Tensor | None = None,
            bound: float = 1.0) -> PackedEC:
    """Pad and cast the compensator to the kernel layout (module docstring); no gate when ``w1`` is None."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"EC dtype must be float16 or bfloat16 (the activation dtype); got {dtype}")
    r, k = a.shape
    n = b.shape[0]
    if b.shape != (n, r):
        raise ValueError(f"B must be (out, r) with r = A.shape[0] = {r}; got {tuple(b.shape)}")
    if not 1 <= r <= MAX_RANK:
        raise ValueError(f"rank must be in 1..{MAX_RANK}; got {r}")
    rp = padded_dim(r)
    dev = a.device

    def padded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros(shape, dtype=dtype, device=dev)
        out[tuple(slice(0, s) for s in t.shape)] = t.to(dtype)
        return out

    gate = [w1, b1, w2, b2]
    if any(t is None for t in gate) and not all(t is None for t in gate):
        raise ValueError("gate parameters W1, b1, W2, b2 must be given together or not at all")
    if w1 is not None:
        h = w1.shape[0]
        if w1.shape != (h, r) or b1.shape != (h,) or w2.shape != (r, h) or b2.shape != (r,):
            raise ValueError(f"gate shapes must be W1 (h, r), b1 (h,), W2 (r, h), b2 (r,) with r={r}; got "
                             f"{tuple(w1.shape)}, {tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}")
        if not 1 <= h <= MAX_RANK:
            raise ValueError(f"gate hidden size must be in 1..{MAX_RANK}; got {h}")
        rp = hp = max(rp, padded_dim(h))  # square gate products (module docstring)
        gate = [padded(w1, (hp, rp)), padded(b1, (hp,)), padded(w2, (rp, hp)), padded(b2, (rp,))]
    return PackedEC(padded(a, (rp, k)), padded(b, (n, rp)), *gate, alpha=float(alpha), bound=float(bound), rank=r)
