"""Model inputs and exports in a bucket (moto's S3 server, fake-gcs-server): train.py's init_from and tokenizer read
from a bucket train as the same folders on a local disk do, bit for bit; convert.py reads a step in a bucket and
writes its export there, which transformers loads as it loads the local export; sample.py answers from a bucket step
as from its local copy; an export is committed without a folder rename (config last), on a bucket and on a file
system that cannot rename folders; bad bucket input gets one sentence and overwrites nothing."""

import json
import os
import sys
from pathlib import Path

import forkserver
import pytest
import torch
from buckets import forget_filesystems
from conftest import ROOT
from test_train import args

import checkpoint
import convert
import data
import images
import loader
import model_files
import sample
import storage
import train
import weight_files
from model import build_model
from model_config import vlm_preset


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=400, seed=0, val_fraction=0.1)  # test_train's


@pytest.fixture(scope="module")
def step(shapes, tmp_path_factory):
    """A local training step: 3 steps of the debug model, its tokenizer carried."""
    out = tmp_path_factory.mktemp("run")
    train.main(args(shapes, out, "--max_iters=3", "--ckpt_interval=3"))
    return out / "step-000003"


@pytest.fixture(scope="module")
def hf_export(step):
    """The step's HF export, on a local disk."""
    return convert.llava_to_hf(step, step.parent / "hf")


def upload_folder(folder, url):
    for f in sorted(Path(folder).rglob("*")):
        if f.is_file():
            storage.upload(f, storage.join(url, f.relative_to(folder).as_posix()))
    return url


def download_folder(url, folder):
    for name in storage.ls(url):
        storage.write_bytes(Path(folder, name), storage.read_bytes(storage.join(url, name)))
    return Path(folder)


def first_losses(out):
    events = [json.loads(line) for line in storage.read_text(storage.join(out, "log.jsonl")).splitlines()]
    return [e["loss"] for e in events if "loss" in e]


# -----------------------------------------------------------------------------
# training from a bucket


@pytest.mark.slow
def test_training_from_bucket_inputs_equals_training_from_local_folders(shapes, step, hf_export, s3_bucket, gcs_bucket,
                                                                        tmp_path):
    """init_from an HF folder in S3 and our step in GCS, the tokenizer the step carries in GCS: the same losses, bit for
    bit, as from the local folders (the HF export holds the step's tensors, renamed)."""
    hf, gcs_step = upload_folder(hf_export, f"{s3_bucket}/hf"), upload_folder(step, f"{gcs_bucket}/run/step-3")
    assert storage.read_bytes(f"{gcs_step}/tokenizer.model") == (shapes / "tokenizer.model").read_bytes()
    runs = {"local": (step, shapes / "tokenizer.model"), "hf_in_s3": (hf, f"{gcs_step}/tokenizer.model"),
            "step_in_gcs": (gcs_step, gcs_step)}  # a folder names the tokenizer it holds
    cmds = [[sys.executable, str(ROOT / "train.py"), *args(shapes, tmp_path / name, "--max_iters=2", f"--init_from={init}",
                                                           f"--tokenizer={tokenizer}")]
            for name, (init, tokenizer) in runs.items()]
    results = forkserver.run_many(cmds, os.environ | {"OMP_NUM_THREADS": "1"}, parallel=2)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    losses = {name: first_losses(tmp_path / name) for name in runs}
    assert len(losses["local"]) == 2 and losses["hf_in_s3"] == losses["local"] == losses["step_in_gcs"], losses


def test_a_tokenizer_unlike_the_one_a_step_carries_is_refused(shapes, step, s3_bucket, tmp_path):
    """A step in a bucket carries its run's tokenizer: init_from it with another tokenizer (a file replaced in the bucket
    since) stops in one sentence, before anything trains."""
    bucket_step = upload_folder(step, f"{s3_bucket}/run/step-3")
    other = tmp_path / "other.json"
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(other))
    with pytest.raises(SystemExit, match=rf"encodes text unlike {bucket_step}/tokenizer.model, the tokenizer"):
        train.main(args(shapes, tmp_path / "out", "--max_iters=1", f"--init_from={bucket_step}", f"--tokenizer={other}"))
    assert checkpoint.checkpoints(tmp_path / "out") == []


# -----------------------------------------------------------------------------
# convert.py and sample.py on a step in a bucket


