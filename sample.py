"""
Ask a trained model about an image.

    python sample.py --ckpt out/shapes/step-001500 --image data/shapes/images/019999.png \
        --prompt "How many circles are there?"
    python sample.py --ckpt llava-1.5-7b-hf --image cat.jpg --prompt "What is this?" --template vicuna_v1

--ckpt is a llavax checkpoint directory (a training step or a convert.py output) or an HF LLaVA
directory, converted in memory. The template defaults to the one the checkpoint was trained with.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import convert
import data


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--image", help="an image file; leave out for a text-only prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--template", help="default: the training config's, else vicuna_v1")
    p.add_argument("--tokenizer", help="default: tokenizer.model or tokenizer.json in --ckpt")
    p.add_argument("--image-mode", default="pad", choices=["pad", "crop", "resize"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:
        p.error(f"--temperature must be >= 0 (got {args.temperature}), --top-p in (0, 1] (got {args.top_p}), "
                f"--max-new-tokens >= 1 (got {args.max_new_tokens})")
    ckpt = Path(args.ckpt)
    if not ckpt.is_dir():
        sys.exit(f"sample: --ckpt {ckpt}: not a directory")
    try:
        trained = json.loads((ckpt / "state.json").read_text())["config"] if (ckpt / "state.json").exists() else {}
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"sample: {ckpt / 'state.json'}: unreadable ({type(e).__name__}: {e}); pass --template")
    template = args.template or trained.get("template", "vicuna_v1")
    if template not in data.TEMPLATES:
        sys.exit(f"sample: unknown template {template!r}; choose from {sorted(data.TEMPLATES)}")
    try:
        tok = data.Tokenizer(args.tokenizer or ckpt)
        model = convert.load_model(ckpt, device=args.device).eval()
    except (OSError, ValueError, RuntimeError, convert.ConversionError) as e:
        sys.exit(f"sample: {e}")
    cfg = model.cfg
    question = f"{data.IMAGE_TAG}\n{args.prompt}" if args.image else args.prompt
    ids, _ = data.tokenize([(data.generation_prompt(template, question, tok), False)], tok, cfg.image_token_id,
                           cfg.n_image_tokens)
    if len(ids) + args.max_new_tokens > cfg.llm.max_seq_len:
        sys.exit(f"sample: --prompt is {len(ids)} tokens (with the template and image); with --max-new-tokens "
                 f"{args.max_new_tokens} that exceeds the model's max_seq_len={cfg.llm.max_seq_len}")
    pixels = None
    if args.image:
        try:
            image = data.load_image(Path(args.image).read_bytes(), cfg.vision.image_size, args.image_mode)
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            sys.exit(f"sample: --image {args.image}: cannot read it as an image ({e})")
        pixels = data.normalize_images(image[None]).to(args.device)
    stop = data.stop_token_id(template, tok)
    out = model.generate(torch.tensor([ids], device=args.device), pixels, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, eos_id=stop,
                         generator=torch.Generator(args.device).manual_seed(args.seed))[0].tolist()
    print(tok.decode(out[: out.index(stop)] if stop in out else out).strip())


if __name__ == "__main__":
    main()
