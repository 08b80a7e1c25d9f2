"""Every parameter's gradient of train.py's micro-step on torch_xla SPMD (mesh 1x2x2 over 4 CPU devices) against
CPU eager, for stage x dtype x activation checkpointing x packing (tests/xla_grads.py runs both sides)."""

import itertools
import os
import sys

import pytest
import torch
from conftest import ROOT, start_in_background, wait_for_background

from shapes import make_shapes

pytestmark = [pytest.mark.slow, pytest.mark.full]  # make test: tests/test_xla.py's losses on 4 meshes
COMBOS = list(itertools.product((0, 1, 2), ("float32", "bfloat16"), (False, True), (False, True)))
# bf16 on both sides, but XLA's autocast casts other ops than CPU's and GSPMD sums in another order
RTOL = {"float32": 2e-4, "bfloat16": 6e-2}
# plus a floor relative to the whole gradient: a key bias's gradient is exactly zero, what is left is rounding
ATOL = {"float32": 1e-6, "bfloat16": 1e-3}


BACKGROUND_FIXTURE = "grads"  # the fixture that waits for start_background's job


def start_background(tmp_path_factory):  # at the start of the session (tests/conftest.py)
    shapes = tmp_path_factory.mktemp("grad_shapes")
    make_shapes(shapes, n=40, seed=1, val_fraction=0.1)
    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_NUM_THREADS": "1",
                        "XLA_FLAGS": "--xla_backend_optimization_level=0"}  # compiles faster; results unchanged
    start_in_background(__name__, [sys.executable, ROOT / "tests/xla_grads.py", shapes, shapes / "grads.pt"], env, shapes)


@pytest.fixture(scope="module")
def grads():
    return torch.load(wait_for_background(__name__, timeout=1800) / "grads.pt")


@pytest.mark.parametrize("stage,dtype,checkpointing,packed", COMBOS)
def test_every_gradient_matches_cpu_eager(grads, stage, dtype, checkpointing, packed):
    (loss_cpu, cpu), (loss_xla, xla) = grads[(stage, dtype, checkpointing, packed)]["cpu"], \
        grads[(stage, dtype, checkpointing, packed)]["xla"]
    rtol = RTOL[dtype]
    assert abs(loss_xla - loss_cpu) <= rtol * abs(loss_cpu)
    trained = [n for n, g in cpu.items() if g is not None]
    assert trained and all(n.startswith("projector") for n in trained) == (stage == 1)
    assert [n for n, g in xla.items() if g is not None] == trained  # no gradient lost (or invented) on XLA
    scale = torch.cat([cpu[n].flatten() for n in trained]).norm()
    for n in trained:
        assert cpu[n].norm() > 0 or "bias" in n, n
        err = (xla[n] - cpu[n]).norm()  # each parameter's gradient, relative to its own size
        assert err <= rtol * cpu[n].norm() + ATOL[dtype] * scale, (n, err.item(), cpu[n].norm().item())