def hf_logits(folder, shapes):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(folder).eval()
    s = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=2, seq_len=48, image_size=28,
                           image_token_id=512, n_image_tokens=4, template="llama_3", split="val")
    b = s.batch(0)
    with torch.no_grad():
        return model(input_ids=b["input_ids"], pixel_values=images.normalize_images(b["pixel_values"])).logits


@pytest.mark.slow
def test_convert_and_sample_read_a_step_in_a_bucket_and_export_to_one(shapes, step, hf_export, s3_bucket, tmp_path,
                                                                      capsys):
    bucket_step = upload_folder(step, f"{s3_bucket}/run/step-3")
    convert.main(["to-hf", "--ckpt", bucket_step, "--out", f"{s3_bucket}/hf"])
    assert "config.json" in storage.ls(f"{s3_bucket}/hf") and weight_files.UNFINISHED not in storage.ls(f"{s3_bucket}/hf")
    got = download_folder(f"{s3_bucket}/hf", tmp_path / "hf")
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in hf_export.iterdir())
    assert torch.equal(hf_logits(got, shapes), hf_logits(hf_export, shapes))

    image = next(Path(shapes, "images").glob("*.png"))
    answers = []
    for ckpt in (bucket_step, str(step)):
        capsys.readouterr()
        sample.main(["--ckpt", ckpt, "--image", str(image), "--prompt", "How many circles are there?", "--temperature",
                     "1.0", "--seed", "3", "--max-new-tokens", "6"])
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip(), answers


# -----------------------------------------------------------------------------
# write_dir: no folder renamed, config last, nothing already written lost


@pytest.fixture(params=["no_folder_renames", "s3"])
def export_dir(request, tmp_path, monkeypatch):
    """Where an export goes: a local folder on a file system that refuses folder renames (a default gcsfuse mount),
    or a prefix in moto's S3 bucket."""
    if request.param == "s3":
        return f"{request.getfixturevalue('s3_bucket')}/exports/hf"

    def files_only(real):
        def rename(src, dst, *a, **kw):
            if os.path.isdir(src):
                raise OSError(95, "Operation not supported (folder rename)", str(src))
            return real(src, dst, *a, **kw)
        return rename

    monkeypatch.setattr(os, "rename", files_only(os.rename))
    monkeypatch.setattr(os, "replace", files_only(os.replace))
    return tmp_path / "mount/hf"


