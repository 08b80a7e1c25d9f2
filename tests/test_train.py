"""train.py: exact resume (single, DDP, FSDP under real torchrun), equivalence, preemption, config, stages."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import ROOT, checkpoint_bytes, checkpoint_tensors, run_log
from safetensors.torch import load_file

import chat
import checkpoint
import checkpoint_writer
import config
import evaluation
import images
import loader
import model_files
import parallel
import train
from model import build_model
from model_config import vlm_preset


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=400, seed=0, val_fraction=0.1)


def args(shapes, out, *extra):
    return [str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}",
            f"--out_dir={out}", "--lr_decay_iters=20", "--log_interval=1", "--eval_interval=0", *extra]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, nproc=1, check=True, **kw):
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), str(ROOT / "train.py"), *argv]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if not kw:  # a real process (torchrun's launcher, or train.py), forked after the imports (tests/forkserver.py)
        r = forkserver.run(cmd, env, cwd=ROOT, timeout=300)
    else:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def losses(out):
    return {e["step"]: e["loss"] for e in run_log(out, "loss")}


def checkpoint_model(path):
    return {k[len("model."):]: v for k, v in checkpoint_tensors(path, "model.").items()}


def weights(path):
    return checkpoint_bytes(path, "model.")


@pytest.fixture(scope="module")
def single_run(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run(args(shapes, out, "--max_iters=20", "--keep_last=5"))
    return out


def test_single_process_resume_is_bit_identical(shapes, single_run, tmp_path):
    run(args(shapes, tmp_path, "--max_iters=10"))
    run(args(shapes, tmp_path, "--max_iters=20", "--init_from=resume"))
    assert weights(tmp_path / "step-000020") == weights(single_run / "step-000020")
    assert checkpoint_bytes(tmp_path / "step-000020", "optim.") == checkpoint_bytes(single_run / "step-000020", "optim.")
    state = json.loads((tmp_path / "step-000020/state.json").read_text())
    assert state["iter"] == 20 and state["loader"]["position"] == 20 * 8
    assert (tmp_path / "DONE").exists()


def test_gradient_accumulation_matches_one_big_batch(shapes, single_run, tmp_path):
    run(args(shapes, tmp_path, "--max_iters=5", "--micro_batch_size=4"))
    ref, got = losses(single_run), losses(tmp_path)
    assert all(abs(got[s] - ref[s]) < 1e-5 for s in range(1, 6)), (got, ref)


@pytest.fixture(scope="module")
def ddp_run(shapes, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    run(args(shapes, out, "--max_iters=20", "--parallel=ddp", "--micro_batch_size=4"), nproc=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.full), "fsdp"])
def test_two_process_run_matches_single_and_resumes_exactly(shapes, single_run, ddp_run, tmp_path, parallel):
    a, b = ddp_run if parallel == "ddp" else tmp_path / "a", tmp_path / "b"
    common = [f"--parallel={parallel}", "--micro_batch_size=4"]  # 2 ranks x 4 = the single run's global batch
    if parallel == "fsdp":
        run(args(shapes, a, "--max_iters=20", *common), nproc=2)
    ref, got = losses(single_run), losses(a)
    assert all(abs(got[s] - ref[s]) < 1e-5 for s in range(1, 6)), (got, ref)
    run(args(shapes, b, "--max_iters=10", *common), nproc=2)
    run(args(shapes, b, "--max_iters=20", "--init_from=resume", *common), nproc=2)
    assert weights(b / "step-000020") == weights(a / "step-000020")


@pytest.mark.full  # make test: the process group's SIGTERM below, which checkpoints and resumes bit for bit
def test_sigterm_finishes_the_step_checkpoints_and_resumes(shapes, tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), *args(shapes, tmp_path, "--max_iters=100000", "--ckpt_interval=0")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("step 3:"):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, rest
    assert "stopping after this step" in rest
    (ckpt,) = checkpoint.checkpoints(tmp_path)
    stopped = json.loads((ckpt / "state.json").read_text())["iter"]
    assert stopped >= 3 and not (tmp_path / "DONE").exists()
    r = run(args(shapes, tmp_path, f"--max_iters={stopped + 2}", "--init_from=resume"))
    assert f"resuming from {ckpt}" in r.stdout and f"step {stopped + 2}:" in r.stdout and (tmp_path / "DONE").exists()


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_resumes_exactly(shapes, single_run, tmp_path):
    # as VM shutdown, SLURM and systemd deliver it: TERM to every process of the group, DataLoader workers included
    common = ["--num_workers=2", "--ckpt_interval=0", "--keep_last=5"]
    cmd = [sys.executable, str(ROOT / "train.py"), *args(shapes, tmp_path, "--max_iters=20", *common)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step 4:"):
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, rest
    (ckpt,) = checkpoint.checkpoints(tmp_path)
    assert 4 <= json.loads((ckpt / "state.json").read_text())["iter"] < 20, rest
    run(args(shapes, tmp_path, "--max_iters=20", "--init_from=resume", *common))
    assert weights(tmp_path / "step-000020") == weights(single_run / "step-000020")


def torchrun_workers(torchrun_pid):
    """The train.py processes torchrun started (its children): not their loader workers or a detached writer."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == torchrun_pid:
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


