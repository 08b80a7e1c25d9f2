"""
The Hugging Face processor files convert.py's to-hf writes beside the weights, so that AutoProcessor
preprocesses exactly as llavax trained: the image processor for data.py's image mode, LlavaProcessor's
settings, a chat template rendering data.py's template, and <image> in tokenizer.json.

Split from convert.py (weights and formats) because it is a separate concern: it reads data.py, not model
weights, and follows transformers' processor formats rather than checkpoint layouts.
"""

import json
import sys
from pathlib import Path

import data

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja")
TEMPLATE_NAMES = sorted(data.TEMPLATES)
VIDEO_TAG = "<video>"  # OneVision's video placeholder (LlavaOnevisionProcessor's default)


class ExportError(ValueError):
    pass


def image_processor_config(size, mode, mean=data.CLIP_MEAN, std=data.CLIP_STD):
    """HF's image processor for data.load_image's modes: 'crop' = shortest edge then centre crop (CLIP's),
    'resize' = squash to size x size, 'pad' = LlavaImageProcessor's pad to square with the mean colour first."""
    square, shortest = {"height": size, "width": size}, {"shortest_edge": size}
    return {"image_processor_type": "LlavaImageProcessor" if mode == "pad" else "CLIPImageProcessor",
            "do_resize": True, "size": square if mode == "resize" else shortest, "resample": 3,  # bicubic
            "do_center_crop": mode != "resize", "crop_size": square, "do_pad": mode == "pad",
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean),
            "image_std": list(std), "do_convert_rgb": True, "processor_class": "LlavaProcessor"}


def chat_template(template):
    """A jinja chat template that renders what data.py's template renders. Built by rendering a two-round
    conversation with marker texts and cutting the string at them, so it follows data.py's templates exactly.
    Text goes in as string expressions: HF renders with trim_blocks, which would eat a newline after a tag."""
    lit = lambda text: "{{ " + json.dumps(text) + " }}"  # noqa: E731
    content = ("{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
               + lit(data.IMAGE_TAG + "\n") + "{% elif c.type == 'video' %}" + lit(VIDEO_TAG + "\n")
               + "{% endif %}{% endfor %}{% for c in m.content %}{% if c.type == 'text' %}"
               "{{ c.text }}{% endif %}{% endfor %}{% endif %}")
    if template == "plain":  # stage 1: the image, then the caption; questions are not shown
        first_answer = "(messages | selectattr('role', 'equalto', 'assistant') | list)[:1]"
        return lit("<s>" + data.IMAGE_TAG) + "{% for m in " + first_answer + " %}" + content + lit("\n") + "{% endfor %}"
    marks = ["\x01Q1\x01", "\x01A1\x01", "\x01Q2\x01", "\x01A2\x01"]
    conv = [{"from": r, "value": m} for r, m in zip(["human", "gpt"] * 2, marks)]
    text = "".join(t for t, _ in data.TEMPLATES[template](conv))
    cuts = [text.index(m) for m in marks]
    first, user_end, turn_sep, _, last = [text[a:b] for a, b in zip([0] + [c + len(m) for c, m in zip(cuts, marks)],
                                                                      cuts + [len(text)])]
    generation = data.generation_prompt(template, marks[0])
    # a system message: its text in place of the template's default (cut from a rendering with a system marker)
    with_system = "".join(t for t, _ in data.TEMPLATES[template]([{"from": "system", "value": "\x01S\x01"}] + conv))
    before_system, after_system = with_system[: with_system.index(marks[0])].split("\x01S\x01")
    system_text = ("{% for m in messages | selectattr('role', 'equalto', 'system') %}{% if loop.first %}"
                   "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'text' %}"
                   "{{ c.text }}{% endif %}{% endfor %}{% endif %}{% endif %}{% endfor %}")
    return ("{% set ns = namespace(first=true) %}{% for m in messages %}{% if m.role == 'user' %}{% if ns.first %}"
            "{% if messages | selectattr('role', 'equalto', 'system') | list %}" + lit(before_system) + system_text
            + lit(after_system) + "{% else %}" + lit(first) + "{% endif %}{% set ns.first = false %}{% else %}"
            + lit(turn_sep) + "{% endif %}" + content + "{% elif m.role == 'assistant' %}" + lit(user_end) + content
            + "{% endif %}{% endfor %}{% if add_generation_prompt %}" + lit(generation.split(marks[0])[1])
            + "{% else %}" + lit(last) + "{% endif %}")


