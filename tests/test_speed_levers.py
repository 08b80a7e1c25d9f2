"""Issue 24's speed levers, checked on CPU: frozen weights stored in bf16 (frozen_dtype), selective and every-k
activation checkpointing (checkpoint_policy, checkpoint_every), bench.py's --peer hf-liger refusal without CUDA, and
scripts/gpu_speed.sh at its debug size. Their GPU speed is measured by scripts/gpu_speed.sh, never here."""

import json
import os
import shutil
import socket
import subprocess
import sys

import forkserver
import pytest
import torch
from conftest import ROOT, checkpoint_bytes, checkpoint_tensors, image_batch, run_log, tiny_hf_llava
from torch.utils._python_dispatch import TorchDispatchMode

import config
import model_files
import parallel
from lora import LoRAConfig, apply_lora, merge_lora
from model import build_model
from model_config import vlm_preset


def ours_from_hf(hf, path):
    hf.save_pretrained(path)
    return model_files.load_model(path)


def copy_of(model):
    twin = build_model(model.cfg, init=False)
    twin.load_state_dict(model.state_dict(), strict=not model.cfg.llm.tie_embeddings)
    return twin.train()


def assert_grads_close(grads, ref_grads, tol):
    """Each gradient within tol of its reference, relative to its largest element, or to 1e-3 of the largest of all
    (the key bias's gradient is 0 up to rounding: a key bias shifts every score of a query alike)."""
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max() for g in ref_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=tol, atol=tol * max(ref_grads[name].abs().max(), 1e-3 * scale),
                                   msg=name)


def loss_and_grads(model, ids, pixels, labels, amp, positions=None):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(ids, pixels, labels, "sum", positions)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# -----------------------------------------------------------------------------
# frozen weights in bf16


TIED_QWEN = {"llm": {"tie_embeddings": True, "qkv_bias": True, "n_kv_heads": 2}, "vision": {"kind": "siglip"},
             "vision_layer": -1, "vision_select": "cls_patch"}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("arch", ["hf-llava", "tied-qwen-siglip"])
def test_bf16_frozen_weights_give_the_autocast_losses_and_gradients(tmp_path, stage, arch):
    """Autocast rounds a frozen fp32 weight to bf16 at every use; storing that bf16 value once gives the same
    forward and the same trained gradients (bit-identical on CPU: asserted to 1e-6), and stays within bf16 rounding
    (2%) of transformers' fp32 loss. Only the frozen matmul weights change dtype; nothing trained is bf16."""
    if arch == "hf-llava":
        hf = tiny_hf_llava()
        base = ours_from_hf(hf, tmp_path / "hf")
    else:
        cfg = vlm_preset("debug").with_overrides(TIED_QWEN | {"image_token_id": 511})
        hf, base = None, build_model(cfg, seed=3)
    ids, pixels, labels = image_batch(base.cfg.n_image_tokens, base.cfg.image_token_id, base.cfg.llm.vocab_size,
                                      batch=3, seq=37, image_size=base.cfg.vision.image_size)
    fp32_frozen, bf16_frozen = copy_of(base), copy_of(base)
    for m in (fp32_frozen, bf16_frozen):
        parallel.freeze(m, stage)
    parallel.store_frozen(bf16_frozen, torch.bfloat16)
    ref_loss, ref_grads = loss_and_grads(fp32_frozen, ids, pixels, labels, amp=True)
    loss, grads = loss_and_grads(bf16_frozen, ids, pixels, labels, amp=True)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss
    assert_grads_close(grads, ref_grads, 1e-6)
    if hf is not None:  # transformers' fp32 loss, the mean over supervised tokens
        with torch.no_grad():
            theirs = hf(input_ids=ids, pixel_values=pixels, labels=labels).loss
        assert abs(loss / (labels[:, 1:] != -100).sum() - theirs) <= 2e-2 * theirs
    dtypes = {n: p.dtype for n, p in bf16_frozen.named_parameters()}
    assert all(dtypes[n] == torch.float32 for n, p in bf16_frozen.named_parameters() if p.requires_grad)
    frozen_matmuls = [n for n, p in bf16_frozen.named_parameters() if not p.requires_grad and p.dim() >= 2
                      and "embedding" not in n and n != "llm.output.weight"]
    assert frozen_matmuls and all(dtypes[n] == torch.bfloat16 for n in frozen_matmuls), frozen_matmuls
    # embeddings (the residual stream starts from them), norms and a tied output layer stay fp32
    assert dtypes["llm.tok_embeddings.weight"] == dtypes["llm.norm.weight"] == torch.float32
    tied_or_trained = base.cfg.llm.tie_embeddings or stage == 2
    assert bf16_frozen.llm.output.weight.dtype == (torch.float32 if tied_or_trained else torch.bfloat16)


