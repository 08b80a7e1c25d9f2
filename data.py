"""
Data for llavax: LLaVA conversations and images -> Energon-compatible tar shards, and what training would read.

    python data.py pack --json llava_v1_5_mix665k.json --images DIR --out SHARDS [--shard-size 1000] [--val-ratio 0.01]
    python data.py pack ... --out s3://BUCKET/shards      # or gs://: each shard uploaded when complete, .nv-meta last
    python data.py pack --parquet 'DIR/*.parquet' --out SHARDS [--columns image=img,conversations=messages]
    python data.py pack --mixture configs/mixtures/onevision.yaml --raw RAW --workers 16   # every dataset it names
    python data.py shapes --out DIR [--n 20000] [--seed 0] [--tokenizer T] [--overwrite]   # the demo data (shapes.py)
    python data.py audit SHARDS|JSON|PARQUET [--config configs/x.py] [--sheet F.png]   # what training gets (audit.py)
    python data.py audit MIX.yaml --config configs/x.py   # a mixture (or --config alone: its data_dir): by source

Writing shards: pack.py (reading JSON and parquet: sources.py); the demo data: shapes.py; reading them into batches:
loader.py.
"""

import argparse
import contextlib
import json
import math
import signal
import sys
from pathlib import Path

import chat
import config
import shapes
import storage
from model_config import VLMConfig
from audit import audit, audit_mixture
from pack import pack_mixture, pack_source
from sources import JsonRecords, ParquetRows
from video import VideoSettings


def audit_arguments(a):
    a.add_argument("source", nargs="?", help="a shard folder (or tar), a mixture (.yaml), a LLaVA JSON/JSONL with "
                   "--images, or parquet / Arrow rows (a file, a folder of them, a glob), read as pack reads them; "
                   "default: the --config's data_dir (a mixture gets a table)")
    a.add_argument("--images", help="the image folder of a LLaVA JSON")
    columns_argument(a)
    a.add_argument("--min-kept", type=share(all_allowed=True), default=0.0, help="exit 1 when fewer than this share "
                   "of the samples would train (default 0: only when none would)")
    a.add_argument("--split", default="train", help="the split of a shard folder to read")
    a.add_argument("--config", help="a train.py config file (e.g. configs/shapes.py): fills the settings below")
    a.add_argument("--tokenizer")
    a.add_argument("--template", help=f"one of {sorted(chat.TEMPLATES)}")
    a.add_argument("--seq-len", type=int)
    a.add_argument("--pack", type=int, help="samples packed a row (train.py's pack); 0: one sample a row")
    a.add_argument("--rows", type=int, help="rows a batch (train.py's micro_batch_size)")
    a.add_argument("--image-size", type=int)
    a.add_argument("--image-mode", choices=("pad", "crop", "resize"))
    a.add_argument("--n-image-tokens", type=int)
    a.add_argument("--image-token-id", type=int)
    a.add_argument("--max-tiles", type=int, help="tile slots a row (train.py's max_tiles): anyres, several images")
    a.add_argument("--world-size", type=int, default=1, help="a mixture: the run's ranks (torchrun's processes), each "
                                                           "reading --rows rows a batch")
    a.add_argument("--show", type=int, default=4, help="print the first N samples in full")
    a.add_argument("--limit", type=int, default=0, help="audit only the first N samples (0: all)")
    a.add_argument("--sheet", help="write a contact sheet of the shown samples here (.png or .html)")
    a.add_argument("--hf-tokenizer", help="a folder with tokenizer_config.json holding a chat_template: compare")
    a.add_argument("--progress", type=float, default=5.0, help="a progress bar on stderr (a terminal), else a line "
                   "every N seconds at first, then further apart; 0: none")
    video_arguments(a.add_argument_group("a JSON's video files, read as pack reads them: the same flags as pack's"))


