"""
Video files in records ("video": "clip.mp4", .webm, .mkv, .avi, .mov, .gif...): the frames LLaVA-NeXT's training
loader takes from a file, decoded at pack time with PyAV (FFmpeg inside its wheel) in a helper process that is
bounded in time and memory. pack.py stores them as the record's frames (KEY.f0.jpg, KEY.f1.jpg...), as it stores frames
extracted beforehand, so the loader and energon read a video sample as they read any other.

    read_video(path or bytes, VideoSettings()) -> ([(ext, frame bytes)], info), or raises VideoDropped(reason)
    frame_indices(total_frames, fps, settings)  -> (frame indices, the times LLaVA-Video's instruction states)

Which frames: as LLaVA-NeXT's `process_video_with_decord` (llava/utils.py) picks them: one frame every
round(fps / video_fps), and when that makes more than frames_upbound frames, or with force_sample, frames_upbound
frames spread evenly over the whole video (np.linspace(0, total - 1, n) cast to int). total is the number of the
stream's packets and fps its average frame rate, what decord's len() and get_avg_fps() return.
"""

import errno
import io
import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np
from PIL import Image

from chat import IMAGE_TAG, ROLES, VIDEO_TAG


@dataclass(frozen=True)
class VideoSettings:
    """How pack reads a video file. The frame choice defaults to LLaVA-OneVision's training scripts
    (scripts/train/finetune_ov.sh: --frames_upbound 32, video_fps 1); LLaVA-Video's are frames_upbound=64,
    force_sample=True, time_instruction=True. The limits bound one file's decoding."""
    frames_upbound: int = 32  # at most this many frames, spread evenly (0: no bound)
    video_fps: float = 1.0  # frames a second to take when the bound allows
    force_sample: bool = False  # always frames_upbound frames, spread evenly (LLaVA-Video)
    time_instruction: bool = False  # LLaVA-Video's sentence on the duration and frame times, before the question
    frame_format: str = "jpg"  # how frames are stored: "jpg" (quality 95, 4:4:4) or "png" (lossless)
    timeout_s: float = 120.0  # wall-clock seconds for one file, probe and decode
    memory_mb: int = 2048  # address space the decoding process may add
    max_frame_pixels: int = 7680 * 4320  # width x height of one frame: 8K UHD
    max_decode_pixels: int = 1920 * 1080 * 30 * 600  # width x height x frames decoded: 10 minutes of 1080p at 30 fps

    def __post_init__(self):
        if not isinstance(self.frames_upbound, int) or self.frames_upbound < 0:
            raise ValueError(f"video: frames_upbound must be a whole number >= 0, not {self.frames_upbound!r}")
        # nan compares False with everything: a plain `<= 0` let it through, and every video then dropped as corrupt
        for name in ("video_fps", "timeout_s", "memory_mb", "max_frame_pixels", "max_decode_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"video: {name} must be a number > 0, not {value!r}")
        if self.force_sample and not self.frames_upbound:
            raise ValueError("video: force_sample takes frames_upbound frames: give frames_upbound > 0")
        if self.frame_format not in ("jpg", "png"):
            raise ValueError(f"video: frame_format is 'jpg' or 'png', not {self.frame_format!r}")


class VideoDropped(Exception):
    """A video file pack cannot use; .reason is its drop reason (counted by pack and `data.py audit`)."""

    def __init__(self, reason, detail=""):
        super().__init__(f"{reason}{f' ({detail})' if detail else ''}")
        self.reason, self.detail = reason, detail


JPEG_QUALITY = 95
# FFmpeg opens a still image as a one-frame stream; a record whose "video" is a picture is not a video
STILL_IMAGE_FORMATS = ("image2", "image2pipe")


# -----------------------------------------------------------------------------
# which frames: LLaVA-NeXT's rule


def frame_indices(total_frames, fps, settings):
    """(indices, times): the frames of a video of total_frames at fps that LLaVA-NeXT's loader takes, in order (an
    index may repeat when force_sample asks for more frames than the video has), and the times its instruction states
    for them. Its quirk is kept: without the even spread a frame's time is its index / the step, seconds only when
    video_fps is 1 and the step is exactly fps. A video under video_fps / 2 frames a second (a slow slideshow GIF)
    takes every frame here; LLaVA-NeXT's range() gets a step of 0 there, raises, and skips the sample."""
    step = max(1, round(fps / settings.video_fps))
    indices = list(range(0, total_frames, step))
    times = [i / step for i in indices]
    if settings.frames_upbound > 0 and (len(indices) > settings.frames_upbound or settings.force_sample):
        indices = np.linspace(0, total_frames - 1, settings.frames_upbound, dtype=int).tolist()
        times = [i / fps for i in indices]
    return indices, times


def time_instruction(video_time, frame_times):
    """LLaVA-Video's sentence, character for character (LLaVA-NeXT's train.py, add_time_instruction), the missing
    space after "located at ...s." included."""
    located = ",".join(f"{t:.2f}s" for t in frame_times)
    return (f"The video lasts for {video_time:.2f} seconds, and {len(frame_times)} frames are uniformly sampled from "
            f"it. These frames are located at {located}.Please answer the following questions related to this video.")


def video_conversation(conv, instruction=None):
    """The conversation of a video record with its tag as <video>: LLaVA-NeXT's video data writes <image> for the video
    (pack accepts one <image> and no <video> as the video's tag). With an instruction (time_instruction), the first user
    turn becomes "<video>\\n{instruction}\\n{its text without the tag}", as LLaVA-NeXT rewrites conversations[0];
    a tag written in a later turn moves there."""
    conv = [dict(t) for t in conv]
    if not any(VIDEO_TAG in t["value"] for t in conv):
        for t in conv:
            t["value"] = t["value"].replace(IMAGE_TAG, VIDEO_TAG)
    if instruction is None:
        return conv
    user = next((t for t in conv if ROLES[t["from"]] == "user"), None)
    if user is None:  # nothing to rewrite; place_image_tags gives the video a turn of its own
        return conv
    for t in conv:
        if t is not user:
            t["value"] = t["value"].replace(VIDEO_TAG, "")
    user["value"] = f"{VIDEO_TAG}\n{instruction}\n{user['value'].replace(VIDEO_TAG, '')}"
    return conv


# -----------------------------------------------------------------------------
# decoding, in the helper process (serve)


def encode_frame(rgb, frame_format):
    buf = io.BytesIO()
    if frame_format == "png":
        Image.fromarray(rgb).save(buf, format="PNG", compress_level=1)
    else:  # 4:4:4: no second chroma subsampling on top of the video's own
        Image.fromarray(rgb).save(buf, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
    return buf.getvalue()


def open_container(source):
    import av

    try:
        return av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), metadata_errors="ignore")
    except av.error.FFmpegError as e:  # not a container FFmpeg knows, empty, an MP4 cut before its index
        raise dropped(e, "video_unreadable") from None