@pytest.mark.slow
@pytest.mark.full  # make test: tests/test_checkpoint.py's one-process run, SIGKILLed while its stop writer writes
def test_torchrun_stop_checkpoint_survives_the_sigkill_after_the_grace_period(shapes, ddp_run, tmp_path):
    # torchrun forwards SIGTERM to each worker's group and SIGKILLs them 30 s later (hard-coded in torch 2.9);
    # a stop checkpoint slower than that (LLAVAX_TEST_SLOW_CHECKPOINT: a slow disk) must still be completed
    common = ["--max_iters=10", "--micro_batch_size=4", "--ckpt_interval=0", "--num_workers=1", "--keep_last=5"]
    out = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train.py"), *args(shapes, out, *common)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LLAVAX_TEST_SLOW_CHECKPOINT": "5"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step 2:"):
            os.killpg(proc.pid, signal.SIGTERM)  # as systemd or a shell's kill -- -PGID deliver it
            break
    t0 = time.time()
    markers = [checkpoint_writer.writer_pid_file(out, rank) for rank in (0, 1)]
    while not all(m.exists() for m in markers) and time.time() < t0 + 10:  # every rank has forked its writer
        time.sleep(0.05)
    writer = int(markers[0].read_text())
    assert not checkpoint.checkpoints(out)  # the kill comes mid-write
    for pid in torchrun_workers(proc.pid):  # what torchrun does when its 30 s are up, brought forward
        os.kill(pid, signal.SIGKILL)
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    assert "got signal 15" in rest, rest
    while os.path.exists(f"/proc/{writer}") and time.time() < t0 + 60:  # the writer lives on, in its own session
        time.sleep(0.2)
    (ckpt,) = checkpoint.checkpoints(out)
    assert 2 <= json.loads((ckpt / "state.json").read_text())["iter"] < 10
    r = run(args(shapes, out, "--init_from=resume", *common), nproc=2)
    assert f"resuming from {ckpt}" in r.stdout
    assert weights(out / "step-000010") == weights(ddp_run / "step-000010")  # uninterrupted, 20 steps


