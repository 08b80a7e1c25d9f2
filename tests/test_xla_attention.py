"""attention='blockwise' (an online softmax over key blocks, no T x T scores) against SDPA: on CPU eager here, and on
torch_xla SPMD over 4 CPU devices in tests/xla_attention.py (parity, the compiled program's peak memory in T, the
compile count); the Pallas kernels' refusal off a TPU."""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, start_in_background, wait_for_background

import config
from attention import blockwise_attention
from model import build_model
from model_config import vlm_preset
from xla_attention import MEMORY_T, PARITY, packed_rows


BACKGROUND_FIXTURE = "xla"  # the fixture that waits for start_background's job


def start_background(tmp_path_factory):  # at the start of the session (tests/conftest.py)
    out = tmp_path_factory.mktemp("attention")
    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_NUM_THREADS": "1",
                        "XLA_FLAGS": f"--xla_dump_to={out / 'dump'} --xla_dump_hlo_as_text "
                                     "--xla_backend_optimization_level=0"}  # faster codegen; same buffer assignment
    start_in_background(__name__, [sys.executable, ROOT / "tests/xla_attention.py", out / "dump", out / "results.json"],
                        env, out)


@pytest.fixture(scope="module")
def xla():
    return json.loads((wait_for_background(__name__, timeout=1200) / "results.json").read_text())


def sdpa(q, k, v, segments=None, window=None):
    """transformers' eager attention, as its Qwen2 builds the mask: causal, same sample, kv > q - window; K/V repeated
    to every head."""
    T, rep = q.shape[2], q.shape[1] // k.shape[1]
    i = torch.arange(T)
    mask = (i[None, :] <= i[:, None])[None, None]
    if window:
        mask = mask & (i[None, :] > i[:, None] - window)
    if segments is not None:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)


CASES = [  # (B, H, Hkv, T, head_dim, block, window, packed)
    (2, 4, 4, 37, 8, 16, None, False),  # T not a multiple of the block
    (2, 6, 2, 101, 16, 32, None, True),  # GQA, packed rows of odd lengths
    (1, 4, 1, 77, 8, 16, 9, True),  # multi-query, a window shorter than a block
    (3, 2, 2, 64, 8, 64, 40, False),  # one block
    (2, 4, 2, 50, 8, 128, None, True),  # a block longer than the rows
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_blockwise_attention_equals_sdpa_forward_and_backward(case, dtype):
    B, H, Hkv, T, hd, block, window, packed = case
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, h, T, hd, generator=g).to(dtype).requires_grad_() for h in (H, Hkv, Hkv))
    segments = (packed_rows(B, T, seed=T)["position_ids"] == 0).cumsum(1) if packed else None
    y = blockwise_attention(q, k, v, segments, window, block)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    y_ref = sdpa(*ref, segments, window)
    dy = torch.randn(y.shape, generator=g)
    grads = torch.autograd.grad(y, (q, k, v), dy.to(dtype))
    grads_ref = torch.autograd.grad(y_ref, ref, dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the inputs' own rounding of products and sums
    assert y.dtype == dtype and (y.float() - y_ref).abs().max() <= tol * y_ref.abs().max()
    for got, want in zip(grads, grads_ref):
        assert got.dtype == dtype and (got.float() - want).abs().max() <= tol * want.abs().max()


def test_model_with_blockwise_attention_equals_dense_on_packed_rows_with_a_window():
    """A Qwen2-style model (GQA, bias, a windowed layer) on packed rows: the loss and every gradient as with SDPA and
    the dense (B, 1, T, T) document mask."""
    mcfg = vlm_preset("debug").with_overrides({"llm": {"n_kv_heads": 1, "qkv_bias": True, "sliding_window": 23,
                                                       "sliding_layers": [0]}})
    b = packed_rows(3, 97, seed=0, vocab=500)
    losses, grads = [], []
    for kernel in (None, lambda q, k, v, segments, window: blockwise_attention(q, k, v, segments, window, 32)):
        model = build_model(mcfg, seed=0)
        model.llm.attention_kernel = kernel
        _, loss = model(b["input_ids"], None, b["labels"], position_ids=b["position_ids"])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) <= 1e-5 * losses[0]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n, want in grads[0].items():
        assert (grads[1][n] - want).abs().max() <= 1e-5 * want.abs().max() + 1e-9, n


