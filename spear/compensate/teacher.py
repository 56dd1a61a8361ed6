"""The FP model's next-token distributions on its own samples: the calibration's teacher.

Two forms. The full distribution, fp16 log-probabilities ``(n, L, vocab)``, from one forward pass
over the sequences (:func:`teacher_logprobs`). Or :class:`TopKTeacher`, the k most likely tokens
per position and the probability left over (6k + 4 bytes a position instead of 2 x vocab), which is
what many self-samples or a large vocabulary can afford. The top-k form comes out of the sampling
pass itself (:func:`sample_with_teacher`): the logits the model computes to draw each token are the
teacher at that position, so no second pass over the sequences is needed. It is cached on disk
beside the self-samples (same key, plus k), so later runs with the same model and sampling
settings (other seeds of the EC initialisation, other plans, other training settings) load it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from spear.config import SampleConfig
from spear.data.selfsample import _cache_path, cached_samples, sample_sequences


@dataclass
class TopKTeacher:
    """A sparse teacher: the k most likely tokens per position and the probability left over.

    ``logp`` (n, L, k) fp16 log-probabilities of those tokens, ``idx`` (n, L, k) int32 their
    ids, ``tail`` (n, L) fp32 log of the remaining mass. The loss against it is the KL between
    the teacher and the student both coarsened to k + 1 outcomes (the k tokens and "any
    other"): exact for the tokens that carry the teacher's mass, a lower bound of the full KL.
    Indexing (rows) and ``.to(device)`` behave like a tensor's.
    """

    logp: torch.Tensor
    idx: torch.Tensor
    tail: torch.Tensor

    def __getitem__(self, rows) -> "TopKTeacher":
        return TopKTeacher(self.logp[rows], self.idx[rows], self.tail[rows])

    def to(self, device) -> "TopKTeacher":
        return TopKTeacher(self.logp.to(device), self.idx.to(device), self.tail.to(device))

    @property
    def shape(self) -> torch.Size:
        return self.logp.shape

    def __len__(self) -> int:
        return self.logp.shape[0]

    @classmethod
    def cat(cls, parts: list["TopKTeacher"], dim: int = 0) -> "TopKTeacher":
        return cls(*(torch.cat([getattr(t, f) for t in parts], dim) for f in ("logp", "idx", "tail")))


def top_k_of(logits: torch.Tensor, k: int) -> TopKTeacher:
    """The top-``k`` form of the distributions ``softmax(logits)`` (..., vocab), on the CPU."""
    lp = F.log_softmax(logits.float(), dim=-1)
    top, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
    # log(1 - sum p_top), computed without cancellation from the log-probabilities
    tail = torch.log1p(-top.exp().sum(-1).clamp(max=1.0 - 1e-7))
    return TopKTeacher(top.to(torch.float16).cpu(), idx.to(torch.int32).cpu(), tail.cpu())


@torch.no_grad()
def teacher_logprobs(model: nn.Module, ids: torch.Tensor, batch_size: int = 8, progress: bool = True,
                     top_k: int = 0) -> torch.Tensor | TopKTeacher:
    """FP log-probabilities (n, L, vocab) in fp16, computed batch by batch; with ``top_k`` a
    :class:`TopKTeacher` instead."""
    device = next(model.parameters()).device
    out = []
    for i in tqdm(range(0, ids.shape[0], batch_size), desc="teacher logits", unit="batch", disable=not progress,
                  leave=False):
        logits = model(input_ids=ids[i:i + batch_size].to(device), use_cache=False).logits
        out.append(top_k_of(logits, top_k) if top_k else F.log_softmax(logits.float(), dim=-1).to(torch.float16).cpu())
    return TopKTeacher.cat(out) if top_k else torch.cat(out)


def _teacher_path(model: nn.Module, cfg: SampleConfig, top_k: int) -> Path:
    return _cache_path(model, cfg).parent.parent / "teacher" / f"{_cache_path(model, cfg).stem}-k{top_k}.safetensors"


def _save(path: Path, ids: torch.Tensor, teacher: TopKTeacher) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        save_file({"ids": ids.contiguous(), "logp": teacher.logp.contiguous(), "idx": teacher.idx.contiguous(),
                   "tail": teacher.tail.contiguous()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sample_with_teacher(model: nn.Module, tokenizer, cfg: SampleConfig, top_k: int, progress: bool = True,
                        cache: bool = True) -> tuple[torch.Tensor, TopKTeacher]:
    """``(ids, teacher)``: ``cfg``'s self-samples of ``model`` (the same sequences as
    :func:`spear.data.selfsample.sample_sequences`) and the top-``top_k`` teacher at every position.

    From the cache when both were kept; from a forward pass when only the sequences were (then
    kept); else from the sampling pass itself, which keeps both."""
    from safetensors.torch import load_file

    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    path = _teacher_path(model, cfg, top_k) if cache else None
    if path is not None and path.is_file():
        t = load_file(str(path))
        return t["ids"], TopKTeacher(t["logp"], t["idx"], t["tail"])
    ids = cached_samples(model, cfg) if cache else None
    if ids is not None:
        teacher = teacher_logprobs(model, ids, progress=progress, top_k=top_k)
    else:
        parts: dict[int, list[TopKTeacher]] = {}

        def record(start: int, logits: torch.Tensor) -> None:
            parts.setdefault(start, []).append(top_k_of(logits[:, None], top_k))

        ids = sample_sequences(model, tokenizer, cfg, cache=cache, progress=progress, on_logits=record)
        teacher = TopKTeacher.cat([TopKTeacher.cat(parts[s], dim=1) for s in sorted(parts)])
        if teacher.shape[:2] != ids.shape:
            raise RuntimeError(f"the sampling pass recorded teacher positions {tuple(teacher.shape[:2])} "
                               f"for self-samples {tuple(ids.shape)}")
    if path is not None:
        _save(path, ids, teacher)
    return ids, teacher
