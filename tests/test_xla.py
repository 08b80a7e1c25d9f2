"""The torch_xla SPMD path on CPU virtual devices: the same losses as the CPU eager run for both stages (on two
meshes; four, packed rows and LoRA in make test-full), one compiled step for tiled batches of every mix, the sharding
rules, checkpoints across XLA and CPU and across meshes, and mesh errors.
The XLA runs share one subprocess (tests/xla_runs.py), so they neither disturb nor slow the other tests."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, checkpoint_bytes
from test_train import args, losses, run
from xla_runs import LORA, PACKED, tiled

pytestmark = pytest.mark.slow
REL = 1e-4


@pytest.fixture(scope="module")
def xla(request, tmp_path_factory):
    """The CPU runs, then tests/xla_runs.py; with --full when a selected test of this module is marked full."""
    from shapes import make_shapes

    full = any(item.get_closest_marker("full") for item in request.session.items if item.module is request.module)
    shapes = tmp_path_factory.mktemp("xla_shapes")
    make_shapes(shapes, n=400, seed=0, val_fraction=0.1)
    out = tmp_path_factory.mktemp("xla")
    cpu = {}
    for stage in (1, 2):
        cpu[stage] = out / f"cpu-stage{stage}"
        run(args(shapes, cpu[stage], f"--stage={stage}", "--max_iters=5", "--ckpt_interval=0"))
    run(args(shapes, out / "cpu-straight", "--max_iters=20", "--ckpt_interval=10", "--keep_last=5"))
    make_mixed(out / "mixed")
    run(args(shapes, out / "cpu-tiled", *tiled(out / "mixed")))
    (out / "xla-resume").mkdir()
    shutil.copytree(out / "cpu-straight/step-000010", out / "xla-resume/step-000010")  # the CPU run's checkpoint
    if full:
        run(args(shapes, out / "cpu-packed", "--max_iters=5", "--ckpt_interval=0", *PACKED))
        run(args(shapes, out / "cpu-lora", *LORA))
        # FSDP2 on 2 ranks writes step 10; XLA resumes it on a (2, 1, 2) mesh
        run(args(shapes, out / "fsdp", "--max_iters=10", "--parallel=fsdp", "--micro_batch_size=4"), nproc=2)
        (out / "xla-from-fsdp").mkdir()
        shutil.copytree(out / "fsdp/step-000010", out / "xla-from-fsdp/step-000010")
    env = os.environ | {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                        "XLA_FLAGS": "--xla_backend_optimization_level=0"}  # compiles faster; the same numbers
    r = subprocess.run([sys.executable, str(ROOT / "tests/xla_runs.py"), str(shapes), str(out), *["--full"] * full],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    results = json.loads((out / "results.json").read_text())
    # and the CPU side resumes what XLA saved
    run(args(shapes, out / "xla-save", "--max_iters=20", "--ckpt_interval=10", "--init_from=resume"))
    return out, shapes, cpu, results


SIZES = [(500, 333), (333, 500), (90, 20), (20, 90), (61, 61), (7, 200), (640, 480), (28, 28)]  # (width, height)


def make_mixed(out, n=48):
    """LLaVA-OneVision-style records, packed: single images whose sizes select each grid of xla_runs.TILED_MODEL
    (2x2, 1x2, 2x1, 1x1-ish strips, odd sizes), two-image samples and text-only ones, in an order that gives every
    batch of 8 another mix."""
    import numpy as np

    from pack import pack
    from shapes import NUMBERS, draw_scene

    rng, records = np.random.default_rng(0), []
    (out / "images").mkdir(parents=True)
    for i in range(n):
        kind = ("single", "single", "two", "text")[int(rng.integers(4))]
        scenes = [draw_scene(rng, 48) for _ in range({"single": 1, "two": 2, "text": 0}[kind])]
        names = []
        for j, (img, _) in enumerate(scenes):
            names.append(f"{i:03d}-{j}.{'jpg' if j else 'png'}")
            img.resize(SIZES[int(rng.integers(len(SIZES)))]).save(out / "images" / names[-1])
        circles = [sum(s == "circle" for s, *_ in objects) for _, objects in scenes]
        if kind == "text":
            conv = [{"from": "human", "value": "How many sides has a square?"}, {"from": "gpt", "value": "four"}]
        elif kind == "single":
            conv = [{"from": "human", "value": "<image>\nHow many circles are there?"},
                    {"from": "gpt", "value": NUMBERS[circles[0]]}]
        else:
            more = "the first" if circles[0] > circles[1] else "the second" if circles[1] > circles[0] else "neither"
            conv = [{"from": "human", "value": "<image>\n<image>\nWhich image has more circles?"},
                    {"from": "gpt", "value": more}]
        records.append({"id": f"mixed-{i}", "image": names, "conversations": conv} if names else
                       {"id": f"mixed-{i}", "conversations": conv})
    (out / "mixed.json").write_text(json.dumps(records))
    pack(out / "mixed.json", out / "images", out / "shards", shard_size=1000, overwrite=True)


def close(a, b):
    return abs(a - b) <= REL * abs(b)


@pytest.mark.parametrize("stage,mesh", [(1, "1x2x2"), (2, "2x2x1"), pytest.param(1, "4x1x1", marks=pytest.mark.full),
                                        pytest.param(2, "1x4x1", marks=pytest.mark.full)])
def test_xla_losses_match_cpu_eager(xla, stage, mesh):
    out, _, cpu, results = xla
    expected = list(losses(cpu[stage]).values())
    got = results["losses"][f"stage{stage}-{mesh}"]
    assert len(got) == len(expected) == 5
    assert all(close(g, e) for g, e in zip(got, expected)), (got, expected)


@pytest.mark.full
def test_xla_packed_rows_match_cpu_eager(xla):
    out, _, _, results = xla
    expected = list(losses(out / "cpu-packed").values())
    assert len(expected) == 5 and all(close(g, e) for g, e in zip(results["losses"]["packed"], expected))


@pytest.mark.full
def test_xla_lora_with_activation_checkpointing_matches_cpu_eager(xla):
    out, _, _, results = xla
    expected = list(losses(out / "cpu-lora").values())
    assert len(expected) == 5 and all(close(g, e) for g, e in zip(results["losses"]["lora"], expected))


@pytest.mark.full
def test_compile_count_is_flat_after_warmup(xla):
    _, _, _, results = xla
    compiles = results["compiles"]
    assert len(compiles) == 10 and results["dropped"] > 0  # varying data, some rows dropped to padding
    # the count is the process's running total (earlier runs included): the first two steps compile (the
    # second sees AdamW's step count > 0), then steps 3-10 reuse the same graphs whatever the data and lr
    assert compiles[1] == compiles[-1], compiles


def test_parameters_and_moments_are_sharded_by_the_rules(xla):
    _, _, _, results = xla
    fsdp, mixed = results["sharding"]["1x4x1"], results["sharding"]["1x2x2"]
    # 4-way fsdp: column-parallel (out, in) weights shard `in`, row-parallel ones shard `out`
    assert fsdp["llm.layers.0.attention.wq.weight"]["param"] == [64, 16]
    assert fsdp["llm.layers.0.attention.wo.weight"]["param"] == [16, 64]
    assert fsdp["llm.tok_embeddings.weight"]["param"] == [512, 16]
    assert fsdp["llm.norm.weight"]["param"] == [64]  # replicated
    # LoRA adapters (r 4): the dimension shared with their layer over fsdp, r whole
    assert fsdp["llm.layers.0.attention.wq.lora_A.weight"]["param"] == [4, 16]
    assert fsdp["llm.layers.1.feed_forward.w2.lora_B.weight"]["param"] == [16, 4]
    assert mixed["llm.layers.0.attention.wq.lora_A.weight"]["param"] == [4, 32]
    # fsdp 2 x tp 2: heads / the MLP hidden dimension over tp, the other dimension over fsdp
    assert mixed["llm.layers.1.feed_forward.w2.weight"]["param"] == [32, 96]
    assert mixed["vision.blocks.0.mlp.c_fc.bias"]["param"] == [128]
    for shapes in (fsdp, mixed):
        for name, s in shapes.items():
            assert s["exp_avg"] == s["param"], name  # AdamW state sharded like its parameter


def test_checkpoints_move_between_xla_and_cpu(xla):
    out, _, _, results = xla
    straight = losses(out / "cpu-straight")
    # XLA saved step 10, the CPU resumed it to 20
    after_xla = losses(out / "xla-save")
    assert sorted(after_xla) == list(range(1, 21))
    assert all(close(after_xla[s], straight[s]) for s in range(1, 21)), (after_xla, straight)
    # the CPU saved step 10, XLA resumed it to 20
    resumed = {int(k): v for k, v in results["xla_resume_losses"].items()}
    assert sorted(resumed) == list(range(11, 21))
    assert all(close(resumed[s], straight[s]) for s in resumed), (resumed, straight)
    # XLA saved, XLA resumed: the same steps as 20 straight XLA steps, and the same final weights
    resumed, straight_xla = results["xla-xla"], results["xla-straight"]
    assert sorted(int(s) for s in resumed) == list(range(11, 21))
    assert all(resumed[s] == straight_xla[s] for s in resumed), (resumed, straight_xla)
    assert checkpoint_bytes(out / "xla-xla/step-000020") == checkpoint_bytes(out / "xla-straight/step-000020")
    state = json.loads((out / "xla-save/step-000010/state.json").read_text())
    assert state["iter"] == 10 and state["loader"]["position"] == 80


def loaded_exactly(saved, written):
    return all(checkpoint_bytes(written, p) == checkpoint_bytes(saved, p) for p in ("model.", "optim."))


def test_checkpoints_reshard_across_xla_meshes(xla):
    out = xla[0]
    # XLA (1, 2, 2) -> XLA (4, 1, 1): every weight and moment as saved
    assert loaded_exactly(out / "xla-save/step-000010", out / "xla-remesh/step-000011")


@pytest.mark.full  # make test: tests/test_checkpoint.py reshards FSDP2 across world sizes, the test above XLA meshes
def test_checkpoints_reshard_between_xla_and_fsdp2(xla, tmp_path):
    out, shapes, _, _ = xla
    # FSDP2 (2 ranks) -> XLA mesh (2, 1, 2): every weight and moment as saved
    assert loaded_exactly(out / "fsdp/step-000010", out / "xla-from-fsdp/step-000011")
    # XLA (1, 2, 2) -> FSDP2 on 2 ranks
    shutil.copytree(out / "xla-save/step-000010", tmp_path / "step-000010")
    r = run(args(shapes, tmp_path, "--max_iters=11", "--skip_steps=[(10, 11)]", "--init_from=resume", "--keep_last=5",
                 "--parallel=fsdp", "--micro_batch_size=4"), nproc=2)
    assert "world changed from 1 to 2" in r.stdout and "micro_batch_size changed from 8 to 4" in r.stdout
    assert loaded_exactly(out / "xla-save/step-000010", tmp_path / "step-000011")


@pytest.mark.full
def test_the_stock_xla_planner_loses_replicated_shards_and_ours_keeps_them(xla):
    missing = xla[3]["planner_keys"]
    assert set(missing) == {"4x1x1", "1x4x1", "1x2x2", "2x2x1", "2x1x2"}
    assert all(m["ours"] == [] for m in missing.values()), missing
    # pytorch/xla#7919: a shard that two local devices hold is dropped: with dp > 1 every sharded tensor and its
    # moments (96 tensors of the debug model on 2x2x1), with tp > 1 those replicated over tp or fsdp
    assert "model.llm.layers.0.attention.wk.weight" in missing["2x2x1"]["stock"]
    assert "optim.state.llm.layers.0.attention.wk.weight.exp_avg" in missing["2x2x1"]["stock"]
    assert missing["1x2x2"]["stock"] and missing["2x1x2"]["stock"]


@pytest.mark.full
def test_nonfinite_update_is_skipped_inside_the_compiled_step(xla):
    _, _, _, results = xla
    poisoned, skipped = results["xla-nan"], results["xla-skip"]
    assert poisoned["3"] is None and "3" not in skipped  # no loss for the skipped update; skip_steps logs none
    # the next step starts from the same weights as when the batch was skipped by skip_steps
    assert close(poisoned["4"], skipped["4"]) and close(poisoned["2"], skipped["2"]), (poisoned, skipped)


def test_bad_meshes_are_clear_errors(xla):
    _, _, _, results = xla
    errors = results["mesh_errors"]
    assert "3 devices, but there are 4" in errors["[3,1,1]"]
    assert "at most one -1" in errors["[-1,-1,1]"]
    assert "[dp, fsdp, tp]" in errors["[1,2]"]
    assert "8 devices" in errors["[2,2,2]"]


def test_tiled_steps_compile_once_and_match_cpu_eager(xla):
    """Batches of single images of many aspect ratios (different grids, OneVision's reduction), two-image samples
    and text-only rows, in another mix each step: one compiled step, and the CPU eager losses."""
    from xla_runs import TILED_MODEL

    import loader
    from model_config import vlm_preset

    out, shapes, _, results = xla
    vlm = vlm_preset("debug").with_overrides(TILED_MODEL)
    stream = loader.ShardStream(out / "mixed/shards", shapes / "tokenizer.model", batch_size=8, seq_len=48, image_size=28,
                              image_token_id=512, n_image_tokens=4, template="llama_3", vlm=vlm, max_tiles=5)
    batches = [stream.batch(k) for k in range(10)]  # what the 10 steps read
    tokens = [tuple((b["image_weight"].sum(-1) > 0).sum(-1).tolist()) for b in batches]  # image tokens a row
    assert len(set(tokens)) == 10 and len({n for t in tokens for n in t}) >= 6, tokens
    assert not any(b["dropped"].any() for b in batches)
    assert max(int((b["image_weight"] > 0).sum(-1).max()) for b in batches) == 4  # bilinear reduction taps in use
    compiles, got = results["tiled"]["compiles"], results["tiled"]["losses"]
    expected = list(losses(out / "cpu-tiled").values())
    assert len(got) == len(expected) == 10 and all(close(g, e) for g, e in zip(got, expected)), (got, expected)
    assert compiles[1] == compiles[-1], compiles