def test_kill_during_checkpoint_write_keeps_the_previous_one(shapes, tmp_path):
    # fault injection: SIGKILL ourselves halfway through writing the step-10 checkpoint
    script = (f"import sys, os, signal; sys.path.insert(0, {str(ROOT)!r}); import checkpoint_writer, train\n"
              "real = checkpoint_writer.write_manifest\n"
              "def dying(d, files):\n"  # every shard is on disk; the manifest, the commit, is next
              "    if 'step-000010' in str(d): os.kill(os.getpid(), signal.SIGKILL)\n"
              "    real(d, files)\n"
              "checkpoint_writer.write_manifest = dying\n"
              f"train.main({args(shapes, tmp_path, '--max_iters=20', '--ckpt_interval=5')!r})\n")
    r = forkserver.run([sys.executable, "-c", script], os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == -signal.SIGKILL
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000005"]
    assert (tmp_path / "step-000010/.metadata").exists() and not (tmp_path / "step-000010/manifest.json").exists()
    r = run(args(shapes, tmp_path, "--max_iters=12", "--init_from=resume"))
    assert f"removing {tmp_path / 'step-000010'}: its write did not finish" in r.stdout
    assert "resuming from" in r.stdout and "step-000005" in r.stdout
    assert checkpoint.verify_checkpoint(tmp_path / "step-000010") is None  # written again, whole
    assert [p.name for p in checkpoint.checkpoints(tmp_path)][-1] == "step-000012"


def test_skip_steps_consume_batches_without_training(shapes, single_run, tmp_path):
    run(args(shapes, tmp_path, "--max_iters=10", "--skip_steps=[(3, 6)]"))
    log = run_log(tmp_path)
    assert [e["step"] for e in log if e.get("skipped")] == [3, 4, 5]
    ref, got = losses(single_run), losses(tmp_path)
    assert all(got[s] == ref[s] for s in (1, 2, 3)) and got[7] != ref[7]
    assert json.loads((tmp_path / "step-000010/state.json").read_text())["loader"]["position"] == 80


def test_updates_skipped_for_a_nonfinite_loss_are_not_counted_as_trained(shapes, tmp_path, monkeypatch):
    """Steps whose update is skipped (a non-finite loss) trained nothing: their samples count as dropped and their
    tokens as not trained, by source, as the same steps under skip_steps count them (which only the reason tells
    apart), in the checkpoint's figures and the run's closing line."""
    said = {}
    said["skip"] = run(args(shapes, tmp_path / "skip", "--max_iters=10", "--skip_steps=[(3, 5), (7, 8)]")).stdout
    monkeypatch.setenv("LLAVAX_TEST_NONFINITE", "3,4,7")
    said["nan"] = run(args(shapes, tmp_path / "nan", "--max_iters=10")).stdout
    figures = {k: json.loads((tmp_path / k / "step-000010/state.json").read_text())["loader"]["by_source"]
               for k in said}
    assert figures["nan"]["samples"] == figures["skip"]["samples"] and figures["nan"]["tokens"] == figures["skip"]["tokens"]
    (name, drawn), = figures["nan"]["samples"].items()
    assert drawn == 80 and figures["nan"]["dropped"][name].get("nonfinite_update") == 24
    assert figures["nan"]["dropped"][name] == {("nonfinite_update" if k == "skip_steps" else k): v
                                               for k, v in figures["skip"]["dropped"][name].items()}
    closing = {k: next(line for line in v.splitlines() if f"data: source {name}:" in line) for k, v in said.items()}
    assert closing["nan"].replace("nonfinite_update", "skip_steps") == closing["skip"], closing
    gone = sum(figures["nan"]["dropped"][name].values())
    assert f"{drawn} samples drawn, {drawn - gone} trained, {gone} dropped" in closing["nan"], closing


# -----------------------------------------------------------------------------
# in-process: config and stages


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(SystemExit, match="unknown key 'n_layer'"):
        config.load_config(["--n_layer=3"])
    with pytest.raises(SystemExit, match="max_iters must be int"):
        config.load_config(["--max_iters=ten"])
    with pytest.raises(SystemExit, match="lr must be float"):
        config.load_config(["--lr='fast'"])
    bad = tmp_path / "bad.py"
    bad.write_text("batch_size = 8\nlearning_rate = 1e-3\n")
    with pytest.raises(SystemExit, match=f"unknown key 'learning_rate' in {bad}"):
        config.load_config([str(bad)])
    cfg = config.load_config([str(ROOT / "configs/debug.py"), "--lr=3e-4", "--skip_steps=[(1, 2)]", "--template=vicuna_v1"])
    assert cfg["lr"] == 3e-4 and cfg["skip_steps"] == [(1, 2)] and cfg["template"] == "vicuna_v1"


def test_model_and_data_mismatches_are_config_errors(shapes, tmp_path):
    with pytest.raises(SystemExit, match="seq_len=600 exceeds the model's max_seq_len=512"):
        train.main(args(shapes, tmp_path / "a", "--seq_len=600"))
    overrides = "--model_overrides={'vision': {'image_size': 28}, 'llm': {'vocab_size': 576}, 'image_token_id': 5}"
    with pytest.raises(SystemExit, match="image_token_id=5 must lie in"):
        train.main(args(shapes, tmp_path / "b", overrides))
    with pytest.raises(SystemExit, match="python data.py shapes"):
        train.main(args(shapes, tmp_path / "c", f"--data_dir={tmp_path / 'nowhere'}"))


@pytest.mark.parametrize("stage,trained", [(1, {"projector"}), (2, {"projector", "llm"})])
def test_stages_change_exactly_the_intended_parameters(shapes, tmp_path, stage, trained):
    cfg = vlm_preset("debug")
    cfg.vision.image_size, cfg.llm.vocab_size, cfg.image_token_id = 28, 576, 512
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "init")
    train.main(args(shapes, tmp_path / "out", f"--stage={stage}", f"--init_from={tmp_path / 'init'}", "--max_iters=3"))
    before, after = load_file(tmp_path / "init/model.safetensors"), checkpoint_model(tmp_path / "out/step-000003")
    changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
    assert changed == trained
    for k in before:  # every parameter of a trained module moved, except the ones no loss reaches
        if k.split(".")[0] in trained:
            assert not torch.equal(before[k], after[k]), k


