"""Faults that must never cost a good state or train on garbage: injected non-finite losses and weights, corrupted
checkpoint files, foreign checkpoints in out_dir, changed configs on resume, step numbers past six digits, held-out
questions too long for the model; and every bad input a user can type, through the real command lines."""

import json
import os
import shutil
import subprocess
import sys

import forkserver
import pytest
import torch
from conftest import ROOT, checkpoint_bytes, checkpoint_tensors, run_log
from test_train import args, run, shapes, weights  # noqa: F401  (shapes is a fixture)

import chat
import checkpoint
import checkpoint_writer
import config
import evaluation
import loader
import parallel
import model


@pytest.fixture(scope="module")
def base(shapes, tmp_path_factory):  # noqa: F811
    """An uninterrupted 6-step run with checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("base")
    run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=5"))
    return out


def no_traceback(r):
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


# -----------------------------------------------------------------------------
# non-finite losses and weights (test-only hooks in train.py: LLAVAX_TEST_NONFINITE, LLAVAX_TEST_INF_WEIGHT)


def test_nonfinite_step_is_skipped_exactly_like_a_skipped_batch(shapes, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLAVAX_TEST_NONFINITE", "3")
    poisoned = run(args(shapes, tmp_path / "nan", "--max_iters=6"))
    monkeypatch.delenv("LLAVAX_TEST_NONFINITE")
    run(args(shapes, tmp_path / "skip", "--max_iters=6", "--skip_steps=[(3, 4)]"))
    assert "step 3: non-finite loss or gradient" in poisoned.stdout
    assert weights(tmp_path / "nan/step-000006") == weights(tmp_path / "skip/step-000006")
    assert checkpoint_bytes(tmp_path / "nan/step-000006", "optim.") == \
        checkpoint_bytes(tmp_path / "skip/step-000006", "optim.")
    assert [e["step"] for e in run_log(tmp_path / "nan") if e.get("nonfinite_skipped")] == [3]
    assert (tmp_path / "nan/DONE").exists()


def test_nonfinite_steps_in_a_row_stop_with_a_clear_error(shapes, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLAVAX_TEST_NONFINITE", "2,3,4")
    r = run(args(shapes, tmp_path, "--max_iters=20", "--ckpt_interval=2", "--keep_last=1", "--max_nonfinite_steps=3"),
            check=False)
    no_traceback(r)
    assert "3 steps in a row had a non-finite loss or gradient" in r.stderr and "max_nonfinite_steps" in r.stderr
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000004"] and not (tmp_path / "DONE").exists()
    assert checkpoint.verify_checkpoint(tmp_path / "step-000004") is None
    assert all(torch.isfinite(t).all() for t in checkpoint_tensors(tmp_path / "step-000004", "model.").values())


def test_nonfinite_weights_are_never_checkpointed_and_the_good_one_is_kept(shapes, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LLAVAX_TEST_INF_WEIGHT", "4")
    r = run(args(shapes, tmp_path, "--max_iters=20", "--ckpt_interval=3", "--keep_last=1"), check=False)
    no_traceback(r)
    assert "not writing step-000006: non-finite values" in r.stderr and "step-000003" in r.stderr
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000003"]
    assert checkpoint.verify_checkpoint(tmp_path / "step-000003") is None


@pytest.mark.slow
def test_nonfinite_on_one_rank_skips_the_update_on_every_rank(shapes, tmp_path, monkeypatch):  # noqa: F811
    # FSDP: each rank sees only its shard's gradient norm, so the flag must be agreed (DDP takes the same path)
    common = ["--parallel=fsdp", "--micro_batch_size=4", "--max_iters=5"]
    monkeypatch.setenv("LLAVAX_TEST_NONFINITE", "2@1")
    r = run(args(shapes, tmp_path / "nan", *common), nproc=2)
    monkeypatch.delenv("LLAVAX_TEST_NONFINITE")
    run(args(shapes, tmp_path / "skip", *common, "--skip_steps=[(2, 3)]"), nproc=2)
    assert "step 2: non-finite loss or gradient" in r.stdout
    assert weights(tmp_path / "nan/step-000005") == weights(tmp_path / "skip/step-000005")


# -----------------------------------------------------------------------------
# checkpoint integrity


def flip_a_value(path):
    """Flip the lowest bit of one byte in the middle of a shard file (tensor data): the file still loads."""
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


def drop_from_index(d, key="model.llm.norm.weight"):
    """A checkpoint whose DCP index lost a tensor (as torch_xla 2.9's planner loses replicated ones, pytorch/xla#7919)
    with a manifest that matches it: only the index check can tell."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(d)).read_metadata()
    del meta.state_dict_metadata[key]
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    (d / "manifest.json").unlink()
    checkpoint_writer.write_manifest(d, checkpoint.describe([f for f in d.iterdir() if f.is_file()]))


def list_a_gone_file(d):
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["__1_0.distcp"] = {"size": 10, "sha256": "0" * 64}  # a second rank's shard, never there
    (d / "manifest.json").write_text(json.dumps(manifest))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "flipped_value": (lambda d: flip_a_value(d / "__0_0.distcp"), "__0_0.distcp differs"),
    "truncated_shard": (lambda d: truncate(d / "__0_0.distcp"), "__0_0.distcp is"),
    "missing_shard": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "bad_index": (lambda d: (d / ".metadata").write_bytes(b"\xff" * 8 + (d / ".metadata").read_bytes()[8:]),
                  ".metadata differs"),
    "manifest_lists_a_gone_file": (list_a_gone_file, "__1_0.distcp is missing"),
    "index_without_a_tensor": (drop_from_index, "1 missing (model.llm.norm.weight)"),
    "truncated_state": (lambda d: truncate(d / "state.json"), "state.json is"),
    "missing_rng": (lambda d: (d / "rng.safetensors").unlink(), "rng.safetensors is missing"),
    "no_manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    "bad_manifest": (lambda d: (d / "manifest.json").write_text("{"), "manifest.json is unreadable"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_each_corruption_is_found_and_named(base, tmp_path, kind):
    corrupt, reason = CORRUPTIONS[kind]
    ckpt = shutil.copytree(base / "step-000006", tmp_path / "step-000006")
    assert checkpoint.verify_checkpoint(ckpt) is None
    corrupt(ckpt)
    assert reason in checkpoint.verify_checkpoint(ckpt)


def test_resume_falls_back_past_a_silently_corrupted_checkpoint(shapes, base, tmp_path):  # noqa: F811
    out = shutil.copytree(base, tmp_path / "run")
    flip_a_value(out / "step-000006/__0_0.distcp")
    r = run(args(shapes, out, "--max_iters=6", "--ckpt_interval=3", "--keep_last=1", "--init_from=resume",
                 "--log_interval=2"))
    assert f"skipping {out / 'step-000006'}: __0_0.distcp differs from its sha256" in r.stdout
    assert f"resuming from {out / 'step-000003'}" in r.stdout
    assert "log_interval changed from 1 to 2 (allowed)" in r.stdout
    # retrained from step 3: the same bytes as the uninterrupted run, written over the step marked CORRUPT
    assert weights(out / "step-000006") == weights(base / "step-000006")
    assert not (out / "step-000006/CORRUPT").exists() and checkpoint.verify_checkpoint(out / "step-000006") is None
    assert [p.name for p in checkpoint.checkpoints(out)] == ["step-000006"]


def test_step_numbers_of_any_width_sort_numerically_and_pruning_spares_newer(tmp_path):
    for step in (999, 999999, 1000000, 12, 500):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}/manifest.json").write_text("{}")
    (tmp_path / "step-000500/CORRUPT").write_text("{}")  # marked at a resume: never taken, never pruned
    (tmp_path / "step-000100.corrupt-1").mkdir()
    (tmp_path / "step-000200").mkdir()  # a write that did not finish: no manifest
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000012", "step-000999", "step-999999",
                                                             "step-1000000"]
    checkpoint.prune_checkpoints(tmp_path, tmp_path / "step-000999", keep_last=1)  # never anything after the newest
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-000999", "step-999999", "step-1000000"]
    checkpoint.prune_checkpoints(tmp_path, tmp_path / "step-1000000", keep_last=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step-999999", "step-1000000"]
    assert (tmp_path / "step-000500/CORRUPT").exists()


def test_held_out_questions_longer_than_the_model_are_counted_and_skipped(shapes):  # noqa: F811
    cfg = config.load_config([str(ROOT / "configs/debug.py"), f"--tokenizer={shapes / 'tokenizer.model'}"])
    stream = loader.ShardStream(shapes / "shards", cfg["tokenizer"], batch_size=1, seq_len=48, image_size=28,
                              image_token_id=512, n_image_tokens=4, template="llama_3", split="val")
    lengths = []
    for i in range(10):
        conv, image = loader.sample_conversation(stream.read(i)[1])
        lengths.append(len(chat.prompt_and_answer(conv, True, "llama_3", stream.tok, 512, 4)[0]))
    limit = max(lengths) + 7  # the longest prompts, with 8 answer tokens, no longer fit
    model_cfg = config.model_config(cfg)
    model_cfg.llm.max_seq_len = limit
    raw = model.build_model(model_cfg, seed=0)
    env = parallel.Env({"device": "cpu"})
    acc, shown, asked, too_long = evaluation.answer_accuracy(raw, stream, env, cfg, 10)
    assert too_long == sum(n + 8 > limit for n in lengths) > 0 and asked == 10 - too_long


# -----------------------------------------------------------------------------
# every bad input a user can type: one message naming it, no traceback, a non-zero exit


@pytest.fixture(scope="module")
def bad_inputs(base, tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "cfg.yaml").write_text("max_iters: 5\n")
    (d / "yamlish.py").write_text("max_iters: 5\n")
    (d / "raises.py").write_text("max_iters = 5\nlr = 1e-3 / undefined_name\n")
    (d / "bogus.model").write_bytes(b"not a sentencepiece model\n" * 10)
    (d / "empty_data").mkdir()
    (d / "a_file").write_text("")
    for name, file, corrupt in (("trunc_state", "state.json", truncate),
                                ("trunc_shard", "__0_0.distcp", truncate)):
        shutil.copytree(base / "step-000006", d / name / "step-000006")
        corrupt(d / name / "step-000006" / file)
    shutil.copytree(base / "step-000006", d / "bad_config")
    (d / "bad_config/config.json").write_text('{"vision": {"dim": 64,')
    shutil.copytree(base / "step-000006", d / ".step-000006.tmp-999999")
    return d


def cases(shapes, base, d):  # noqa: F811
    t = ["train.py", *args(shapes, d / "out", "--max_iters=2")]
    ckpt = str(base / "step-000006")
    s = ["sample.py", "--ckpt", ckpt, "--prompt", "How many circles are there?"]
    image = str(shapes / "images/000000.png")
    return {
        "yaml_config": (["train.py", str(d / "cfg.yaml")], "cfg.yaml"),
        "yaml_in_a_py_file": (["train.py", str(d / "yamlish.py")], "yamlish.py:1"),
        "config_that_raises": (["train.py", str(d / "raises.py")], "raises.py:2"),
        "zero_batch_size": ([*t, "--batch_size=0"], "batch_size"),
        "negative_interval": ([*t, "--log_interval=-5"], "log_interval"),
        "unknown_template": ([*t, "--template=vicuna"], "template 'vicuna'"),
        "unknown_image_mode": ([*t, "--image_mode=stretch"], "image_mode 'stretch'"),
        "seq_len_under_image_tokens": ([*t, "--seq_len=4"], "seq_len=4"),
        "missing_tokenizer": ([*t, f"--tokenizer={d / 'nope.model'}"], "nope.model"),
        "bogus_tokenizer": ([*t, f"--tokenizer={d / 'bogus.model'}"], "bogus.model"),
        "empty_data_dir": ([*t, f"--data_dir={d / 'empty_data'}"], "empty_data"),
        "unwritable_out_dir": ([*t, f"--out_dir={d / 'a_file' / 'out'}"], "a_file"),
        "truncated_state_json": ([*t, f"--out_dir={d / 'trunc_state'}", "--init_from=resume"], "state.json"),
        "truncated_shard": ([*t, f"--out_dir={d / 'trunc_shard'}", "--init_from=resume"], "__0_0.distcp"),
        "malformed_checkpoint_config": ([*t, f"--init_from={d / 'bad_config'}"], "bad_config/config.json"),
        "scratch_into_foreign_checkpoints": ([*t, f"--out_dir={base}"], "step-000006"),
        # copies of the good run: one run at a time may hold an out_dir (lease.py), and these run two at a time
        "resume_with_another_seed": ([*t, f"--out_dir={d / 'base_seed'}", "--init_from=resume", "--seed=1"], "seed"),
        "resume_with_another_global_batch": ([*t, f"--out_dir={d / 'base_batch'}", "--init_from=resume",
                                              "--micro_batch_size=4", "--batch_size=16"], "batch_size"),
        "resume_into_another_stage": ([*t, f"--out_dir={d / 'base_stage'}", "--init_from=resume", "--stage=1",
                                       "--allow_config_change=['stage']"], "does not fit this run"),
        "sample_missing_image": ([*s, "--image", str(d / "nope.png")], "nope.png"),
        "sample_unknown_template": ([*s, "--template", "vicuna_v9"], "vicuna_v9"),
        "sample_negative_temperature": ([*s, "--temperature", "-1"], "--temperature"),
        "sample_prompt_too_long": ([*s[:-1], "circles " * 600, "--image", image], "--prompt"),
        "convert_truncated_shard": (["convert.py", "consolidate", "--ckpt", str(d / "trunc_shard/step-000006"), "--out",
                                     str(d / "consolidated")], "__0_0.distcp is"),
        "convert_leftover_temporary": (["convert.py", "to-hf", "--ckpt", str(d / ".step-000006.tmp-999999"), "--out",
                                        str(d / "hf")], ".step-000006.tmp-999999"),
        "launch_nproc_abc": (["scripts/launch.sh", "--dry-run", str(ROOT / "configs/debug.py")], "NPROC_PER_NODE"),
    }


CASES = list(cases(*(ROOT,) * 3))


@pytest.fixture(scope="module")
def bad_runs(shapes, base, bad_inputs):  # noqa: F811
    """Every case's (returncode, stderr) and whether the good run's files stayed as they were. The python command
    lines run two at a time as processes forked after the imports (tests/forkserver.py): each start was mostly
    importing torch on one core."""
    before = sorted(p.name for p in base.iterdir())
    for copy in ("base_seed", "base_batch", "base_stage"):
        if not (bad_inputs / copy).exists():
            shutil.copytree(base, bad_inputs / copy)
    env = os.environ | {"OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "abc"}
    argvs = {case: cases(shapes, base, bad_inputs)[case][0] for case in CASES}
    python = [case for case in CASES if argvs[case][0].endswith(".py")]
    results = dict(zip(python, forkserver.run_many([[sys.executable, ROOT / argvs[c][0], *argvs[c][1:]] for c in python],
                                                   env, cwd=ROOT, parallel=2)))
    for case in set(CASES) - set(python):
        results[case] = subprocess.run(["bash", ROOT / argvs[case][0], *argvs[case][1:]], capture_output=True, text=True,
                                       env=env, cwd=ROOT, timeout=300)
    return results, sorted(p.name for p in base.iterdir()) == before


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clear_message(shapes, base, bad_inputs, bad_runs, case):  # noqa: F811
    _, name = cases(shapes, base, bad_inputs)[case]
    results, untouched = bad_runs
    r = results[case]
    no_traceback(r)
    assert name in r.stderr, r.stderr[-2000:]
    assert untouched  # nothing of the good run was deleted or added
