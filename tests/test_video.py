"""Video files in records (video.py, pack.py): the frames LLaVA-NeXT's loader takes (its rule written here in our own
words), decoded from videos made here with PyAV in several codecs, frame rates and lengths; every broken file a
drop reason, never a crash or a hang; packed video samples read by the loader as tiles. References: the frame
number painted into each frame, transformers' PyAV video reader (load_video), SigLIP's PIL image processor."""

import dataclasses
import fractions
import gc
import io
import json
import os
import re
import signal
import threading
import time

import av
import numpy as np
import pytest
import torch
from PIL import Image
from test_multi_image_data import chat_tokenizer, conv, levels, tiny_onevision_config

import chat
import images
import loader
import audit
import pack
import video
from video import VideoDropped, VideoSettings, frame_indices, read_video, time_instruction, video_conversation


# -----------------------------------------------------------------------------
# videos made here: frame i carries i as 10 black or white squares along its top, so a decoded frame names itself

W, H, BITS, SIDE = 160, 96, 10, 16


def painted(i, w=W, h=H):
    """Frame i: a moving colour ramp under a row of squares spelling i in binary (most significant first)."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // w + 3 * i) % 256, (y * 255 // h) % 256, np.full_like(x, (40 + 7 * i) % 256)], -1)
    for b in range(BITS):
        rgb[:SIDE, b * SIDE : (b + 1) * SIDE] = 255 * ((i >> (BITS - 1 - b)) & 1)
    return rgb.astype(np.uint8)


def frame_number(rgb):
    """The number painted into a decoded frame (each square read at its centre)."""
    grey = rgb[SIDE // 2, SIDE // 2 :: SIDE][:BITS].astype(int).mean(-1)
    return int("".join("1" if v > 127 else "0" for v in grey), 2)


def write_video(path, codec, fps, n_frames, w=W, h=H, **container_options):
    rate = fractions.Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w", options=container_options) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = w, h, "rgb8" if codec == "gif" else "yuv420p"
        for i in range(n_frames):
            for p in s.encode(av.VideoFrame.from_ndarray(painted(i, w, h), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def decoded(frames):
    return [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for _, data in frames]


def encoders():
    """The encoders this PyAV wheel has, of those the tests use."""
    found = set()
    for name in ("libx264", "mpeg4", "libvpx-vp9", "gif"):
        try:
            av.codec.Codec(name, "w")
            found.add(name)
        except Exception:  # noqa: BLE001  not in this wheel
            pass
    return found


ENCODERS = encoders()

# (file, encoder, frames a second, frames): h264 in mp4, mkv and mov, MPEG-4 part 2 in avi, VP9 in webm, GIF;
# NTSC rates, 60 fps, lengths no rate divides
VIDEOS = [("a.mp4", "libx264", 30, 97), ("b.mkv", "libx264", 30000 / 1001, 61), ("c.webm", "libvpx-vp9", 24, 53),
          ("d.avi", "mpeg4", 25, 79), ("e.mov", "libx264", 60, 131), ("f.gif", "gif", 10, 23)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return {name: write_video(d / name, codec, fps, n) for name, codec, fps, n in VIDEOS if codec in ENCODERS}


# -----------------------------------------------------------------------------
# which frames: LLaVA-NeXT's rule


def llava_next_frames(total, fps, frames_upbound, video_fps, force_sample):
    """llava/utils.py process_video_with_decord (LLaVA-NeXT df17966), restated: a frame every round(fps / video_fps);
    if that is more than frames_upbound (> 0), or force_sample, frames_upbound indices from linspace over
    [0, total - 1] floored, with times index / fps instead of index / step."""
    every = round(fps / video_fps)
    picked = np.arange(0, total, every)
    stamps = picked / every
    if frames_upbound > 0 and (force_sample or picked.size > frames_upbound):
        picked = np.floor(np.linspace(0, total - 1, frames_upbound)).astype(int)
        stamps = picked / fps
    return picked.tolist(), stamps.tolist()


def test_frame_indices_are_llava_nexts_over_many_lengths_rates_and_settings():
    checked = 0
    for total in (1, 2, 5, 31, 53, 97, 300, 1799, 18001):
        for fps in (8, 10, 12.5, 23.976, 24, 25, 29.97, 30, 50, 59.94, 60, 120):
            for video_fps in (0.5, 1, 2, 3):
                for upbound in (0, 1, 8, 32, 64):
                    for force in (False, True) if upbound else (False,):
                        got = frame_indices(total, fps, VideoSettings(upbound, video_fps, force))
                        assert got == llava_next_frames(total, fps, upbound, video_fps, force), \
                            (total, fps, video_fps, upbound, force)
                        checked += 1
    assert checked > 3000
    # by hand: 53 frames at 25 fps, 1 a second -> 0, 25, 50 at "0, 1, 2 s"; 32 from 3000 frames spread evenly
    assert frame_indices(53, 25, VideoSettings()) == ([0, 25, 50], [0, 1, 2])
    assert frame_indices(3000, 30, VideoSettings())[0][:4] == [0, 96, 193, 290]
    # force_sample on a video shorter than the bound repeats frames, as decord's get_batch returns them
    assert frame_indices(3, 30, VideoSettings(5, force_sample=True))[0] == [0, 0, 1, 1, 2]
    # a step that rounds to 0 (LLaVA-NeXT raises there and skips the sample) takes every frame
    assert frame_indices(4, 0.4, VideoSettings())[0] == [0, 1, 2, 3]


@pytest.mark.parametrize("setting", [{"video_fps": float("nan")}, {"video_fps": float("inf")}, {"timeout_s": 0},
                                     {"timeout_s": float("nan")}, {"memory_mb": 0}, {"max_decode_pixels": -1},
                                     {"max_frame_pixels": 0}, {"frames_upbound": 2.5}])
def test_settings_no_video_could_mean_are_refused_not_blamed_on_the_videos(videos, setting):
    """Before, VideoSettings(video_fps=nan) (and a zero time, memory or pixel bound) was taken, and every video then
    dropped as corrupt or too large."""
    with pytest.raises(ValueError, match=f"video: {next(iter(setting))} must be"):
        VideoSettings(**setting)
    read_video(videos["a.mp4"], VideoSettings())  # the same file reads with the defaults


def test_force_sample_over_a_short_video_stores_llava_nexts_repeats_and_says_so(videos, tmp_path, capfd):
    """97 frames, force_sample with a bound of 200: LLaVA-NeXT's loader takes 200 frames (np.linspace over the 97,
    some 3 times), so pack stores those 200, and says which videos repeat frames (before: not a word)."""
    folder = videos["a.mp4"].parent
    recs = [{"id": "short", "video": "a.mp4", "conversations": conv("<video>\nWhat moves?", "A ramp.")},
            {"id": "long_enough", "video": "a.mp4", "conversations": conv("<video>\nAnd now?", "Still a ramp.")}]
    (tmp_path / "v.json").write_text(json.dumps(recs))
    pack.pack(tmp_path / "v.json", folder, tmp_path / "forced", video=VideoSettings(200, force_sample=True))
    err = capfd.readouterr().err
    assert "pack: 2 videos have fewer frames than frames_upbound 200 (force_sample): their frames are stored " \
           "repeated, one up to 3 times, as LLaVA-NeXT's loader repeats them" in err and "first: short, long_enough" in err
    import tarfile

    with tarfile.open(tmp_path / "forced/shard-000000.tar") as tar:
        frames = [m.name for m in tar.getmembers() if m.name.startswith("sample000000000.f")]
    assert len(frames) == 200 == len(llava_next_frames(97, 30, 200, 1, True)[0])
    pack.pack(tmp_path / "v.json", folder, tmp_path / "bounded", video=VideoSettings(32, force_sample=True))
    assert "repeated" not in capfd.readouterr().err  # 32 of 97: no frame twice, nothing to say


def test_the_time_instruction_is_llava_videos_sentence_and_rewrites_the_first_turn_as_llava_next_does():
    text = time_instruction(3.5, [0.0, 1.25, 2.5])
    assert text == ("The video lasts for 3.50 seconds, and 3 frames are uniformly sampled from it. These frames are "
                    "located at 0.00s,1.25s,2.50s.Please answer the following questions related to this video.")
    # LLaVA-NeXT: '<image>\n{instruction}\n' + the first turn without its tag (its newline stays)
    c = video_conversation(conv("<image>\nWhat happens?", "It moves."), text)
    assert c[0]["value"] == f"<video>\n{text}\n\nWhat happens?" and c[1]["value"] == "It moves."
    assert video_conversation(conv("What happens?"), text)[0]["value"] == f"<video>\n{text}\nWhat happens?"
    assert video_conversation(conv("Look: <image> what?"))[0]["value"] == "Look: <video> what?"  # the tag alone


# -----------------------------------------------------------------------------
# decoding: the chosen frames, in every codec, equal to a reference decode


@pytest.mark.parametrize("name", [v[0] for v in VIDEOS])
def test_each_codec_gives_the_frames_the_rule_names_equal_to_transformers_pyav_reader(videos, name):
    from transformers.video_utils import load_video

    if name not in videos:
        pytest.skip(f"this PyAV wheel has no encoder for {name}")
    _, _, fps, n = next(v for v in VIDEOS if v[0] == name)
    for settings in (VideoSettings(8, frame_format="png"), VideoSettings(0, 2, frame_format="png"),
                     VideoSettings(16, force_sample=True)):
        frames, info = read_video(videos[name], settings)
        assert info["total_frames"] == n
        if name.endswith(".gif"):  # GIF keeps delays in 1/100 s
            assert info["fps"] == pytest.approx(fps, rel=0.05)
        else:
            assert info["fps"] == pytest.approx(fps, rel=1e-3)
        want, _ = frame_indices(n, info["fps"], settings)
        assert info["frame_indices"] == want
        got = decoded(frames)
        assert [frame_number(f) for f in got] == want  # the frames painted with those numbers
        unique = sorted(set(want))
        ref, _ = load_video(str(videos[name]), backend="pyav", sample_indices_fn=lambda unique=unique, **_: np.array(unique))
        gc.collect()  # load_video leaves its container open: its FFmpeg threads live until collected, and a process
        # forked while they do (a later test's Pool, under xdist) deadlocks
        for index, frame in zip(want, got):
            diff = np.abs(frame.astype(int) - ref[unique.index(index)])
            if settings.frame_format == "png":
                assert diff.max() == 0, (name, index)
            else:  # JPEG quality 95, 4:4:4
                limit = (24, 3) if name.endswith(".gif") else (16, 1.2)  # a GIF's dithering costs JPEG more
                assert diff.max() <= limit[0] and diff.mean() < limit[1], (name, index, diff.max(), diff.mean())


def test_a_bound_on_pixels_time_and_memory_and_a_crashing_decoder_are_drop_reasons(videos):
    path = videos["a.mp4"]
    cases = {"video_resolution_too_large": VideoSettings(max_frame_pixels=W * H - 1),
             "video_too_long": VideoSettings(max_decode_pixels=W * H * 90)}  # frames 0, 30, 60, 90: 91 to decode
    for reason, settings in cases.items():
        with pytest.raises(VideoDropped) as e:
            read_video(path, settings)
        assert e.value.reason == reason
    read_video(path, VideoSettings(max_decode_pixels=W * H * 91))  # just enough

    # a file whose open never returns (a FIFO no one writes): the helper is killed at the deadline, the next file
    # gets a new one; the helper killed by a signal mid-file; a memory cap that no decode fits under
    fifo = path.parent / "never.mp4"
    if not fifo.exists():
        os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(VideoDropped) as e:
        read_video(fifo, VideoSettings(timeout_s=1.0))
    assert e.value.reason == "video_timeout" and time.monotonic() - start < 10
    assert read_video(path)[1]["total_frames"] == 97
    threading.Timer(1.0, lambda: os.kill(video.DECODER.proc.pid, signal.SIGSEGV)).start()  # blocked on the FIFO
    with pytest.raises(VideoDropped) as e:
        read_video(fifo, VideoSettings(timeout_s=30))
    assert e.value.reason == "video_decoder_crashed" and e.value.detail == f"signal {int(signal.SIGSEGV)}"
    with pytest.raises(VideoDropped) as e:
        read_video(path, VideoSettings(memory_mb=1))
    assert e.value.reason == "video_out_of_memory", e.value
    assert read_video(path)[1]["total_frames"] == 97


def broken_videos(d, good):
    """{file name: the drop reason pack must give it}."""
    made = {}
    whole = write_video(d / "whole.mp4", "libx264", 30, 90, movflags="faststart").read_bytes()
    (d / "cut.mp4").write_bytes(whole[: len(whole) // 2])  # index first, half the frames' data gone
    made["cut.mp4"] = "video_truncated"
    at_end = good.read_bytes()  # PyAV's MP4 keeps its index (moov) at the end: cut, it cannot be opened
    (d / "cut_index.mp4").write_bytes(at_end[: len(at_end) // 2])
    made["cut_index.mp4"] = "video_unreadable"
    (d / "empty.mkv").write_bytes(b"")
    made["empty.mkv"] = "video_unreadable"
    (d / "notes.mp4").write_text("not a video, whatever its name says\n" * 20)
    made["notes.mp4"] = "video_unreadable"
    Image.fromarray(painted(3)).save(d / "still.png")
    (d / "still.mov").write_bytes((d / "still.png").read_bytes())
    made["still.mov"] = "video_still_image"
    with av.open(str(d / "sound.mp4"), "w") as c:  # audio only
        s = c.add_stream("aac", rate=16000)
        for _ in range(8):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 16000
            for p in s.encode(frame):
                c.mux(p)
    made["sound.mp4"] = "video_no_video_stream"
    with av.open(str(d / "nothing.avi"), "w") as c:  # a video stream with no frame in it (AVI keeps its header)
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        c.start_encoding()
    made["nothing.avi"] = "video_no_frames"
    if "mpeg4" in ENCODERS:  # an AVI whose codec tag no decoder knows
        avi = write_video(d / "x.avi", "mpeg4", 25, 10).read_bytes()
        (d / "unknown.avi").write_bytes(avi.replace(b"FMP4", b"QQQQ"))
        made["unknown.avi"] = "video_unknown_codec"
    return made


def test_broken_files_are_drop_reasons(videos, tmp_path):
    for name, reason in broken_videos(tmp_path, videos["a.mp4"]).items():
        with pytest.raises(VideoDropped) as e:
            read_video(tmp_path / name, VideoSettings(timeout_s=30))
        assert e.value.reason == reason, (name, e.value)


# -----------------------------------------------------------------------------
# pack, audit and the loader


@pytest.fixture(scope="module")
def packed(videos, tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    folder = d / "videos"
    folder.mkdir()
    for name, path in videos.items():
        (folder / name).write_bytes(path.read_bytes())
    broken = broken_videos(folder, videos["a.mp4"])
    recs = [{"id": "onevision", "video": "a.mp4", "conversations": conv("<video>\nWhat moves?", "A ramp.")},
            {"id": "llava_video", "video": "b.mkv", "conversations": conv("<image>\nWhat moves?", "A ramp.")},
            {"id": "untagged", "video": "a.mp4", "conversations": conv("What moves?", "A ramp.")},
            {"id": "missing", "video": "gone.mp4", "conversations": conv("<video>\nWhat?")},
            {"id": "outside", "video": "../a.mp4", "conversations": conv("<video>\nWhat?")},
            {"id": "two_tags", "video": "a.mp4", "conversations": conv("<video> <image> What?")}]
    recs += [{"id": name, "video": name, "conversations": conv("<video>\nWhat?")} for name in broken]
    (d / "videos.json").write_text(json.dumps(recs))
    settings = VideoSettings(frames_upbound=6, video_fps=2, time_instruction=True)
    # one worker: this process has decoded with PyAV (FFmpeg threads alive), and a Pool forked from it can deadlock
    skips = pack.pack(d / "videos.json", folder, d / "shards", video=settings, workers=1)
    return d, folder, recs, broken, skips, settings


def test_pack_stores_the_frames_and_counts_every_bad_video_by_reason(packed, capsys):
    d, folder, recs, broken, skips, settings = packed
    want = {"missing_video": 1, "image_outside_images_dir": 1, "image_tag_in_video_sample": 1}
    for reason in broken.values():
        want[reason] = want.get(reason, 0) + 1
    assert dict(skips.counts) == want
    assert json.loads((d / "shards/.nv-meta/llavax.json").read_text())["skipped"] == dict(sorted(want.items()))
    import tarfile

    members = {}
    with tarfile.open(d / "shards/shard-000000.tar") as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            members.setdefault(key, {})[ext] = tar.extractfile(m).read()
    assert len(members) == 3
    by_id = {json.loads(m["json"])["id"]: m for m in members.values()}
    a = by_id["onevision"]
    meta = json.loads(a["json"])
    assert sorted(k for k in a if k.startswith("f")) == [f"f{i}.jpg" for i in range(6)]
    assert meta["video"]["frame_indices"] == frame_indices(97, 30, settings)[0] == [0, 19, 38, 57, 76, 96]  # 7 > 6
    assert [frame_number(np.asarray(Image.open(io.BytesIO(a[f"f{i}.jpg"])))) for i in range(6)] == \
        meta["video"]["frame_indices"]
    instruction = time_instruction(97 / 30, [i / 30 for i in meta["video"]["frame_indices"]])
    assert meta["conversations"][0]["value"] == f"<video>\n{instruction}\n\nWhat moves?"
    assert json.loads(by_id["llava_video"]["json"])["conversations"][0]["value"].startswith("<video>\nThe video lasts")
    assert json.loads(by_id["untagged"]["json"])["conversations"][0]["value"] == f"<video>\n{instruction}\nWhat moves?"
    # data.py audit on the JSON: the same reasons, counted
    tok = chat_tokenizer(d / "tok")
    cfg = tiny_onevision_config(tok)
    out = io.StringIO()
    audit.audit(d / "videos.json", tok, "chatml", 400, 28, cfg.n_image_tokens, cfg.image_token_id, images_dir=folder,
               show=0, progress=0, out=out, vlm=cfg, max_tiles=8)
    text = out.getvalue()
    for reason, n in want.items():
        assert f"dropped, {reason}: {n} " in text, text
    assert "kept: 3" in text


def shown_prompts(text):
    """The prompts an audit shows, without the lines that name where each sample came from."""
    shown = text.split("\n--- ", 1)[1].split("\nsamples: ", 1)[0]
    return re.sub(r"(?m)^(--- )?\d+: \S+: ", "", shown)


def test_an_audit_of_a_video_json_gives_packs_prompts_and_the_loaders_drop_reasons(packed):
    """With pack's video settings the audit of the JSON shows the prompts pack wrote (LLaVA-Video's time instruction,
    6 frames at 2 a second: before, it had no such flags and showed other prompts), and a model without a video token
    drops the videos as the loader does, video_without_video_token (before: unreadable_sample: ValueError)."""
    d, folder, recs, broken, skips, settings = packed
    tok = chat_tokenizer(d / "tok")
    cfg = tiny_onevision_config(tok)
    args = (tok, "chatml", 400, 28, cfg.n_image_tokens, cfg.image_token_id)
    texts = {}
    for name, source in (("json", d / "videos.json"), ("shards", d / "shards")):
        out = io.StringIO()
        audit.audit(source, *args, images_dir=folder, show=3, progress=0, out=out, vlm=cfg, max_tiles=8,
                    video=settings)
        texts[name] = out.getvalue()
    assert "The video lasts for 3.23 seconds, and 6 frames" in texts["json"]
    assert shown_prompts(texts["json"]) == shown_prompts(texts["shards"])
    no_video_token = dataclasses.replace(cfg, video_token_id=None)
    out = io.StringIO()
    audit.audit(d / "videos.json", *args, images_dir=folder, show=0, progress=0, out=out, vlm=no_video_token,
                max_tiles=8, video=settings)
    stream = loader.ShardStream(d / "shards", tok, batch_size=2, seq_len=400, image_size=28,
                                image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template="chatml",
                                vlm=no_video_token, max_tiles=8)
    reasons = []
    for sample in range(len(stream)):
        with pytest.raises(chat.DropSample) as e:
            stream.encode(sample)
        reasons.append(str(e.value).split(" ")[0])
    assert reasons == ["video_without_video_token"] * 3
    assert "dropped, video_without_video_token: 3 " in out.getvalue() and "unreadable_sample" not in out.getvalue()


def test_a_packed_video_sample_reaches_the_loader_as_its_frames(packed):
    """The loader's tile slots hold the stored frames squashed to S x S, which equal the reference decode of the
    same frames squashed by SigLIP's PIL image processor (LLaVA-NeXT's per-frame preprocessing) within JPEG's error."""
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    from transformers.video_utils import load_video

    d, folder, *_ = packed
    tok = chat_tokenizer(d / "tok")
    cfg = tiny_onevision_config(tok)
    stream = loader.ShardStream(d / "shards", tok, batch_size=3, seq_len=400, image_size=28,
                                image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens,
                                template="chatml", shuffle_block=1, vlm=cfg, max_tiles=8)
    b = stream.batch(0)
    assert not b["dropped"].any() and b["pixel_values"].shape == (3, 8, 3, 28, 28)
    processor = SiglipImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for row, sample in enumerate(b["sample_id"].tolist()):
        _, members = stream.read(sample)
        meta = json.loads(members["json"])
        indices = meta["video"]["frame_indices"]
        ref, _ = load_video(str(folder / meta["video"]["file"]), backend="pyav",
                            sample_indices_fn=lambda indices=indices, **_: np.array(indices))
        gc.collect()  # its FFmpeg threads, as above
        frames = [members[f"f{i}.jpg"] for i in range(len(indices))]
        tiles = b["pixel_values"][row, : len(indices)]
        assert torch.equal(tiles, torch.cat([images.image_tiles(f, cfg, "video") for f in frames]))
        want = levels(processor(images=list(ref), return_tensors="pt")["pixel_values"], ([0.5] * 3, [0.5] * 3))
        diff = (tiles.float() - want).abs()
        assert diff.max() <= 8 and diff.mean() < 1, (row, diff.max(), diff.mean())
        n_video = (b["input_ids"][row] == cfg.video_token_id).sum().item()
        assert n_video == sum(len(index) for _, index, _ in loader.image_layouts(cfg, "video", [(H, W)] * len(frames)))


def test_loader_frames_are_llava_onevision_video_processors_within_its_resize():
    """transformers' LlavaOnevisionVideoProcessor resizes with torchvision (needs it installed); ours with PIL."""
    pytest.importorskip("torchvision")
    from transformers import LlavaOnevisionVideoProcessor

    from test_multi_image_data import onevision_config

    cfg = onevision_config()
    frames = np.stack([painted(i, 640, 360) for i in range(4)])
    stats = cfg.vision.image_stats
    processor = LlavaOnevisionVideoProcessor(image_mean=list(stats[0]), image_std=list(stats[1]))
    theirs = levels(processor(videos=[frames], return_tensors="pt")["pixel_values_videos"][0], stats)
    ours = torch.cat([images.image_tiles(png, cfg, "video") for png in map(png_bytes, frames)])
    diff = (ours.float() - theirs).abs()
    assert diff.max() <= 12 and diff.mean() < 0.5, (diff.max(), diff.mean())


def png_bytes(rgb):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()