def test_bf16_frozen_base_under_fp32_lora_adapters(tmp_path):
    """LoRA on the frozen LLM: the base matmuls in bf16, the adapters fp32 and trained, their gradients those of the
    fp32 base under autocast; merging folds the adapters into the bf16 weight in fp32, rounded once."""
    base = ours_from_hf(tiny_hf_llava(), tmp_path / "hf")
    apply_lora(base, LoRAConfig(r=4, alpha=8, targets=["llm"]), seed=0)
    with torch.no_grad():
        for m in base.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.weight.normal_(std=0.05)
    ids, pixels, labels = image_batch(base.cfg.n_image_tokens, 511, 512, batch=2, seq=23)
    fp32_base, bf16_base = copy_of(base), copy_of(base)
    for m in (fp32_base, bf16_base):
        parallel.freeze(m, 2)
    parallel.store_frozen(bf16_base, torch.bfloat16)
    wq = bf16_base.llm.layers[0].attention.wq
    assert wq.weight.dtype == torch.bfloat16 and wq.lora_A.weight.dtype == wq.lora_B.weight.dtype == torch.float32
    assert wq.lora_A.weight.requires_grad and not wq.weight.requires_grad
    d = config.DEFAULTS
    optimizer = parallel.make_optimizer(bf16_base, parallel.Env({"device": "cpu"}), d["lr"], (d["beta1"], d["beta2"]),
                                        d["weight_decay"], d["lr_scale"])
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    ref_loss, ref_grads = loss_and_grads(fp32_base, ids, pixels, labels, amp=True)
    loss, grads = loss_and_grads(bf16_base, ids, pixels, labels, amp=True)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss and any("lora_B" in n for n in grads)
    assert_grads_close(grads, ref_grads, 1e-6)
    merge_lora(fp32_base)
    merge_lora(bf16_base)
    w, w_ref = bf16_base.llm.layers[0].attention.wq.weight, fp32_base.llm.layers[0].attention.wq.weight
    assert w.dtype == torch.bfloat16
    # the base's bf16 rounding and the merged sum's: each at most 2^-8 of the value
    torch.testing.assert_close(w.float(), w_ref, rtol=2**-7, atol=2**-8 * w_ref.abs().max())


def lever_args(shapes, out, *extra):
    return [str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}",
            f"--out_dir={out}", "--log_interval=1", "--eval_interval=0", "--dtype=bfloat16", "--stage=1",
            "--max_iters=4", "--ckpt_interval=2", "--keep_last=5", *extra]


def run(argv, script="train.py"):
    r = forkserver.run([sys.executable, str(ROOT / script), *argv], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(out):
    return {e["step"]: e["loss"] for e in run_log(out, "loss")}


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=200, seed=1, val_fraction=0.1)


