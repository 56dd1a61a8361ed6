"""The compensator spec against the modules it describes: what a checkpoint records rebuilds the
module, its parameter count is the module's, and its runtime factors compute the module."""

import pytest
import torch

from spear.compensate.ec import GatedCompensator
from spear.compensate.lowrank import LowRankCompensator
from spear.compensate.registry import build_compensator, compensator_spec
from spear.compensate.spec import CompensatorSpec, factors
from spear.errors import SpearError
from spear.select.budget import ec_params


def _modules():
    g = torch.Generator().manual_seed(0)
    yield LowRankCompensator(torch.randn(3, 40, generator=g), torch.randn(24, 3, generator=g))
    for gated, per_rank in ((True, True), (True, False), (False, True)):
        ec = GatedCompensator(torch.randn(5, 40, generator=g), torch.randn(24, 5, generator=g), hidden=6,
                              gated=gated, bound=0.5, alpha=0.7, per_rank=per_rank)
        if gated:
            with torch.no_grad():
                ec.w2.normal_(0, 1.0, generator=g)
                ec.b2.normal_(0, 0.5, generator=g)
                ec.set_input_scale(torch.rand(5, generator=g) + 0.5)
        yield ec


@pytest.mark.parametrize("i", range(4))
def test_spec_rebuilds_counts_and_exports_the_module(i):
    """Catches: a spec field not recorded (the rebuilt shell differs), a parameter not counted in the
    selection's cost, the gate's input scale or alpha lost in the runtime factors."""
    comp = list(_modules())[i]
    record = compensator_spec(comp)
    spec = CompensatorSpec.from_dict(record)
    shell = build_compensator(record, 40, 24)
    assert {k: v.shape for k, v in shell.state_dict().items()} == {k: v.shape for k, v in comp.state_dict().items()}
    assert spec.params(40, 24) == sum(t.numel() for t in comp.state_dict().values())
    if spec.kind == "spear-ec":
        assert ec_params(40, 24, spec.rank, spec.hidden, spec.gated, spec.per_rank) == spec.params(40, 24)
    f = factors(comp)
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(1))
    u = x @ f.a.t()
    if f.gated:
        h = torch.nn.functional.silu(u @ f.w1.t() + f.b1)
        u = u * (1 + f.bound * torch.tanh(h @ f.w2.t() + f.b2))
    torch.testing.assert_close(f.alpha * (u @ f.b.t()), comp(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,message", [
    ({"kind": "lowrank", "rank": 0}, "rank must be"),
    ({"kind": "spear-ec", "rank": 4, "hidden": 0, "gated": True}, "hidden >= 1"),
    ({"kind": "spear-ec", "rank": 4, "hidden": 8, "gated": True, "bound": 2.0}, "bound"),
    ({"kind": "magic", "rank": 4}, "unknown compensator kind"),
    ({"kind": "lowrank", "rank": 4, "extra": 1}, "unknown field"),
])
def test_bad_specs_are_refused(bad, message):
    with pytest.raises(SpearError, match=message):
        CompensatorSpec.from_dict(bad)


def test_kernel_limits():
    assert CompensatorSpec("spear-ec", 128, 16, True).kernel_limits(128) is None
    assert "rank 200" in CompensatorSpec("lowrank", 200).kernel_limits(128)
    assert "gate width 256" in CompensatorSpec("spear-ec", 8, 256, True).kernel_limits(128)
