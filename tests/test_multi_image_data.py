"""Several images a sample, video frames and anyres tiles: pack.py's records and members against tarfile,
webdataset and megatron-energon; images.py's tiles against transformers' LLaVA-NeXT / OneVision / SigLIP image
processors (PIL backends); the loader's static tile slots against model.image_layout / place_images."""

import io
import json
import tarfile

import pytest
from PIL import Image
from test_images import photo

import pack

# -----------------------------------------------------------------------------
# records and shards: KEY.0.jpg, KEY.1.png... in tag order; KEY.f0.jpg... video frames


def conv(question, answer="Two."):
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


@pytest.fixture(scope="module")
def multi_json(tmp_path_factory):
    """OneVision-format records: several images with a tag each, video frames, and each way to get them wrong."""
    d = tmp_path_factory.mktemp("multi")
    imgs = d / "images"
    imgs.mkdir()
    sizes = {"a.jpg": (640, 480), "b.png": (333, 500), "c.jpg": (500, 333), "p.jpg": (1920, 1080)}
    for name, (w, h) in sizes.items():
        photo(w, h, seed=w).save(imgs / name, **({"quality": 90} if name.endswith("jpg") else {}))
    for i in range(3):
        photo(120, 90, seed=i).save(imgs / f"f{i}.jpg")
    (imgs / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    good = [
        {"id": "two", "image": ["a.jpg", "b.png"], "conversations": conv("<image> or <image>: which has more?")},
        {"id": "three", "image": ["c.jpg", "a.jpg", "b.png"],
         "conversations": conv("First <image>\nthen <image>\nand <image>?", "The third.")},
        {"id": "single", "image": "p.jpg", "conversations": conv("What is it?", "A photo.")},
        {"id": "video", "video": ["f0.jpg", "f1.jpg", "f2.jpg"],
         "conversations": conv("<video>\nWhat happens?", "It moves.")},
        {"id": "text", "conversations": conv("Hi?", "Hello.")},
    ]
    bad = [
        {"id": "one_tag_two_images", "image": ["a.jpg", "b.png"], "conversations": conv("<image> which?")},
        {"id": "three_tags_two_images", "image": ["a.jpg", "b.png"], "conversations": conv("<image><image><image>")},
        {"id": "video_file", "video": "clip.mp4", "conversations": conv("<video> what?")},
        {"id": "missing_frame", "video": ["f0.jpg", "f9.jpg"], "conversations": conv("<video> what?")},
        {"id": "both", "image": "a.jpg", "video": ["f0.jpg"], "conversations": conv("<video> what?")},
        {"id": "video_tag_no_video", "image": "a.jpg", "conversations": conv("<video> <image> what?")},
        {"id": "missing_second", "image": ["a.jpg", "nope.jpg"], "conversations": conv("<image> <image>")},
    ]
    (d / "d.json").write_text(json.dumps(good + bad))
    skips = pack.pack(d / "d.json", imgs, d / "out", shard_size=3)
    return d, good, skips


def test_multi_image_and_video_records_pack_and_bad_ones_are_skipped_by_reason(multi_json):
    d, good, skips = multi_json
    assert dict(skips.counts) == {"image_tag_count_mismatch": 2, "video_file_not_frames": 1, "missing_video_frame": 1,
                                  "image_and_video": 1, "video_tag_without_video": 1, "missing_image": 1}
    names = [m.name for p in sorted((d / "out").glob("*.tar")) for m in tarfile.open(p)]
    # the documented naming: one member per image, numbered in tag order; frames with an f
    assert names[:5] == ["sample000000000.0.jpg", "sample000000000.1.png", "sample000000000.txt",
                         "sample000000000.json", "sample000000001.0.jpg"]
    assert "sample000000002.jpg" in names and [n for n in names if ".f" in n] == \
        ["sample000000003.f0.jpg", "sample000000003.f1.jpg", "sample000000003.f2.jpg"]


def test_webdataset_and_energon_yield_every_image_of_a_sample_in_order(multi_json):
    import webdataset as wds
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    d, good, _ = multi_json
    want = {r["conversations"][1]["value"]: [Image.open(d / "images" / n).size for n in
                                            ([r["image"]] if isinstance(r.get("image"), str) else
                                             r.get("image") or r.get("video") or [])] for r in good}
    tars = sorted(str(p) for p in (d / "out").glob("*.tar"))
    got = {}
    for s in wds.WebDataset(tars, shardshuffle=False):
        keys = sorted((k for k in s if k.endswith((".jpg", ".png")) or k in ("jpg", "png")),
                      key=lambda k: int(k.split(".")[0].lstrip("f")) if "." in k else 0)
        got[s["txt"].decode()] = [Image.open(io.BytesIO(s[k])).size for k in keys]
    assert got == want
    ds = get_train_dataset(d / "out", split_part="train", batch_size=None, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, repeat=False,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    got = {}
    for s in get_loader(ds):  # energon decodes images to (3, H, W) tensors
        images = s.image if isinstance(s.image, list) else [] if s.image is None else [s.image]
        got[s.answers] = [(img.shape[-1], img.shape[-2]) for img in images]
    assert got == want
