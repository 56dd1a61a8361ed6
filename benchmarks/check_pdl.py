"""Programmatic dependent launch: does the engine still produce the reference's tokens?

    python benchmarks/check_pdl.py wait trigger          # EngineConfig.pdl modes, in order
    python benchmarks/check_pdl.py trigger --only w4a16.py,_launch_norm   # PDL for these launchers only

The tiny Llama of tests/serve/test_gpu.py, W4 g128 RTN, fp16 on the Triton kernels with CUDA
graphs, 24 greedy tokens for its four prompts. Every engine token is scored against the fp32
model teacher-forced on the engine's own prefix; a token whose reference logit falls more than
0.05 below the reference's best is printed as (index, gap). Needs a CUDA GPU (Hopper).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spear.config import QuantConfig  # noqa: E402
from spear.kernels import _common  # noqa: E402
from spear.quant import quantize_model_rtn  # noqa: E402
from tests.serve import test_gpu as engine_case  # noqa: E402


def bad_tokens(ref, base, graphs=True, pdl="off"):
    eng = engine_case._engine(copy.deepcopy(base), graphs=graphs, pdl=pdl)
    outs = [o.output_token_ids for o in eng.generate(engine_case.PROMPTS, engine_case.GREEDY)]
    res = []
    for prompt, got in zip(engine_case.PROMPTS, outs):
        gap = engine_case.logit_gaps(ref, prompt, got)
        res.append([(i, round(float(v), 3)) for i, v in enumerate(gap.tolist()) if v > 0.05])
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="+", choices=sorted(_common.PDL_MODES), help="set_pdl levels to check, in order")
    p.add_argument("--only", help="comma-separated kernel files or launcher functions launched with PDL "
                                  "(e.g. w4a16.py,_launch_norm,rope_write_kv); default: every decode kernel")
    p.add_argument("--no-graphs", action="store_true", help="eager decode instead of CUDA graphs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = engine_case._model(1)
    quantize_model_rtn(model, QuantConfig(bits=4, group_size=128), progress=False)
    ref = copy.deepcopy(model).cuda()
    base = copy.deepcopy(model).cuda().half()
    if args.only:
        only = set(args.only.split(","))
        full = _common.pdl

        def pdl():  # the launcher decides (each launcher calls _common.pdl() itself)
            caller = inspect.stack()[1]
            return full() if {os.path.basename(caller.filename), caller.function} & only else dict(PDL=0)

        _common.pdl = pdl
    for mode in args.modes:  # the engine sets the mode (EngineConfig.pdl)
        print(f"{mode} graphs={not args.no_graphs} only={args.only or 'all'}:",
              bad_tokens(ref, base, graphs=not args.no_graphs, pdl=mode), flush=True)
    _common.set_pdl("off")
    return 0


if __name__ == "__main__":
    sys.exit(main())
