"""Triton kernels for W4A16 layers with error compensators, and the registered op.

layout.py     packed weight / compensator layouts and ``pack()`` (N-major, or K-major with kmajor=True)
reference.py  plain-torch references (the contract)
w4a16.py      W4 GEMM: split-K, fused compensator epilogue
_kmajor.py    its CUDA-core decode loop for the K-major layout
dequant.py    W4 -> fp16/bf16 for the dequantize + cuBLAS prefill path
ec.py         compensator kernels of the semi-fused prefill path
ops.py        ``spear::w4a16_ec`` (torch.library.triton_op) and the dispatch by token count
fused.py      RMSNorm (+ residual), rotary + KV write, SiLU·mul for the CUDA decode layer
attention.py  paged decode attention over the serving engine's block tables
w8a16.py      W8 GEMM (int8 per-channel weights) for an 8-bit output head, ``spear::w8a16``
"""

from spear.kernels.layout import PackedEC, PackedW4, pack, pack_ec, unpack
from spear.kernels.ops import w4a16_linear
from spear.kernels.w8a16 import pack_w8, w8a16_linear

__all__ = ["PackedEC", "PackedW4", "pack", "pack_ec", "pack_w8", "unpack", "w4a16_linear", "w8a16_linear"]
