"""The engine's model of the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2.

Built from the transformers config alone (no transformers module runs in the engine); its
weights come from a checkpoint through ``build_model`` (spear/serve/model/loader.py reads them):

    embed_tokens -> [ RMSNorm -> qkv_proj -> PagedAttention (rotary, cache) -> o_proj
                      -> (+ residual) RMSNorm -> gate_up_proj -> SiLU·mul -> down_proj ] x L
                 -> RMSNorm -> lm_head

q/k/v and gate/up are one ``Linear`` each, built merged at load from the checkpoint's separate
linears and their compensators (spear/serve/model/layers/linear.py); each residual add runs inside
the RMSNorm after it. Numerics follow transformers' Llama modules so that greedy output equals
``generate`` token for token.

Under tensor parallelism (``tp``: this rank among ``tp.size``; spear/parallel) each rank holds
its share of the attention heads and the MLP: q/k/v and gate/up column-parallel, o and down
row-parallel (their partial outputs summed by the rank's collectives, ``set_comm``), the output
head split along the vocabulary and gathered (replicated when the vocabulary does not split
evenly); embeddings and norms are replicated. The KV cache of a rank holds its kv heads.
"""

from __future__ import annotations

import torch
from torch import nn

from spear.errors import SpearError
from spear.parallel import split_of
from spear.parallel.shard import TPRank, check_splits
from spear.serve.model.layers.attention import AttentionMetadata, PagedAttention
from spear.serve.model.layers.linear import Context, Linear, MemberWeights, parallel_linear
from spear.serve.model.layers.norm import RMSNorm

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def check_supported(config) -> None:
    """Refuse a config this model cannot run, in one line."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        raise SpearError(f"the serving engine runs Llama-family models ({', '.join(SUPPORTED_TYPES)}); "
                         f"this model's type is {kind!r}")
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SpearError(f"the serving engine's Llama MLP is SiLU-gated; this model's hidden_act is {act!r}")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int, tp: TPRank = TPRank()):
        super().__init__()
        d, hd = config.hidden_size, head_dim(config)
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        prefix = f"model.layers.{index}"
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.q_size, self.kv_size = nh * hd // tp.size, nkv * hd // tp.size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)

        def linear(k, outs, names, **kw):
            return parallel_linear(split_of(names[0]), tp, k, outs, [f"{prefix}.{n}" for n in names], **kw)

        self.qkv_proj = linear(d, [nh * hd, nkv * hd, nkv * hd], [f"self_attn.{n}_proj" for n in "qkv"],
                               bias=qkv_bias)
        self.attn = PagedAttention(nh // tp.size, nkv // tp.size, hd)
        self.o_proj = linear(nh * hd, [d], ["self_attn.o_proj"], bias=bool(getattr(config, "attention_bias", False)))
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.gate_up_proj = linear(d, [config.intermediate_size] * 2, ["mlp.gate_proj", "mlp.up_proj"], bias=mlp_bias,
                                   interleave=True)
        self.down_proj = linear(config.intermediate_size, [d], ["mlp.down_proj"], bias=mlp_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, k_cache, v_cache, meta: AttentionMetadata,
                ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) in, (h, residual) out: the next norm adds ``h`` to ``residual``."""
        if residual is None:
            x, residual = self.input_layernorm(h, ctx), h
        else:
            x, residual = self.input_layernorm(h, ctx, residual)
        q, k, v = self.qkv_proj(x, ctx).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        h = self.o_proj(self.attn(q, k, v, k_cache, v_cache, meta, ctx), ctx)
        x, residual = self.post_attention_layernorm(h, ctx, residual)
        act = self.gate_up_proj.silu_mul(x, ctx)  # SiLU·mul in the W4 GEMM's epilogue where it runs there
        if act is None:
            gate, up = self.gate_up_proj(x, ctx).chunk(2, dim=-1)
            if gate.is_cuda:
                from spear.kernels import fused

                act = fused.silu_mul(gate, up, pdl=ctx.pdl)
            else:
                act = nn.functional.silu(gate) * up
        return self.down_proj(act, ctx), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, tp: TPRank = TPRank()):
        super().__init__()
        check_supported(config)
        check_splits(config, tp)
        self.config, self.tp = config, tp
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the vocabulary split across ranks and gathered, where it splits evenly; else every rank holds it
        vocab_split = config.vocab_size % tp.size == 0
        self.lm_head = parallel_linear("column", tp if vocab_split else TPRank(), config.hidden_size,
                                       [config.vocab_size], ["lm_head"], gather=True)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.comm = None

    def set_comm(self, comm) -> None:
        """Hand the rank's collectives (spear.parallel.comm) to every layer that splits."""
        self.comm = comm
        for lin, _ in self.linears().values():
            lin.set_comm(comm)

    def linears(self) -> dict[str, tuple[Linear, int]]:
        """Checkpoint module name -> (the layer holding it, its member index)."""
        out = {}
        for layer in list(self.layers) + [self]:
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) if layer is not self \
                    else (self.lm_head,):
                for i, name in enumerate(lin.names):
                    out[name] = (lin, i)
        return out

    def plain_parameters(self) -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> the parameter it fills (embeddings and norms)."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            out[f"model.layers.{i}.input_layernorm.weight"] = layer.input_layernorm.weight
            out[f"model.layers.{i}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return out

    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, ctx: Context, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the tokens ``rows`` selects (every token when None)."""
        if self.comm is not None:
            self.comm.begin_step()
        h = self.embed_tokens(input_ids)
        residual = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, kc, vc, meta, ctx)
        if rows is not None:
            h, residual = h[rows], residual[rows]
        x, _ = self.norm(h, ctx, residual)
        return self.lm_head(x, ctx).float()


def build_model(config, quantized: dict[str, MemberWeights], tensors: dict[str, torch.Tensor], device, dtype,
                max_rank: int, kernels: bool | None = None, tp: TPRank = TPRank(),
                ) -> tuple[LlamaForCausalLM, list[tuple[str, str]]]:
    """The model with every weight in place on ``device``. ``quantized``: the checkpoint's quantized
    linears by module name (with their compensators); ``tensors``: every other tensor by name (dense
    linears as ``<module>.weight`` / ``.bias``). Returns (model, load report: (layer, why it runs
    dense) for each quantized layer off the kernel path on CUDA). Every tensor the model needs must
    be given and every one given must be used, else a SpearError names it. ``kernels``: see
    ``Linear.finalize`` (True packs for the kernels off CUDA too, where the ops run their references).
    ``tp``: build this tensor-parallel rank's share (each linear cuts its tensors as it loads them)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    model.to_empty(device="cpu")
    linears = model.linears()
    tensors = dict(tensors)
    unknown = sorted(set(quantized) - set(linears))
    if unknown:
        raise SpearError(f"checkpoint module {unknown[0]} has no place in the {config.model_type} model"
                         + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    for name, (lin, member) in linears.items():
        w = quantized.get(name)
        if w is None:
            weight = tensors.pop(f"{name}.weight", None)
            if weight is None and name == "lm_head" and model.tied:
                weight = tensors.get("model.embed_tokens.weight")
            if weight is None:
                raise SpearError(f"the checkpoint lacks tensor {name}.weight")
            w = MemberWeights(name, weight=weight, bias=tensors.pop(f"{name}.bias", None))
        if w.bias is not None and not lin.has_bias:
            raise SpearError(f"{name}: the checkpoint has a bias the model's config does not")
        lin.load(member, w)
    plain = model.plain_parameters()
    missing = sorted(set(plain) - set(tensors))
    if missing:
        raise SpearError(f"the checkpoint lacks tensor {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                         if len(missing) > 1 else ""))
    unknown = sorted(set(tensors) - set(plain))
    if unknown:
        raise SpearError(f"checkpoint tensor {unknown[0]} has no place in the {config.model_type} model"
                         + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    with torch.no_grad():
        for name, p in plain.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise SpearError(f"checkpoint tensor {name}: shape {tuple(t.shape)}, the config expects "
                                 f"{tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
    model.to(device=device, dtype=dtype)
    report = []
    seen = set()
    for lin, _ in linears.values():
        if id(lin) in seen:
            continue
        seen.add(id(lin))
        lin.finalize(torch.device(device), dtype, max_rank, kernels)
        if lin.reason is not None:
            report.append((", ".join(lin.names), lin.reason))
    return model.eval(), report