def test_an_export_commits_its_config_last_without_a_folder_rename(step, export_dir, monkeypatch):
    model = build_model(vlm_preset("debug"), seed=0)
    put, seen = weight_files.put_file, []

    def killed_after_two(src, dst):  # the process dies while it puts its files into place
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append(storage.name(dst))
        put(src, dst)

    monkeypatch.setattr(weight_files, "put_file", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        model_files.save_model(model, export_dir, tokenizer_dir=step)
    monkeypatch.setattr(weight_files, "put_file", put)
    assert storage.ls(export_dir) == sorted([weight_files.UNFINISHED, *seen]) and "config.json" not in seen
    with pytest.raises(weight_files.ConversionError, match="a write that did not finish"):
        model_files.read_checkpoint(export_dir)

    model_files.save_model(model, export_dir, tokenizer_dir=step)  # our unfinished write is replaced
    assert storage.ls(export_dir) == ["config.json", "model.safetensors", "tokenizer.model"]
    before = {n: storage.read_bytes(storage.join(export_dir, n)) for n in storage.ls(export_dir)}
    with pytest.raises(weight_files.ConversionError, match="already exists; refusing to overwrite"):
        model_files.save_model(build_model(vlm_preset("debug"), seed=1), export_dir)  # a finished one: kept
    assert {n: storage.read_bytes(storage.join(export_dir, n)) for n in storage.ls(export_dir)} == before

    other = build_model(vlm_preset("debug"), seed=1)
    model_files.save_model(other, export_dir, overwrite=True, shard_bytes=200_000)  # asked for: no old file left
    held = storage.ls(export_dir)
    assert "model.safetensors" not in held and "tokenizer.model" not in held and "model.safetensors.index.json" in held
    for k, v in model_files.load_model(export_dir).state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k


# -----------------------------------------------------------------------------
# bad input: one sentence each, nothing overwritten


def test_bad_bucket_inputs_get_one_sentence_and_overwrite_nothing(shapes, step, s3_bucket, tmp_path, monkeypatch, capsys):
    empty, missing = f"{s3_bucket}/nothing-here", "s3://llavax-no-such-bucket/run/step-3"
    bucket_step = upload_folder(step, f"{s3_bucket}/run/step-3")
    export = upload_folder(step, f"{s3_bucket}/kept")  # a folder of files in the way of an export
    kept = {n: storage.read_bytes(f"{export}/{n}") for n in storage.ls(export)}
    train_cases = {
        ("init_from", missing): "init_from s3://llavax-no-such-bucket/run/step-3: bucket 'llavax-no-such-bucket' does "
                                "not exist",
        ("tokenizer", "hdfs://namenode/tokenizer.model"): "tokenizer hdfs://namenode/tokenizer.model: unknown storage "
                                                          "scheme 'hdfs://'",
        ("init_from", empty): f"init_from '{empty}': cannot load the model ({empty}: no config.json; not a llavax or HF "
                              f"LLaVA checkpoint directory)",
        ("out_dir", f"{s3_bucket}/runs/lr?versionId=1"): f"out_dir {s3_bucket}/runs/lr?versionId=1: s3fs reads "
                                                         f"?versionId= in a key as an object version",
    }
    for (key, url), said in train_cases.items():
        with pytest.raises(SystemExit) as e:
            train.main(args(shapes, tmp_path / key, "--max_iters=1", f"--{key}={url}"))
        assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)
        assert checkpoint.checkpoints(tmp_path / key) == []
    assert storage.ls(f"{s3_bucket}/runs") == []

    convert_cases = {
        ("--ckpt", missing, "--out", str(tmp_path / "hf")): "bucket 'llavax-no-such-bucket' does not exist",
        ("--ckpt", str(step), "--out", f"s3://{storage.bucket(missing)}/hf"): "bucket 'llavax-no-such-bucket' does not",
        ("--ckpt", empty, "--out", str(tmp_path / "hf")): "no config.json; not a llavax or HF LLaVA checkpoint",
        ("--ckpt", bucket_step, "--out", export): "already exists; refusing to overwrite it",
    }
    for argv, said in convert_cases.items():
        with pytest.raises(SystemExit) as e:
            convert.main(["to-hf", *argv])
        assert str(e.value).startswith("convert: error: ") and said in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(SystemExit, match=r"^sample: --ckpt s3://llavax-no-such-bucket/run/step-3: bucket "):
        sample.main(["--ckpt", missing, "--prompt", "Hi"])

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(k, raising=False)  # no credentials anywhere
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "CLOUDSDK_CONFIG"):
        monkeypatch.setenv(k, str(tmp_path / "none"))
    forget_filesystems()
    try:
        with pytest.raises(SystemExit, match=rf"^init_from {bucket_step}: no AWS credentials: set AWS_ACCESS_KEY_ID"):
            train.main(args(shapes, tmp_path / "creds", "--max_iters=1", f"--init_from={bucket_step}"))
        with pytest.raises(SystemExit, match=r"^tokenizer gs://llavax-tok/tokenizer.model: no Google credentials"):
            train.main(args(shapes, tmp_path / "creds", "--max_iters=1", "--tokenizer=gs://llavax-tok/tokenizer.model"))
        with pytest.raises(SystemExit, match=r"^convert: error: .*no AWS credentials"):
            convert.main(["to-hf", "--ckpt", str(step), "--out", export])
    finally:
        monkeypatch.undo()
        forget_filesystems()
    assert {n: storage.read_bytes(f"{export}/{n}") for n in storage.ls(export)} == kept


def test_outputs_naming_an_existing_object_are_refused(shapes, step, s3_bucket, tmp_path):
    """out_dir, convert.py --out and data.py pack --out naming an object (a file in a bucket) would write object/...
    keys beside it: refused in one sentence, as a local file is, and the object is left as it was."""
    obj = f"{s3_bucket}/a-file"
    storage.write_bytes(obj, b"not a folder")
    with pytest.raises(SystemExit) as e:
        train.main(args(shapes, tmp_path / "x", "--max_iters=1", f"--out_dir={obj}"))
    assert str(e.value) == f"out_dir {obj}: an existing object, not a folder or prefix; give a folder (a prefix in " \
                           f"a bucket) to write into", str(e.value)
    with pytest.raises(SystemExit, match=r"^convert: error: .*a-file: an existing object, not a folder"):
        convert.main(["to-hf", "--ckpt", str(step), "--out", obj])
    with pytest.raises(SystemExit, match=rf"^pack: --out {obj}: an existing object, not a folder or prefix"):
        data.main(["pack", "--json", str(shapes / "shapes.json"), "--images", str(shapes / "images"), "--out", obj])
    assert storage.read_bytes(obj) == b"not a folder" and storage.ls(obj) == []
