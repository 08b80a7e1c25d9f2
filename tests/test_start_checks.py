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
