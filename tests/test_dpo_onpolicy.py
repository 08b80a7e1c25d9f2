"""dpo.py pairs: on-policy preference pairs (OneVision-Chat's iterative DPO). The model's answers are read back with
sample.py, a separate path (its own prompt rendering, tokenization and batch), and the data is rewritten so that
the model answers some questions right: those are dropped, or keep the data's own rejected answer, as documented."""

import json
import re

import pytest
import torch

import chat
import dpo
import loader
import model_files
import sample
from model import build_model
from model_config import vlm_preset
from pack import pack
from shapes import make_shapes


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random debug model (as a checkpoint) and shapes pairs rewritten so that it answers the even-numbered
    questions right: their chosen answer is the model's own greedy one, as sample.py gives it."""
    root = tmp_path_factory.mktemp("onpolicy")
    shapes = make_shapes(root / "shapes", n=36, seed=1, val_fraction=0.25, preference=True)
    tok = chat.Tokenizer(shapes / "tokenizer.model")
    cfg = vlm_preset("debug")
    cfg.llm.vocab_size, cfg.image_token_id = 576, 512
    assert tok.vocab_size <= cfg.image_token_id
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # logit 0 for the ids pairs never samples (the image token, ids past the tokenizer), far
        model.llm.output.weight[tok.vocab_size :] = 0  # below the top of ~500 random ones: greedy is sample.py's
    model_files.save_model(model, root / "model")
    records = json.loads((shapes / "preference.json").read_text())
    return root, shapes, records


def greedy_answers(root, shapes, records, capsys):
    questions = [r["conversations"][0]["value"].replace(chat.IMAGE_TAG + "\n", "") for r in records]
    sample.main(["--ckpt", str(root / "model"), "--tokenizer", str(shapes / "tokenizer.model"), "--template", "llama_3",
                 "--device", "cpu", "--max-new-tokens", "8", "--image", *[str(shapes / "images" / r["image"])
                                                                            for r in records], "--prompt", *questions])
    said = capsys.readouterr().out.split("\n")[:-1]
    assert len(said) == len(records)
    return said


def pairs(root, shapes, source, out, *extra):
    dpo.main(["pairs", "--ckpt", str(root / "model"), "--data", str(source), "--out", str(out), "--template", "llama_3",
              "--tokenizer", str(shapes / "tokenizer.model"), "--batch-size", "5", *extra])
    return {r["source_id"]: r for r in json.loads((out / "source/pairs.json").read_text())}


def test_rejected_is_the_models_own_wrong_answer_and_right_ones_are_dropped_or_keep_the_datas(setup, tmp_path, capsys):
    root, shapes, records = setup
    said = dict(zip([r["id"] for r in records], greedy_answers(root, shapes, records, capsys), strict=True))
    right = set()
    for i, r in enumerate(records):
        if i % 2 == 0 and said[r["id"]] and said[r["id"]].lower() != r["chosen"].lower():
            r["rejected"], r["chosen"] = r["chosen"], said[r["id"]]  # the model's answer is now the right one
            right.add(r["id"])
    (tmp_path / "pairs.json").write_text(json.dumps(records))
    pack(tmp_path / "pairs.json", shapes / "images", tmp_path / "data", val_ids=lambda i: i.startswith("val"))
    assert len(right) >= 6 and sum(i.startswith("val") for i in right) >= 2

    got = pairs(root, shapes, tmp_path / "data", tmp_path / "greedy", "--samples", "1")
    for r in records:
        pair = got.get(r["id"])
        if r["id"] in right and r["id"].startswith("train"):
            assert pair is None, r["id"]  # answered right, on-policy only: dropped
            continue
        assert pair is not None and pair["chosen"] == r["chosen"] and pair["conversations"] == r["conversations"]
        expected = (r["rejected"], "data") if r["id"] in right else (said[r["id"]], "greedy")  # val keeps all
        assert (pair["rejected"], pair["rejected_from"]) == expected, r["id"]
    assert "pairs: train: 27 questions" in capsys.readouterr().out
    stream = loader.ShardStream(tmp_path / "greedy", shapes / "tokenizer.model", 2, 64, 28, 512, 4, "llama_3",
                              preference=True, split="val")
    assert len(stream) == 9 and stream.batch(0)["input_ids"].shape == (4, 64)  # pairs: rows [chosen..., rejected...]

    # sampled answers (temperature 1): a right greedy answer gets a sampled wrong one; --keep-answered keeps the rest
    got = pairs(root, shapes, tmp_path / "data", tmp_path / "sampled", "--samples", "4", "--keep-answered")
    assert set(got) == {r["id"] for r in records}
    for r in records:
        pair = got[r["id"]]
        assert pair["rejected"] and pair["rejected"].lower() != pair["chosen"].lower()
        if r["id"] not in right:
            assert (pair["rejected"], pair["rejected_from"]) == (said[r["id"]], "greedy")
        else:
            assert pair["rejected_from"] in ("sampled", "data")  # a wrong sample, else the data's own rejected
            expected = r["rejected"] if pair["rejected_from"] == "data" else pair["rejected"]
            assert pair["rejected"] == expected and pair["rejected"] != said[r["id"]]
    assert sum(got[i]["rejected_from"] == "sampled" for i in right) >= 1


