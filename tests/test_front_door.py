"""What a newcomer meets first: `train.py --help` lists every key, flags typed the way argparse users type them are
read, a typo names the nearest key, and a start says only what this run changes."""

import re
import warnings

import pytest
from conftest import ROOT
from test_train import args

import config
import train


def help_of(argv, capsys):
    with pytest.raises(SystemExit) as e:
        config.load_config(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_key_with_its_default_type_and_meaning(capsys):
    for flag in ("--help", "-h"):
        text = help_of([flag], capsys)
        assert text.startswith("usage: python train.py [CONFIG.py ...]")
        listed = {k: shown for k, shown, _ in re.findall(r"^  (\w+) = (.*?)  \((\w+)\)", text, re.M)}
        assert set(listed) == set(config.DEFAULTS)  # every key, none twice
        for key, default in config.DEFAULTS.items():
            shown = repr(default)
            assert listed[key] == (shown if len(shown) <= 48 else shown[:45] + "..."), key
        assert re.search(r"^  max_iters = 1500  \(int\)  \S", text, re.M)  # a meaning, from config.py's comment
        assert all(re.search(rf"^  {k} = .*\)  \S", text, re.M) for k in config.DEFAULTS), "a key without its meaning"
        headings = [line for line in text.splitlines()[2:] if line and not line.startswith(" ")]
        assert headings[:3] == ["I/O", "the commands that make this config's inputs", "data"], headings


def test_help_after_a_config_shows_what_it_sets(capsys):
    text = help_of([str(ROOT / "configs/dpo_shapes.py"), "--max_iters", "7", "--help"], capsys)
    assert re.search(r"^ \*objective = 'dpo'  \(str\)", text, re.M)
    assert re.search(r"^ \*max_iters = 7  \(int\)", text, re.M)
    assert re.search(r"^  seed = 0  \(int\)", text, re.M)  # unchanged: no mark


@pytest.mark.parametrize("argv,key,value", [
    (["--max_iters", "10"], "max_iters", 10),
    (["--out_dir", "out/x y"], "out_dir", "out/x y"),
    (["--lr", "1e-4"], "lr", 1e-4),
    (["--skip_steps", "[(3, 5)]"], "skip_steps", [(3, 5)]),
    (["--resume=true"], "resume", True),
    (["--resume", "FALSE"], "resume", False),
    (["--compile=Yes"], "compile", True),
    (["--wandb_log=0"], "wandb_log", False),
    (["--activation_checkpointing", "on"], "activation_checkpointing", True),
])
def test_flags_as_people_type_them(argv, key, value):
    assert config.parse(argv, config.DEFAULTS)[key] == value


@pytest.mark.parametrize("argv,said", [
    (["--max_iter=5"], "config: unknown key 'max_iter' (from '--max_iter=5'): did you mean max_iters"),
    (["--max_iters"], "config: expected --key=value (or --key value), got '--max_iters' with no value"),
    (["--max_iters=ten"], "config: max_iters must be int, got 'ten' (str)"),
    (["--resume=maybe"], "config: resume must be bool, got 'maybe' (str)"),
    (["--lora={'alpah': 3}"], "config: lora={'alpah': 3}: no field 'alpah': did you mean alpha?"),
    (["--model_overrides={'llm': {'n_layer': 3}}"], "did you mean n_layers"),
])
def test_a_typo_is_one_sentence_naming_the_nearest_key(argv, said):
    with pytest.raises(SystemExit) as e:
        config.load_config(argv)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_start_says_what_this_run_changes_and_a_resume_no_flag_it_was_given(shapes_data, tmp_path, capsys):
    shapes = shapes_data(n=200, seed=3, val_fraction=0.1)
    train.main(args(shapes, tmp_path, "--max_iters=2", "--ckpt_interval=2"))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("config (what differs from config.py's defaults): {") and '"max_iters": 2' in first
    assert '"beta1"' not in first and len(first) < 1500, first  # the defaults are in out_dir/config.json
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.main(args(shapes, tmp_path, "--max_iters=4", "--ckpt_interval=2", "--resume", "true"))
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]  # nothing a user can act on
    out = capsys.readouterr().out
    assert "resuming from" in out and "resume changed" not in out and "max_iters changed from 2 to 4" in out, out


def test_the_audit_header_says_whether_rows_are_packed(shapes_data, capsys):
    import audit

    shapes = shapes_data(n=200, seed=3, val_fraction=0.1)
    for packing, said in ((0, "unpacked,"), (2, "packed 2 samples a row into 8 rows,")):
        audit.audit(shapes / "shards", shapes / "tokenizer.model", "llama_3", 64, 28, 4, 512, pack=packing, rows=8,
                   show=0, progress=0, limit=5)
        header = capsys.readouterr().out.splitlines()[0]
        assert said in header and "pack 0" not in header, header
