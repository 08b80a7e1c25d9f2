"""
The data benchmarks of bench.py: images decoded and preprocessed, pack, the loader from files and buckets, video.
Each prints a table for BENCHMARKS.md; bench.py is the command line that runs them.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import storage
from chat import IMAGE_TAG
from images import CLIP_MEAN, CLIP_STD, load_image, normalize_images
from model_config import vlm_preset
from pack import pack, pack_source
from shards import read_members, sample_offsets, shard_files
from sources import JsonRecords, ParquetRows


# -----------------------------------------------------------------------------
# benchmark: decode + preprocess to `size` px, ours against webdataset + PIL


def make_bench_shards(out, n=400, width=640, height=480, seed=0, shard_size=100):
    """Photo-like 640x480 JPEGs (smooth gradients plus noise), packed."""
    bench_records(out, n, width, height, seed)
    pack(Path(out) / "bench.json", Path(out) / "images", Path(out) / "shards", shard_size=shard_size, overwrite=True)
    return Path(out) / "shards"


def bench_records(out, n=400, width=640, height=480, seed=0):
    """n records of photo-like JPEGs (smooth gradients plus noise): OUT/images/I.jpg and OUT/bench.json."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    records = []
    for i in range(n):
        base = np.stack([np.sin(xx / rng.uniform(20, 90) + c) * np.cos(yy / rng.uniform(20, 90)) for c in range(3)], -1)
        pixels = np.clip(127 + 100 * base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(out / "images" / f"{i}.jpg", quality=90)
        records.append({"id": i, "image": f"{i}.jpg", "conversations": [
            {"from": "human", "value": f"{IMAGE_TAG}\nDescribe the image."}, {"from": "gpt", "value": "Waves."}]})
    (out / "bench.json").write_text(json.dumps(records))
    return records


def bench_pack(args):
    """Pack the same JPEG records from a JSON file and its image folder, and from parquet rows (row groups of 100,
    the images inside), alternating, --rounds times each; the fastest of each is reported."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    work = Path(args.workdir)
    if not (work / "bench.json").exists() or len(json.loads((work / "bench.json").read_text())) != args.n:
        bench_records(work, args.n, args.width, args.height)
    records = json.loads((work / "bench.json").read_text())
    image_bytes = sum((work / "images" / r["image"]).stat().st_size for r in records)
    rows = [{"id": r["id"], "image": {"bytes": (work / "images" / r["image"]).read_bytes(), "path": r["image"]},
             "conversations": r["conversations"]} for r in records]
    (work / "parquet").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), work / "parquet/bench.parquet", row_group_size=100)
    del rows
    print(f"{args.n} records, {image_bytes / args.n / 1e3:.0f} KB JPEGs ({args.width}x{args.height}), "
          f"{image_bytes / 1e6:.0f} MB of images; parquet file {(work / 'parquet/bench.parquet').stat().st_size / 1e6:.0f} "
          "MB\n| source | workers | seconds | samples/s | MB/s of images |\n|---|---|---|---|---|")
    for workers in args.workers:
        best = {}
        for _ in range(args.rounds):
            for kind in ("JSON + image folder", "parquet rows"):
                source = JsonRecords(work / "bench.json", work / "images") if kind.startswith("JSON") else \
                    ParquetRows(work / "parquet/bench.parquet")
                t0 = time.perf_counter()
                pack_source(source, work / "out", shard_size=1000, workers=workers, overwrite=True)
                best[kind] = min(best.get(kind, float("inf")), time.perf_counter() - t0)
        for kind, seconds in best.items():
            print(f"| {kind} | {workers} | {seconds:.2f} | {args.n / seconds:.0f} | {image_bytes / 1e6 / seconds:.1f} |")


def bench_images(shards, size=336, repeats=2):
    """images/s on one core for our reader (draft decode, resize, pad, batched normalize) and webdataset + PIL."""
    import time

    torch.set_num_threads(1)
    files = shard_files(shards)

    def ours():
        n = 0
        for path in files:
            with open(path, "rb") as f:
                for start, end in sample_offsets(path):
                    _, members = read_members(f, start, end)
                    normalize_images(load_image(members["jpg"], size, "pad")[None])
                    n += 1
        return n

    def webdataset_pil():
        import webdataset as wds

        mean = np.array(CLIP_MEAN, dtype=np.float32)
        std = np.array(CLIP_STD, dtype=np.float32)
        n = 0
        for sample in wds.WebDataset([str(f) for f in files], shardshuffle=False).decode("pil"):
            img = sample["jpg"].convert("RGB")
            w, h = img.size  # LLaVA's expand2square, then the processor's resize and normalize
            square = Image.new("RGB", (max(w, h),) * 2, tuple(int(m * 255) for m in CLIP_MEAN))
            square.paste(img, ((max(w, h) - w) // 2, (max(w, h) - h) // 2))
            x = np.asarray(square.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
            ((x - mean) / std).transpose(2, 0, 1)
            n += 1
        return n

    results = {}
    for name, fn in (("llavax", ours), ("webdataset+PIL", webdataset_pil)):
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = fn()
            best = max(best, n / (time.perf_counter() - t0))
        results[name] = best
    return results


# -----------------------------------------------------------------------------
# loader: the same shards from local files and from an S3 server behind injected latency


class LatencyProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 that holds every request `latency` seconds before forwarding it to
    127.0.0.1:upstream: a bucket's time to first byte (50-100 ms on S3 and GCS) in front of a local S3 server."""

    def __init__(self, upstream, latency):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        hop_by_hop = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
                      "expect", "content-length"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_one_request(self):
                try:
                    super().handle_one_request()
                except ConnectionError:  # a client that went away (a loader worker at its end)
                    self.close_connection = True

            def forward(self):
                time.sleep(latency)
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop_by_hop}
                if not hasattr(self, "upstream"):  # one connection upstream for each client connection
                    self.upstream = http.client.HTTPConnection("127.0.0.1", upstream, timeout=60)
                self.upstream.request(self.command, self.path, body=body, headers=headers)
                r = self.upstream.getresponse()
                data = r.read()
                self.send_response_only(r.status)
                for k, v in dict(r.getheaders()).items():  # once each: the S3 server sends two "Server" headers
                    if k.lower() not in hop_by_hop:
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length if length is not None else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def time_loader(loader, n_batches, step_s, warmup=2):
    """(samples/s, share of the time spent waiting for batches) over n_batches after `warmup`, each batch followed
    by step_s seconds of simulated training (the loader's workers go on meanwhile)."""
    batches, waited, n = iter(loader), 0.0, 0
    for _ in range(warmup):
        next(batches)
        time.sleep(step_s)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        t = time.perf_counter()
        n += len(next(batches)["sample_id"])
        waited += time.perf_counter() - t
        time.sleep(step_s)
    total = time.perf_counter() - t0
    return n / total, waited / total