@pytest.mark.parametrize("kind", ["flash", "splash"])
def test_pallas_kernels_are_refused_off_a_tpu_in_one_sentence(kind):
    with pytest.raises(SystemExit, match=rf"^config: attention='{kind}' is torch_xla's Pallas kernel, which runs only on "
                                         r"a TPU \(device='xla' on a TPU VM\), not on device='cpu': use "
                                         r"attention='blockwise' \(bounded memory on every device\) or 'dense'$"):
        config.load_config([f"--attention={kind}", "--device=cpu"])
    with pytest.raises(SystemExit, match="attention must be one of"):
        config.load_config(["--attention=ring"])


# -----------------------------------------------------------------------------
# on 4 CPU XLA devices (tests/xla_attention.py)


@pytest.mark.full  # the XLA runs of tests/xla_attention.py
@pytest.mark.parametrize("name", [p[0] for p in PARITY])
def test_xla_blockwise_loss_and_gradients_equal_cpu_sdpa(xla, name):
    r = xla["parity"][name]
    loss_xla, loss_cpu = r["loss"]
    assert abs(loss_xla - loss_cpu) <= 1e-5 * abs(loss_cpu)
    assert r["n_grads"] >= 21  # every LLM parameter's (the rows are text)
    assert r["grad_err"] <= 1e-5  # the largest difference, relative to the largest gradient, of any parameter


@pytest.mark.full  # the XLA runs of tests/xla_attention.py
def test_xla_peak_memory_grows_linearly_in_seq_len(xla):
    peaks = {int(t): b for t, b in xla["memory"]["blockwise"].items()}
    assert sorted(peaks) == list(MEMORY_T)
    for short, long in zip(MEMORY_T, MEMORY_T[1:]):  # twice the tokens: about twice the bytes
        assert 1.7 <= peaks[long] / peaks[short] <= 2.1, peaks
    dense = {int(t): b for t, b in xla["memory"]["dense"].items()}
    assert dense[4096] / dense[2048] > 3.5  # the T x T scores: quadratic
    assert peaks[4096] < 0.4 * dense[4096]


@pytest.mark.full  # the XLA runs of tests/xla_attention.py
def test_xla_compile_count_is_flat_as_packing_and_tiles_vary(xla):
    assert xla["compiles"] == [xla["compiles"][0]] * 5


@pytest.mark.full  # the XLA runs of tests/xla_attention.py
@pytest.mark.parametrize("kind", ["flash", "splash"])
def test_xla_pallas_kernels_are_refused_on_a_cpu_xla_device(xla, kind):
    assert xla["refusals"][kind] == (f"config: attention='{kind}' is torch_xla's Pallas kernel, which runs only on a "
                                     "TPU (device='xla' on a TPU VM), not on an XLA CPU device: use "
                                     "attention='blockwise' (bounded memory on every device) or 'dense'")


@pytest.mark.full  # the XLA runs of tests/xla_attention.py
def test_bench_attention_memory_formula_matches_the_compiled_programs(xla):
    """bench.py attention's per-row bytes for the 1-layer model against XLA's own peak of its compiled step: dense at
    4096 tokens (the T x T terms), blockwise at 16384 (the tiles)."""
    import memory
    from xla_attention import MEMORY_LLM

    c = vlm_preset("debug").with_overrides({"llm": MEMORY_LLM}).llm
    for kind, T in (("dense", 4096), ("blockwise", 16384)):
        measured = xla["memory"][kind][str(T)]
        assert 0.75 <= memory.attention_bytes(c, T, kind, checkpointing=False) / measured <= 1.25, (kind, measured)
