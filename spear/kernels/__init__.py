"""Triton kernels for W4A16 layers with error compensators, the registered ops, and their policy.

policy.py         KernelPolicy: every threshold, launch table and switch, frozen; ``plan`` (the path)
launch.py         the W4 GEMM's launch ``Config`` and the built-in launch table
layout.py         packed weight / compensator layouts and ``pack()`` (N-major, or K-major)
reference.py      plain-torch references of every kernel (the contract)
w4a16.py          W4 GEMM: split-K, fused compensator epilogue (_kmajor.py, _nmajor.py, _frag_fma.py: its
                  decode loops; _mma.py: the fragment layout's tensor-core loop)
dequant.py        W4 -> fp16/bf16 for the dequantize + cuBLAS prefill path
ec.py             compensator kernels of the semi-fused prefill path
ops.py            ``spear::w4a16_ec`` (torch.library.custom_op), dispatched by the policy
fused.py          RMSNorm (+ residual), rotary + KV write, SiLU·mul
attention.py      paged decode attention over the serving engine's block tables
w8a16.py          W8 GEMM (int8 per-channel weights) for an 8-bit output head, ``spear::w8a16``
tune.py, timing.py  launch sweeps and timing on the GPU at hand

Nothing here imports the serving engine. Importing a kernel module decorates its Triton kernels,
so this package imports none of them itself: ``from spear.kernels.ops import w4a16_linear``.
"""