def test_resume_true_starts_from_init_from_then_continues_its_own_steps(shapes, tmp_path, capsys):
    """The launch scripts pass --resume=True on every start: the first must load init_from (a stage 2 fine-tune's
    stage 1 weights), not random weights, and a restart its own newest step."""
    cfg = vlm_preset("debug")
    cfg.vision.image_size, cfg.llm.vocab_size, cfg.image_token_id = 28, 576, 512
    model_files.save_model(build_model(cfg, seed=7), tmp_path / "init")
    common = [f"--init_from={tmp_path / 'init'}", "--ckpt_interval=2", "--keep_last=5"]
    train.main(args(shapes, tmp_path / "straight", *common, "--max_iters=4"))
    train.main(args(shapes, tmp_path / "scratch", "--max_iters=1", "--ckpt_interval=0"))
    capsys.readouterr()
    train.main(args(shapes, tmp_path / "restarted", *common, "--resume=True", "--max_iters=2"))
    assert "starting from " + str(tmp_path / "init") in capsys.readouterr().out
    train.main(args(shapes, tmp_path / "restarted", *common, "--resume=True", "--max_iters=4"))
    assert "resuming from " + str(tmp_path / "restarted/step-000002") in capsys.readouterr().out
    straight, restarted = losses(tmp_path / "straight"), losses(tmp_path / "restarted")
    assert restarted == straight and sorted(straight) == [1, 2, 3, 4]
    assert straight[1] != losses(tmp_path / "scratch")[1]  # init_from's weights, not the seed's
    assert weights(tmp_path / "restarted/step-000004") == weights(tmp_path / "straight/step-000004")


def test_trained_checkpoint_converts_to_hf_and_transformers_agrees(shapes, single_run, tmp_path):
    from transformers import LlavaForConditionalGeneration

    r = forkserver.run([sys.executable, str(ROOT / "convert.py"), "to-hf", "--ckpt", str(single_run / "step-000020"),
                        "--out", str(tmp_path / "hf")], os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ours = model_files.load_model(single_run / "step-000020").eval()
    s = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=2, seq_len=48, image_size=28,
                         image_token_id=512, n_image_tokens=4, template="llama_3", split="val")
    b = s.batch(0)
    pixels = images.normalize_images(b["pixel_values"])  # the loader hands over uint8; train.py normalises on device
    with torch.no_grad():
        theirs = hf(input_ids=b["input_ids"], pixel_values=pixels).logits
        mine, _ = ours(b["input_ids"], pixels)
    assert (theirs - mine).abs().max() < 1e-4
    assert (tmp_path / "hf/tokenizer.model").exists()
    # issue 21: the demo's sentencepiece-only tokenizer through AutoProcessor gave no image tokens ("tokens: 0")
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    image = Image.new("RGB", (333, 500), (200, 40, 40))
    assert hf(**processor(images=image, text="<image>\nWhat is at the top?", return_tensors="pt")).logits.shape[1] > 4
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is at the top?"}]}]
    inputs = processor(text=processor.apply_chat_template(conversation, add_generation_prompt=True), images=image)
    tok = chat.Tokenizer(shapes / "tokenizer.model")
    assert inputs.input_ids[0] == chat.tokenize([(chat.generation_prompt("llama_3", "<image>\nWhat is at the top?", tok),
                                                  False)], tok, 512, 4)[0]


@pytest.mark.parametrize("name", ["debug", "shapes", "pretrain", "finetune", "tpu_pretrain", "bench"])
def test_shipped_configs_parse(name):
    cfg = config.load_config([str(ROOT / "configs" / f"{name}.py")])
    assert cfg["batch_size"] % cfg["micro_batch_size"] == 0