def split_bench_shards(work, n_sources):
    """The bench samples (work/bench.json) as n_sources datasets of equal size, in work/sources/NNN."""
    records = json.loads((work / "bench.json").read_text())
    folders = [work / "sources" / f"{k:04d}" for k in range(n_sources)]
    for k, folder in enumerate(folders):
        if not (folder / ".nv-meta" / ".info.json").exists():
            part = work / "sources" / f"{k:04d}.json"
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps(records[k::n_sources]))
            pack(part, work / "images", folder, shard_size=10, overwrite=True)
    return folders


def bench_mixture_start(n_sources, work):
    """A mixture of n_sources small datasets (copies of one): seconds to open it, files held open and the resident
    memory after reading 50 batches of 8 from a loader with two workers."""
    import resource
    import shutil

    from loader import Loader, ShardStream
    from shapes import train_tokenizer

    one = work / "one"
    if not (one / ".nv-meta" / ".info.json").exists():
        make_bench_shards(work / "one-src", 40, width=64, height=48, shard_size=10)
        shutil.copytree(work / "one-src" / "shards", one, dirs_exist_ok=True)
    copies = [work / "copies" / f"{k:04d}" for k in range(n_sources)]
    for c in copies:
        if not c.exists():
            shutil.copytree(one, c)
    if not (work / "tokenizer.model").exists():
        train_tokenizer(["Describe the image.", "Waves."] * 50, work / "tokenizer", 320)
    t0 = time.perf_counter()
    stream = ShardStream([{"path": str(c), "weight": 1} for c in copies], work / "tokenizer.model", batch_size=8,
                         seq_len=64, image_size=28, image_token_id=320, n_image_tokens=4)
    opened = time.perf_counter() - t0
    batches = iter(Loader(stream, num_workers=2))
    for _ in range(50):
        next(batches)
    fds = len(os.listdir("/proc/self/fd"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {n_sources} | {len(stream)} | {opened:.2f} | {fds} | {rss:.0f} |")


def bench_loader(args):
    """The bench JPEGs (make_bench_shards) read by the loader, decoded to 336 px, from local files and from moto's S3
    server behind --latency_ms a request: with the ranged reads fetched ahead (shards.ShardReader), and one request
    a sample, as reading without prefetch would."""
    import shards
    from loader import Loader, ShardStream
    from shapes import train_tokenizer

    work = Path(args.workdir)
    local = work / "shards"
    if not (local / ".nv-meta" / ".info.json").exists():
        # small shards: moto reads a whole object to answer a ranged GET (a real bucket does not)
        make_bench_shards(work, args.n, shard_size=10)
    if not (work / "tokenizer.model").exists():
        train_tokenizer(["Describe the image.", "Waves."] * 50, work / "tokenizer", 320)
    url = start_s3(args.latency_ms) + "/shards"
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        storage.upload(f, f"{url}/{f.relative_to(local)}")
    n = sum(json.loads((local / ".nv-meta" / ".info.json").read_text())["shard_counts"].values())
    kib = sum(f.stat().st_size for f in local.glob("*.tar")) / 1024 / n
    print(f"loader: {n} samples ({kib:.0f} KiB a sample), batch {args.batch}, {args.workers} workers, {args.step_ms} ms "
          f"a simulated step, S3 (moto) behind {args.latency_ms:g} ms a request")
    ahead, best = shards.AHEAD, {}
    sources = {"local files": (local, ahead), f"S3 +{args.latency_ms:g} ms, read ahead": (url, ahead),
               f"S3 +{args.latency_ms:g} ms, one request a sample": (url, 1)}
    if args.sources > 1:  # the same samples as a mixture of equal sources, equal weights (mixture.py)
        folders = split_bench_shards(work, args.sources)
        for f in sorted(p for d in folders for p in d.rglob("*") if p.is_file()):
            storage.upload(f, f"{url}-mix/{f.relative_to(work / 'sources')}")
        sources |= {f"local files, {args.sources} sources": ([{"path": str(d), "weight": 1} for d in folders], ahead),
                    f"S3 +{args.latency_ms:g} ms, read ahead, {args.sources} sources":
                        ([{"path": f"{url}-mix/{d.name}", "weight": 1} for d in folders], ahead)}
    for _ in range(args.rounds):  # the sources alternate, so a busy moment of the machine hits them alike
        for name, (where, n_ahead) in sources.items():
            shards.AHEAD = n_ahead  # read at fork time by the workers too
            stream = ShardStream(where, work / "tokenizer.model", batch_size=args.batch, seq_len=640, image_size=336,
                                 image_token_id=320, n_image_tokens=576)
            rate, waiting = time_loader(Loader(stream, args.workers), args.batches, args.step_ms / 1000)
            best[name] = max(best.get(name, (0, 0)), (rate, waiting))
    shards.AHEAD = ahead
    print("| source | samples/s | waiting on data |\n|---|---|---|\n" + "\n".join(
        f"| {name} | {rate:.1f} | {waiting:.0%} |" for name, (rate, waiting) in best.items()))


# -----------------------------------------------------------------------------
# video: pack throughput on MP4 files; the loader on video shards against image shards, and against decoding the
# video bytes at load time (the storage pack does not choose)


def scene(width, height, n_frames, seed):
    """n_frames RGB frames of a camera panning over a photo-like scene (smooth colour fields, fine texture, discs)
    while a red block crosses it."""
    rng = np.random.default_rng(seed)
    big_h, big_w = height + 200, width + 400
    world = np.full((big_h, big_w, 3), 128.0, np.float32)
    for scale, amp in ((64, 90), (16, 40), (4, 6)):
        field = rng.normal(0, 1, (big_h // scale + 2, big_w // scale + 2, 3)).astype(np.float32)
        field = np.kron(field, np.ones((scale, scale, 1), np.float32))[:big_h, :big_w]
        k = max(1, scale // 2)  # a box blur of the blocks
        world += amp * (field + np.roll(field, k, 0) + np.roll(field, k, 1) + np.roll(field, (k, k), (0, 1))) / 4
    yy, xx = np.mgrid[0:big_h, 0:big_w]
    for _ in range(25):
        cx, cy, r = rng.integers(0, big_w), rng.integers(0, big_h), rng.integers(10, 80)
        world[(xx - cx) ** 2 + (yy - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    world = np.clip(world, 0, 255).astype(np.uint8)
    for t in range(n_frames):
        x, y = int(200 + 180 * np.sin(t / 90)), int(100 + 90 * np.cos(t / 70))
        frame = world[y : y + height, x : x + width].copy()
        left = (t * 6) % width
        frame[height // 3 : height // 3 + 60, max(0, left - 30) : left + 30] = (240, 30, 30)
        yield frame


def bench_video_files(work, sizes, seconds, fps=30):
    """H.264 MP4s (x264's defaults: CRF 23, preset medium) of `scene`, one a size, kept in work/videos; the JSON of
    their records, and of image records (one JPEG a sample, a frame of the same size, quality 95) beside it."""
    import av

    folder = work / "videos"
    folder.mkdir(parents=True, exist_ok=True)
    videos, pictures = [], []
    for i, (w, h) in enumerate(sizes):
        name = f"{i}_{w}x{h}_{seconds}s.mp4"
        if not (folder / name).exists():
            with av.open(str(folder / f"tmp-{name}"), "w") as c:
                s = c.add_stream("libx264", rate=fps)
                s.width, s.height, s.pix_fmt = w, h, "yuv420p"
                for frame in scene(w, h, int(seconds * fps), seed=i):
                    for packet in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                        c.mux(packet)
                for packet in s.encode():
                    c.mux(packet)
            os.replace(folder / f"tmp-{name}", folder / name)
            Image.fromarray(next(scene(w, h, 1, seed=i))).save(folder / f"{i}.jpg", quality=95)
        turns = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A red block."}]
        videos.append({"id": i, "video": name, "conversations": turns})
        pictures.append({"id": i, "image": f"{i}.jpg", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                                          turns[1]]})
    (work / "videos.json").write_text(json.dumps(videos))
    (work / "images.json").write_text(json.dumps(pictures))
    return folder, videos


def tiles_from_video_bytes(data, settings, size):
    """What a loader would do with the video bytes in the shard: LLaVA-NeXT's frames decoded and squashed to
    size x size (the storage pack does not choose; timed here only)."""
    from video import count_packets, frame_indices, open_container, video_stream

    total, fps, _ = count_packets(data, settings)
    indices, _ = frame_indices(total, float(fps), settings)
    wanted, found = set(indices), {}
    with open_container(data) as container:
        for i, frame in enumerate(container.decode(video_stream(container, settings))):
            if i in wanted:
                found[i] = torch.from_numpy(np.array(frame.to_image().resize((size, size), Image.BICUBIC)))
            if i >= max(indices):
                break
    return torch.stack([found[i] for i in indices]).permute(0, 3, 1, 2)  # (n, 3, size, size)


def samples_per_second(work_fn, n, rounds):
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            work_fn(i)
        best = min(best, time.perf_counter() - t0)
    return n / best


def bench_video(args):
    """pack on MP4 records (samples/s, MB/s of video), then one process's loader samples/s (a DataLoader worker's
    rate, tiles squashed to 384 px as for LLaVA-OneVision) on the video shards, on the same shards with PNG frames,
    on image shards (one JPEG a sample, anyres tiles), and decoding the MP4 bytes at load time instead."""
    from loader import ShardStream
    from shapes import train_tokenizer
    from sources import JsonRecords
    from video import VideoSettings

    work = Path(args.workdir)
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes]
    folder, videos = bench_video_files(work, sizes, args.seconds)
    video_mb = sum((folder / r["video"]).stat().st_size for r in videos) / 1e6
    n = len(videos)
    print(f"{n} H.264 MP4s of {args.seconds} s at 30 fps ({', '.join(args.sizes)}), {video_mb:.1f} MB in all; "
          f"LLaVA-OneVision's frame choice (--frames-upbound 32 --video-fps 1)\n"
          "| pack | workers | seconds | samples/s | MB/s of video | bytes a sample in the shard |\n"
          "|---|---|---|---|---|---|")
    shards = {}
    for frames in ("jpg", "png"):
        for workers in args.workers:
            out = work / f"shards-{frames}"
            t0 = time.perf_counter()
            pack_source(JsonRecords(work / "videos.json", folder), out, workers=workers, overwrite=True,
                        video=VideoSettings(frame_format=frames))
            seconds = time.perf_counter() - t0
            per_sample = sum(f.stat().st_size for f in out.glob("*.tar")) / n
            print(f"| {frames.upper()} frames | {workers} | {seconds:.2f} | {n / seconds:.2f} | {video_mb / seconds:.1f} | "
                  f"{per_sample / 1e6:.2f} MB |")
            shards[f"video shards, {frames.upper()} frames"] = out
    pack_source(JsonRecords(work / "images.json", folder), work / "shards-images", overwrite=True)
    shards["image shards, one JPEG a sample"] = work / "shards-images"
    if not (work / "tokenizer.model").exists():
        train_tokenizer(["What moves?", "A red block.", "What?"] * 50, work / "tokenizer", 320)
    cfg = vlm_preset("llava-onevision-qwen2-0.5b")
    size = cfg.vision.image_size
    print(f"\n| loader, one process ({size} px tiles) | samples/s | tiles a sample | bytes a sample |\n|---|---|---|---|")
    for name, where in shards.items():
        stream = ShardStream(where, work / "tokenizer.model", batch_size=1, seq_len=16384, image_size=size,
                             image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template="chatml",
                             vlm=cfg, max_tiles=40, image_mean=cfg.vision.image_stats[0])
        tiles = sum(len(stream.encode(i)[2]) for i in range(n)) / n
        rate = samples_per_second(stream.encode, n, args.rounds)
        per_sample = sum(f.stat().st_size for f in where.glob("*.tar")) / n
        print(f"| {name} | {rate:.2f} | {tiles:.1f} | {per_sample / 1e6:.2f} MB |")
    blobs = [(folder / r["video"]).read_bytes() for r in videos]
    settings = VideoSettings()
    rate = samples_per_second(lambda i: tiles_from_video_bytes(blobs[i], settings, size), n, args.rounds)
    print(f"| the MP4 bytes decoded at load time (not stored so) | {rate:.2f} | "
          f"{len(tiles_from_video_bytes(blobs[0], settings, size))} (first) | {video_mb / n:.2f} MB |")


def start_s3(latency_ms):
    """moto's S3 server in this process (the tests' emulator: pip install 'moto[server]'), behind a LatencyProxy when
    latency_ms, with a new bucket; its s3:// URL. The endpoint and test credentials go to os.environ, for the ranks
    and the loader's workers."""
    import logging
    import os
    import uuid

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line a request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    endpoint = LatencyProxy(port, latency_ms / 1000).url if latency_ms else f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    url = f"s3://llavax-bench-{uuid.uuid4().hex[:8]}"
    storage.filesystem(url).mkdir(storage.bucket(url))
    return url
