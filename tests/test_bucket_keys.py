"""Bucket keys holding what S3 and GCS allow in a name and URLs give meaning to (:: spaces # ? % [ ] * = + unicode),
against the real servers (tests/buckets.py): a run trains under such a prefix from shards and a tokenizer under such
prefixes, resumes bit for bit, and convert.py and sample.py read its steps; a prefix a glob of it would match is never
touched; the one key s3fs cannot address (?versionId=) is refused before anything is written."""

import tempfile
from pathlib import Path

import pytest
from conftest import checkpoint_tensors
from safetensors.torch import load_file
from test_bucket_checkpoint import log_losses, same_state
from test_train import args, run

import checkpoint
import convert
import pack
import sample
import storage
import train

MARKS = "a b#1 ?x=%41 [2]+ü*"  # as a glob it matches other names; in a URL, # and ? would end its path, %41 be "A"


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=120, seed=0, val_fraction=0.1)


def copy_here(step, tmp_path):
    """A bucket step's files in a new local folder, each downloaded as it is."""
    local = Path(tempfile.mkdtemp(dir=tmp_path)) / storage.name(step)
    for name in storage.ls(step):
        storage.write_bytes(local / name, storage.read_bytes(storage.join(step, name)))
    return local


@pytest.mark.parametrize("where,name", [("s3", "run::v2"), pytest.param("s3", MARKS, marks=pytest.mark.full),
                                        pytest.param("gs", "run::v2", marks=pytest.mark.full), ("gs", MARKS)])
def test_a_run_under_a_key_of_any_legal_characters_trains_and_resumes_bit_for_bit(where, name, shapes, tmp_path,
                                                                                  request, capsys):
    """Its shards and tokenizer under prefixes of the same name, the run trains 4 steps; step 4 loses its manifest (a
    kill before the commit) and the resumed run writes it again as the uninterrupted run had it. convert.py and
    sample.py read step 4 there as they read a local copy of it."""
    root = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[where])
    out, data, tok = f"{root}/{name}", f"{root}/{name}-data", f"{root}/{name}-tok/tokenizer.model"
    pack.pack(shapes / "shapes.json", shapes / "images", data, shard_size=37, val_ids=lambda i: str(i).startswith("val"))
    storage.upload(shapes / "tokenizer.model", tok)
    step = f"{out}/step-000004"
    # another run's step 4 in a prefix the name matches as a glob (fsspec's rm and glob would expand it)
    decoy = f"{root}/{name.replace('?', 'Z').replace('[2]', '2').replace('*', '-old')}/step-000004"
    if decoy != step:
        storage.write_text(f"{decoy}/manifest.json", "{}")
    common = ["--max_iters=4", "--ckpt_interval=2", "--keep_last=5", f"--data_dir={data}", f"--tokenizer={tok}"]
    run(args(shapes, out, *common))
    assert [storage.name(p) for p in checkpoint.checkpoints(out)] == ["step-000002", "step-000004"]
    assert checkpoint.verify_checkpoint(step) is None and storage.exists(f"{step}/tokenizer.model")
    uninterrupted, logged = copy_here(step, tmp_path), log_losses(storage.read_text(f"{out}/log.jsonl"))

    storage.rm(f"{step}/manifest.json")
    r = run(args(shapes, out, *common, "--resume=True"))
    assert f"removing {step}: its write did not finish" in r.stdout and f"resuming from {out}/step-000002" in r.stdout
    same_state(step, uninterrupted, tmp_path)
    assert log_losses(storage.read_text(f"{out}/log.jsonl")) == logged
    if decoy != step:
        assert storage.ls(decoy) == ["manifest.json"]  # removing step 4 removed only this run's

    convert.main(["consolidate", "--ckpt", step, "--out", str(tmp_path / "consolidated")])
    weights = load_file(tmp_path / "consolidated" / "model.safetensors")
    want = {k.removeprefix("model."): v for k, v in checkpoint_tensors(uninterrupted, "model.").items()}
    assert weights.keys() == want.keys() and all(weights[k].equal(want[k]) for k in want)
    answers, image = [], str(sorted((shapes / "images").iterdir())[0])
    for ckpt in (step, str(uninterrupted)):
        capsys.readouterr()
        sample.main(["--ckpt", ckpt, "--image", image, "--prompt", "How many?", "--max-new-tokens", "4",
                     "--device", "cpu"])
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].count("\n") == 1, answers


def test_a_key_s3fs_cannot_address_is_refused_before_anything_is_written(shapes, s3_bucket):
    """s3fs cuts a key at ?versionId= (an object version to it): a run there would write under another key."""
    out = f"{s3_bucket}/run?versionId=2"
    with pytest.raises(SystemExit) as e:
        train.main(args(shapes, out, "--max_iters=2"))
    assert str(e.value) == (f"out_dir {out}: s3fs reads ?versionId= in a key as an object version, so this one would "
                            f"be read and written as {s3_bucket}/run; name it without ?versionId=")
    assert storage.ls(s3_bucket) == []
    with pytest.raises(SystemExit) as e:
        train.main(args(shapes, f"{s3_bucket}/run", "--max_iters=2", f"--data_dir={s3_bucket}/data?versionId=1"))
    assert str(e.value).startswith(f"data_dir {s3_bucket}/data?versionId=1: s3fs reads ?versionId= in a key")