@pytest.mark.slow
def test_bf16_frozen_run_trains_saves_resumes_and_exports(shapes, tmp_path):
    """A stage-1 train.py run with frozen_dtype='bfloat16': the fp32-frozen run's losses, checkpoints holding the
    frozen matmul weights in bf16 and AdamW moments for the projector only, an exact resume, and an HF export that
    transformers loads with the same logits as ours."""
    from transformers import LlavaForConditionalGeneration

    run(lever_args(shapes, tmp_path / "fp32"))
    run(lever_args(shapes, tmp_path / "a", "--frozen_dtype=bfloat16"))
    ref, got = losses(tmp_path / "fp32"), losses(tmp_path / "a")
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[s] - ref[s]) <= 1e-6 * ref[s] for s in ref), (got, ref)
    step = tmp_path / "a/step-000004"
    saved = checkpoint_tensors(step)
    assert saved["model.llm.layers.0.feed_forward.w1.weight"].dtype == torch.bfloat16
    assert saved["model.vision.blocks.0.attn.wq.bias"].dtype == torch.bfloat16
    assert saved["model.projector.fc.0.weight"].dtype == saved["model.llm.norm.weight"].dtype == torch.float32
    # 4 steps of projector updates from the same gradients: the same projector (and moments)
    ref_saved = checkpoint_tensors(tmp_path / "fp32/step-000004")
    for key in (k for k in saved if "projector." in k):
        torch.testing.assert_close(saved[key], ref_saved[key], rtol=1e-6, atol=1e-7, msg=key)
    moments = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")}
    assert moments and all(k.startswith("projector.") for k in moments), moments
    # resume from step 2: bit-identical weights and moments at step 4
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a/step-000002", tmp_path / "b/step-000002")
    run(lever_args(shapes, tmp_path / "b", "--frozen_dtype=bfloat16", "--init_from=resume"))
    assert checkpoint_bytes(tmp_path / "b/step-000004", "") == checkpoint_bytes(step, "")
    # the switch may change on resume: an fp32-frozen step is rounded on load as autocast rounds it (the same losses)
    (tmp_path / "c").mkdir()
    shutil.copytree(tmp_path / "fp32/step-000002", tmp_path / "c/step-000002")
    run(lever_args(shapes, tmp_path / "c", "--frozen_dtype=bfloat16", "--init_from=resume"))
    switched = losses(tmp_path / "c")
    assert sorted(switched) == [3, 4] and all(abs(switched[s] - ref[s]) <= 1e-6 * ref[s] for s in switched)
    # export: transformers reads the mixed-dtype weights (upcast to fp32) and agrees with ours
    run(["to-hf", "--ckpt", str(step), "--out", str(tmp_path / "hf")], script="convert.py")
    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = model_files.load_model(step).eval()
    assert torch.equal(ours.llm.layers[0].feed_forward.w1.weight, saved["model.llm.layers.0.feed_forward.w1.weight"].float())
    ids, pixels, _ = image_batch(ours.cfg.n_image_tokens, 512, 512, seq=20)
    with torch.no_grad():
        assert (hf(input_ids=ids, pixel_values=pixels).logits - ours(ids, pixels)[0]).abs().max() < 1e-4


@pytest.mark.slow
@pytest.mark.full
def test_bf16_frozen_under_torchrun_fsdp_matches_fp32_frozen_and_resumes_exactly(shapes, tmp_path):
    """FSDP2 over 2 ranks (gloo): the frozen bf16 weights sit in the same fully_shard groups as fp32 trained ones
    (FSDP2 asks one dtype of the trained parameters only); the losses are the fp32-frozen run's and a resume from
    step 2 is bit-identical."""
    def torchrun(out, *extra):
        port = socket.socket()
        port.bind(("127.0.0.1", 0))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(port.getsockname()[1]), str(ROOT / "train.py"),
               *lever_args(shapes, out, "--parallel=fsdp", "--micro_batch_size=4", *extra)]
        port.close()
        r = forkserver.run(cmd, os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]

    torchrun(tmp_path / "fp32")
    torchrun(tmp_path / "a", "--frozen_dtype=bfloat16")
    ref, got = losses(tmp_path / "fp32"), losses(tmp_path / "a")
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[s] - ref[s]) <= 1e-6 * ref[s] for s in ref), (got, ref)
    assert checkpoint_tensors(tmp_path / "a/step-000004")["model.llm.layers.1.attention.wo.weight"].dtype == torch.bfloat16
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a/step-000002", tmp_path / "b/step-000002")
    torchrun(tmp_path / "b", "--frozen_dtype=bfloat16", "--init_from=resume")
    assert checkpoint_bytes(tmp_path / "b/step-000004", "") == checkpoint_bytes(tmp_path / "a/step-000004", "")


