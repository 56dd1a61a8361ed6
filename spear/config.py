"""Typed, validated configurations; each is saved beside every checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from spear.errors import SpearError


def _from_dict(cls, data: dict):
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise SpearError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    return cls(**data)


CALIB_SOURCES = ("self", "text")


@dataclass(frozen=True)
class Sampling:
    """How the FP model samples its own text (spear/data/selfsample.py): the one declaration of
    these fields for every config that self-samples (SampleConfig, CalibConfig and the compensators'
    CalibrationConfig), checked here."""

    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise SpearError(f"self-sampling temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpearError(f"self-sampling top_p must be in (0, 1], got {self.top_p}")

    def self_samples(self, n: int, length: int) -> "SampleConfig":
        """``n`` self-samples of ``length`` tokens drawn with these settings."""
        return SampleConfig(n=n, length=length, **{f.name: getattr(self, f.name) for f in fields(Sampling)})


@dataclass(frozen=True)
class SampleConfig(Sampling):
    """``n`` self-sampled sequences of ``length`` tokens; ``batch_size`` sequences per forward pass."""

    n: int = 64
    length: int = 128
    batch_size: int = 64  # sequences per forward pass: 1.5x less CPU time per sequence than 16 (the weights are read once per step)

    def __post_init__(self):
        super().__post_init__()
        if self.n < 1 or self.length < 2 or self.batch_size < 1:
            raise SpearError(f"self-sampling needs n>=1, length>=2, batch_size>=1; got {self}")


@dataclass(frozen=True)
class CalibConfig(Sampling):
    """Calibration windows for GPTQ/AWQ.

    ``source="self"`` (the default, data-free) samples ``n_samples`` sequences of
    ``seq_len`` tokens from the FP model (cached, shared with the compensator
    calibration; the defaults match :class:`SampleConfig`); ``"text"`` uses the token
    windows the caller passes. ``batch_size`` is the number of sequences per forward pass
    through one decoder layer.
    """

    source: str = "self"
    n_samples: int = 64
    seq_len: int = 128
    batch_size: int = 8

    def __post_init__(self):
        super().__post_init__()
        if self.source not in CALIB_SOURCES:
            raise SpearError(f"calibration source must be one of {', '.join(CALIB_SOURCES)}; got {self.source!r}")
        if self.n_samples < 1 or self.seq_len < 2 or self.batch_size < 1:
            raise SpearError(f"calibration needs n_samples>=1, seq_len>=2, batch_size>=1; got "
                             f"n_samples={self.n_samples}, seq_len={self.seq_len}, batch_size={self.batch_size}")


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ options: ``damp`` is the fraction of the mean Hessian diagonal added to it;
    ``act_order`` quantizes columns by decreasing Hessian diagonal (with groups, the
    group parameters are fixed from the original weights first, "static groups", so
    groups stay contiguous in spear's layout); ``block_size`` columns per lazy update."""

    damp: float = 0.01
    act_order: bool = False
    block_size: int = 128

    def __post_init__(self):
        if not 0 <= self.damp <= 1:
            raise SpearError(f"GPTQ damp must be in [0, 1] (fraction of the mean Hessian diagonal), got {self.damp}")
        if self.block_size < 1:
            raise SpearError(f"GPTQ block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True)
class AWQConfig:
    """AWQ options: ``grid`` points of alpha in [0, 1] for the scale search s = mean|x|^alpha;
    ``clip`` enables the clipping search over ``clip_grid`` ratios in [``clip_min``, 1]; ``rounding``
    turns the scaled weights into codes: ``"rtn"`` (AWQ's own, to the nearest level) or ``"gptq"``
    (GPTQ's error feedback under the scaled inputs' Hessian, with ``QuantConfig.gptq``'s options and
    the searched clipping ratios); ``fold_kv_heads`` also scales o_proj where attention heads share KV
    heads, one scale per v_proj row repeated over the heads that read it (AWQ's reference leaves o_proj
    unscaled there; on the default model, W4 sym, 2-core CPU, 2026-12-07: g64 28.57 against 28.74, per
    channel 36.76 against 36.57, hence off unless asked)."""

    grid: int = 20
    clip: bool = True
    clip_grid: int = 20
    clip_min: float = 0.5
    rounding: str = "rtn"
    fold_kv_heads: bool = False

    def __post_init__(self):
        if self.grid < 1 or self.clip_grid < 1:
            raise SpearError(f"AWQ grid sizes must be >= 1, got grid={self.grid}, clip_grid={self.clip_grid}")
        if not 0 < self.clip_min <= 1:
            raise SpearError(f"AWQ clip_min must be in (0, 1], got {self.clip_min}")
        if self.rounding not in ("rtn", "gptq"):
            raise SpearError(f"AWQ rounding must be rtn or gptq, got {self.rounding!r}")


OMNIQUANT_INITS = ("search", "max")


@dataclass(frozen=True)
class OmniQuantConfig:
    """OmniQuant (spear/quant/omniquant.py): learnable weight clipping, per output row (and group) a
    factor on the range's maximum and one on its minimum, ``sigmoid`` of a trained logit, and with
    ``let`` learnable channel scales, learned one decoder layer at a time so the quantized layer's
    output matches the FP layer's (MSE).

    ``samples``: at most this many calibration sequences train the clipping (the first of the ids the
    quantizer is given; ``QuantConfig.calib`` draws them), so the time stays bounded whatever a caller
    passes; ``epochs`` passes over them per layer, in batches of ``QuantConfig.calib.batch_size`` (0: the
    start rounded as it is, the ablation without training);
    ``lr`` of the logits (AdamW, constant, no weight decay; 5e-2 moved the factors further and ended
    0.7 ppl higher on the default model); ``init``: where the factors start, ``"search"`` (each row's
    and group's best ratio on a grid in [0.5, 1] under the layer inputs' Hessian, as AWQ's clipping
    search) or ``"max"`` (OmniQuant's own: sigmoid(4) = 0.982, nearly the full range, which the few
    steps a CPU affords barely move); ``let``: also scale the input channels of each group of linears
    sharing an input (q/k/v, gate/up, down after up_proj, o after v_proj; with grouped KV heads one scale per
    v_proj row, repeated over the attention heads that read it), the
    inverse folded into the norm or linear producing that input so the FP function is unchanged
    (OmniQuant's learnable equivalent transformation, weight-only, spear/quant/let.py): a layer starts
    from AWQ's searched scales where they give a lower output error than the unscaled weights, and the
    scales' logarithms train with the clip at ``let_lr`` (AdamW). ``None`` (the default): on with groups,
    off per channel, as measured on the default model (W4 sym, 2-core CPU, 2026-12-07, raw
    benchmarks/data/omniquant-let-cpu-2026-12-07/): g64 28.63 with LET (28.86 before o_proj folded into
    v_proj with grouped KV heads) against 29.70 without (AWQ 28.74),
    per channel 35.83 against 34.55 (AWQ 36.57): per channel AWQ's scales lower each layer's output
    error and still raise the perplexity, with or without training on top."""

    epochs: int = 2
    lr: float = 1e-2
    samples: int = 64
    init: str = "search"
    let: bool | None = None
    let_lr: float = 5e-3

    def __post_init__(self):
        for name, least in (("epochs", 0), ("samples", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise SpearError(f"OmniQuant {name} must be a whole number >= {least}, got {v!r}")
        for name in ("lr", "let_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and 0 < v < float("inf")):
                raise SpearError(f"OmniQuant {name} must be a finite number > 0, got {v!r}")
        if self.let is not None and not isinstance(self.let, bool):
            raise SpearError(f"OmniQuant let must be True, False or None (on with groups), got {self.let!r}")
        if self.init not in OMNIQUANT_INITS:
            raise SpearError(f"OmniQuant init must be one of {', '.join(OMNIQUANT_INITS)}; got {self.init!r}")

    def let_on(self, group_size: int) -> bool:
        """Whether LET runs for a layout of ``group_size`` (0: per channel): ``let`` where it is set, else
        with groups only."""
        return self.let if self.let is not None else group_size > 0


QUANT_METHODS = ("rtn", "gptq", "awq", "omniquant")


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of every selected linear.

    ``group_size=0`` means per-channel (one scale per output row); otherwise one scale
    (and zero) per ``group_size`` consecutive input columns, which must divide
    ``in_features``. Symmetric: codes ``q in [-2^(b-1), 2^(b-1)-1]`` stored with offset
    ``2^(b-1)``, scale ``max|w| / (2^(b-1)-1)``. Asymmetric: ``q in [0, 2^b-1]`` with an
    integer zero point, scale ``(max-min)/(2^b-1)``.
    """

    bits: int = 4
    group_size: int = 0
    symmetric: bool = True
    method: str = "rtn"
    include_lm_head: bool = False
    # Bits of the output head when include_lm_head: 0 = ``bits`` with the body's method, group size
    # and symmetry; any other value = RTN per-channel symmetric at that width (8: the serving
    # engine's W8A16 kernel streams half the fp16 head's bytes at almost no loss of accuracy).
    head_bits: int = 0
    # Options of the calibrated methods (ignored by RTN); saved with every checkpoint.
    calib: CalibConfig = field(default_factory=CalibConfig)
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    awq: AWQConfig = field(default_factory=AWQConfig)
    omniquant: OmniQuantConfig = field(default_factory=OmniQuantConfig)

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 8):
            raise SpearError(f"bits must be one of 2, 3, 4, 8; got {self.bits}")
        if self.group_size < 0:
            raise SpearError(f"group_size must be 0 (per-channel) or positive, got {self.group_size}")
        if self.method not in QUANT_METHODS:
            raise SpearError(f"quantization method must be one of {', '.join(QUANT_METHODS)}; got {self.method!r}")
        if self.head_bits not in (0, 2, 3, 4, 8):
            raise SpearError(f"head_bits must be 0 (as bits) or one of 2, 3, 4, 8; got {self.head_bits}")
        if self.head_bits and not self.include_lm_head:
            raise SpearError("head_bits needs include_lm_head (the head is otherwise kept in full precision)")

    @property
    def separate_head(self) -> bool:
        """Whether the head is quantized on its own (RTN per-channel symmetric at head_bits)."""
        return self.include_lm_head and self.head_bits not in (0, self.bits)

    @property
    def label(self) -> str:
        gran = "per-channel" if self.group_size == 0 else f"g{self.group_size}"
        head = f" + head W{self.head_bits}" if self.separate_head else " + head" if self.include_lm_head else ""
        method = "AWQ+GPTQ" if self.method == "awq" and self.awq.rounding == "gptq" else \
            "OmniQuant" if self.method == "omniquant" else self.method.upper()
        return f"{method} W{self.bits} {gran} {'sym' if self.symmetric else 'asym'}{head}"

    def to_dict(self) -> dict:
        """The settings as they ran: OmniQuant's ``let`` resolved for this group size (a saved None
        would read as whatever a later default says)."""
        d = asdict(self)
        if self.method == "omniquant":
            d["omniquant"]["let"] = self.omniquant.let_on(self.group_size)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "QuantConfig":
        nested = {"calib": CalibConfig, "gptq": GPTQConfig, "awq": AWQConfig, "omniquant": OmniQuantConfig}
        data = {k: _from_dict(nested[k], v) if k in nested and isinstance(v, dict) else v for k, v in data.items()}
        return _from_dict(cls, data)


STATIC_METHODS = ("identity", "loftq", "lqer", "qera-approx", "qera-exact")
# The rows of the default job (`spear run` with no options, pipeline.run_job with its defaults): these static
# baselines and the ungated KL-calibrated EC (with CalibrationConfig's defaults).
DEFAULT_BASELINES = ("lqer", "qera-approx")
DEFAULT_SPEAR_VARIANTS = ("nogate",)


@dataclass(frozen=True)
class StaticCompensationConfig:
    """A static low-rank error compensator ``y = Wq x + B (A x)`` on each planned module.

    ``rank`` applies to every quantized module unless ``plan`` (module -> rank) is given.
    """

    method: str = "lqer"
    rank: int = 4
    plan: dict[str, int] | None = None
    loftq_iters: int = 5

    def __post_init__(self):
        if self.method not in STATIC_METHODS:
            raise SpearError(f"static method must be one of {', '.join(STATIC_METHODS)}; got {self.method!r}")
        if self.rank < 0:
            raise SpearError(f"rank must be >= 0, got {self.rank}")
        if self.loftq_iters < 1:
            raise SpearError(f"loftq_iters must be >= 1, got {self.loftq_iters}")
        for name, r in (self.plan or {}).items():
            if not isinstance(r, int) or r < 0:
                raise SpearError(f"plan rank for {name} must be a non-negative int, got {r!r}")

    def rank_for(self, name: str) -> int:
        if self.plan is not None:
            return self.plan.get(name, 0)
        return self.rank

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StaticCompensationConfig":
        return _from_dict(cls, data)


@dataclass(frozen=True)
class EvalConfig:
    """Which text and windows a perplexity number is measured on."""

    text: str = "wikipedia"
    seq_len: int = 512
    eval_windows: int = 24
    calib_windows: int = 16
    batch_size: int = 1

    def __post_init__(self):
        for name in ("seq_len", "eval_windows", "batch_size"):
            if getattr(self, name) < 1:
                raise SpearError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.calib_windows < 0:
            raise SpearError(f"calib_windows must be >= 0, got {self.calib_windows}")

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["QuantConfig", "CalibConfig", "GPTQConfig", "AWQConfig", "OmniQuantConfig", "QUANT_METHODS", "CALIB_SOURCES", "StaticCompensationConfig", "EvalConfig", "STATIC_METHODS"]