def bench(*extra, size=("--size", "debug")):
    r = forkserver.run([sys.executable, str(ROOT / "bench.py"), "train", *size, "--peer", "hf", "--steps", "2",
                        "--warmup", "1", "--rounds", "1", "--dtype", "float32", "--device", "cpu", *extra],
                       os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.full
def test_bench_runs_ours_against_transformers_on_cpu():
    report = bench()
    assert report["ours"]["tokens_per_s"] > 0 and report["ratio"]["tokens_per_s"] > 0
    # the same weights and batch: the first losses agree
    assert abs(report["ours"]["first_loss"] - report["hf"]["first_loss"]) < 1e-4
    assert report["ours"]["padding_share"] == report["hf"]["padding_share"] > 0.5
    packed = bench("--pack", "--loss-chunk", "64")
    assert packed["ours"]["padding_share"] < 0.3 < packed["hf"]["padding_share"]
    assert packed["ours"]["samples_per_step"] >= 2 * packed["hf"]["samples_per_step"]
    assert abs(packed["ours"]["first_loss"] - packed["hf"]["first_loss"]) < 0.1  # other samples, the same model
    # a train.py config sets the model, the rows and our settings (configs/bench.py is the GPU target)
    from_config = bench("--loss-chunk", "16", size=("--config", str(ROOT / "configs/debug.py")))
    assert from_config["rows"] == 8 and from_config["seq_len"] == 48 and from_config["loss_chunk"] == 16


def test_bench_data_runs_both_pipelines(tmp_path):
    r = forkserver.run([sys.executable, str(ROOT / "bench.py"), "data", "--workdir", str(tmp_path), "--n", "12"],
                       os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "llavax" in r.stdout and "webdataset+PIL" in r.stdout and "ratio" in r.stdout


def test_dropped_samples_are_counted_in_the_training_log(shapes, tmp_path):
    # too short for the image: every sample would drop; refused before a model is built, not trained to the end
    with pytest.raises(SystemExit, match=r"data_dir .*: none of its samples can train with this run's settings "
                                         r"\(seq_len 6, .*: all 32 probed across it drop \(image_beyond_seq_len 32\)"):
        train.main(args(shapes, tmp_path / "never", "--seq_len=6", "--max_iters=2"))
    assert not (tmp_path / "never/log.jsonl").exists()
    # seq_len 25 drops the first two samples of the order (one a step), not all: steps with nothing to learn move no
    # weight and are never DONE, and the log says that the source trained no token
    r = run(args(shapes, tmp_path / "some", "--seq_len=25", "--max_iters=2", "--batch_size=1", "--micro_batch_size=1"),
            check=False)
    assert "the last 2 batch(es) had no supervised token (every sample dropped): the run is not marked DONE; the last " \
           "checkpoint is none" in r.stderr, r.stderr[-2000:]
    said = "trained no token in this log interval: the one sample it drew dropped (no_supervised_tokens 1)"
    assert r.stdout.count(said) == 2, r.stdout
    events = run_log(tmp_path / "some")
    assert sum(e.get("dropped_samples", 0) for e in events) == 2 and not (tmp_path / "some/DONE").exists()


def test_packed_training_matches_one_sample_a_row_and_resumes_exactly(shapes, single_run, tmp_path):
    """4 rows x 96 tokens holding 2 samples each read the same 8 samples a step as 8 rows x 48: the losses agree
    (the document mask, restarted positions and packed image order make packing invisible to the model)."""
    packed = ["--pack=2", "--batch_size=4", "--micro_batch_size=4", "--seq_len=96", "--loss_chunk=40"]
    run(args(shapes, tmp_path / "straight", "--max_iters=20", *packed))
    a, b = losses(single_run), losses(tmp_path / "straight")  # the unpacked run: 8 rows x 48
    assert sorted(a) == sorted(b) == list(range(1, 21))
    assert all(abs(a[s] - b[s]) <= 1e-5 * a[s] for s in range(1, 6)), (a, b)
    assert "no_room_in_pack" not in (tmp_path / "straight/log.jsonl").read_text()
    # exact resume with packing: the stream position counts samples, 2 a row
    run(args(shapes, tmp_path / "resumed", "--max_iters=10", *packed))
    run(args(shapes, tmp_path / "resumed", "--max_iters=20", "--init_from=resume", *packed))
    assert weights(tmp_path / "resumed/step-000020") == weights(tmp_path / "straight/step-000020")
    assert json.loads((tmp_path / "resumed/step-000020/state.json").read_text())["loader"]["position"] == 20 * 8


def test_samples_that_do_not_fit_a_packed_batch_are_counted(shapes, tmp_path):
    r = run(args(shapes, tmp_path, "--max_iters=2", "--pack=3", "--micro_batch_size=4", "--batch_size=4", "--seq_len=64"))
    assert "no_room_in_pack" in r.stdout + r.stderr
    events = run_log(tmp_path)
    assert sum(e.get("dropped_samples", 0) for e in events) > 0


def test_final_accuracy_pass_batches_questions_without_changing_answers(shapes, single_run):
    """Left-padded batches of val questions (5 a batch: the last batch is short) give the answers asked one by one."""

    model = model_files.load_model(single_run / "step-000020")
    s = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=2, seq_len=48, image_size=28,
                         image_token_id=512, n_image_tokens=4, template="llama_3", split="val")
    env = parallel.Env({"device": "cpu"})
    cfg = {"template": "llama_3", "dtype": "float32"}
    alone = evaluation.answer_accuracy(model, s, env, cfg, 12, show=12, batch_size=1)
    batched = evaluation.answer_accuracy(model, s, env, cfg, 12, show=12, batch_size=5)
    assert len(batched[1]) == 12 and batched == alone
    assert len({len(q) for q, _, _ in batched[1]}) > 1  # questions of different lengths shared a batch


# -----------------------------------------------------------------------------
# the tile path (max_tiles > 0): several images a sample, image_index / image_weight placement


def test_one_tile_a_row_trains_as_the_single_image_path(shapes, single_run, tmp_path):
    """max_tiles=1 with a one-view model places each image's features by image_index instead of the placeholder
    count: the same numbers (the single-image path is checked against transformers' LLaVA)."""
    run(args(shapes, tmp_path, "--max_iters=5", "--max_tiles=1"))
    ref, got = losses(single_run), losses(tmp_path)
    assert sorted(got) == [1, 2, 3, 4, 5] and all(abs(got[s] - ref[s]) <= 1e-5 * ref[s] for s in got), (got, ref)


def test_tiled_answer_accuracy_gives_the_single_image_answers(shapes, single_run):
    """The tile path's accuracy pass cuts the loader's rows at the answer and left-pads image_index with them: the
    same greedy answers as the single-image pass, which tokenizes the questions itself."""

    model = model_files.load_model(single_run / "step-000020")
    common = dict(batch_size=5, seq_len=48, image_size=28, image_token_id=512, n_image_tokens=4, template="llama_3",
                  split="val")
    legacy = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", **common)
    tiled = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", **common, vlm=model.cfg, max_tiles=1)
    env = parallel.Env({"device": "cpu"})
    cfg = {"template": "llama_3", "dtype": "float32"}
    n = len(legacy)  # every val question: the tile pass asks them in the loader's shuffled order
    want = evaluation.answer_accuracy(model, legacy, env, cfg, n, show=n)
    got = evaluation.tiled_answer_accuracy(model, tiled, env, cfg, n, show=n)
    assert got[2] == want[2] == n and got[0] == want[0]
    assert sorted(got[1]) == sorted(want[1]) and len({said for _, said, _ in got[1]}) > 1


@pytest.fixture(scope="module")
def shapes2(shapes_data):
    return shapes_data(n=120, seed=0, val_fraction=0.1, images=2)


def multi_args(shapes2, out, *extra):
    """configs/shapes_multi.py, made tiny: the debug model on its 48 px images."""
    tiny = "{'vision': {'image_size': 48, 'patch_size': 16}, 'llm': {'vocab_size': 576}, 'image_token_id': 512}"
    return [str(ROOT / "configs/shapes_multi.py"), f"--data_dir={shapes2 / 'shards'}", "--model=debug",
            f"--tokenizer={shapes2 / 'tokenizer.model'}", f"--out_dir={out}", f"--model_overrides={tiny}",
            "--batch_size=4", "--micro_batch_size=4", "--warmup_iters=2", "--lr_decay_iters=6", "--log_interval=1",
            "--eval_interval=0", "--ckpt_interval=0", "--num_workers=0", *extra]


@pytest.mark.slow
def test_two_image_demo_trains_answers_and_resumes_exactly(shapes2, tmp_path, capsys):
    """The two-image shapes demo end to end, briefly (in this process): two tile slots a row, no sample dropped or
    cut, a stop at step 3 and a resume that ends on the weights of a straight run; the held-out pass asks every
    val question."""
    train.main(multi_args(shapes2, tmp_path / "straight", "--max_iters=6", "--final_accuracy_samples=12"))
    out = capsys.readouterr().out
    assert "held-out exact-match accuracy" in out and "on 12 questions" in out, out[-2000:]
    truths = [line.rsplit("truth: ", 1)[1] for line in out.splitlines() if "Which image has more circles?" in line]
    assert len(truths) == 5 and set(truths) <= {"the first", "the second", "neither"}, out[-2000:]  # whole answers
    events = run_log(tmp_path / "straight")
    assert sum(e.get("dropped_samples", 0) for e in events) == 0
    train.main(multi_args(shapes2, tmp_path / "resumed", "--max_iters=3", "--final_accuracy_samples=0"))
    train.main(multi_args(shapes2, tmp_path / "resumed", "--max_iters=6", "--init_from=resume",
                          "--final_accuracy_samples=0"))
    assert weights(tmp_path / "resumed/step-000006") == weights(tmp_path / "straight/step-000006")


@pytest.mark.parametrize("stage", [1, 2])
def test_image_newline_trains_with_the_llm(shapes, tmp_path, stage):
    """LLaVA-NeXT's train.py unfreezes image_newline with the language model: stage 2 trains it, stage 1 does not."""
    cfg = vlm_preset("debug").with_overrides({"vision": {"image_size": 28, "patch_size": 14}, "llm": {"vocab_size": 576},
                                              "image_token_id": 512, "anyres": "anyres",
                                              "grid_pinpoints": [[28, 56], [56, 28], [56, 56]]})
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "init")
    train.main(args(shapes, tmp_path / "out", f"--stage={stage}", f"--init_from={tmp_path / 'init'}", "--max_iters=2",
                    "--max_tiles=5"))
    before, after = load_file(tmp_path / "init/model.safetensors"), checkpoint_model(tmp_path / "out/step-000002")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert ("image_newline" in changed) == (stage == 2) and any(k.startswith("projector") for k in changed)