@pytest.mark.parametrize("flag,value,message", [
    ("--ckpt", "nope", r"pairs: --ckpt \S*nope: cannot load the model and its tokenizer \(.*no config.json"),
    ("--data", "nope", r"\S*nope: no dataset there \(nothing under it\)"),
    ("--samples", "0", None),
    ("--out", "held", r"pairs: --out \S*held already holds a dataset \(shard-000000.tar, ...\); pass --overwrite"),
    ("--out", "raw", r"pairs: --out \S*raw already holds a dataset \(source/, ...\); pass --overwrite"),  # was deleted
    ("--out", "data", r"pairs: --out \S*preference is --data; write the pairs elsewhere"),  # even with --overwrite
])
def test_bad_pairs_input_is_one_sentence(setup, tmp_path, flag, value, message, capsys):
    root, shapes, _ = setup
    args = {"--ckpt": str(root / "model"), "--data": str(shapes / "preference"), "--out": str(tmp_path / "out"),
            "--template": "llama_3", "--tokenizer": str(shapes / "tokenizer.model")}
    args[flag] = str(tmp_path / value) if flag in ("--ckpt", "--data", "--out") else value
    if value == "data":
        args["--out"] = str(shapes / "preference/")
    if value == "held":  # a dataset already there: refused before any answering
        (tmp_path / "held").mkdir()
        (tmp_path / "held/shard-000000.tar").write_bytes(b"")
    if value == "raw":  # a folder whose source/ holds the user's own images and JSON, and no shards yet
        (tmp_path / "raw/source/images").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        dpo.main(["pairs", *[x for kv in args.items() for x in kv], *(["--overwrite"] if value == "data" else [])])
    if message is None:  # argparse's own: a usage line, then the error
        assert e.value.code == 2 and "error: --samples, --max-new-tokens and --batch-size must be >= 1" in \
            capsys.readouterr().err
        return
    assert "\n" not in str(e.value.code) and re.search(message, str(e.value.code))


@pytest.mark.parametrize("vocab_size,image_token_id", [(300, 299), (576, 100)])  # too few ids; a text id as image
def test_pairs_refuses_a_tokenizer_the_model_does_not_read(setup, tmp_path, vocab_size, image_token_id):
    root, shapes, _ = setup  # it failed inside the embedding (IndexError), or placed the image on a text token
    cfg = vlm_preset("debug")
    cfg.llm.vocab_size, cfg.image_token_id = vocab_size, image_token_id
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "model")
    with pytest.raises(SystemExit, match=r"pairs: the tokenizer \(\S+tokenizer.model: \d+ ids\) does not fit --ckpt"):
        pairs(tmp_path, shapes, shapes / "preference", tmp_path / "out")


def test_pairs_with_every_question_dropped_says_so(setup, tmp_path, capsys):
    root, shapes, _ = setup  # it said the model had answered every question right
    cfg = vlm_preset("debug")
    cfg.llm.vocab_size, cfg.image_token_id, cfg.llm.max_seq_len = 576, 512, 12  # no prompt fits
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "model")
    with pytest.raises(SystemExit, match="every question was dropped"):
        pairs(tmp_path, shapes, shapes / "preference", tmp_path / "out")
    assert "dropped: prompt_and_answer_beyond_max_seq_len 27" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_long_prompt_does_not_cut_the_answers_of_its_batch(setup, tmp_path, capsys):
    """Prompts of 23-28 tokens, max_seq_len 33, 8 new tokens: a prompt with no room for 8 is dropped and counted; it
    made generate stop its whole batch at max_seq_len, so the others' rejected answers were cut short too."""
    root, shapes, _ = setup
    long = pairs(root, shapes, shapes / "preference", tmp_path / "long", "--samples", "1", "--batch-size", "16")
    model = model_files.load_model(root / "model")
    model.cfg.llm.max_seq_len = 33  # the same weights (RoPE's table is only shorter)
    model_files.save_model(model, tmp_path / "model")
    capsys.readouterr()
    short = pairs(tmp_path, shapes, shapes / "preference", tmp_path / "short", "--samples", "1", "--batch-size", "16")
    dropped = re.search(r"pairs: train: 27 questions.*dropped: prompt_and_answer_beyond_max_seq_len (\d+)",
                        capsys.readouterr().out)
    assert dropped and 0 < int(dropped[1]) < 27 and 0 < len(short) < len(long)
    for source_id, pair in short.items():
        assert pair["rejected"] == long[source_id]["rejected"], source_id