def dropped(error, reason, detail=""):
    """VideoDropped(reason) for an FFmpeg error, or MemoryError for one under the memory cap: FFmpeg's ENOMEM, the
    EAGAIN of a thread it could not start (swscale's threads need stacks), or any error while the process maps near
    the cap (near_the_cap) (H.264's decoder reports a refused allocation as bad data). Called
    while the container is open, before its buffers are freed."""
    import av

    if isinstance(error, (av.error.MemoryError, av.error.BlockingIOError)) or near_the_cap():
        return MemoryError(str(error))
    return VideoDropped(reason, detail or str(error))


def video_stream(container, settings):
    """The stream decord would read (FFmpeg's best video stream), refused early when it cannot be decoded."""
    if container.format.name in STILL_IMAGE_FORMATS or container.format.name.endswith("_pipe"):
        raise VideoDropped("video_still_image", container.format.name)
    stream = container.streams.best("video")
    if stream is None:
        raise VideoDropped("video_no_video_stream", f"streams: {', '.join(s.type for s in container.streams) or 'none'}")
    if stream.codec_context is None:
        raise VideoDropped("video_unknown_codec", "no decoder in this FFmpeg for the video stream")
    stream.codec_context.thread_count = 1  # pack's --workers spread the videos over processes
    check_frame_size(stream.codec_context.width, stream.codec_context.height, settings)
    return stream


def check_frame_size(width, height, settings):
    if width * height > settings.max_frame_pixels:
        raise VideoDropped("video_resolution_too_large", f"{width}x{height}, max {settings.max_frame_pixels} pixels")


