"""
Ask a trained model about an image.

    python sample.py --ckpt out/shapes/step-001500 --image data/shapes/images/019999.png \
        --prompt "How many circles are there?"
    python sample.py --ckpt llava-1.5-7b-hf --image cat.jpg --prompt "What is this?" --template vicuna_v1
    python sample.py --ckpt CKPT --image a.jpg b.jpg c.jpg --prompt "What is this?"    # one batch, 3 answers
    python sample.py --ckpt CKPT --image a.jpg a.jpg --prompt "What colour?" "How many?"
    python sample.py --ckpt CKPT --image a.jpg b.jpg --together --prompt "Which image has more circles?"
    python sample.py --ckpt CKPT --image f0.jpg f1.jpg f2.jpg --video --prompt "What happens?"   # OneVision
    python sample.py --ckpt out/ov --image clip.mp4 --prompt "What happens?"    # a video file: its frames, as pack

--ckpt is a llavax checkpoint directory (a training step or a convert.py output), a training run's out_dir (its
newest committed step), or an HF LLaVA directory, converted in memory; a local folder, or a prefix in a bucket
(s3://, gs://). The template defaults to the one the checkpoint was trained with.
Several images and/or prompts run as one left-padded batch: N images with one prompt, one image
with N prompts, or N of each paired in order; one answer is printed per line. --together asks each
prompt about all the images at once (one <image> each, in order; put the tags in the prompt to place
them), --video about the images as the frames of one video. A LLaVA-NeXT / OneVision model (anyres) tiles
each image as its training loader does (loader.tiled_prompt).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import chat
import checkpoint
import loader
import model_files
import storage
import weight_files
from config import check_device
from images import image_hw, load_image, normalize_images
from model import left_pad
from progress import progress

DEFAULT_NEW_TOKENS = 64

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--image", nargs="+", default=[], help="image files; leave out for text-only prompts")
    p.add_argument("--prompt", nargs="+", required=True)
    p.add_argument("--template", help="default: the training config's, else vicuna_v1")
    p.add_argument("--tokenizer", help="default: tokenizer.model or tokenizer.json in --ckpt")
    p.add_argument("--image-mode", default="pad", choices=["pad", "crop", "resize"])
    p.add_argument("--together", action="store_true", help="every prompt is about all the images (several a sample)")
    p.add_argument("--video", action="store_true", help="the images are the frames of one video (OneVision)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: 64, or what the model's max_seq_len leaves after the longest prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32, help="prompts a batch; more go batch after batch, with a "
                   "progress bar on stderr")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or (args.max_new_tokens is not None and args.max_new_tokens < 1) \
            or args.batch_size < 1:
        p.error(f"--temperature must be >= 0 (got {args.temperature}), --top-p in (0, 1] (got {args.top_p}), "
                f"--max-new-tokens >= 1 (got {args.max_new_tokens}), --batch-size >= 1 (got {args.batch_size})")
    check_device(args.device, "sample: --device")
    ckpt = args.ckpt if storage.is_url(args.ckpt) else Path(args.ckpt)  # a folder, or a prefix in a bucket
    try:
        if storage.is_url(ckpt):
            storage.check_key(ckpt)
            storage.check_bucket(ckpt)
        elif not ckpt.is_dir():
            sys.exit(f"sample: --ckpt {ckpt}: not a directory")
        ckpt = newest_step(ckpt)
        state = storage.join(ckpt, "state.json")
        trained = json.loads(storage.read_text(state))["config"] if storage.exists(state) else {}
    except storage.StorageError as e:
        sys.exit(f"sample: --ckpt {e}")
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"sample: {state}: unreadable ({type(e).__name__}: {e}); pass --template")
    template = args.template or trained.get("template", "vicuna_v1")
    if template not in chat.TEMPLATES:
        sys.exit(f"sample: unknown template {template!r}; choose from {sorted(chat.TEMPLATES)}")
    try:
        tok = chat.Tokenizer(args.tokenizer or ckpt)
        model = model_files.load_model(ckpt, device=args.device).eval()
    except (OSError, ValueError, RuntimeError, weight_files.ConversionError) as e:
        sys.exit(f"sample: {e}")
    cfg = model.cfg
    video_files(args)
    n = max(len(args.image), len(args.prompt))
    if not (args.together or args.video) and (len(args.image) not in (0, 1, n) or len(args.prompt) not in (1, n)):
        sys.exit(f"sample: {len(args.image)} images and {len(args.prompt)} prompts do not pair up; give one of "
                 "either, or the same number of each")
    if args.together or args.video or cfg.anyres or cfg.video_token_id is not None:
        ids, mask, pixels, extra = tiled_batch(args, cfg, template, tok)
        return answer(args, model, template, tok, ids, mask, pixels, extra)
    images = [args.image[i if len(args.image) > 1 else 0] for i in range(n)] if args.image else []
    prompts = [args.prompt[i if len(args.prompt) > 1 else 0] for i in range(n)]
    rows = []
    for prompt in prompts:
        if prompt.count(chat.IMAGE_TAG) > (1 if images else 0):
            sys.exit(f"sample: --prompt {prompt!r} has {prompt.count(chat.IMAGE_TAG)} {chat.IMAGE_TAG} tags for "
                     f"{1 if images else 0} image; --together asks about several images at once")
        question = f"{chat.IMAGE_TAG}\n{prompt}" if images and chat.IMAGE_TAG not in prompt else prompt
        ids, _ = chat.tokenize([(chat.generation_prompt(template, question, tok), False)], tok, cfg.image_token_id,
                               cfg.n_image_tokens)
        fit_new_tokens(args, prompt, len(ids), cfg.llm.max_seq_len)
        rows.append(ids)
    ids, mask = left_pad(rows, tok.pad_id)
    pixels = []
    for f in images:
        try:
            pixels.append(load_image(Path(f).read_bytes(), cfg.vision.image_size, args.image_mode,
                                          mean=cfg.vision.image_stats[0], resample=cfg.vision.resample))
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            sys.exit(f"sample: --image {f}: cannot read it as an image ({e})")
    pixels = normalize_images(torch.stack(pixels).to(args.device), *cfg.vision.image_stats) if pixels else None
    answer(args, model, template, tok, ids, mask, pixels, {})


def tiled_batch(args, cfg, template, tok):
    """(ids, mask, pixel_values (B, n_slots, 3, S, S), {image_index, image_weight}) for a tiling model, or for
    --together / --video: each row as the tiled training loader would build it (loader.tiled_prompt)."""
    from anyres import place_images

    blobs = getattr(args, "frames", [])  # a video file's, else the images
    for f in args.image if not blobs else []:
        try:
            blobs.append(Path(f).read_bytes())
            image_hw(blobs[-1])
        except OSError as e:  # PIL's UnidentifiedImageError is an OSError
            sys.exit(f"sample: --image {f}: cannot read it as an image ({e})")
    if args.together or args.video:
        per_row = [(prompt, blobs) for prompt in args.prompt]
    else:  # paired as main() checked
        n = max(len(blobs), len(args.prompt))
        per_row = [(args.prompt[i % len(args.prompt)], blobs[i % len(blobs)] if blobs else []) for i in range(n)]
        per_row = [(prompt, [b] if b else []) for prompt, b in per_row]
    kind = "video" if args.video else None
    rows, tiles, layouts = [], [], []
    for prompt, images in per_row:
        try:
            ids, row_tiles, row_layouts = loader.tiled_prompt(cfg, template, tok, prompt, images, kind, args.image_mode,
                                                            cfg.vision.image_stats[0])
        except (OSError, ValueError) as e:
            sys.exit(f"sample: --prompt {prompt!r}: {e}")
        fit_new_tokens(args, prompt, len(ids), cfg.llm.max_seq_len)
        rows.append(ids)
        tiles.append(row_tiles)
        layouts.append(row_layouts)
    ids, mask = left_pad(rows, tok.pad_id)
    S, n_slots = cfg.vision.image_size, max([len(t) for t in tiles if t is not None], default=0)
    pixels = torch.zeros((len(rows), max(n_slots, 1), 3, S, S), dtype=torch.uint8)
    index, weight = zip(*(place_images(row, row_layouts, cfg) for row, row_layouts in zip(ids, layouts)))
    for r, row_tiles in enumerate(tiles):
        if row_tiles is not None:
            pixels[r, : len(row_tiles)] = row_tiles
    pixels = normalize_images(pixels.to(args.device), *cfg.vision.image_stats) if n_slots else None
    return ids, mask, pixels, {"image_index": torch.stack(index).to(args.device),
                               "image_weight": torch.stack(weight).to(args.device)}


VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v")


def newest_step(ckpt):
    """--ckpt as given, or for a training run's out_dir (it holds step-N folders) its newest committed step."""
    if not checkpoint.steps(ckpt):
        return ckpt
    committed = checkpoint.checkpoints(ckpt)
    if not committed:
        names = ", ".join(storage.name(p) for p in checkpoint.steps(ckpt))
        sys.exit(f"sample: --ckpt {ckpt} is a training run's folder with no committed checkpoint ({names}: no "
                 f"{checkpoint.MANIFEST}, the write did not finish, or marked CORRUPT): name a step folder")
    print(f"sample: --ckpt {ckpt} is a training run's folder: its newest committed checkpoint, "
          f"{storage.name(committed[-1])}", file=sys.stderr)
    return committed[-1]


