"""The torch_xla SPMD runs of test_xla.py, in one process on CPU virtual devices (PJRT_DEVICE=CPU
CPU_NUM_DEVICES=4): python tests/xla_runs.py SHAPES_DIR OUT_DIR [--full] writes OUT_DIR/results.json.
Without --full (make test): both stages on a mesh each, the tile path, checkpoints between XLA and CPU and across XLA
meshes, the sharding rules and mesh errors. --full (make test-full) adds the other meshes, packed rows, LoRA, the
compile count of varying data, FSDP2's checkpoint, the stock planner and a non-finite step."""

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import parallel  # noqa: E402
import train  # noqa: E402
from lora import LoRAConfig, apply_lora  # noqa: E402
from model import build_model  # noqa: E402
from model_config import vlm_preset  # noqa: E402

# each mesh once, each stage on two of them (the gradient matrix in xla_grads.py covers stages x dtypes x
# checkpointing x packing on one mesh; these runs check five-step losses across meshes): make test runs the first
# mesh of each stage, which between them shard over all three axes
STAGE_MESHES = {1: ([1, 2, 2], [4, 1, 1]), 2: ([2, 2, 1], [1, 4, 1])}
# LoRA on the LLM and the ViT's attention (stage 0: the rest of the ViT and the projector in full), under torch_xla's
# (reentrant) activation checkpointing, which gave the ViT's adapters no gradient while its input needed none
LORA = ["--stage=0", "--lora={'r': 4, 'alpha': 8, 'targets': ['llm', 'vision.attn']}", "--max_iters=5", "--ckpt_interval=0"]
PACKED = ["--pack=2", "--batch_size=4", "--micro_batch_size=4", "--seq_len=96", "--loss_chunk=40"]
# the tile path: OneVision's anyres_max (with its bilinear reduction at this size: N=2), up to a base view and a 2x2
# grid a row, on test_xla.py's mixed data (single images of many aspect ratios, two-image and text-only samples)
TILED_MODEL = {"vision": {"image_size": 28, "patch_size": 14}, "llm": {"vocab_size": 576}, "image_token_id": 512,
               "anyres": "anyres_max_2", "grid_pinpoints": [[28, 56], [56, 28], [56, 56]]}


def tiled(mixed):
    return [f"--data_dir={mixed / 'shards'}", f"--model_overrides={TILED_MODEL!r}", "--max_tiles=5", "--max_iters=10",
            "--ckpt_interval=0"]


def common(shapes, out):
    return [str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}",
            f"--out_dir={out}", "--lr_decay_iters=20", "--log_interval=1", "--eval_interval=0", "--device=xla"]


def log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def shard_shapes(mesh_shape):
    """Local shard shape of a few parameters and of their AdamW moments, by the sharding rules."""
    import torch_xla
    import torch_xla.core.xla_model
    import torch_xla.runtime as xr

    xr.use_spmd()
    env = SimpleNamespace(kind="xla", device=torch_xla.device(), mesh=parallel.make_mesh(mesh_shape, [1, 1, 1], 4))
    model = apply_lora(build_model(vlm_preset("debug"), seed=0), LoRAConfig(r=4, targets=["llm"]))
    parallel.shard_spmd(model, env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parallel.init_optimizer_state(model, optimizer, env)
    params = dict(model.named_parameters())
    names = ["llm.layers.0.attention.wq.weight", "llm.layers.0.attention.wo.weight", "llm.layers.1.feed_forward.w2.weight",
             "llm.tok_embeddings.weight", "vision.blocks.0.mlp.c_fc.bias", "llm.norm.weight",
             "llm.layers.0.attention.wq.lora_A.weight", "llm.layers.1.feed_forward.w2.lora_B.weight"]

    torch_xla.sync()
    torch_xla.core.xla_model.wait_device_ops()

    def local(t):
        return list(torch_xla._XLAC._get_local_shards([t])[0][0][0].shape)  # (tensor, device) pairs

    return {n: {"param": local(params[n]), "exp_avg": local(optimizer.state[params[n]]["exp_avg"])} for n in names}


def planner_keys(out):
    """Per mesh: the model and moment tensors missing from a checkpoint written by torch_xla 2.9's stock
    SPMDSavePlanner and by ours (checkpoint.planners)."""
    import torch.distributed.checkpoint as dcp
    import torch_xla
    import torch_xla.runtime as xr
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    import checkpoint

    xr.use_spmd()
    missing = {}
    for mesh in ([4, 1, 1], [1, 4, 1], [1, 2, 2], [2, 2, 1], [2, 1, 2]):
        env = SimpleNamespace(kind="xla", device=torch_xla.device(), mesh=parallel.make_mesh(mesh, [1, 1, 1], 4))
        model = build_model(vlm_preset("debug"), seed=0)
        parallel.shard_spmd(model, env)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        parallel.init_optimizer_state(model, optimizer, env)
        tensors, _ = checkpoint.train_state(model, model, optimizer, env)
        name = "x".join(map(str, mesh))
        for kind, planner in (("stock", SPMDSavePlanner()), ("ours", checkpoint.planners(env)[0])):
            with checkpoint.quiet():
                dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(out / f"{name}-{kind}")), planner=planner)
            saved = checkpoint.saved_tensors(out / f"{name}-{kind}")
            missing.setdefault(name, {})[kind] = sorted(set(tensors) - set(saved))
    return missing


