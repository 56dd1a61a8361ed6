"""The kernels of W4A16 layers with error compensators and of the serving engine's steps (Triton and,
on Hopper, Gluon), their registered ops, launch tables and policy. One line a module:

layout.py          packed W4 layouts (the fragment layout; N-major for the shapes it refuses), ``pack()``
reference.py       plain-torch references of every kernel (the contract)
policy.py          KernelPolicy: every threshold, launch table and switch, frozen; the op's integers
launch.py          the launch table (one family per kernel, declared once) and TritonConfig / GluonConfig
planner.py         ``plan()``: which kernel, launch and compensator form a W4 call takes on a device
ops.py             ``spear::w4a16_ec`` (torch.library.custom_op): runs what the plan names
w4a16.py           the Triton W4 GEMM: split-K, the fused compensator, the epilogue
_fragment.py       its main loop over the fragment layout, and that layout's dequantize kernel
_nmajor.py         its main loops over the N-major layout (tensor-core tiles, the one-token loop)
_ec_programs.py    its fused compensator's programs (u = A x, the gate, alpha B v)
_epilogue.py       its tile's end: the split-K sum, bias, SiLU·mul, the store
_common.py         Triton building blocks the kernels share (unpacking, the gate, PDL, spin-waits)
gluon_w4.py        the warp-specialized Gluon W4 GEMM for Hopper (producer warp, two consumer warpgroups)
gluon_fragment.py  its Gluon pieces on the fragment layout's values (conversion, scales, EC wgmma)
dequant.py         W4 -> fp16/bf16 for the dequantize + cuBLAS path of large token counts
ec.py              the compensator's kernels of the semi-fused path (ec_gate, ec_up)
w8a16.py           W8 GEMM (int8 per-channel weights) for an 8-bit output head, ``spear::w8a16``
fused.py           RMSNorm (+ residual), rotary + KV write, SiLU·mul
_rotary.py         rotary device functions shared by fused.rope_write_kv and the decode attention kernel
attention.py       paged decode attention over the serving engine's block tables
paged_prefill.py   paged attention of mixed steps (prefill chunks and decodes)
tp_reduce.py       the row-parallel sum of tensor-parallel ranks with the compensator's second half
timing.py          the timing protocol of sweeps and benchmarks (CUDA graphs, weight copies)
tune.py            ``spear tune-kernels``: the fragment GEMM's launches measured on the GPU at hand
tune_gluon.py      the same for the Gluon GEMM
precompile.py      a W4 layer's launches compiled into Triton's cache by parallel processes (an engine's start)

Nothing here imports the serving engine. Importing a kernel module decorates its Triton kernels,
so this package imports none of them itself: ``from spear.kernels.ops import w4a16_linear``.
"""
