"""What a program is given that it cannot use, said in one sentence when it starts (not a traceback, not a run that
trains and then fails), and the inputs people give sample.py that it must take: a video file, a run's folder."""

import pytest
from test_anyres_review import onevision_ckpt  # noqa: F401  the fixture: a tiny OneVision checkpoint with <video>

import sample


def test_sample_takes_a_video_file_as_the_frames_pack_would_store(onevision_ckpt, tmp_path, capsys):  # noqa: F811
    """`sample.py --image clip.mp4` (was: cannot read it as an image): its frames, as video.read_video takes them for
    data.py pack, asked about as one video: the same answer as those frames given as files with --video."""
    from test_video import write_video

    from video import read_video

    clip = write_video(tmp_path / "clip.mp4", "libx264", 30, 97, w=80, h=60)
    ask = ["--ckpt", str(onevision_ckpt), "--prompt", "What happens?", "--template", "chatml", "--max-new-tokens",
           "4", "--device", "cpu"]
    sample.main(ask + ["--image", str(clip)])
    said = capsys.readouterr().out.splitlines()
    frames, info = read_video(clip)
    assert len(frames) == 4 == len(info["frame_indices"])  # 97 frames at 30 fps: one a second
    files = []
    for i, (ext, data) in enumerate(frames):
        files.append(tmp_path / f"{i}.{ext}")
        files[-1].write_bytes(data)
    sample.main(ask + ["--video", "--image", *map(str, files)])
    assert len(said) == 1 and said == capsys.readouterr().out.splitlines()
    with pytest.raises(SystemExit, match=r"0.jpg: a video file \(.*clip.mp4\) is asked about alone"):
        sample.main(ask + ["--image", str(clip), str(files[0])])
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(64))
    with pytest.raises(SystemExit, match=r"^sample: --image .*broken.mp4: cannot read it as a video \(video_"):
        sample.main(ask + ["--image", str(tmp_path / "broken.mp4")])


def test_sample_refuses_a_run_folder_without_a_committed_step(tmp_path):
    """A training run's out_dir whose steps never committed (no manifest: killed mid-write): one sentence naming
    them, not the run's config.json read as a model."""
    (tmp_path / "out/step-000010").mkdir(parents=True)
    (tmp_path / "out/step-000010/.metadata").write_bytes(b"half")
    (tmp_path / "out/config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"^sample: --ckpt .*out is a training run's folder with no committed "
                                         r"checkpoint \(step-000010: no manifest.json"):
        sample.main(["--ckpt", str(tmp_path / "out"), "--prompt", "Hi", "--device", "cpu"])


# -----------------------------------------------------------------------------
# train.py's configuration: a value it cannot use, said at start


def test_a_word_for_a_bool_key_names_the_key_and_its_type():
    """`--tensorboard_log maybe` said `maybe: no such file` (the word taken for a config file); written with = or
    apart, it names the key and what it takes. A flag alone before a config file, or before yes, still reads."""
    import config
    from conftest import ROOT

    for argv in (["--tensorboard_log", "maybe"], ["--tensorboard_log=maybe"], ["--compile", "sometimes", "--seed=1"]):
        with pytest.raises(SystemExit, match=r"^config: (--)?(tensorboard_log|compile)[ =].*(is|must be) a bool, "
                                             r"True or False \(also true/false, yes/no, on/off, 1/0\)") as e:
            config.load_config(argv)
        assert argv[-1] != "--seed=1" or "sometimes" in str(e.value)
    debug = config.load_config(["--compile", str(ROOT / "configs/debug.py")])
    assert debug["compile"] is True and debug["seq_len"] == 48
    assert config.load_config(["--tensorboard_log", "yes"])["tensorboard_log"] is True
    assert config.load_config(["--tensorboard_log", "off"])["tensorboard_log"] is False


def test_min_lr_above_lr_is_refused_and_equal_is_a_constant_schedule():
    import config

    with pytest.raises(SystemExit, match=r"^config: min_lr=0.001 is above lr=0.0001: .*set min_lr <= lr$"):
        config.load_config(["--lr=1e-4", "--min_lr=1e-3"])
    assert config.load_config(["--lr=1e-6", "--min_lr=1e-6"])["min_lr"] == 1e-6  # configs/ppo_onevision.py's


def test_a_warmup_longer_than_the_schedule_is_said_at_start(shapes_data, tmp_path, capsys):
    """`--warmup_iters 500 --max_iters 10` trained at lr x 10/500 at most, silently: now a sentence at start naming
    both keys (a warning: a few steps of a long recipe are a smoke test). The first part of a longer schedule
    (lr_decay_iters past max_iters) says nothing."""
    import config
    import train
    from conftest import ROOT

    cfg = lambda *argv: config.load_config(list(argv))  # noqa: E731
    said = config.schedule_warning(cfg("--warmup_iters", "500", "--max_iters", "10"))
    assert said == "config: warning: warmup_iters=500 is longer than max_iters=10: the learning rate never reaches " \
                   "lr=0.0003 (at most 6e-06)"
    assert "lr_decay_iters=40" in config.schedule_warning(cfg("--warmup_iters=50", "--lr_decay_iters=40",
                                                              "--max_iters=100"))
    assert config.schedule_warning(cfg("--warmup_iters=100", "--lr_decay_iters=1000", "--max_iters=66")) is None
    assert config.schedule_warning(cfg("--warmup_iters=10", "--max_iters=10")) is None
    shapes = shapes_data(n=64, seed=0, val_fraction=0.1)
    train.main([str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}",
                f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2",
                "--warmup_iters=500", "--eval_interval=0", "--log_interval=1", "--ckpt_interval=0", "--device=cpu"])
    out = capsys.readouterr().out
    assert "config: warning: warmup_iters=500 is longer than max_iters=2" in out


def test_a_cuda_device_without_a_gpu_is_one_sentence(monkeypatch, tmp_path, capsys):
    """`--device cuda` where torch finds no GPU was torch's traceback from set_device; train.py and sample.py say it
    before anything starts (no out_dir taken)."""
    import torch

    import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^config: device='cuda', but torch finds no CUDA GPU here \(torch .*\): run "
                                         r"on the CPU \(device 'cpu'\)$"):
        train.main([f"--out_dir={tmp_path / 'out'}", "--device=cuda"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match=r"^sample: --device='cuda', but torch finds no CUDA GPU"):
        sample.main(["--ckpt", str(tmp_path), "--prompt", "Hi", "--device", "cuda"])


def test_convert_from_hf_help_names_every_architecture_it_converts(capsys):
    """`convert.py from-hf --help` named only Llama and CLIP: every model_type hf_config converts (LLMs, vision towers,
    VLMs) is named."""
    import convert
    import hf_config

    with pytest.raises(SystemExit):
        convert.main(["from-hf", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    llms = {t for t in hf_config.LLM_TYPES.values()} | set(hf_config.FAMILIES)
    towers = {t for t in hf_config.VISION_TYPES if t}
    missing = [name for name in sorted(llms | towers) + list(hf_config.HF_ARCHITECTURES.values()) if name not in said]
    assert not missing, missing