def audit_command(args):
    """The settings of train.py (its defaults, then --config), overridden by the flags given; exits with audit's status."""
    if args.config and not Path(args.config).is_file():
        raise SystemExit(f"audit: --config {args.config}: no such file")
    cfg = config.load_config([args.config] if args.config else [])
    # the image settings of the model train.py would build: a llavax checkpoint's config.json, else the preset
    ckpt = Path(cfg["init_from"], "config.json") if cfg["init_from"] not in ("scratch", "resume") else None
    try:
        if ckpt and ckpt.is_file() and json.loads(ckpt.read_text()).get("model_type") != "llava":
            mcfg, origin = VLMConfig.from_dict(json.loads(ckpt.read_text())), str(ckpt)
        else:
            mcfg, origin = config.model_config(cfg), f"preset {cfg['model']!r} with model_overrides"
            origin += f" ({ckpt} not read: give the image flags if that model differs)" if ckpt else ""
    except (ValueError, TypeError) as e:
        raise SystemExit(f"audit: the model settings of {ckpt or args.config or 'train.py'}: {e}") from None
    if None in (args.image_size, args.n_image_tokens, args.image_token_id):
        print(f"audit: model settings from {origin}")
    given = lambda flag, default: default if flag is None else flag  # noqa: E731
    max_tiles = given(args.max_tiles, cfg.get("max_tiles", 0))
    if max_tiles < 0:
        raise SystemExit(f"audit: --max-tiles must be >= 0, got {max_tiles}")
    config.check_tiles(mcfg, max_tiles)  # what train.py refuses (an anyres model without room for one image) is refused here
    source = cfg["data_dir"] if args.source is None else args.source
    if isinstance(source, list) or str(source).endswith((".yaml", ".yml")):  # a mixture: a table of its sources
        stream_args = {"tokenizer": given(args.tokenizer, cfg["tokenizer"]),
                       "batch_size": given(args.rows, cfg["micro_batch_size"]), "pack": given(args.pack, cfg["pack"]),
                       "seq_len": given(args.seq_len, cfg["seq_len"]), "image_size": given(args.image_size,
                                                                                          mcfg.vision.image_size),
                       "image_token_id": given(args.image_token_id, mcfg.image_token_id),
                       "n_image_tokens": given(args.n_image_tokens, mcfg.n_image_tokens),
                       "template": given(args.template, cfg["template"]),
                       "image_mode": given(args.image_mode, cfg["image_mode"]), "image_mean": mcfg.vision.image_stats[0],
                       "shuffle_block": cfg["shuffle_block"],  # the run's order, which the audit reads as it will
                       "group": cfg["batch_size"] * max(given(args.pack, cfg["pack"]), 1)
                       if cfg["group_by_modality_length"] else 0}  # a step's samples of one modality, as train.py
        stream_args |= {"vlm": mcfg, "max_tiles": max_tiles} if max_tiles else {}
        if args.world_size < 1:
            raise SystemExit(f"audit: --world-size must be >= 1, got {args.world_size}")
        sys.exit(audit_mixture(source, stream_args, cfg["max_iters"], cfg["batch_size"], args.limit, args.progress,
                               cfg["seed"], split=args.split, world_size=args.world_size))
    sys.exit(audit(source, given(args.tokenizer, cfg["tokenizer"]), given(args.template, cfg["template"]),
                   given(args.seq_len, cfg["seq_len"]), given(args.image_size, mcfg.vision.image_size),
                   given(args.n_image_tokens, mcfg.n_image_tokens), given(args.image_token_id, mcfg.image_token_id),
                   given(args.image_mode, cfg["image_mode"]), args.images, args.split, given(args.pack, cfg["pack"]),
                   given(args.rows, cfg["micro_batch_size"]), args.show, args.limit, args.sheet, args.hf_tokenizer,
                   args.progress, vlm=mcfg, max_tiles=max_tiles, video=args.video, columns=args.columns,
                   min_kept=args.min_kept))