def test_lever_config_errors_name_the_key():
    for bad, message in [(["--frozen_dtype=bfloat16"], "frozen_dtype='bfloat16' needs dtype='bfloat16'"),
                         (["--frozen_dtype=fp16", "--dtype=bfloat16"], "frozen_dtype must be 'float32' or 'bfloat16'"),
                         (["--frozen_dtype=bfloat16", "--dtype=bfloat16", "--device=xla"], "not under XLA"),
                         (["--checkpoint_policy=matmuls"], "checkpoint_policy must be 'full' or 'selective'"),
                         (["--checkpoint_policy=selective", "--device=xla"], "torch_xla's checkpoint recomputes whole"),
                         (["--checkpoint_every=0"], "checkpoint_every must be > 0"),
                         # they did nothing, silently, without checkpointing on
                         (["--checkpoint_policy=selective"], "it is off: set activation_checkpointing=True"),
                         (["--checkpoint_every=2"], "checkpoint_every=2 say how activation_checkpointing")]:
        with pytest.raises(SystemExit, match=message):
            config.load_config(bad)
    with pytest.raises(SystemExit, match="use checkpoint_policy='full' under XLA"):
        parallel.checkpoint_fn("xla", "selective")


# -----------------------------------------------------------------------------
# selective and every-k activation checkpointing


class MatmulCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):  # forward matmuls and attention (not backward's)
        self.n += op in (torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
        return op(*args, **(kwargs or {}))


def packed_inputs(cfg, seed=2):
    """Two rows of 29 tokens, the first holding two samples (position ids restart: a document mask), images first."""
    ids, pixels, labels = image_batch(cfg.n_image_tokens, cfg.image_token_id, cfg.llm.vocab_size, batch=2, seq=29,
                                      image_at=1, image_size=cfg.vision.image_size, seed=seed)
    positions = torch.arange(29).repeat(2, 1)
    positions[0, 17:] = torch.arange(12)
    return ids, pixels, labels, positions


@pytest.mark.parametrize("policy,every", [("full", 1), ("selective", 1), ("selective", 2), ("full", 3)])
def test_checkpointing_policies_give_the_uncheckpointed_gradients_and_recompute_what_they_say(policy, every):
    """fp32: every policy gives the plain run's loss and gradients (1e-5); in backward, 'full' reruns the matmuls of
    the blocks it checkpoints, 'selective' none (it keeps their outputs), every=k only blocks 0, k, 2k, ..."""
    cfg = vlm_preset("debug").with_overrides({"llm": {"n_layers": 3}, "vision": {"n_layers": 3}})
    base = build_model(cfg, seed=5)
    ids, pixels, labels, positions = packed_inputs(cfg)

    def run_counted(fn):
        model = copy_of(base)
        parallel.set_checkpointing(model, fn, every)
        with MatmulCounter() as forward:
            loss = model(ids, pixels, labels, "sum", positions)[1]
        with MatmulCounter() as backward:
            loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, forward.n, \
            backward.n

    ref_loss, ref_grads, fwd, ref_bwd = run_counted(None)
    loss, grads, _, bwd = run_counted(parallel.checkpoint_fn("cpu", policy))
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss
    assert_grads_close(grads, ref_grads, 1e-5)
    # what backward reran of the checkpointed blocks' forward: the ViT's (its biased layers are addmm; vision_layer -2
    # of 3 uses 2 blocks) and the LLM's (bias-free: mm, which backward also runs, so counted by the LLM's attention).
    # torch stops a recompute once backward has what it needs: the last matmul (c_proj, w2) is never rerun
    vit_rerun = 5 + 1  # wq wk wv wo c_fc, attention
    vit_blocks = [i for i in range(2) if i % every == 0]
    llm_blocks = [i for i in range(3) if i % every == 0]
    rerun = 0 if policy == "selective" else vit_rerun * len(vit_blocks) + len(llm_blocks)
    assert bwd - ref_bwd == rerun and fwd > rerun


@pytest.mark.full
def test_selective_checkpointing_compiles_with_the_blocks():
    """With compile, the selective checkpoint is compiled whole, the compiled block inside it: dynamo traces it
    (frames compiled, not skipped as it does a compiled block called under the policy's dispatch mode) and the
    gradients are the eager ones. aot_eager: the graphs and AOT autograd's partition without C++ codegen."""
    from torch._dynamo.utils import counters

    cfg = vlm_preset("debug")
    base = build_model(cfg, seed=6)
    ids, pixels, labels, positions = packed_inputs(cfg, seed=3)
    _, ref_grads = loss_and_grads(copy_of(base), ids, pixels, labels, amp=False, positions=positions)
    torch._dynamo.reset()
    counters.clear()
    model = copy_of(base)
    parallel.set_checkpointing(model, parallel.checkpoint_fn("cpu", "selective", compile_backend="aot_eager"))
    for block in list(model.vision.blocks) + list(model.llm.layers):
        block.compile(backend="aot_eager")
    _, grads = loss_and_grads(model, ids, pixels, labels, amp=False, positions=positions)
    assert counters["frames"]["ok"] >= 2, dict(counters["frames"])  # one graph for the ViT's blocks, one for the LLM's
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.full
def test_compiled_selective_backward_graph_reruns_no_matmul():
    """Compiled with inductor's partitioner (min-cut, as torch.compile's default backend partitions), an LLM block's
    backward graph under 'selective' holds the matmuls of no checkpointing (its own, for the gradients) and none of
    the forward's; under 'full' it holds the forward's again (less w2, whose output backward does not need)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    matmuls = {}

    def counting(graph):
        def compiler(gm, example_inputs):
            matmuls[graph] = sum(n.op == "call_function" and n.target in (torch.ops.aten.mm.default,
                                 torch.ops.aten.addmm.default, torch.ops.aten.bmm.default) for n in gm.graph.nodes)
            return make_boxed_func(gm)
        return compiler

    backend = aot_autograd(fw_compiler=counting("forward"), bw_compiler=counting("backward"),
                           partition_fn=min_cut_rematerialization_partition)
    cfg = vlm_preset("debug")
    model = build_model(cfg, seed=0).train()
    x = torch.randn(2, 19, cfg.llm.dim, requires_grad=True)
    cos, sin = model.llm.rope_cos[:19], model.llm.rope_sin[:19]
    counted = {}
    for policy, fn in [("none", lambda block, *args: block(*args)), ("full", parallel.checkpoint_fn("cpu", "full")),
                       ("selective", parallel.checkpoint_fn("cpu", "selective"))]:
        torch._dynamo.reset()
        torch.compile(fn, backend=backend)(model.llm.layers[0], x, cos, sin, None, 0, None).sum().backward()
        counted[policy] = dict(matmuls)
    assert counted["none"] == {"forward": 7, "backward": 14}, counted  # wq wk wv wo w1 w2 w3; dgrad and wgrad each
    assert counted["selective"] == counted["none"] and counted["full"]["backward"] == 14 + 6, counted


@pytest.mark.parametrize("stage,frozen_dtype", [(1, "bfloat16"), pytest.param(1, "float32", marks=pytest.mark.full),
                                                      pytest.param(2, "float32", marks=pytest.mark.full)])
def test_computed_activation_bytes_are_what_the_compiler_saves(stage, frozen_dtype):
    """memory.kept_bytes (the activations BENCHMARKS.md's memory table counts) against the tensors inductor's min-cut
    partitioner keeps between forward and backward for an LLM block under bf16 autocast, per policy; and the bf16
    weight copies it keeps when a weight is fp32 (none when frozen_dtype stores them in bf16)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    import memory

    kept = {}

    def forward_compiler(gm, example_inputs):  # the forward's outputs past the first are what backward reads
        saved = next(n for n in gm.graph.nodes if n.op == "output").args[0][1:]
        values = [n.meta["val"] for n in saved if n is not None and n.op != "placeholder"]  # inputs cost nothing
        kept["tensors"] = [(tuple(v.shape), v.numel() * v.element_size()) for v in values
                           if isinstance(v, torch.Tensor) and v.dim() >= 2]  # 'full' also keeps a 1-d RNG state
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition)
    cfg = vlm_preset("debug").with_overrides({"llm": {"dim": 96, "ffn_dim": 272, "n_heads": 6, "n_kv_heads": 2}})
    c = cfg.llm
    model = build_model(cfg, seed=0).train()
    parallel.freeze(model, stage)
    if frozen_dtype == "bfloat16":
        parallel.store_frozen(model, torch.bfloat16)
    B, T = 3, 40
    x = torch.randn(B, T, c.dim, requires_grad=True)
    layer = model.llm.layers[0]
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    weight_shapes = {s for m in layer.modules() if isinstance(m, torch.nn.Linear) for s in (m.weight.shape,
                                                                                            m.weight.shape[::-1])}
    for policy, fn in [("none", lambda block, *args: block(*args)), ("full", parallel.checkpoint_fn("cpu", "full")),
                       ("selective", parallel.checkpoint_fn("cpu", "selective"))]:
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.compile(fn, backend=backend)(layer, x, model.llm.rope_cos[:T], model.llm.rope_sin[:T], None, 0,
                                                     None)
        out.float().sum().backward()
        copies = sum(size for shape, size in kept["tensors"] if shape in weight_shapes)  # B * T is no weight's side
        activations = sum(size for _, size in kept["tensors"]) - copies
        fp32_weights = frozen_dtype == "float32" or stage == 2
        # + the block's fp32 input (4 D a token), a graph input: kept by the checkpoint, or by autograd
        assert activations + 4 * c.dim * B * T == memory.kept_bytes(c, policy, stage != 1) * B * T, (policy, kept)
        assert copies == (2 * weights if policy == "none" and fp32_weights else 0), (policy, kept)


# -----------------------------------------------------------------------------
# bench.py's Liger peer and the prepared GPU script


def test_bench_liger_peer_without_cuda_is_one_sentence():
    r = forkserver.run([sys.executable, str(ROOT / "bench.py"), "train", "--size", "debug", "--peer", "hf-liger",
                        "--device", "cpu"], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--peer hf-liger" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.full
def test_gpu_speed_script_runs_its_matrix_at_the_debug_size_on_cpu(tmp_path):
    """scripts/gpu_speed.sh --debug: every row of the GPU matrix at the debug size on the CPU (the Liger row is
    reported as skipped without CUDA), one JSON and one markdown table."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu_speed.sh"), "--debug", "--out", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "speed.json").read_text())
    names = [row["name"] for row in rows]
    assert len(names) == len(set(names)) >= 8
    assert [row["name"] for row in rows if "skipped" in row] == ["stage 2: transformers + Liger"]
    ran = [row for row in rows if "skipped" not in row]
    assert all(row["result"]["samples_per_s"] > 0 for row in ran), [row for row in ran if "samples_per_s" not in
                                                                    row.get("result", {})]
    assert {row["phase"] for row in ran} >= {"ours", "hf", "bf16", "bf16-selective", "bf16-every2", "bf16-none"}
    bigger = next(row for row in ran if row["phase"] == "bf16-bigger" and "stage 1" in row["name"])
    assert bigger["settings"]["batch"] == 6 and bigger["settings"]["frozen_dtype"] == "bfloat16"
    table = (tmp_path / "speed.md").read_text()
    assert table.count("\n|") >= len(rows) + 1


@pytest.mark.parametrize("stage", [1, 2])
def test_computed_weight_bytes_are_what_a_bf16_frozen_model_holds(stage):
    """bench.py levers' weight bytes (4 a parameter, less 2 for each one store_frozen keeps in bf16) are the bytes a
    built model holds after store_frozen: the formula BENCHMARKS.md states for LLaVA-1.5-7B, checked on a small one."""
    import memory

    cfg = vlm_preset("debug").with_overrides({"llm": {"n_layers": 3, "ffn_dim": 200}, "vision": {"n_layers": 3}})
    model = build_model(cfg, seed=0)
    parallel.freeze(model, stage)
    parallel.store_frozen(model, torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert memory.lever_memory(build_model(cfg, seed=0), stage, "bfloat16", "full", 1, 2, 64)[0] == held
    assert memory.lever_memory(build_model(cfg, seed=0), stage, "float32", "full", 1, 2, 64)[0] == 4 * sum(
        p.numel() for p in model.parameters())


def test_the_7b_bench_config_is_issue_24s_row_and_bench_levers_runs():
    cfg = config.load_config([str(ROOT / "configs/bench_7b_stage1.py")])
    vlm = config.model_config(cfg)
    assert (vlm.llm.dim, vlm.llm.n_layers, vlm.vision.image_size, cfg["stage"], cfg["seq_len"], cfg["pack"],
            cfg["micro_batch_size"], cfg["activation_checkpointing"], cfg["compile"]) == (4096, 32, 336, 1, 2048, 3, 8,
                                                                                           True, True)
    r = forkserver.run([sys.executable, str(ROOT / "bench.py"), "levers"], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0 and "13.82 GB" in r.stdout and r.stdout.count("\n|") == 10, r.stdout + r.stderr


def test_a_bf16_frozen_lora_checkpoint_merges_its_small_update_in_fp32(tmp_path):
    """to-hf --merge-lora of a frozen_dtype='bfloat16' LoRA run: the merged weight (W in bf16, a small update from
    fp32 adapters) rounded back to bf16 lost about a third of an update 1/200 of W's size; the exported model must
    be the adapted one the run trained."""
    from lora import adapters_off, merge_lora_state

    cfg = vlm_preset("debug")
    cfg.vision.image_size, cfg.vision.patch_size, cfg.llm.vocab_size, cfg.image_token_id = 28, 14, 576, 512
    model = build_model(cfg, seed=0)
    lora = LoRAConfig(r=4, alpha=8, targets=["llm"])
    apply_lora(model, lora, seed=0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.weight.normal_(std=5e-5)
    parallel.freeze(model, 2)
    parallel.store_frozen(model, torch.bfloat16)
    merged = merge_lora_state(model.state_dict(), lora)
    assert merged["llm.layers.0.attention.wq.weight"].dtype == torch.float32
    plain = build_model(vlm_preset("debug").with_overrides({"vision": {"image_size": 28, "patch_size": 14},
                                                            "llm": {"vocab_size": 576}, "image_token_id": 512}),
                        init=False)
    plain.load_state_dict(merged)
    ids, pixels, _ = image_batch(cfg.n_image_tokens, 512, 512, batch=2, seq=20)
    with torch.no_grad():
        adapted = model.float().eval()(ids, pixels)[0]  # the bf16-stored base read in fp32, as the run computed it
        with adapters_off(model):
            base = model(ids, pixels)[0]
        got = plain.eval()(ids, pixels)[0]
    update = (adapted - base).abs().max()
    assert update > 1e-4 and (got - adapted).abs().max() < 1e-2 * update  # in bf16: ~30%


def test_the_long_recipes_default_to_bounded_attention_resolved_at_setup(capsys):
    """attention='bounded' (the recipes' default) is blockwise where there is no TPU, said once; the TPU recipes and the
    OneVision post-training configs set it (dense attention at their row lengths does not fit a pod's chips)."""
    import functools
    from types import SimpleNamespace

    import attention
    import config
    import parallel
    from conftest import ROOT

    kernel = parallel.attention_kernel("bounded", 128, SimpleNamespace(kind="cpu", master=True, rank=0))
    assert isinstance(kernel, functools.partial) and kernel.func is attention.blockwise_attention
    assert "attention='bounded': blockwise (no TPU with Pallas here)" in capsys.readouterr().out
    for name in ("onevision_qwen2_7b", "llava_next_7b", "tpu_pretrain", "dpo_onevision", "grpo_onevision",
                 "ppo_onevision"):
        assert config.parse([str(ROOT / f"configs/{name}.py")], config.DEFAULTS)["attention"] == "bounded", name


def test_each_tpu_recipe_as_written_fits_the_pod_it_runs_on():
    """bench.py xla's computed GiB a chip of configs/tpu_pretrain.py, llava_next_7b.py and onevision_qwen2_7b.py as
    written, on the pods docs/recipes.md names: each within the chip's HBM; OneVision's rows would not fit with the
    dense attention the configs had before."""
    import memory

    for config_file, (pod, _) in memory.TPU_RECIPES.items():
        gib, hbm = memory.recipe_memory(config_file)
        assert gib <= hbm, (config_file, pod, gib, hbm)
    dense, hbm = memory.recipe_memory("configs/onevision_qwen2_7b.py", attention="dense")
    assert dense > hbm


def test_the_tpu_recipe_table_says_what_it_assumes(capsys):
    """bench.py xla's table of the recipes as written counts one row a chip where a recipe's micro_batch_size is below
    the pod's chips, and its bounded attention is a Pallas kernel never run here: each row says so, rather than
    showing a figure for a batch the config does not have."""
    import config
    import memory

    memory.print_recipe_memory()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == set(memory.TPU_RECIPES)
    for config_file, (pod, _) in memory.TPU_RECIPES.items():
        cfg = config.load_config([str(ROOT / config_file)])
        chips = (memory.PODS | memory.ATTENTION_PODS)[pod][0]
        assert (f"assumed: --micro_batch_size={chips}" in rows[config_file]) == (cfg["micro_batch_size"] < chips)
        assert ("never run" in rows[config_file]) == (cfg["attention"] in ("bounded", "splash", "flash"))
