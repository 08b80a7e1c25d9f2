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


def test_help_groups_keys_under_config_pys_headings_and_shows_the_longer_notes(capsys):
    # a one-line comment opens a group; a longer one explains the key below it ("(above)" in its line refers to it)
    text = help_of(["--help"], capsys)
    headings = [line for line in text.splitlines()[2:] if line and not line.startswith(" ")]
    assert "backend" in headings and "objective='ppo'" in headings, headings
    assert not {"'dense'", "FSDP2", "multi-tier", "a resume on another mixture"} & set(headings), headings
    assert re.search(r"^   # 'dense': SDPA .*\n(   # .*\n)*  attention = 'dense'", text, re.M)
    assert headings.index("backend") < headings.index("preference training")
    backend = text.split("\nbackend\n")[1].split("\n\n")[0]
    assert "  seed = 0  (int)" in backend and "  peak_flops = 0.0" in backend  # not under a note's first words


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
    (["--compile"], "compile", True),  # a boolean flag alone, as argparse's store_true
    (["--resume", str(ROOT / "configs/dpo_shapes.py")], "resume", True),
    (["--resume", str(ROOT / "configs/dpo_shapes.py")], "objective", "dpo"),  # the file still read
    (["--compile", "--max_iters", "3"], "max_iters", 3),
    (["--seed", "-3"], "seed", -3),  # a negative number is a value, not a flag
    (["--wandb_run_name", "a run"], "wandb_run_name", "a run"),
])
def test_flags_as_people_type_them(argv, key, value):
    assert config.parse(argv, config.DEFAULTS)[key] == value


@pytest.mark.parametrize("argv,said", [
    (["--max_iter=5"], "config: unknown key 'max_iter' (from '--max_iter=5'): did you mean max_iters"),
    (["--max_iters"], "config: expected --key=value (or --key value), got '--max_iters' with no value"),
    (["--max_iters=ten"], "config: max_iters must be int, got 'ten' (str)"),
    (["--resume=maybe"], "config: resume must be a bool, True or False (also true/false, yes/no, on/off, 1/0), got "
                         "'maybe' (str)"),
    (["--lora={'alpah': 3}"], "config: lora={'alpah': 3}: no field 'alpah': did you mean alpha?"),
    (["--model_overrides={'llm': {'n_layer': 3}}"], "did you mean n_layers"),
    (["--model=debgu"], "config: model 'debgu' is no preset: did you mean debug?"),  # not "model_overrides {...}"
])
def test_a_typo_is_one_sentence_naming_the_nearest_key(argv, said):
    with pytest.raises(SystemExit) as e:
        config.load_config(argv)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("text,said", [
    ("max_iters = 10\nmax_iter = 3\n", ":2: did you mean max_iters"),
    ("lr = 1e-3\nmax_iters = 'ten'\n", "config: max_iters must be int, got 'ten' (str) in {file}:2"),
    ("from math import pi\n", "config: unknown key 'pi' in {file}:1"),
])
def test_a_config_files_mistake_names_its_file_and_line(tmp_path, text, said):
    file = tmp_path / "mine.py"
    file.write_text(text)
    with pytest.raises(SystemExit) as e:
        config.load_config([str(file)])
    assert said.format(file=file) in str(e.value) and str(file) in str(e.value), str(e.value)


def test_every_preset_named_is_one():
    from model_config import VLM_PRESETS, vlm_preset

    assert all(vlm_preset(name) for name in VLM_PRESETS) and "debug" in VLM_PRESETS


def test_the_keys_are_config_pys_assignments_and_nothing_it_imports():
    assert set(config.DEFAULTS) == {key for _, key, _ in config.described_keys()}
    assert "HF_ARCHITECTURES" not in config.DEFAULTS


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
