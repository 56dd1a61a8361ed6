"""The settings of one KL calibration run (:class:`CalibrationConfig`) and those that follow the model:
how much self-sampled text and how many steps the device affords (``for_device``), the teacher's form
by vocabulary (``for_vocab``). :mod:`spear.compensate.calibrate` trains with them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from spear.config import Sampling
from spear.errors import SpearError


# A full fp16 teacher up to this size (80 x 128 self-samples of the default model's 49,152 tokens:
# 0.94 GiB); past it the top-AUTO_TOP_K form (25 KB a position; the default 528 x 128: 1.66 GB).
# BENCHMARKS.md, "Calibration on a large vocabulary": on Gemma-3-270M (262,144 tokens) the top 64 leave 21% of real text's next
# tokens and 14% of the W4 model's KL outside the objective, the top 4096 4% and 1%.
FULL_TEACHER_MAX_BYTES = 2**30
AUTO_TOP_K = 4096
# More training self-samples (and a teacher of as many) halve the automatic k, down to MIN_AUTO_TOP_K, to keep
# the top-k teacher within this size: 1,040 x 128 positions get the top 2,048 (1.6 GB), 2,064 the top 1,024.
# At 512 samples the top 256 recovered as much as the top 4,096 (BENCHMARKS.md, "More self-samples").
TOP_K_TEACHER_MAX_BYTES = 2**31
MIN_AUTO_TOP_K = 256
# (training self-samples, steps) by where the calibration runs, when not given. More text trained on for
# longer keeps paying (BENCHMARKS.md, "More self-samples", H100, 3 seeds each, the default model's RTN W4 gap
# at the 1% selection with tuned scales and norms: 512 and 240 steps 72.2 ± 0.1%, 2,048 and 960 75.3 ± 0.4%),
# but a CPU pays for both linearly (a step of the default model: ~3 s on 2 cores): its default keeps `spear run`
# of the default model within half an hour, an accelerator's takes minutes.
CPU_SIZES = (512, 240)
ACCELERATOR_SIZES = (2048, 960)
TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CalibrationConfig(Sampling):
    """Self-sampling (``Sampling``'s temperature, top_p and seed), optimisation and EC-shape settings
    of one calibration run."""

    # None: by the device (for_device; CPU_SIZES or ACCELERATOR_SIZES). 512 training self-samples: 71.6 ± 0.2%
    # of the default model's RTN W4 gap against 64's 64.4 ± 1.2% (BENCHMARKS.md, "More self-samples"); the
    # teacher of that many follows the vocabulary (for_vocab).
    n_samples: int | None = None
    val_samples: int = 16
    sample_len: int = 128
    steps: int | None = None
    batch_size: int = 4
    lr: float = 2e-3  # A, B
    gate_lr: float = 1e-2  # gate MLP
    alpha_lr: float = 1e-2
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of steps
    clip: float = 1.0
    eval_every: int = 40
    patience: int = 3  # evaluations without improvement before stopping
    # The token gate is optional: on SmolLM2-135M it never beat the same low-rank term
    # calibrated without it (BENCHMARKS.md, "SPEAR calibration"), so the default is off.
    gated: bool = False
    hidden: int = 8
    bound: float = 1.0
    gate_per_rank: bool = True  # one γ per rank component (False: one per module)
    init: str = "qera-approx"  # static solution the ECs start from
    # The closed-form init's activation statistics come from the first stats_samples training
    # self-samples (8,192 tokens at 128 each): more samples for the KL do not make that pass longer.
    stats_samples: int = 64
    # None: follow the vocabulary (the full distribution while it takes at most FULL_TEACHER_MAX_BYTES,
    # else its top AUTO_TOP_K tokens; see for_model); 0: the full teacher; k: its top k + the rest
    teacher_top_k: int | None = None
    full_teacher_max_bytes: int = FULL_TEACHER_MAX_BYTES  # with teacher_top_k None: the full teacher up to here
    # Also KL-train every quantized linear's scales (a log-factor per scale, folded into the
    # fp16 scales at the end; spear/compensate/scales.py), and the norm layers' elementwise weights in
    # place: no extra memory, and on the default job 0.7, 1.1 and 0.8 points more of the gap at seeds
    # 0, 1, 2 (2-core CPU, 2026-12-06; BENCHMARKS.md, "More self-samples"), so on by default, for
    # `spear run`, `spear calibrate` and pipeline.run_job alike. Off (both): only the ECs train, the
    # ECs' own effect (the "ECs alone" rows of the benchmarks pass that explicitly); blockwise
    # calibration trains the ECs only and needs both off.
    tune_scales: bool = True
    scale_lr: float = 1e-3  # learning rate of the scales' log-factors
    tune_norms: bool = True
    norm_lr: float = 1e-4
    # The dtype the training steps' forward and backward compute in ("bfloat16": torch.autocast, 1.1-1.3x
    # faster on the 2-core CPU, BENCHMARKS.md). The parameters, the optimizer, the teacher and the
    # validation KL (early stopping, the state kept) stay in float32.
    train_dtype: str = "float32"

    def __post_init__(self):
        super().__post_init__()
        positive = ("n_samples", "val_samples", "steps", "batch_size", "eval_every", "patience", "hidden",
                    "stats_samples")
        for name in positive:
            if name in ("n_samples", "steps") and getattr(self, name) is None:
                continue  # resolved by the device (for_device)
            if getattr(self, name) < 1:
                raise SpearError(f"calibration {name} must be >= 1, got {getattr(self, name)}")
        if self.sample_len < 2:
            raise SpearError(f"calibration sample_len must be >= 2, got {self.sample_len}")
        for name in ("lr", "gate_lr", "alpha_lr", "scale_lr", "norm_lr", "clip"):
            if not getattr(self, name) > 0:
                raise SpearError(f"calibration {name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.warmup < 1:
            raise SpearError(f"warmup must be a fraction in [0, 1), got {self.warmup}")
        if self.teacher_top_k is not None and self.teacher_top_k < 0:
            raise SpearError(f"teacher_top_k must be 0 (full distribution), >= 1, or None (by vocabulary); "
                             f"got {self.teacher_top_k}")
        if isinstance(self.full_teacher_max_bytes, bool) or not isinstance(self.full_teacher_max_bytes, int) or \
                self.full_teacher_max_bytes < 1:
            raise SpearError(f"full_teacher_max_bytes must be a whole number >= 1, got {self.full_teacher_max_bytes!r}")
        if self.train_dtype not in TRAIN_DTYPES:
            raise SpearError(f"train_dtype must be one of {', '.join(TRAIN_DTYPES)}; got {self.train_dtype!r}")
        if self.init not in ("identity", "lqer", "qera-approx", "qera-exact"):
            raise SpearError(f"init must be identity, lqer, qera-approx or qera-exact; got {self.init!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def teacher_bytes(self, vocab_size: int) -> int:
        """Bytes of the teacher for every self-sample: fp16 log-probabilities, or the top-k form."""
        if self.n_samples is None:
            raise SpearError("the number of self-samples follows the device: resolve it with for_device first")
        positions = (self.n_samples + self.val_samples) * self.sample_len
        k = self.teacher_top_k
        return positions * (2 * vocab_size if not k else 6 * min(k, vocab_size) + 4)

    def for_device(self, device: torch.device | str) -> "CalibrationConfig":
        """This config with ``n_samples`` and ``steps`` left None resolved for ``device``: CPU_SIZES on a
        CPU, ACCELERATOR_SIZES elsewhere. Given values are kept."""
        n, steps = CPU_SIZES if torch.device(device).type == "cpu" else ACCELERATOR_SIZES
        return replace(self, n_samples=n if self.n_samples is None else self.n_samples,
                       steps=steps if self.steps is None else self.steps)

    def for_vocab(self, vocab_size: int) -> "CalibrationConfig":
        """This config with the teacher's form resolved: ``teacher_top_k=None`` becomes 0 (the full teacher)
        while that takes at most ``full_teacher_max_bytes``, else AUTO_TOP_K, halved (not below
        MIN_AUTO_TOP_K) while the top-k teacher would take more than TOP_K_TEACHER_MAX_BYTES."""
        if self.teacher_top_k is not None:
            return self
        full = replace(self, teacher_top_k=0)
        if full.teacher_bytes(vocab_size) <= self.full_teacher_max_bytes:
            return full
        top = replace(self, teacher_top_k=min(AUTO_TOP_K, vocab_size))
        while top.teacher_top_k // 2 >= MIN_AUTO_TOP_K and top.teacher_bytes(vocab_size) > TOP_K_TEACHER_MAX_BYTES:
            top = replace(top, teacher_top_k=top.teacher_top_k // 2)
        return top

    def for_model(self, model: nn.Module) -> "CalibrationConfig":
        """:meth:`for_device` with the device of ``model``'s parameters, then :meth:`for_vocab` with the width
        of its logits: every setting that follows the model resolved (idempotent)."""
        return self.for_device(next(model.parameters()).device).for_vocab(model_vocab(model))


def model_vocab(model: nn.Module) -> int:
    """The width of ``model``'s logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head.out_features if head is not None and hasattr(head, "out_features") else model.config.vocab_size
