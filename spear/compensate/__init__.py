"""Error compensators: what they are, how they start, how they are calibrated.

spec.py        CompensatorSpec (a checkpoint's record, the selection's cost, the kernels' limits) and
               ECFactors (the runtime form every engine computes)
lowrank.py     the static low-rank term B (A x)
ec.py          SPEAR's gated EC alpha · B (gamma(A x) ⊙ A x)
registry.py    the kinds a checkpoint can hold
svd_init.py    the static family's factors (LQER, QERA, LoftQ, ZeroQuant-V2) as pure functions
static.py      attaching static compensators
stats.py       activation statistics for the scaled methods
calibrate.py   data-free KL calibration on self-sampled text (blockwise.py: one layer at a time)
workflow.py    attach + calibrate, as the CLI runs them; scales.py: tuning the quantization scales too
gate_stats.py  the gate's spread per module, for reports
"""
