"""The fused per-layer kernels (RMSNorm, rotary + KV write, SiLU·mul) against the torch references
of ``spear.kernels.reference`` (CPU: Triton interpreter, small shapes)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from spear.kernels import fused
from spear.kernels import reference as ref
from tests.kernels._helpers import DEVICE, sqnr_db

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max error relative to the largest reference value, and an SQNR floor (dB). fp32: only the
# mean's summation order, rsqrt and exp may differ. 16-bit: the kernels round where torch
# rounds, so at most a last-bit flip when those fp32 values land on a rounding boundary.
REL_TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SQNR = {torch.float32: 120.0, torch.float16: 60.0, torch.bfloat16: 45.0}


def check(out: torch.Tensor, expect: torch.Tensor, what: str) -> None:
    assert out.dtype == expect.dtype, f"{what}: dtype {out.dtype} != {expect.dtype}"
    assert out.shape == expect.shape, f"{what}: shape {tuple(out.shape)} != {tuple(expect.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    if torch.equal(out.cpu(), expect.cpu()):
        return
    err = float((out.double().cpu() - expect.double().cpu()).abs().max() / expect.double().abs().max().clamp_min(1e-30))
    s = sqnr_db(expect, out)
    assert err <= REL_TOL[expect.dtype] and s >= SQNR[expect.dtype], (
        f"{what}: max error {err:.2e} (tol {REL_TOL[expect.dtype]:.0e}), SQNR {s:.1f} dB (floor {SQNR[expect.dtype]})")


def randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("t,n", [(1, 64), (3, 200), (17, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(poisoned, dtype, t, n):
    x = randn(t, n, dtype=dtype, seed=t, scale=3.0)
    w = randn(n, dtype=dtype, seed=n, scale=0.2) + 1
    check(fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), f"rms_norm {dtype} {t}x{n}")


def test_rms_norm_fp32_weight_promotes(poisoned):
    """A 16-bit x with an fp32 weight gives fp32, as the torch product promotes."""
    x = randn(2, 3, 40, dtype=torch.float16, seed=0)
    w = randn(40, dtype=torch.float32, seed=1) + 1
    check(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), "rms_norm fp16 x, fp32 weight")


@pytest.mark.parametrize("t,n", [(1, 64), (17, 96)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(poisoned, dtype, t, n):
    x = randn(t, n, dtype=dtype, seed=t)
    r = randn(t, n, dtype=dtype, seed=t + 1, scale=4.0)
    w = randn(n, dtype=dtype, seed=n, scale=0.2) + 1
    s, out = fused.add_rms_norm(x, r, w, 1e-6)
    ref_s = r + x
    assert torch.equal(s, ref_s), "the residual sum is one correctly rounded add"
    check(out, ref.rms_norm(ref_s, w, 1e-6), f"add_rms_norm {dtype} {t}x{n}")


# ---------------------------------------------------------------------------- rotary + KV write


def _scattered_slots(t: int, num_blocks: int, block_size: int, seed: int) -> torch.Tensor:
    """Distinct slots for t tokens: runs of consecutive offsets in shuffled blocks, as a
    block table hands them out, starting mid-block."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num_blocks, generator=g)
    start = int(torch.randint(block_size, (), generator=g))
    pos = torch.arange(start, start + t)
    return blocks[pos // block_size] * block_size + pos % block_size


@pytest.mark.parametrize("d", [16, 24, 32, 64])
@pytest.mark.parametrize("t,h,hkv", [(1, 4, 2), (3, 4, 4), (17, 4, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(poisoned, dtype, t, h, hkv, d):
    num_blocks, block_size, max_len = 9, 4, 64
    q, k, v = (randn(t, n, d, dtype=dtype, seed=i + d) for i, n in enumerate((h, hkv, hkv)))
    # a real rotary table (cos/sin of position x frequency), in the activation dtype
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).double() / d)
    ang = torch.arange(max_len).double()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    cos_t, sin_t = ang.cos().to(dtype).to(DEVICE), ang.sin().to(dtype).to(DEVICE)
    positions = torch.randint(max_len, (t,), generator=torch.Generator().manual_seed(t)).to(DEVICE)
    slots = _scattered_slots(t, num_blocks, block_size, seed=d + t).to(DEVICE)
    k0 = randn(num_blocks, block_size, hkv, d, dtype=dtype, seed=100)
    v0 = randn(num_blocks, block_size, hkv, d, dtype=dtype, seed=101)

    cos, sin = cos_t[positions], sin_t[positions]
    ref_q = ref.apply_rope(q, cos, sin)
    ref_k, ref_v = k0.clone(), v0.clone()
    ref.write_kv(ref_k, ref_v, ref.apply_rope(k, cos, sin), v, slots)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots] = True

    # q, k, v as column slices of one fused projection (strided rows), as the engine passes them
    qkv = torch.cat([x.reshape(t, -1) for x in (q, k, v)], dim=1)
    q_s, k_s, v_s = (x.view(t, -1, d) for x in qkv.split([h * d, hkv * d, hkv * d], dim=1))
    # per-token rows (as reference.apply_rope takes them), then whole tables + positions, then strided
    for args, kw, qkv_in in (((cos, sin), {}, (q, k, v)),
                             ((cos_t, sin_t), dict(positions=positions.to(torch.int32)), (q, k, v)),
                             ((cos_t, sin_t), dict(positions=positions), (q_s, k_s, v_s))):
        kc, vc = k0.clone(), v0.clone()
        out = fused.rope_write_kv(*qkv_in, *args, kc, vc, slots, **kw)
        what = f"{dtype} t={t} h={h}/{hkv} d={d} {'positions' if kw else 'rows'} {'strided' if qkv_in[0] is q_s else ''}"
        check(out, ref_q, "q " + what)
        kc, vc, rk, rv = (c.view(-1, hkv, d) for c in (kc, vc, ref_k, ref_v))
        check(kc[written], rk[written], "k cache " + what)
        assert torch.equal(vc[written], rv[written]), "v is copied unchanged"
        assert torch.equal(kc[~written], k0.view(-1, hkv, d)[~written]), "k cache changed outside the slots"
        assert torch.equal(vc[~written], v0.view(-1, hkv, d)[~written]), "v cache changed outside the slots"


# ---------------------------------------------------------------------------- SiLU · up


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) = inf, as on GPUs
@pytest.mark.parametrize("shape", [(1, 40), (3, 64), (17, 200)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(poisoned, dtype, shape):
    gate = randn(*shape, dtype=dtype, seed=shape[0], scale=4.0)
    gate.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -30.0], dtype=dtype)  # exp over/underflow
    up = randn(*shape, dtype=dtype, seed=shape[1])
    check(fused.silu_mul(gate, up), F.silu(gate) * up, f"silu_mul {dtype} {shape}")
    # the two halves of one fused gate/up projection (strided rows)
    g_s, u_s = torch.cat((gate, up), dim=1).split(shape[1], dim=1)
    check(fused.silu_mul(g_s, u_s), F.silu(gate) * up, f"silu_mul strided {dtype} {shape}")