# the types of the pack and video flags: a value no pack could mean is refused by argparse (exit 2) before anything
# is read, never blamed on the data (a nan --video-fps dropped every video as corrupt)


def whole(low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {low}")
        return value
    return parse


def positive(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def share(all_allowed):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (0 <= value < 1 or (all_allowed and value == 1)):
            raise argparse.ArgumentTypeError(f"{text!r} is not a share >= 0 and {'<=' if all_allowed else '<'} 1")
        return value
    return parse


def columns_argument(a):
    a.add_argument("--columns", help="other column names: image=COL,conversations=COL,id=COL (image= : text-only)")


def video_arguments(a):
    """The video flags of pack, and of audit, which reads a JSON's video files as pack would."""
    d = VideoSettings()  # LLaVA-OneVision's; LLaVA-Video's: --frames-upbound 64 --force-sample --time-instruction
    a.add_argument("--frames-upbound", type=whole(0), default=d.frames_upbound, help="at most this many frames a "
                   f"video, spread evenly (0: no bound; default {d.frames_upbound})")
    a.add_argument("--video-fps", type=positive, default=d.video_fps, help="frames a second to take while the bound "
                   f"allows (default {d.video_fps:g})")
    a.add_argument("--force-sample", action="store_true", help="always --frames-upbound frames, spread evenly (a video "
                   "with fewer frames has some repeated, as LLaVA-NeXT's loader repeats them; pack says how many)")
    a.add_argument("--time-instruction", action="store_true", help="LLaVA-Video's sentence on the duration and the "
                   "frame times before the first question")
    a.add_argument("--video-frames", choices=("jpg", "png"), default=d.frame_format, help="how frames are stored: "
                   "JPEG quality 95 4:4:4 (default) or lossless PNG")
    a.add_argument("--video-timeout", type=positive, default=d.timeout_s, help="seconds to decode one file "
                   f"(default {d.timeout_s:g})")
    a.add_argument("--video-memory-mb", type=whole(1), default=d.memory_mb, help="memory decoding one file may add "
                   f"(default {d.memory_mb})")
    a.add_argument("--video-max-pixels", type=whole(1), default=d.max_decode_pixels, help="width x height x frames to "
                   "decode before the last one taken (default: 10 minutes of 1080p at 30 fps)")


def video_settings(args, parser):
    """The VideoSettings of the video flags; what no flag alone refuses (--force-sample without a bound) exits 2."""
    if args.force_sample and not args.frames_upbound:
        parser.error("--force-sample takes --frames-upbound frames a video: give --frames-upbound > 0")
    try:
        return VideoSettings(args.frames_upbound, args.video_fps, args.force_sample, args.time_instruction,
                             args.video_frames, args.video_timeout, args.video_memory_mb,
                             max_decode_pixels=args.video_max_pixels)
    except ValueError as e:
        parser.error(str(e))


def stopped(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def pack_command(args):
    given = [flag for flag in ("json", "parquet", "mixture") if getattr(args, flag)]
    if len(given) != 1:
        raise SystemExit("pack: give one of --json (with --images), --parquet or --mixture (with --raw)")
    if args.json and not args.images:
        raise SystemExit("pack: --json needs --images, the folder its image names are relative to")
    if args.columns and args.json:
        raise SystemExit("pack: --columns maps parquet / Arrow columns; a JSON file's keys are LLaVA's")
    options = {"shard_size": args.shard_size, "val_ratio": args.val_ratio, "strict": args.strict,
               "video": args.video}
    with stop_on_sigterm():
        run_pack(args, options)


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM (a scheduler's stop) raises KeyboardInterrupt inside: the pack says it was interrupted, never "done"."""
    try:
        previous = signal.signal(signal.SIGTERM, stopped)
    except ValueError:  # not the main thread: no signal reaches this one
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_pack(args, options):
    if args.mixture:
        if not args.raw or args.out:
            raise SystemExit("pack: --mixture needs --raw DIR (where each dataset's raw input is) and no --out (each "
                             "dataset goes to the path the mixture file names)")
        pack_mixture(args.mixture, args.raw, args.workers, args.images, args.columns, args.overwrite, **options)
        return
    if not args.out:
        raise SystemExit("pack: --out is required (a folder, or s3:// / gs:// prefix)")
    source = JsonRecords(args.json, args.images) if args.json else ParquetRows(args.parquet, args.columns)
    pack_source(source, args.out, workers=args.workers, overwrite=args.overwrite, **options)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="LLaVA JSON/JSONL + image folder, or parquet rows -> tar shards with .nv-meta; "
                                    "or every dataset of a mixture file")
    a.add_argument("--json", help="a LLaVA JSON or JSONL file (local or s3:// / gs://), with --images")
    a.add_argument("--images", help="the local folder the JSON's image names are relative to (--mixture: default --raw)")
    a.add_argument("--parquet", nargs="+", help="parquet or Arrow files, folders of them or glob patterns (local or "
                                                "s3:// / gs://): rows of id, image {bytes, path}, conversations")
    columns_argument(a)
    a.add_argument("--mixture", help="a mixture file (Energon metadataset or LLaVA-NeXT data YAML): pack each dataset "
                                     "it names into its path, from --raw")
    a.add_argument("--raw", help="--mixture: the folder (or bucket prefix) with each dataset's raw input, NAME.json / "
                                 "NAME.jsonl or NAME/*.parquet")
    a.add_argument("--out")
    a.add_argument("--shard-size", type=whole(1), default=1000, help="samples a shard (default 1000)")
    a.add_argument("--val-ratio", type=share(all_allowed=False), default=0.0, help="the share of records held out in "
                   "val shards, by a hash of their id (>= 0, < 1; default 0)")
    a.add_argument("--workers", type=whole(1), default=1, help="processes (--mixture: in all, across datasets)")
    a.add_argument("--strict", action="store_true", help="exit non-zero if any record was skipped")
    a.add_argument("--overwrite", action="store_true", help="replace the dataset already in --out (its shards first)")
    video_arguments(a.add_argument_group("video files (\"video\": \"clip.mp4\"), decoded at pack time: video.py"))
    b = sub.add_parser("shapes", help="generate the synthetic shapes dataset, tokenizer and shards")
    b.add_argument("--out", required=True)
    b.add_argument("--n", type=int, default=20000)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--image-size", type=int, default=48)
    b.add_argument("--turns", type=int, default=1, help="questions per image, as a multi-turn conversation")
    b.add_argument("--images", type=int, default=1, help="2: two images a sample, 'Which image has more circles?'")
    b.add_argument("--preference", action="store_true", help="also right/wrong answer pairs in OUT/preference (DPO)")
    b.add_argument("--tokenizer", help="use this tokenizer.model (another shapes dataset's) instead of training one: "
                                       "the two can then be mixed in one run")
    b.add_argument("--overwrite", action="store_true", help="replace the shapes dataset already in --out")
    c = sub.add_parser("audit", help="what training would get from a dataset: counts, lengths, prompts, images, the "
                                     "chat template")
    audit_arguments(c)
    args = p.parse_args(argv)
    if args.cmd in ("pack", "audit"):  # every setting checked before anything is read
        args.video = video_settings(args, a if args.cmd == "pack" else c)
    try:
        if args.cmd == "audit":
            audit_command(args)
        elif args.cmd == "pack":
            pack_command(args)
        else:
            shapes.make_shapes(args.out, args.n, args.seed, image_size=args.image_size, turns=args.turns,
                               images=args.images, preference=args.preference, tokenizer=args.tokenizer,
                               overwrite=args.overwrite)
    except storage.StorageError as e:  # a bucket that is not there, no credentials, an outage: one sentence
        raise SystemExit(f"{args.cmd}: {e}") from None


if __name__ == "__main__":
    main()
