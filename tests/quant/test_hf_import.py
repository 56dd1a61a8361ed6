"""HF GPTQ/AWQ folders written in their int32 layouts by transcriptions of the formats' own packers
(AutoGPTQ's and AutoAWQ's, not spear's unpacking read backwards), then imported bit-exactly; golden
words derived by hand from the formats' rules; and, where AutoAWQ is installed, a folder it packs."""

import json

import numpy as np
import pytest
import torch

from spear.errors import SpearError
from spear.quant import quantized_modules
from spear.quant.hf_import import convert_linear, import_hf_quantized, unpack_int32

from .conftest import make_tiny_llama


def _autogptq_pack(w, scales, zeros, group_size, bits, v1):
    """``(qweight, qzeros)`` as AutoGPTQ writes them: a transcription of ``QuantLinear.pack`` in
    auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py (v0.7.1; 2/4/8 bits). The codes are
    re-derived from the weight, ``round((W + zero·scale) / scale)``; word ``row`` of qweight packs
    input channels ``row·32/bits ..`` from the lowest bits up (packed along the *input* dim), qzeros
    packs output channels the same way, and the original format stores ``zero − 1``."""
    scales = scales.t().contiguous().float()  # (G, out)
    zeros = zeros.t().contiguous().long()
    scale_zeros = zeros * scales
    in_f = w.shape[1]
    intweight = torch.stack([torch.round((w[:, idx] + scale_zeros[idx // group_size]) / scales[idx // group_size])
                             for idx in range(in_f)]).long().numpy().astype(np.uint32)  # (in, out)
    qweight = np.zeros((in_f // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 32 // bits):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    if v1:
        zeros = zeros - 1
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 32 // bits):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))


def _autoawq_pack(w, scales, zeros, group_size):
    """``(qweight, qzeros)`` as AutoAWQ's GEMM layout writes them: a transcription of
    ``WQLinear_GEMM.from_linear`` in awq/modules/linear/gemm.py (v0.2.9; 4-bit). Codes packed along
    the *output* dim, nibble i of each word holding column ``order_map[i]`` of its block of 8."""
    scales = scales.t().contiguous().float()  # (G, out)
    zeros = zeros.t().contiguous().to(torch.int32)
    scale_zeros = zeros * scales
    in_f, out_f = w.shape[1], w.shape[0]
    intweight = torch.cat([torch.round((w[:, idx] + scale_zeros[idx // group_size]) / scales[idx // group_size]
                                       ).to(torch.int)[:, None] for idx in range(in_f)], dim=1)
    intweight = intweight.t().contiguous().to(torch.int32)  # (in, out)
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros((in_f, out_f // 32 * 4), dtype=torch.int32)
    for col in range(out_f // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
    qzeros = torch.zeros((zeros.shape[0], out_f // 32 * 4), dtype=torch.int32)
    for col in range(out_f // 8):
        for i in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + order_map[i]] << (i * 4)
    return qweight, qzeros


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def write_quantized_folder(path, method, bits=4, group_size=16, fmt="gptq", sym=False, permute_groups=False,
                           seed=0, awq_packer=None):
    """A tiny Llama saved in a HF GPTQ/AWQ layout; returns {module: (codes, scales, zeros)} in spear's layout."""
    from safetensors.torch import save_file

    model = make_tiny_llama(seed=seed)
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    expected = {}
    qmax = 2**bits - 1
    for name, lin in model.named_modules():
        if type(lin) is not torch.nn.Linear or name == "lm_head":
            continue
        out_f, in_f = lin.weight.shape
        gs = in_f if group_size == -1 else group_size
        n_g = in_f // gs
        codes = torch.randint(0, qmax + 1, (out_f, in_f), generator=g, dtype=torch.uint8)
        scales = (torch.rand(out_f, n_g, generator=g) * 0.02 + 0.001).half()
        zeros = (torch.full((out_f, n_g), 2 ** (bits - 1)) if sym
                 else torch.randint(1 if fmt == "gptq" else 0, qmax + 1, (out_f, n_g), generator=g)).to(torch.uint8)
        expected[name] = (codes, scales, zeros, 0 if group_size == -1 else gs)
        del tensors[f"{name}.weight"]
        w = ((codes.float().reshape(out_f, n_g, gs) - zeros.float().unsqueeze(-1))
             * scales.float().unsqueeze(-1)).reshape(out_f, in_f)
        if method == "gptq":
            qweight, qzeros = _autogptq_pack(w, scales, zeros, gs, bits, v1=fmt == "gptq")
            # Static groups written out of order: group labels permuted, each still a contiguous run.
            label = torch.randperm(n_g, generator=g) if permute_groups else torch.arange(n_g)
            file_scales, file_zeros = torch.empty_like(scales.T), torch.empty_like(qzeros)
            file_scales[label], file_zeros[label] = scales.T, qzeros
            tensors[f"{name}.qweight"] = qweight
            tensors[f"{name}.qzeros"] = file_zeros
            tensors[f"{name}.scales"] = file_scales.contiguous()
            tensors[f"{name}.g_idx"] = label.repeat_interleave(gs).to(torch.int32)
        else:
            qweight, qzeros = (awq_packer or _autoawq_pack)(w, scales, zeros, gs)
            tensors[f"{name}.qweight"] = qweight
            tensors[f"{name}.qzeros"] = qzeros
            tensors[f"{name}.scales"] = scales.T.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
              "desc_act": permute_groups, "static_groups": permute_groups, "checkpoint_format": fmt}
    else:
        qc = {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": fmt}
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    _tokenizer().save_pretrained(path)
    return expected


@pytest.mark.parametrize("method,fmt,bits,group_size,sym,permute", [
    ("gptq", "gptq", 4, 16, False, False),
    ("gptq", "gptq_v2", 4, 16, False, True),
    ("gptq", "gptq", 4, -1, True, False),
    ("gptq", "gptq_v2", 8, 32, False, False),
    ("gptq", "gptq", 2, 16, False, True),
    ("awq", "gemm", 4, 16, False, False),
    ("awq", "gemm", 4, 32, False, False),
])
def test_import_dequantizes_exactly(tmp_path, method, fmt, bits, group_size, sym, permute):
    """Folders packed by the transcribed AutoGPTQ / AutoAWQ packers import to the exact codes, scales
    and zeros, and dequantize exactly.

    Catches: ``unpack_int32`` reading the highest bits first (every case); v1's ``zeros + 1``
    dropped (the "gptq" cases); the static-group reorder ``scales[order], zeros[order]`` dropped
    (the permuted cases); an identity ``AWQ_ORDER`` or ``_awq_unorder`` gathering by it instead of
    scattering (the AWQ cases)."""
    expected = write_quantized_folder(tmp_path / "hf", method, bits, group_size, fmt, sym, permute)
    model, tokenizer, quant, _ = import_hf_quantized(tmp_path / "hf")
    mods = quantized_modules(model)
    assert set(mods) == set(expected) and quant.method == method and quant.bits == bits
    assert quant.symmetric == sym
    for name, (codes, scales, zeros, gs) in expected.items():
        m = mods[name]
        assert m.group_size == gs and m.symmetric == sym
        assert torch.equal(m.codes, codes) and torch.equal(m.scales, scales) and torch.equal(m.zeros, zeros)
        want = (codes.float().reshape(codes.shape[0], -1, codes.shape[1] // scales.shape[1])
                - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
        assert torch.equal(m.dequantized_weight(), want.reshape(codes.shape))
    assert tokenizer.bos_token == "t1"


def test_import_cli_writes_a_loadable_checkpoint(tmp_path):
    from spear.cli import main
    from spear.models.checkpoint import load_checkpoint

    write_quantized_folder(tmp_path / "hf", "gptq", fmt="gptq")
    assert main(["-q", "import", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]) == 0
    imported, _, _, _ = import_hf_quantized(tmp_path / "hf")
    loaded, _ = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, imported(ids).logits)
    cfg = json.loads((tmp_path / "ck" / "spear_config.json").read_text())
    assert cfg["quant"]["method"] == "gptq" and cfg["meta"]["imported_from"]["checkpoint_format"] == "gptq"


def test_scattered_g_idx_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    write_quantized_folder(tmp_path / "hf", "gptq", fmt="gptq_v2")
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[key] = (torch.arange(64) % 4).to(torch.int32)  # act-order without static groups
    save_file(tensors, str(f))
    with pytest.raises(SpearError, match="contiguous"):
        import_hf_quantized(tmp_path / "hf")


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"bits": 3}, "3-bit"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format"),
])
def test_unsupported_configs_are_refused(tmp_path, change, message):
    write_quantized_folder(tmp_path / "hf", "gptq")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"].update(change)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(SpearError, match=message):
        import_hf_quantized(tmp_path / "hf")


def test_v1_zero_overflow_and_shape_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    write_quantized_folder(tmp_path / "hf", "gptq", fmt="gptq")
    f = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.0.mlp.up_proj.qzeros"
    tensors[key] = torch.full_like(tensors[key], -1)  # every zero stored as 15 -> 16 in v1
    save_file(tensors, str(f))
    with pytest.raises(SpearError, match="wraps"):
        import_hf_quantized(tmp_path / "hf")
    tensors[key] = tensors[key][:, :1].contiguous()
    save_file(tensors, str(f))
    with pytest.raises(SpearError, match="shape"):
        import_hf_quantized(tmp_path / "hf")


def test_unpack_int32_handles_the_sign_bit():
    word = torch.tensor([[-1, 0x7654_3210]], dtype=torch.int32)
    assert unpack_int32(word, 4, 1).tolist() == [[15] * 8 + [0, 1, 2, 3, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match="int32"):
        unpack_int32(word.long(), 4, 1)


def _words(vals) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 tensors the files hold (two's complement)."""
    w = torch.tensor(vals, dtype=torch.int64)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _golden_tensors(name, qweight, qzeros, n_out):
    return {f"{name}.qweight": _words(qweight), f"{name}.qzeros": _words(qzeros),
            f"{name}.scales": torch.full((1, n_out), 0.5, dtype=torch.float16)}


def test_golden_gptq_words():
    """One 8 -> 8 4-bit GPTQ linear, words written by hand from the format's rule (qweight
    (in/8, out): word of output o packs inputs 0..7 from the lowest nibble up; qzeros (G, out/8)
    packs outputs likewise; v1 stores zero − 1, v2 the zero): code[o, i] = (i + o) mod 8, zero[o] = o + 1.

    Catches: v1's ``zeros = zeros + 1`` dropped in ``convert_linear``; ``unpack_int32`` reading the
    highest bits first (``shifts = torch.arange(32 - bits, -1, -bits)``)."""
    qweight = [[0x76543210, 0x07654321, 0x10765432, 0x21076543, 0x32107654, 0x43210765, 0x54321076, 0x65432107]]
    codes = torch.tensor([[(i + o) % 8 for i in range(8)] for o in range(8)], dtype=torch.uint8)
    zeros = torch.arange(1, 9, dtype=torch.uint8).reshape(8, 1)
    for fmt, qzeros in (("gptq", [[0x76543210]]), ("gptq_v2", [[0x87654321]])):
        qc = {"quant_method": "gptq", "bits": 4, "group_size": 8, "checkpoint_format": fmt}
        c, s, z, gs = convert_linear(_golden_tensors("l", qweight, qzeros, 8), "l", qc, 8, 8)
        assert torch.equal(c, codes) and torch.equal(z, zeros) and gs == 8, fmt
        assert torch.equal(s, torch.full((8, 1), 0.5, dtype=torch.float16))


def test_golden_awq_words():
    """One 8 -> 8 AWQ GEMM linear by hand (qweight (in, out/8): nibble j of a word holds column
    [0, 2, 4, 6, 1, 3, 5, 7][j] of its block of 8; qzeros (G, out/8) likewise): code[o, i] = o for
    every input, zero[o] = 7 − o. Nibbles 7..0 then read 7,5,3,1,6,4,2,0 and 0,2,4,6,1,3,5,7.

    Catches: a wrong AWQ order map (``AWQ_ORDER = (0, 1, ..., 7)``), or ``_awq_unorder`` applying
    the map as a gather (``out = blocks[..., AWQ_ORDER]``) instead of its inverse."""
    qweight = [[0x75316420]] * 8
    qc = {"quant_method": "awq", "bits": 4, "group_size": 8}
    c, _, z, _ = convert_linear(_golden_tensors("l", qweight, [[0x02461357]], 8), "l", qc, 8, 8)
    assert torch.equal(c, torch.arange(8, dtype=torch.uint8).reshape(8, 1).expand(8, 8))
    assert torch.equal(z, (7 - torch.arange(8, dtype=torch.uint8)).reshape(8, 1))


@pytest.mark.parametrize("layout", ["no checkpoint_format", "quantize_config.json"])
def test_older_gptq_folders_are_v1(tmp_path, layout):
    """GPTQ folders from before ``checkpoint_format`` existed (no key; or AutoGPTQ's separate
    quantize_config.json and no quantization_config in config.json) are the original format, v1,
    whose qzeros hold zero − 1.

    Catches: ``read_quant_config`` defaulting ``checkpoint_format`` to "gptq_v2", or dropping the
    quantize_config.json fallback: the old tests always wrote the key into config.json."""
    expected = write_quantized_folder(tmp_path / "hf", "gptq", fmt="gptq")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg.pop("quantization_config")
    del qc["checkpoint_format"]
    if layout == "no checkpoint_format":
        cfg["quantization_config"] = qc
    else:
        del qc["quant_method"]
        (tmp_path / "hf" / "quantize_config.json").write_text(json.dumps(qc))
    cfg_path.write_text(json.dumps(cfg))
    model, _, quant, _ = import_hf_quantized(tmp_path / "hf")
    mods = quantized_modules(model)
    assert quant.method == "gptq" and set(mods) == set(expected)
    for name, (codes, scales, zeros, _) in expected.items():
        assert torch.equal(mods[name].codes, codes) and torch.equal(mods[name].zeros, zeros), name


def test_awq_folder_packed_by_autoawq(tmp_path):
    """AutoAWQ itself (when installed; it is not a dependency) packs every linear of the folder."""
    gemm = pytest.importorskip("awq.modules.linear.gemm", reason="AutoAWQ (pip install autoawq) packs the fixture")

    def packer(w, scales, zeros, group_size):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        q = gemm.WQLinear_GEMM.from_linear(lin, 4, group_size, scales=scales.t().contiguous(),
                                           zeros=zeros.t().contiguous().float())
        return q.qweight, q.qzeros

    expected = write_quantized_folder(tmp_path / "hf", "awq", group_size=32, fmt="gemm", awq_packer=packer)
    mods = quantized_modules(import_hf_quantized(tmp_path / "hf")[0])
    for name, (codes, scales, zeros, _) in expected.items():
        m = mods[name]
        assert torch.equal(m.codes, codes) and torch.equal(m.scales, scales) and torch.equal(m.zeros, zeros), name