def video_files(args):
    """A video file given as --image: its frames (args.frames), asked about as one video (--video), as data.py pack
    stores a video sample's."""
    videos = [f for f in args.image if Path(f).suffix.lower() in VIDEO_SUFFIXES]
    if not videos:
        return
    if len(args.image) > 1:
        sys.exit(f"sample: --image {' '.join(args.image)}: a video file ({videos[0]}) is asked about alone")
    from video import VideoDropped, read_video

    try:
        frames, _ = read_video(videos[0])
    except VideoDropped as e:
        sys.exit(f"sample: --image {videos[0]}: cannot read it as a video ({e})")
    args.frames, args.video = [data for _, data in frames], True


def fit_new_tokens(args, prompt, n_prompt, max_seq_len):
    """--max-new-tokens as asked, if the prompt leaves room for it; unset, 64 or the room the longest prompt leaves
    (the shapes demo's model holds 64 tokens in all)."""
    room = max_seq_len - n_prompt
    if args.max_new_tokens is None and room >= 1:
        args.room = min(getattr(args, "room", DEFAULT_NEW_TOKENS), room)
    elif args.max_new_tokens is None or n_prompt + args.max_new_tokens > max_seq_len:
        asked = f"--max-new-tokens {args.max_new_tokens}" if args.max_new_tokens else "a single new token"
        sys.exit(f"sample: --prompt {prompt!r} is {n_prompt} tokens (with the template and images); with {asked} that "
                 f"exceeds the model's max_seq_len={max_seq_len}")


def answer(args, model, template, tok, ids, mask, pixels, extra):
    """Generate for the left-padded rows, --batch-size at a time (each row padded as in one batch of all: the same
    answers), and print one answer a line as each batch ends."""
    stop, generator, n = chat.stop_token_id(template, tok), torch.Generator(args.device).manual_seed(args.seed), len(ids)
    with progress(total=n, desc="sample", unit="prompt", disable=n <= args.batch_size) as bar:
        for rows in (slice(first, first + args.batch_size) for first in range(0, n, args.batch_size)):
            try:
                out = model.generate(ids[rows].to(args.device), pixels[rows] if pixels is not None else None,
                                     max_new_tokens=args.max_new_tokens or args.room, temperature=args.temperature,
                                     top_p=args.top_p, eos_id=stop, generator=generator,
                                     attention_mask=mask[rows].to(args.device), **{k: v[rows] for k, v in extra.items()})
            except ValueError as e:  # e.g. prompt + max_new_tokens longer than the model's max_seq_len
                sys.exit(f"sample: {e}")
            for tokens in out.tolist():
                print(chat.decode_answer(tok, tokens, stop), flush=True)
            bar.update(len(out))

if __name__ == "__main__":
    main()