# ---------------------------------------------------------------------------- inputs and fallback


def test_bad_inputs_raise():
    f16 = dict(dtype=torch.float16, device=DEVICE)
    x, w = torch.zeros(2, 32, **f16), torch.ones(32, **f16)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, torch.ones(16, **f16), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        fused.rms_norm(torch.zeros(32, 2, **f16).t(), w, 1e-6)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        fused.rms_norm(x.int(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm(x, x.float(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm(x, torch.zeros(3, 32, **f16), w, 1e-6)

    q, k = torch.zeros(3, 4, 16, **f16), torch.zeros(3, 2, 16, **f16)
    cos = torch.zeros(3, 16, **f16)
    cache = torch.zeros(4, 4, 2, 16, **f16)
    slots = torch.arange(3, device=DEVICE)
    good = dict(q=q, k=k, v=k, cos=cos, sin=cos, k_cache=cache, v_cache=cache.clone(), slots=slots)
    bad = [
        (dict(k=torch.zeros(3, 2, 8, **f16)), "shape"),
        (dict(v=torch.zeros(2, 2, 16, **f16)), "shape"),
        (dict(q=torch.zeros(3, 4, 15, **f16), k=torch.zeros(3, 2, 15, **f16), v=torch.zeros(3, 2, 15, **f16),
              cos=torch.zeros(3, 15, **f16), sin=torch.zeros(3, 15, **f16)), "even"),
        (dict(cos=cos.float()), "dtype"),
        (dict(cos=torch.zeros(5, 16, **f16), sin=torch.zeros(5, 16, **f16)), "one row per token"),
        (dict(k_cache=torch.zeros(4, 4, 4, 16, **f16)), "caches"),
        (dict(v_cache=torch.zeros(4, 4, 2, 16, **f16).transpose(0, 1)), "contiguous"),
        (dict(slots=slots[:2]), "slots"),
        (dict(slots=slots.float()), "slots"),
        (dict(positions=torch.zeros(3, 1, dtype=torch.long, device=DEVICE)), "positions"),
        (dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
        (dict(k=torch.zeros(3, 16, 2, **f16).transpose(1, 2)), "contiguous within each token"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            fused.rope_write_kv(**{**good, **change})

    with pytest.raises(ValueError, match="match"):
        fused.silu_mul(x, torch.zeros(2, 16, **f16))
    with pytest.raises(ValueError, match="match"):
        fused.silu_mul(x, x.float())
    with pytest.raises(ValueError, match="unit stride"):
        fused.silu_mul(x.t(), x.t())


@pytest.mark.skipif(DEVICE != "cpu", reason="the torch fallback is for non-CUDA tensors")
def test_cpu_tensors_take_the_torch_reference():
    """Without the Triton interpreter, CPU tensors go through the torch references of
    ``spear.kernels.reference``, bit for bit. This session runs under the interpreter (switched on
    in tests/conftest.py before any import), so the check runs in a fresh interpreter without
    TRITON_INTERPRET.

    Catches: ``fused._use_kernel`` ignoring the tensor's device (``return True``): a Triton launch
    on CPU tensors without the interpreter fails."""
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


_FALLBACK_SCRIPT = r'''
import torch
import torch.nn.functional as F
from spear.kernels import _common, fused
from spear.kernels import reference as ref

assert not _common.INTERPRET
torch.manual_seed(0)
x, r = torch.randn(3, 32), torch.randn(3, 32)
w = torch.rand(32) + 0.5
assert torch.equal(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
s, out = fused.add_rms_norm(x, r, w, 1e-6)
assert torch.equal(s, r + x) and torch.equal(out, ref.rms_norm(r + x, w, 1e-6))
assert torch.equal(fused.silu_mul(x, r), F.silu(x) * r)
q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
cos_t, sin_t = torch.randn(10, 16), torch.randn(10, 16)
pos, slots = torch.tensor([9, 0, 4]), torch.tensor([5, 14, 2])
kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
out = fused.rope_write_kv(q, k, v, cos_t, sin_t, kc, vc, slots, positions=pos)
assert torch.equal(out, ref.apply_rope(q, cos_t[pos], sin_t[pos]))
assert torch.equal(kc.view(-1, 2, 16)[slots], ref.apply_rope(k, cos_t[pos], sin_t[pos]))
assert torch.equal(vc.view(-1, 2, 16)[slots], v)
print("ok")
'''


# ---------------------------------------------------------------------------- sm_90 compile check


@pytest.mark.skipif(os.environ.get("SPEAR_COMPILE_CHECK") != "1",
                    reason="set SPEAR_COMPILE_CHECK=1 (compiles for sm_90 in a subprocess, ~10 s)")
def test_kernels_compile_for_sm90():
    """The interpreter only runs the branches a launch takes; compile every variant for Hopper."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-4000:]


_COMPILE_SCRIPT = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from spear.kernels.fused import _rms_norm_kernel, _rope_kv_kernel, _silu_mul_kernel

def compile(fn, ptrs, consts, scalars=None, **opts):
    consts = {"PDL": 0, **consts}  # the launchers pass it (programmatic dependent launch off)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "constexpr" if name in consts else scalars[name]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 128), options=opts)

for dt in ("fp16", "bf16", "fp32"):
    p = "*" + dt
    for res, pdl in ((False, 0), (True, 0), (True, 1)):
        compile(_rms_norm_kernel, dict(x_ptr=p, r_ptr=p, w_ptr=p, sum_ptr=p, out_ptr=p),
                dict(N=4096, BLOCK=4096, HAS_RES=res, PDL=pdl), dict(eps="fp32"), num_warps=8)
    compile(_rms_norm_kernel, dict(x_ptr=p, r_ptr=p, w_ptr="*fp32", sum_ptr=p, out_ptr="*fp32"),
            dict(N=5120, BLOCK=8192, HAS_RES=True), dict(eps="fp32"), num_warps=8)
    for has_pos in (False, True):
        ptrs = {n: p for n in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "kc_ptr", "vc_ptr")}
        compile(_rope_kv_kernel, dict(ptrs, pos_ptr="*i64", slot_ptr="*i64"),
                dict(H=32, HKV=8, D=128, BH=8, BD=64, HAS_POS=has_pos, PDL=1 if has_pos else 0),
                dict(stride_q="i32", stride_k="i32", stride_v="i32"), num_warps=4, enable_fp_fusion=False)
    k = compile(_silu_mul_kernel, dict(g_ptr=p, u_ptr=p, out_ptr=p), dict(BLOCK=1024, PAIRS=False),
                dict(n="i32", cols="i32", stride_g="i32", stride_u="i32"), num_warps=4)
    for pdl, pairs in ((1, False), (0, True)):
        compile(_silu_mul_kernel, dict(g_ptr=p, u_ptr=p, out_ptr=p), dict(BLOCK=1024, PDL=pdl, PAIRS=pairs),
                dict(n="i32", cols="i32", stride_g="i32", stride_u="i32"), num_warps=4)
    if dt == "bf16":
        assert "cvt.rn.bf16.f32" in k.asm["ptx"]
print("ok")
'''