def count_packets(source, settings):
    """(total frames, fps, stream facts) as decord counts them: every packet of the stream (PyAV's closing empty
    packet aside), and the stream's average frame rate."""
    import av

    with open_container(source) as container:
        stream = video_stream(container, settings)
        total = 0
        try:
            for packet in container.demux(stream):
                total += not (packet.size == 0 and packet.dts is None)
        except av.error.FFmpegError as e:
            raise dropped(e, "video_truncated", f"after {total} packets: {e}") from None
        declared = stream.frames  # the container's own count; 0 where it keeps none (webm, mkv)
        if declared and total < declared:
            raise VideoDropped("video_truncated", f"{total} of the {declared} frames its header lists")
        if not total:
            raise VideoDropped("video_no_frames")
        fps = stream.average_rate
        if not fps:
            raise VideoDropped("video_no_frame_rate")
        facts = {"format": container.format.name, "codec": stream.codec_context.name,
                 "width": stream.codec_context.width, "height": stream.codec_context.height}
    return total, Fraction(fps), facts


def decode_frames(source, settings):
    """([(ext, bytes)] of the chosen frames in order, info). Frame i is the i-th frame the decoder returns, in
    presentation order, which is decord's i-th frame by timestamp in every file whose packets each hold a frame."""
    import av

    total, fps, facts = count_packets(source, settings)
    indices, times = frame_indices(total, float(fps), settings)
    last = max(indices)
    if facts["width"] * facts["height"] * (last + 1) > settings.max_decode_pixels:
        raise VideoDropped("video_too_long", f"{last + 1} frames of {facts['width']}x{facts['height']} to decode, "
                                             f"max {settings.max_decode_pixels} pixels")
    wanted, found = set(indices), {}
    with open_container(source) as container:
        stream = video_stream(container, settings)
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    check_frame_size(frame.width, frame.height, settings)
                    found[i] = encode_frame(frame.to_ndarray(format="rgb24"), settings.frame_format)
                if i >= last:
                    break
        except av.error.FFmpegError as e:
            raise dropped(e, "video_corrupt", f"frame {len(found)}: {e}") from None
    if len(found) < len(wanted):
        raise VideoDropped("video_truncated", f"the decoder gave fewer than the {last + 1} frames needed")
    info = facts | {"total_frames": total, "fps": float(fps), "frame_indices": indices,
                    "video_time": total / float(fps), "frame_times": times}
    return [(settings.frame_format, found[i]) for i in indices], info


# -----------------------------------------------------------------------------
# the decoding process: a hang, a crash or a memory blow-up in FFmpeg costs one record, never the pack worker.
# Each process that reads videos (a pack worker) keeps one helper process, started with subprocess (os.fork from a
# process with threads can deadlock the child: FFmpeg threads left by an earlier decode did, in the tests), killed at
# the deadline and started afresh on the next file. Messages both ways: a length-prefixed JSON header, then the
# byte strings whose sizes it lists.


def mapped_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


memory_cap = None  # (bytes mapped when the cap was set, bytes allowed beyond them): set in the helper process only


def limit_memory(extra_bytes):
    """Cap this process's address space at what it maps now plus extra_bytes (Linux; elsewhere no cap)."""
    global memory_cap
    try:
        import resource

        mapped = mapped_bytes()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, mapped + extra_bytes))
        memory_cap = (mapped, extra_bytes)
    except (ImportError, OSError, ValueError):
        pass


def near_the_cap():
    """Mapped within a quarter of the allowance of the cap, or within 64 MB (a refused allocation's size is not known:
    a 4K frame's buffers are tens of MB, so under a small cap the mapped size alone can sit well below it)."""
    return memory_cap is not None and \
        mapped_bytes() >= memory_cap[0] + memory_cap[1] - max(0.25 * memory_cap[1], 64 << 20)


def message(header, blobs=()):
    text = json.dumps(header).encode()
    return b"".join([struct.pack("<Q", len(text)), text, *blobs])


