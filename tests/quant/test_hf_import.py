"""HF GPTQ/AWQ folders written here in their int32 layouts, then imported bit-exactly."""

import json

import pytest
import torch

from spear.errors import SpearError
from spear.quant import quantized_modules
from spear.quant.hf_import import import_hf_quantized, unpack_int32

from .conftest import make_tiny_llama

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (held in int64) reinterpreted as int32, as the files store them."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along dim 0: word i holds rows i*per .. i*per+per-1, lowest bits first."""
    per = 32 // bits
    v = vals.long().reshape(vals.shape[0] // per, per, *vals.shape[1:])
    words = sum(v[:, j] << (bits * j) for j in range(per))
    return _to_int32(words)


def _pack_cols(vals: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    per = 32 // bits
    v = vals.long().reshape(vals.shape[0], vals.shape[1] // per, per)
    if order is not None:
        v = v[..., order]  # nibble j holds column order[j] of its block
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return _to_int32(words)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def write_quantized_folder(path, method, bits=4, group_size=16, fmt="gptq", sym=False, permute_groups=False,
                           seed=0):
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
        if method == "gptq":
            stored_z = zeros.long() - (1 if fmt == "gptq" else 0)
            # Static groups written out of order: group labels permuted, each still a contiguous run.
            label = torch.randperm(n_g, generator=g) if permute_groups else torch.arange(n_g)
            file_scales = torch.empty_like(scales.T)
            file_zeros = torch.empty_like(stored_z.T)
            file_scales[label] = scales.T
            file_zeros[label] = stored_z.T
            tensors[f"{name}.qweight"] = _pack_rows(codes.T, bits)
            tensors[f"{name}.qzeros"] = _pack_cols(file_zeros, bits)
            tensors[f"{name}.scales"] = file_scales.contiguous()
            tensors[f"{name}.g_idx"] = label.repeat_interleave(gs).to(torch.int32)
        else:
            tensors[f"{name}.qweight"] = _pack_cols(codes.T.contiguous(), bits, AWQ_ORDER)
            tensors[f"{name}.qzeros"] = _pack_cols(zeros.T.contiguous(), bits, AWQ_ORDER)
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
