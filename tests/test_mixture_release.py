"""The published LLaVA-OneVision mixture files (configs/mixtures/) pack and train from the HF release as it is: a RAW
tree holding a tiny copy of every dataset the release has, and none of those the recipe names that nobody published
(released: false). `data.py pack --mixture` packs what is there and says which sources it left out; train.py trains on
the mixture and says the share of the recipe they held, which the others take; a source the release should hold and
RAW lacks still stops the pack."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

import data
import mixture
import train

ROOT = Path(__file__).resolve().parents[1]
MIXTURES = ["onevision_mid_stage.yaml", "onevision.yaml", "onevision_single_image.yaml"]


def release(tmp_path, shapes, name, records=3):
    """The mixture file copied where its ../../data/onevision paths land in tmp_path, and RAW with NAME.json (a few of
    the shapes demo's records, their images beside) for every source but those marked released: false."""
    (tmp_path / "configs/mixtures").mkdir(parents=True)
    mix = tmp_path / "configs/mixtures" / name
    shutil.copy(ROOT / "configs/mixtures" / name, mix)
    raw = tmp_path / "raw"
    shutil.copytree(shapes / "images", raw / "images")
    demo = json.loads((shapes / "shapes.json").read_text())
    entries = yaml.safe_load(mix.read_text())["datasets"]
    unpublished = [Path(e["path"]).name for e in entries if e.get("released") is False]
    for i, e in enumerate(entries):
        if e.get("released") is not False:
            picked = [dict(r, id=f"{i}-{r['id']}", image=f"images/{r['image']}") for r in demo[i : i + records]]
            (raw / f"{Path(e['path']).name}.json").write_text(json.dumps(picked))
    return mix, raw, unpublished


@pytest.mark.parametrize("name", MIXTURES[:1] + [pytest.param(n, marks=pytest.mark.full) for n in MIXTURES[1:]])
def test_a_published_mixture_packs_and_trains_from_the_release_as_it_is(tmp_path, shapes_data, capsys, name):
    shapes = shapes_data(n=120, seed=0)
    mix, raw, unpublished = release(tmp_path, shapes, name)
    assert unpublished, f"{name} marks no source released: false"
    published = next(raw.glob("*.json"))
    kept = published.read_text()
    published.unlink()  # a source the release holds, missing from RAW: still refused, naming it
    with pytest.raises(SystemExit, match=f"no raw input under {raw} for 1 of its datasets: {published.stem}"):
        data.main(["pack", "--mixture", str(mix), "--raw", str(raw)])
    published.write_text(kept)
    data.main(["pack", "--mixture", str(mix), "--raw", str(raw), "--shard-size", "50", "--val-ratio", "0"])
    said = capsys.readouterr()
    for source in unpublished:
        assert f"pack: {source}: left out" in said.err + said.out
    assert "mixture: left out" in said.err + said.out
    packed = {s.name for s in mixture.sources(str(mix))}
    assert not packed & set(unpublished) and len(packed) == len(yaml.safe_load(mix.read_text())["datasets"]) - \
        len(unpublished)
    line = mixture.Mixture(str(mix)).left_out_line()
    for source in unpublished:
        assert source in line
    out = tmp_path / "out"
    train.main([str(ROOT / "configs/debug.py"), f"--data_dir={mix}", f"--tokenizer={shapes / 'tokenizer.model'}",
                f"--out_dir={out}", "--max_iters=2", "--lr_decay_iters=2", "--log_interval=1", "--eval_interval=0",
                "--batch_size=4", "--micro_batch_size=4", "--device=cpu"])
    said = capsys.readouterr()
    assert line in said.out + said.err
    assert (out / "DONE").exists() or any(out.iterdir())
    with pytest.raises(SystemExit):  # the table of the mixture by source says it too
        data.main(["audit", str(mix), "--config", str(ROOT / "configs/debug.py"), "--tokenizer",
                   str(shapes / "tokenizer.model"), "--limit", "8"])
    assert f"audit: {line}" in capsys.readouterr().out


@pytest.mark.parametrize("entry,message", [({"released": "no"}, "released must be true or false, got 'no'"),
                                           ({"released": False, "records": 0}, "records must be a whole number >= 1")])
def test_a_bad_released_or_records_is_one_sentence(tmp_path, entry, message):
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"datasets": [{"path": "a"}, {"path": "b", **entry}]}))
    with pytest.raises(mixture.MixtureError, match=rf"datasets\[1\]: {message}"):
        mixture.sources(str(mix))


def test_a_weighted_mixture_says_the_weight_a_left_out_source_held(tmp_path, shapes_data):
    """Drawn by weight, a source left out gives up its weight's part of the draws; a never-published source that is
    there (a copy of your own) is read as any other."""
    shapes = shapes_data(n=120, seed=0)
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({"datasets": [
        {"path": str(shapes / "shards"), "weight": 3.0},
        {"path": str(shapes / "shards"), "name": "own_copy", "weight": 2.0, "released": False},
        {"path": str(tmp_path / "internal_92K"), "weight": 5.0, "released": False, "records": 92000}]}))
    assert [s.name for s in mixture.sources(str(mix))][1:] == ["own_copy"]
    line = mixture.Mixture(str(mix)).left_out_line()
    assert "left out 1 source(s)" in line and "internal_92K (weight 5)" in line and "50.00% of the recipe" in line
    assert "other 2 sources" in line