def read_exactly(fd, n, deadline=None):
    """n bytes from fd; None at end of file or (with a deadline) when it passes first."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                return None
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(fd, deadline=None):
    """(header, [blobs]) or None (end of file, or the deadline passed)."""
    size = read_exactly(fd, 8, deadline)
    text = size and read_exactly(fd, struct.unpack("<Q", size)[0], deadline)
    if not text:
        return None
    header, blobs = json.loads(text), []
    for n in header.get("sizes", []):
        blob = read_exactly(fd, n, deadline)
        if blob is None:
            return None
        blobs.append(blob)
    return header, blobs


def serve():
    """The helper's loop: a request ({"path", "settings"}) on stdin, the frames or a drop reason on stdout, until
    stdin closes (its parent is gone). Its memory is capped at what it maps after its imports plus memory_mb."""
    import av  # noqa: F401  before the cap, and PIL's encoders: a library mapped under it can fail to load

    Image.init()

    read_fd, out = sys.stdin.fileno(), sys.stdout.buffer
    limited = spent = False
    while not spent and (request := read_message(read_fd)) is not None:
        settings = VideoSettings(**request[0]["settings"])
        if not limited:
            limit_memory(settings.memory_mb << 20)
            limited = True
        signal.alarm(int(settings.timeout_s) + 10)  # an orphan (its parent killed mid-file) ends by itself
        try:
            frames, info = decode_frames(request[0]["path"], settings)
            answer = message({"info": info, "exts": [ext for ext, _ in frames],
                              "sizes": [len(data) for _, data in frames]}, [data for _, data in frames])
        except VideoDropped as e:
            answer = message({"reason": e.reason, "detail": e.detail})
        except Exception as e:  # noqa: BLE001  whatever else a broken file makes PyAV or PIL raise
            # an allocation refused under the cap: then a fresh process for the next file, not a fragmented heap
            spent = isinstance(e, MemoryError) or getattr(e, "errno", None) == errno.ENOMEM
            answer = message({"reason": "video_out_of_memory", "detail": f"over {settings.memory_mb} MB"} if spent
                             else {"reason": "video_corrupt", "detail": f"{type(e).__name__}: {e}"})
        signal.alarm(0)
        out.write(answer)
        out.flush()


class Decoder:
    """This process's helper process (video.serve), started on first use and after a timeout or a crash."""

    def __init__(self):
        self.proc, self.owner, self.memory_mb = None, None, None

    def start(self, memory_mb):
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); import video; video.serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, bufsize=0)
        self.owner, self.memory_mb = os.getpid(), memory_mb

    def stop(self):
        """Kill the helper; its exit status (a crash's own, if it had died already)."""
        self.proc.kill()
        code = self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc = None
        return code

    def decode(self, path, settings):
        """([(ext, bytes)], info) of the video at path, or VideoDropped."""
        if self.proc is not None and self.owner != os.getpid():
            self.proc = None  # a forked process's copy of its parent's helper: the parent's to use
        if self.proc is not None and (self.proc.poll() is not None or self.memory_mb != settings.memory_mb):
            self.stop()
        if self.proc is None:
            self.start(settings.memory_mb)
        answer, deadline = None, time.monotonic() + settings.timeout_s
        try:
            self.proc.stdin.write(message({"path": str(path), "settings": asdict(settings)}))
            answer = read_message(self.proc.stdout.fileno(), deadline)
        except BrokenPipeError:  # it died between files
            pass
        finally:
            if answer is None:  # past the deadline, dead, or an exception (KeyboardInterrupt) here
                late, code = time.monotonic() >= deadline, self.stop()
        if answer is None:
            if late:
                raise VideoDropped("video_timeout", f"not decoded in {settings.timeout_s:g} s")
            raise VideoDropped("video_decoder_crashed", f"signal {-code}" if code < 0 else f"exit status {code}")
        header, blobs = answer
        if header.get("reason") == "video_out_of_memory":
            self.stop()  # it exits after one: the next file gets a new one
        if "reason" in header:
            raise VideoDropped(header["reason"], header["detail"])
        return list(zip(header["exts"], blobs)), header["info"]


DECODER = Decoder()  # one helper a process: a pack worker's videos go through it one at a time


def read_video(source, settings=VideoSettings()):
    """([(ext, frame bytes)], info) of a video file (a path, or its bytes), the frames LLaVA-NeXT's loader takes under
    `settings`; raises VideoDropped(reason) for a file that is not a usable video, one that takes longer than
    settings.timeout_s or more memory than settings.memory_mb, or one that crashes the decoder. info: the stream's
    facts, total_frames, fps, frame_indices, video_time, frame_times, and the settings."""
    if isinstance(source, bytes):  # a row's video: a file the helper can open
        with tempfile.NamedTemporaryFile(suffix=".video") as f:
            f.write(source)
            f.flush()
            return read_video(f.name, settings)
    frames, info = DECODER.decode(source, settings)
    return frames, info | {"settings": asdict(settings)}