def test_tile_settings_that_cannot_work_are_config_errors(shapes, tmp_path):
    anyres = ("--model_overrides={'vision': {'image_size': 28, 'patch_size': 14}, 'llm': {'vocab_size': 576}, "
              "'image_token_id': 512, 'anyres': 'anyres', 'grid_pinpoints': [[56, 28], [56, 56]]}")
    with pytest.raises(SystemExit, match="max_tiles=0, but the model tiles images"):
        train.main(args(shapes, tmp_path / "a", anyres))
    with pytest.raises(SystemExit, match="max_tiles=2 is fewer than the 3 tiles"):
        train.main(args(shapes, tmp_path / "b", anyres, "--max_tiles=2"))
    with pytest.raises(SystemExit, match="max_tiles must be >= 0"):
        train.main(args(shapes, tmp_path / "c", "--max_tiles=-1"))


def test_the_readme_sample_command_answers_from_a_demo_checkpoint(shapes, tmp_path):
    # the demo's model holds 64 tokens in all: a 31-token prompt cannot take sample.py's 64 new tokens, so unset,
    # --max-new-tokens is what the prompt leaves (it was an error for the README's own command)
    run([f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={tmp_path}",
         "--max_iters=2", "--eval_interval=0", "--final_accuracy_samples=0", "--log_interval=1"])
    ask = [sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "step-000002"), "--image",
           str(shapes / "images/000000.png"), "--prompt", "How many circles are there?"]
    r = forkserver.run(ask, os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 1, r.stderr[-2000:]
    # the run's folder as --ckpt (its config.json was read as a model's): its newest committed step, said so
    (tmp_path / "step-000003").mkdir()  # a step whose write never finished: no manifest
    run_folder = forkserver.run([*ask[:3], str(tmp_path), *ask[4:]], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert run_folder.returncode == 0 and run_folder.stdout == r.stdout, run_folder.stderr[-2000:]
    assert "its newest committed checkpoint, step-000002" in run_folder.stderr
    r = forkserver.run(ask + ["--max-new-tokens", "64"], os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 1 and "exceeds the model's max_seq_len=64" in r.stderr and "Traceback" not in r.stderr
