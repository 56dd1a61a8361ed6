"""Import Hugging Face GPTQ / AWQ checkpoints into spear's quantized-linear form.

Both store, per quantized linear ``<module>.``, int32 words that each pack
``32 / bits`` codes from the lowest bits up, plus fp16 ``scales``:

GPTQ (AutoGPTQ / GPTQModel / optimum, ``quant_method: "gptq"``)
    qweight (in·bits/32, out)   codes packed along the *input* dim
    qzeros  (G, out·bits/32)    zero points packed along the output dim; the
                                original format (``checkpoint_format`` "gptq", v1)
                                stores ``zero − 1``, "gptq_v2" stores the zero
    scales  (G, out) fp16;  g_idx (in,) int32, the group of each input channel
    w[o, i] = scales[g_idx[i], o] · (code[i, o] − zero[g_idx[i], o])
AWQ (AutoAWQ GEMM, ``quant_method: "awq"``, ``version: "gemm"``)
    qweight (in, out·bits/32), qzeros (G, out·bits/32), scales (G, out): codes
    packed along the *output* dim with the 8 nibbles of a word holding columns
    [0, 2, 4, 6, 1, 3, 5, 7] of its block of 8; groups are consecutive inputs.

spear's layout needs each group to be a contiguous run of input columns. A
``g_idx`` that only relabels such runs (static groups) is reordered; one that
scatters channels across groups (act-order without static groups) cannot be
represented exactly and is refused. Dequantized weights are bit-exact.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from spear.config import QuantConfig
from spear.errors import SpearError
from spear.fileio import read_json
from spear.models.modules import set_module
from spear.quant.linear import QuantLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack int32 words into ``32 // bits`` codes each (lowest bits first) along ``dim``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {packed.dtype}")
    if 32 % bits:
        raise ValueError(f"{bits}-bit codes do not tile a 32-bit word")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    # Arithmetic shift of a negative word fills with ones above; the mask drops them.
    vals = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (..., per) along a new last dim
    vals = vals.movedim(dim, -2)
    vals = vals.reshape(*vals.shape[:-2], vals.shape[-2] * per)
    return vals.movedim(-1, dim).to(torch.uint8)


def _awq_unorder(vals: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's nibble interleave along the last dim (blocks of 8 columns)."""
    *lead, n = vals.shape
    blocks = vals.reshape(*lead, n // 8, 8)
    out = torch.empty_like(blocks)
    out[..., list(AWQ_ORDER)] = blocks
    return out.reshape(*lead, n)


def read_quant_config(folder: Path) -> dict:
    """The ``quantization_config`` of config.json, else an older ``quantize_config.json``."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SpearError(f"{folder} has no config.json; expected a Hugging Face model folder")
    config = read_json(cfg_path)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None and (folder / "quantize_config.json").is_file():
        older = read_json(folder / "quantize_config.json")
        if not isinstance(older, dict):
            raise SpearError(f"{folder / 'quantize_config.json'}: expected a JSON object, got {type(older).__name__}")
        qc = {"quant_method": "gptq", **older}
    if not isinstance(qc, dict):
        raise SpearError(f"{folder}/config.json has no quantization_config: not a GPTQ/AWQ checkpoint")
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise SpearError(f"quant_method {qc.get('quant_method')!r} in {folder} is not importable; spear imports gptq and awq")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in (2, 4, 8):
        raise SpearError(f"{method} checkpoint with {bits}-bit codes: spear imports 2, 4 and 8 bits "
                         "(3-bit words straddle int32 boundaries)")
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise SpearError(f"GPTQ checkpoint_format {fmt!r} is not importable; expected 'gptq' or 'gptq_v2'")
        qc["checkpoint_format"] = fmt
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise SpearError(f"AWQ version {version!r} is not importable; spear reads the GEMM layout")
        if bits != 4:
            raise SpearError(f"AWQ GEMM checkpoints are 4-bit; got bits={bits}")
    qc["bits"] = bits
    qc["group_size"] = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return qc


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        try:
            files = sorted(set(data["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise SpearError(f"{index} is not a valid safetensors index: no weight_map of file names ({exc})") from None
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise SpearError(f"{folder} has no model.safetensors (or index); only safetensors checkpoints are imported")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(folder / f)))
    return out


def _contiguous_groups(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """For each contiguous run of ``group_size`` inputs, the stored group it uses; refuses scattered groups."""
    runs = g_idx.long().reshape(-1, group_size)
    first = runs[:, 0]
    if not (runs == first.unsqueeze(1)).all() or sorted(first.tolist()) != list(range(runs.shape[0])):
        raise SpearError(f"{name}.g_idx assigns input channels to groups out of contiguous runs of {group_size} "
                         "(act-order without static groups); spear's layout needs contiguous groups, so this "
                         "checkpoint cannot be imported exactly — re-quantize with static_groups=True or desc_act=False")
    return first


def convert_linear(tensors: dict[str, torch.Tensor], name: str, qc: dict, in_f: int, out_f: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(codes (out, in), scales fp16 (out, G), zeros (out, G), group_size)`` of one packed linear."""
    bits, method = qc["bits"], qc["quant_method"].lower()
    gs = qc["group_size"] if 0 < qc["group_size"] < in_f else in_f
    if in_f % gs:
        raise SpearError(f"{name}: group_size {gs} does not divide in_features={in_f}")
    g = in_f // gs
    per = 32 // bits
    want = ({"qweight": (in_f // per, out_f)} if method == "gptq" else {"qweight": (in_f, out_f // per)})
    want.update(qzeros=(g, out_f // per), scales=(g, out_f))
    for key, shape in want.items():
        t = tensors.get(f"{name}.{key}")
        if t is None:
            raise SpearError(f"checkpoint lacks {name}.{key}")
        if tuple(t.shape) != shape:
            raise SpearError(f"{name}.{key}: shape {tuple(t.shape)}, expected {shape} for a {in_f}->{out_f} "
                             f"{bits}-bit linear with group size {gs}")
    qweight, qzeros = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"]
    scales = tensors[f"{name}.scales"].to(torch.float16)
    if method == "gptq":
        codes = unpack_int32(qweight, bits, 0).T  # (out, in)
        zeros = unpack_int32(qzeros, bits, 1).long()  # (G, out)
        if qc["checkpoint_format"] == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1
            if int(zeros.max()) > 2**bits - 1:
                raise SpearError(f"{name}.qzeros: a v1 zero point wraps to {int(zeros.max())} (stored as -1); "
                                 f"not representable with {bits}-bit zero points")
        g_idx = tensors.get(f"{name}.g_idx")
        if g_idx is not None and g > 1:
            if tuple(g_idx.shape) != (in_f,):
                raise SpearError(f"{name}.g_idx: shape {tuple(g_idx.shape)}, expected ({in_f},)")
            order = _contiguous_groups(g_idx, gs, name)
            scales, zeros = scales[order], zeros[order]
    else:
        codes = _awq_unorder(unpack_int32(qweight, bits, 1)).T
        zeros = _awq_unorder(unpack_int32(qzeros, bits, 1)).long()
    return codes.contiguous(), scales.T.contiguous(), zeros.T.to(torch.uint8).contiguous(), gs


@torch.no_grad()
def import_hf_quantized(folder: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a HF GPTQ/AWQ folder as ``(model, tokenizer, QuantConfig, quantization_config)``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder).expanduser()
    qc = read_quant_config(folder)
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # build the plain architecture; quantized layers are swapped in below
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _load_tensors(folder)
    names = sorted({k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")})
    if not names:
        raise SpearError(f"{folder} holds no '<module>.qweight' tensors: not a packed GPTQ/AWQ checkpoint")
    symmetric, group_sizes = [], set()
    for name in names:
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            raise SpearError(f"packed module {name} does not exist in the {config.model_type} architecture") from None
        if not isinstance(lin, nn.Linear):
            raise SpearError(f"packed module {name} is a {type(lin).__name__} in the architecture, not a Linear")
        codes, scales, zeros, gs = convert_linear(tensors, name, qc, lin.in_features, lin.out_features)
        sym = bool((zeros == 2 ** (qc["bits"] - 1)).all())
        q = QuantLinear(lin.in_features, lin.out_features, qc["bits"], 0 if gs == lin.in_features else gs, sym,
                        bias=f"{name}.bias" in tensors, dtype=dtype)
        q.set_quantized(codes, scales, zeros)
        if q.bias is not None:
            q.bias.data.copy_(tensors[f"{name}.bias"].to(dtype))
        set_module(model, name, q)
        symmetric.append(sym)
        group_sizes.add(q.group_size)
        for key in ("qweight", "qzeros", "scales", "g_idx", "bias"):
            tensors.pop(f"{name}.{key}", None)
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise SpearError(f"checkpoint tensor {unexpected[0]} has no place in the {config.model_type} architecture")
    model.tie_weights()
    for pname, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            raise SpearError(f"checkpoint {folder} leaves tensor {pname} unset")
    model.eval()
    # The summary config; each module records its own group size (per-channel where a group spans all inputs).
    quant = QuantConfig(bits=qc["bits"], group_size=next(iter(group_sizes)) if len(group_sizes) == 1 else 0,
                        symmetric=all(symmetric), method=qc["quant_method"].lower())
    return model, AutoTokenizer.from_pretrained(folder), quant, qc
