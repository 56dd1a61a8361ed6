"""The engine's layers: linears that own their packed weights and compensators, RMSNorm, rotary,
paged attention. Each forward takes a ``Context`` (the kernel policy, this step's PDL level).

linear.py        Linear (and its column- / row-parallel forms): merged members (q/k/v, gate/up), one quant method
quant_method.py  the W4 / W8 / dense methods a linear holds (vLLM's plugin holds them too), the one EC merge
norm.py          RMSNorm with the residual add fused in
rotary.py        the rotary tables of a config
attention.py     PagedAttention: rotary, the cache write, decode / prefill attention over the paged cache
"""
