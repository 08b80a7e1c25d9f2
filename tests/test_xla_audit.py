"""The compiled-program audit (tests/xla_audit.py): one stage-0 bf16 train step with activation checkpointing and a
chunked loss, of a model whose weights dominate memory, compiled by XLA for 8 CPU devices, read from XLA's own dumps
(the SPMD-partitioned HLO and its buffer assignment), on meshes (1,8,1), (2,4,1), (1,4,2) and torch_xla's FSDPv2.

What XLA's CPU pipeline cannot show is marked xfail with the reason: it has no pass that turns an all-reduce
followed by a slice into a reduce-scatter (TPU's has). Known gathers left are xfail too."""

import json
import os
import sys

import pytest
from conftest import ROOT, start_in_background, wait_for_background
from xla_audit import ROWS, SEQ, VIT_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.full]  # make test: tests/test_xla.py's losses on 4 meshes
MESHES = ["1,8,1", "2,4,1", "1,4,2"]
CPU_PIPELINE = "XLA's CPU pipeline has no all-reduce + dynamic-slice -> reduce-scatter rewrite (TPU's has)"


BACKGROUND_FIXTURE = "audit"  # the fixture that waits for start_background's job


def start_background(tmp_path_factory):  # at the start of the session (tests/conftest.py)
    out = tmp_path_factory.mktemp("audit")
    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "OMP_NUM_THREADS": "1",
                        # level 0: faster CPU codegen; the HLO passes, collectives and buffer assignment are the same
                        "XLA_FLAGS": f"--xla_dump_to={out / 'dump'} --xla_dump_hlo_as_text "
                                     "--xla_backend_optimization_level=0"}
    start_in_background(__name__, [sys.executable, ROOT / "tests/xla_audit.py", out / "dump", out / "audit.json",
                                   *MESHES, "fsdpv2"], env, out)


@pytest.fixture(scope="module")
def audit():
    return json.loads((wait_for_background(__name__, timeout=1800) / "audit.json").read_text())


def activation_gathers(result, batch=(ROWS, ROWS * SEQ, ROWS * VIT_TOKENS)):
    """All-gathers of float tensors with a batch dimension: 8 rows, 320 LLM tokens, 40 ViT tokens. A loss chunk's
    hidden states (80 positions) are gathered by design: the output layer is vocab-parallel over (tp, fsdp), so
    one chunk's activations move instead of the whole (vocab, dim) matrix, as under FSDPv2."""
    return [c for c in result["collectives"] if c[0] == "all-gather" and c[3] in ("f32", "bf16")
            and any(d in batch for d in c[2]) and c[1] >= ROWS * SEQ * 4]  # at least one value per LLM token


def test_no_all_gather_of_llm_or_vit_activations_under_fsdp(audit):
    # before: each ViT LayerNorm's [1, 40, 64], the images, whole hidden states were all-gathered
    r = audit["1x8x1"]
    assert [c for c in r["collectives"] if c[0] == "all-gather"], "FSDP gathers weights: none seen, wrong module?"
    assert not activation_gathers(r), activation_gathers(r)


@pytest.mark.xfail(reason="GSPMD gathers the 32 image features for the FSDP-sharded projector's weight gradient")
def test_no_all_gather_of_image_features(audit):
    assert not activation_gathers(audit["1x8x1"], batch=(ROWS * (VIT_TOKENS - 1),))


@pytest.mark.xfail(reason="with dp > 1 or tp > 1 GSPMD still gathers the embedding lookup and one hidden state")
@pytest.mark.parametrize("mesh", ["2x4x1", "1x4x2"])
def test_no_all_gather_of_activations_on_mixed_meshes(audit, mesh):
    assert not activation_gathers(audit[mesh])


@pytest.mark.parametrize("mesh", MESHES)
def test_parameters_and_moments_are_sharded(audit, mesh):
    dp, fsdp, tp = map(int, mesh.split(","))
    r = audit["x".join(mesh.split(","))]
    share = r["full_param_bytes"] / (fsdp * tp)
    # norms, biases and the class embedding stay replicated: a few percent over the ideal share
    assert share <= r["param_bytes"] <= 1.1 * share
    assert 1.5 * share <= r["moment_bytes"] <= 2 * 1.1 * share  # two moments of the trained parameters


@pytest.mark.xfail(reason=CPU_PIPELINE)
def test_gradients_are_reduce_scattered(audit):
    assert any(c[0] == "reduce-scatter" for c in audit["1x8x1"]["collectives"])


def test_peak_falls_as_fsdp_grows(audit):
    # measured: 53.0 MB on (2,4,1), 33.2 MB on (1,8,1); before this work 76.1 and 68.7 MB
    assert audit["2x4x1"]["peak_bytes"] > 1.3 * audit["1x8x1"]["peak_bytes"]
    assert audit["1x8x1"]["peak_bytes"] <= 1.05 * audit["fsdpv2"]["peak_bytes"]  # FSDPv2: 40.5 MB


def test_against_torch_xla_fsdpv2(audit):
    ours, theirs = audit["1x8x1"], audit["fsdpv2"]
    # FSDPv2 leaves activations to GSPMD, which gathers them wherever they are smaller than the weight they meet
    assert len(activation_gathers(ours)) < len(activation_gathers(theirs))
    assert ours["param_bytes"] <= 1.05 * theirs["param_bytes"]  # both shard every matrix 8 ways