def anyres_processor_configs(cfg, image, settings):
    """LlavaNextImageProcessor / LlavaOnevisionImageProcessor tile as llavax's loader does for cfg.anyres; the
    image mode does not apply (the base view is squashed, the grid aspect-kept and padded, as in HF)."""
    size, pinpoints = cfg.vision.image_size, [list(p) for p in cfg.grid_pinpoints]
    image = image | {"do_pad": True, "image_grid_pinpoints": pinpoints}
    if cfg.anyres == "anyres":
        image |= {"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
                  "size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size},
                  "do_center_crop": True}
        return image, settings | {"processor_class": "LlavaNextProcessor"}
    image |= {"image_processor_type": "LlavaOnevisionImageProcessor", "processor_class": "LlavaOnevisionProcessor",
              "size": {"height": size, "width": size}, "do_center_crop": False}
    image.pop("crop_size")
    # the processor counts the base view as num_image_tokens and the grid as its square root per tile side; under
    # "default" it takes one off (the CLS token a CLIP tower's features drop), so it needs the count with CLS
    settings = {k: v for k, v in settings.items() if k not in ("patch_size", "num_additional_image_tokens")}
    return image, settings | {"processor_class": "LlavaOnevisionProcessor", "video_token": VIDEO_TAG,
                              "num_image_tokens": cfg.n_image_tokens + (cfg.vision_select == "patch"),
                              "vision_aspect_ratio": cfg.anyres}


def write_processor(cfg, directory, template, image_mode):
    if template not in data.TEMPLATES or image_mode not in ("pad", "crop", "resize"):
        raise ExportError(f"cannot write a processor for template {template!r} and image mode {image_mode!r}")
    extra = 1 if cfg.vision.kind == "clip" else 0  # LlavaProcessor: patches + this, - 1 for "default"
    image = image_processor_config(cfg.vision.image_size, image_mode, *cfg.vision.image_stats)
    settings = {"processor_class": "LlavaProcessor", "image_token": data.IMAGE_TAG, "patch_size": cfg.vision.patch_size,
                "vision_feature_select_strategy": "default" if cfg.vision_select == "patch" else "full",
                "num_additional_image_tokens": extra}
    if cfg.anyres:
        image, settings = anyres_processor_configs(cfg, image, settings)
    Path(directory, "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    Path(directory, "processor_config.json").write_text(json.dumps(settings, indent=2))
    Path(directory, "chat_template.jinja").write_text(chat_template(template))
    Path(directory, "chat_template.json").unlink(missing_ok=True)  # one template only: the .jinja wins


def add_image_token_to_tokenizer(directory, image_id, video_id=None):
    """Register <image> (and OneVision's <video>) at the model's ids in tokenizer.json (the added-token list HF
    loads), if not there yet."""
    tags = {data.IMAGE_TAG: image_id} | ({VIDEO_TAG: video_id} if video_id is not None else {})
    path = Path(directory, "tokenizer.json")
    if not path.exists():
        if Path(directory, "tokenizer.model").exists():
            print(f"convert: {directory}: only a sentencepiece tokenizer.model; AutoProcessor needs "
                  + ", ".join(f"{t} (id {i})" for t, i in tags.items()) + " added to it by hand", file=sys.stderr)
        return
    tok = json.loads(path.read_text())
    vocab = tok.get("model", {}).get("vocab") or {}
    vocab = vocab if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}  # Unigram: a list
    known = vocab | {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    missing = [tag for tag in tags if tag not in known]
    for tag, tag_id in tags.items():
        if known.get(tag, tag_id) != tag_id:
            raise ExportError(f"{path}: {tag} has id {known[tag]} but the model uses {tag_id}")
        holder = next((t for t, i in known.items() if i == tag_id and t != tag), None)
        if holder is not None:
            raise ExportError(f"{path}: the model's {tag} id {tag_id} is the tokenizer's {holder!r}; cannot add {tag}")
        if tag not in known:
            tok.setdefault("added_tokens", []).append({"id": tag_id, "content": tag, "single_word": False,
                                                       "lstrip": False, "rstrip": False, "normalized": False,
                                                       "special": True})
            known[tag] = tag_id
    if missing:
        path.write_text(json.dumps(tok, ensure_ascii=False))