def main(shapes, out, full):
    results = {"losses": {}, "sharding": {}, "mesh_errors": {}}
    for stage, meshes in STAGE_MESHES.items():
        for mesh in meshes if full else meshes[:1]:
            d = out / f"stage{stage}-{'x'.join(map(str, mesh))}"
            checkpointing = mesh == [2, 2, 1]  # torch_xla's activation checkpointing must not change the losses
            train.main(common(shapes, d) + [f"--stage={stage}", "--max_iters=5", "--ckpt_interval=0", f"--mesh={mesh}",
                                            f"--activation_checkpointing={checkpointing}"])
            results["losses"][d.name] = [e["loss"] for e in log(d) if "loss" in e]

    # the tile path: one compiled step whatever a batch's image counts and grids, the CPU eager losses
    d = out / "xla-tiled"
    train.main(common(shapes, d) + tiled(out / "mixed") + ["--mesh=[2,2,1]"])
    results["tiled"] = {"losses": [e["loss"] for e in log(d) if "loss" in e],
                        "compiles": [e["xla_compiles"] for e in log(d) if "loss" in e]}

    # checkpoints: XLA writes step 10 (the CPU side resumes it); XLA resumes the CPU run's step 10 to 20
    train.main(common(shapes, out / "xla-save") + ["--max_iters=10", "--ckpt_interval=10", "--mesh=[1,2,2]"])
    train.main(common(shapes, out / "xla-resume") + ["--max_iters=20", "--ckpt_interval=10", "--mesh=[2,1,2]",
                                                     "--init_from=resume"])
    results["xla_resume_losses"] = {e["step"]: e["loss"] for e in log(out / "xla-resume") if "loss" in e}
    # and XLA resumes its own checkpoint: against 20 straight XLA steps on the same mesh
    (out / "xla-xla").mkdir()
    shutil.copytree(out / "xla-save/step-000010", out / "xla-xla/step-000010")
    train.main(common(shapes, out / "xla-xla") + ["--max_iters=20", "--ckpt_interval=10", "--mesh=[1,2,2]",
                                                  "--init_from=resume"])
    train.main(common(shapes, out / "xla-straight") + ["--max_iters=20", "--ckpt_interval=10", "--mesh=[1,2,2]"])
    for name in ("xla-xla", "xla-straight"):
        results[name] = {e["step"]: e["loss"] for e in log(out / name) if "loss" in e}

    # resharding on load: XLA's own step 10 on another mesh, and FSDP2's (2 ranks, test_xla.py). Iteration 10 is
    # skipped (its batch consumed, nothing trained), so step 11 holds exactly what the load produced
    shutil.copytree(out / "xla-save/step-000010", out / "xla-remesh/step-000010")
    for name, mesh in (("xla-remesh", "[4,1,1]"), ("xla-from-fsdp", "[2,1,2]"))[:2 if full else 1]:
        train.main(common(shapes, out / name) + ["--max_iters=11", "--skip_steps=[(10, 11)]", f"--mesh={mesh}",
                                                 "--init_from=resume", "--keep_last=5"])
    for mesh in ([1, 2, 2], [1, 4, 1]):
        results["sharding"]["x".join(map(str, mesh))] = shard_shapes(mesh)
    for bad in ("[3,1,1]", "[-1,-1,1]", "[1,2]", "[2,2,2]"):
        try:
            train.main(common(shapes, out / "bad") + [f"--mesh={bad}", "--max_iters=1"])
            results["mesh_errors"][bad] = None
        except SystemExit as e:
            results["mesh_errors"][bad] = str(e)
    if full:
        full_runs(shapes, out, results)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def full_runs(shapes, out, results):
    """What make test-full adds: packed rows, LoRA, the compile count of varying data, the stock planner, a
    non-finite step."""
    # packed rows: the dense document mask is the static-shape form XLA compiles
    train.main(common(shapes, out / "xla-packed") + ["--max_iters=5", "--ckpt_interval=0", "--mesh=[2,2,1]", *PACKED])
    results["losses"]["packed"] = [e["loss"] for e in log(out / "xla-packed") if "loss" in e]

    train.main(common(shapes, out / "xla-lora") + LORA + ["--mesh=[1,2,2]", "--activation_checkpointing=True"])
    results["losses"]["lora"] = [e["loss"] for e in log(out / "xla-lora") if "loss" in e]

    # compiles: 10 steps of varying data (stage 0, with a dropped sample or two from a short seq_len)
    d = out / "compiles"
    train.main(common(shapes, d) + ["--max_iters=10", "--ckpt_interval=0", "--mesh=[2,2,1]", "--seq_len=24"])
    results["compiles"] = [e["xla_compiles"] for e in log(d) if "loss" in e]
    results["dropped"] = sum(e.get("dropped_samples", 0) for e in log(d))

    results["planner_keys"] = planner_keys(out / "planner")

    # a non-finite loss at iteration 2 (test-only hook): the update is undone inside the compiled step
    os.environ["LLAVAX_TEST_NONFINITE"] = "2"
    train.main(common(shapes, out / "xla-nan") + ["--max_iters=4", "--ckpt_interval=0", "--mesh=[1,4,1]"])
    del os.environ["LLAVAX_TEST_NONFINITE"]
    train.main(common(shapes, out / "xla-skip") + ["--max_iters=4", "--ckpt_interval=0", "--mesh=[1,4,1]",
                                                   "--skip_steps=[(2, 3)]"])
    for name in ("xla-nan", "xla-skip"):
        results[name] = {e["step"]: e["loss"] for e in log(out / name) if "loss" in e}


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), full="--full" in sys.argv[3:])
