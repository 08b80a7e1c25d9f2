"""
The Hugging Face processor files convert.py's to-hf writes beside the weights, so that AutoProcessor
preprocesses exactly as llavax trained: the image processor for data.py's image mode, LlavaProcessor's
settings, a chat template rendering data.py's template, and tokenizer files holding <image> and the special
tokens chat.Tokenizer reads.

Split from convert.py (weights and formats) because it is a separate concern: it reads data.py, not model
weights, and follows transformers' processor formats rather than checkpoint layouts.
"""

import contextlib
import inspect
import json
import sys
from pathlib import Path

import chat
import images
import storage

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja")
TEMPLATE_NAMES = sorted(chat.TEMPLATES)
VIDEO_TAG = "<video>"  # OneVision's video placeholder (LlavaOnevisionProcessor's default)


class ExportError(ValueError):
    pass


def image_processor_config(size, mode, mean=images.CLIP_MEAN, std=images.CLIP_STD, resample=3):
    """HF's image processor for images.load_image's modes: 'crop' = shortest edge then centre crop (CLIP's),
    'resize' = squash to size x size, 'pad' = LlavaImageProcessor's pad to square with the mean colour first; every
    resize with the tower's filter (ViTConfig.resample: 3 bicubic, SigLIP2's 2 bilinear)."""
    square, shortest = {"height": size, "width": size}, {"shortest_edge": size}
    return {"image_processor_type": "LlavaImageProcessor" if mode == "pad" else "CLIPImageProcessor",
            "do_resize": True, "size": square if mode == "resize" else shortest, "resample": resample,
            "do_center_crop": mode != "resize", "crop_size": square, "do_pad": mode == "pad",
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(mean),
            "image_std": list(std), "do_convert_rgb": True, "processor_class": "LlavaProcessor"}


def chat_template(template, bos=None, eos=None, bos_added=False, after_tag=""):
    """A jinja chat template that renders what data.py's template renders with these BOS and EOS strings (None:
    the template's published ones), less the leading BOS where the tokenizer adds it (bos_added). Built by rendering a
    two-round conversation with marker texts and cutting the string at them, so it follows data.py's templates
    exactly. Text goes in as string expressions: HF renders with trim_blocks, which would eat a newline after a
    tag. after_tag follows each <image>, <video> and a leading BOS that text follows (see template_strings)."""
    lit = lambda text: "{{ " + json.dumps(text) + " }}"  # noqa: E731
    published = inspect.signature(chat.TEMPLATES[template]).parameters
    bos = published["bos"].default if bos is None else bos
    eos = published["eos"].default if eos is None else eos
    tags = "" if not after_tag else "".join(f" | replace({json.dumps(t)}, {json.dumps(t + after_tag)})"
                                            for t in (chat.IMAGE_TAG, VIDEO_TAG))
    lead = lambda rest: "" if bos_added or not bos else bos + (after_tag if rest else "")  # noqa: E731
    # llama_2 and llama_3 trim every message; LLaVA's preprocessing trims a message around its one image; qwen3 and
    # smollm3 strip the newlines an answer starts with
    probe = [("human", "\n\x02\n"), ("gpt", "\n\x03\n"), ("human", "q"), ("gpt", "a")]
    probe = chat.TEMPLATES[template]([{"from": r, "value": v} for r, v in probe])
    trained = next(t for t, target in probe if target)  # the first answer, apart from the prompt before it
    strip = lambda mark, text: "" if f"\n{mark}\n" in text else ".lstrip('\\n')" if f"{mark}\n" in text else " | trim"  # noqa: E731
    one_tag = "(m.content | selectattr('type', 'in', ['image', 'video']) | list | length) == 1"
    content = lambda trim: ("{% if m.content is string %}{{ m.content" + trim + tags + " }}{% else %}"  # noqa: E731
                            "{% for c in m.content %}{% if c.type == 'image' %}" + lit(chat.IMAGE_TAG + after_tag + "\n")
                            + "{% elif c.type == 'video' %}" + lit(VIDEO_TAG + after_tag + "\n")
                            + "{% endif %}{% endfor %}{% for c in m.content %}{% if c.type == 'text' %}{% if " + one_tag
                            + " %}{{ c.text | trim }}{% else %}{{ c.text" + trim + " }}{% endif %}{% endif %}{% endfor %}"
                            "{% endif %}")
    question, answer = content(strip("\x02", "".join(t for t, _ in probe))), content(strip("\x03", trained))
    if template == "plain":  # stage 1: the image, then the caption; questions are not shown
        first_answer = "(messages | selectattr('role', 'equalto', 'assistant') | list)[:1]"
        return (lit(lead("") + chat.IMAGE_TAG) + "{% for m in " + first_answer + " %}" + lit(after_tag) + answer
                + lit("\n") + "{% endfor %}")
    marks = ["\x01Q1\x01", "\x01A1\x01", "\x01Q2\x01", "\x01A2\x01"]
    conv = [{"from": r, "value": m} for r, m in zip(["human", "gpt"] * 2, marks)]
    text = "".join(t for t, _ in chat.TEMPLATES[template](conv, bos=bos, eos=eos))
    cuts = [text.index(m) for m in marks]
    first, user_end, turn_sep, last_user_end, last = [text[a:b] for a, b in zip([0] + [c + len(m) for c, m in
                                                                                     zip(cuts, marks)], cuts + [len(text)])]
    answer_start = lit(user_end) if last_user_end == user_end else \
        "{% if loop.last %}" + lit(last_user_end) + "{% else %}" + lit(user_end) + "{% endif %}"
    # qwen3 writes an answer's own reasoning in place of the empty think block that opens an answer without it
    reasoned = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "\n\x05\n</think>\n\x03"}]
    empty = "<think>\n\n</think>\n\n"
    if "<think>\n\x05\n</think>\n\n\x03" in "".join(t for t, _ in chat.TEMPLATES[template](reasoned)) and \
            user_end.endswith(empty) and last_user_end == user_end:
        split = "m.content.split('</think>')"
        answer_start = lit(user_end.removesuffix(empty))
        answer = ("{% if m.content is string and '</think>' in m.content %}{{ '<think>\\n' + " + split
                  + "[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') + '\\n</think>\\n\\n' + " + split
                  + "[-1].lstrip('\\n') }}{% else %}" + lit(empty) + answer + "{% endif %}")
    generation = last_user_end.rstrip(" ")  # data.generation_prompt's cut
    # a system message: its text in place of the template's default (cut from a rendering with a system marker)
    with_system = "".join(t for t, _ in chat.TEMPLATES[template]([{"from": "system", "value": "\x01S\x01"}] + conv,
                                                                 bos=bos, eos=eos))
    before_system, after_system = with_system[: with_system.index(marks[0])].split("\x01S\x01")
    if bos and first.startswith(bos):
        first = lead(first[len(bos):]) + first[len(bos):]
    if bos and before_system.startswith(bos):
        before_system = lead(before_system[len(bos):]) + before_system[len(bos):]
    system_text = ("{% for m in messages | selectattr('role', 'equalto', 'system') %}{% if loop.first %}"
                   "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'text' %}"
                   "{{ c.text }}{% endif %}{% endfor %}{% endif %}{% endif %}{% endfor %}")
    return ("{% set ns = namespace(first=true) %}{% for m in messages %}{% if m.role == 'user' %}{% if ns.first %}"
            "{% if messages | selectattr('role', 'equalto', 'system') | list %}" + lit(before_system) + system_text
            + lit(after_system) + "{% else %}" + lit(first) + "{% endif %}{% set ns.first = false %}{% else %}"
            + lit(turn_sep) + "{% endif %}" + question + "{% elif m.role == 'assistant' %}" + answer_start + answer
            + "{% endif %}{% endfor %}{% if add_generation_prompt %}" + lit(generation)
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


def template_strings(tokenizer):
    """chat_template's keywords for an exported tokenizer (chat.Tokenizer, whether HF's prepends the BOS): its own
    BOS and EOS, no BOS where the tokenizer adds one (llava-hf's convention: the processor tokenizes the rendered
    prompt with special tokens on, and a written BOS would be a second one). A sentencepiece model with legacy=False
    puts no dummy-prefix space after a special token, where training starts a new chunk after <image> (and after
    the BOS) as LLaVA does: the template writes that space, U+2581, so the ids stay training's."""
    if tokenizer is None:
        return {}
    tok, adds_bos = tokenizer
    return {"bos": tok.bos or "", "eos": tok.eos or "", "bos_added": adds_bos,
            "after_tag": "\u2581" if tok.sp is not None and not tok.legacy else ""}


def has_processor(directory):
    """Whether `directory` holds a whole HF processor (from-hf carries one through): processor_config.json, a chat
    template, and the image processor in preprocessor_config.json or, as transformers 5's save_pretrained writes
    it, nested in processor_config.json."""
    held = set(storage.ls(directory))  # a local folder or a bucket prefix
    if "processor_config.json" not in held or not held & {"chat_template.jinja", "chat_template.json"}:
        return False
    return "preprocessor_config.json" in held or \
        "image_processor" in json.loads(storage.read_text(storage.join(directory, "processor_config.json")))


def write_processor(cfg, directory, template, image_mode, tokenizer=None):
    if template not in chat.TEMPLATES or image_mode not in ("pad", "crop", "resize"):
        raise ExportError(f"cannot write a processor for template {template!r} and image mode {image_mode!r}")
    extra = 1 if cfg.vision.kind == "clip" else 0  # LlavaProcessor: patches + this, - 1 for "default"
    image = image_processor_config(cfg.vision.image_size, image_mode, *cfg.vision.image_stats, cfg.vision.resample)
    settings = {"processor_class": "LlavaProcessor", "image_token": chat.IMAGE_TAG, "patch_size": cfg.vision.patch_size,
                "vision_feature_select_strategy": "default" if cfg.vision_select == "patch" else "full",
                "num_additional_image_tokens": extra}
    if cfg.anyres:
        image, settings = anyres_processor_configs(cfg, image, settings)
    Path(directory, "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    Path(directory, "processor_config.json").write_text(json.dumps(settings, indent=2))
    Path(directory, "chat_template.jinja").write_text(chat_template(template, **template_strings(tokenizer)))
    Path(directory, "chat_template.json").unlink(missing_ok=True)  # one template only: the .jinja wins


def token_text(tok, token_id):
    """The string of a token id, or None (no such token)."""
    if token_id is None or token_id < 0:
        return None
    return tok.sp.id_to_piece(token_id) if tok.sp is not None else tok.hf.id_to_token(token_id)


def tokenizer_adds_bos(tok, config):
    """Whether transformers' tokenizer from these files prepends the BOS itself: a sentencepiece model as
    LlamaTokenizer does unless add_bos_token is false; a tokenizer.json as its post-processor says (transformers 5
    follows the post-processor, whatever add_bos_token says)."""
    if tok.bos_id < 0:
        return False
    if tok.sp is not None:
        return bool(config.get("add_bos_token", True))
    return tok.hf.encode("a").ids[:1] == [tok.bos_id] != tok.hf.encode("a", add_special_tokens=False).ids[:1]


def added_token(content):
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


def register_tags(where, known, tags, vocab_size):
    """{id: token} to add so that each tag sits at the model's id. tokenizers numbers added tokens from the end of
    the vocabulary up, ignoring the ids written, so ids between the end and a tag are filled with placeholders."""
    new = {}
    for tag, tag_id in tags.items():
        if known.get(tag, tag_id) != tag_id:
            raise ExportError(f"{where}: {tag} has id {known[tag]} but the model uses {tag_id}")
        holder = next((t for t, i in known.items() if i == tag_id and t != tag), None)
        if holder is not None:
            raise ExportError(f"{where}: the model's {tag} id {tag_id} is the tokenizer's {holder!r}; cannot add {tag}")
        if tag not in known:
            new[tag_id] = tag
    if new:
        taken = set(known.values())
        new |= {i: f"<llavax_unused_{i}>" for i in range(vocab_size, max(new)) if i not in taken and i not in new}
    return dict(sorted(new.items()))


def export_tokenizer(directory, image_id, video_id=None, template=None):
    """Make the tokenizer files in `directory` what transformers loads as the tokenizer llavax trained with:
    <image> (and <video>) at the model's ids in tokenizer.json, converted here from a sentencepiece tokenizer.model
    (kept beside it) so that loading converts nothing; bos/eos/pad and sentencepiece's legacy flag as chat.Tokenizer
    reads them, written out even where the source had no tokenizer_config.json; generation_config.json stopping on
    the template's end of turn and the EOS. Returns (chat.Tokenizer, whether the HF tokenizer prepends the BOS
    itself), or None without a tokenizer."""
    directory = Path(directory)
    if not any((directory / n).exists() for n in ("tokenizer.json", "tokenizer.model")):
        print(f"convert: {directory}: no tokenizer.json or tokenizer.model beside the weights; the export has no "
              "tokenizer", file=sys.stderr)
        return None
    tok = chat.Tokenizer(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    tags = {chat.IMAGE_TAG: image_id} | ({VIDEO_TAG: video_id} if video_id is not None else {})
    if tok.sp is None:
        new = add_to_tokenizer_json(directory / "tokenizer.json", tags)
        if "added_tokens_decoder" in config:  # transformers reads this list too: keep the two alike
            config["added_tokens_decoder"] |= {str(i): added_token(t) for i, t in new.items()}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # not the model's class: it rewrites BOS rules
    else:
        config = sentencepiece_config(tok, config, tags, directory / "tokenizer.model")
    config |= {"bos_token": tok.bos, "eos_token": tok.eos, "pad_token": token_text(tok, tok.pad_id)}
    adds_bos = tokenizer_adds_bos(tok, config)
    if adds_bos and template and not writes_bos(template):  # chatml trains with no BOS: the tokenizer adds none
        if tok.sp is not None:
            config["add_bos_token"] = False
        else:
            path = directory / "tokenizer.json"
            file = json.loads(path.read_text())
            path.write_text(json.dumps(file | {"post_processor": without_bos(file["post_processor"], tok.bos)},
                                       ensure_ascii=False))
        adds_bos = False
    if tok.sp is not None:
        fast = sentencepiece_json(tok, {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()}, adds_bos)
        check_sentencepiece_json(tok, fast, template_strings((tok, adds_bos))["after_tag"])
        fast.save(str(directory / "tokenizer.json"))
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    write_generation_config(directory, tok, template)
    return tok, adds_bos


def add_to_tokenizer_json(path, tags):
    file = json.loads(path.read_text())
    vocab = file.get("model", {}).get("vocab") or {}
    vocab = vocab if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}  # Unigram: a list
    new = register_tags(path, vocab | {t["content"]: t["id"] for t in file.get("added_tokens", [])}, tags, len(vocab))
    if new:
        file.setdefault("added_tokens", []).extend({"id": i} | added_token(t) for i, t in new.items())
        path.write_text(json.dumps(file, ensure_ascii=False))
    return new


def sentencepiece_config(tok, config, tags, where):
    """tokenizer_config.json beside the tokenizer.json converted from a sentencepiece model: the tags, and the
    template markers the model holds as user-defined pieces (shapes.py's <|eot_id|>...), which are special tokens to
    chat.Tokenizer and which transformers splits the text at only as added tokens; chat.Tokenizer's legacy flag
    (it reads tokenizer.model, and this flag, again after from-hf). The class loads tokenizer.json as written:
    transformers 5's LlamaTokenizer would rebuild it as a BPE with no normalizer."""
    decoder = config.get("added_tokens_decoder", {})
    known = {tok.sp.id_to_piece(i): i for i in range(tok.vocab_size)} | {t["content"]: int(i) for i, t in decoder.items()}
    new = register_tags(where, known, tags, tok.vocab_size)
    decoder = {str(i): added_token(piece) for piece, i in tok.specials.items()} | decoder
    decoder |= {str(i): added_token(t) for i, t in new.items()}
    return config | {
        "tokenizer_class": "PreTrainedTokenizerFast", "legacy": tok.legacy, "added_tokens_decoder": decoder,
        "unk_token": token_text(tok, tok.sp.unk_id()),
        "add_bos_token": config.get("add_bos_token", True) and tok.bos is not None, "add_eos_token": False}


# -----------------------------------------------------------------------------
# tokenizer.json for a sentencepiece model. Without it transformers converts tokenizer.model on every load, which
# needs sentencepiece and a protobuf its generated code accepts (protobuf 6 does not, and the fallback misreads
# the file); converted here, in llavax's environment, and checked against training's ids before it is written.

# text where a fast tokenizer and sentencepiece part ways: spaces at either end and in runs, newlines, tabs,
# digits, accents (composed and combining), CJK, emoji, full-width and non-breaking spaces, compatibility forms
PROBE_TEXTS = ["What is in the image?", " one leading space", "   three leading spaces", "trailing space ",
               "trailing spaces   ", "two  spaces, four    spaces", " ", "  ", "\n", "\nA new line first", "\n\n  x",
               "last line\n", "a\n\nb \n c", "tab\there\t", "\r\nwindows", "digits 0123456789 3.14 1,000,000",
               "café naïve Ünïcödé e\u0301 ß", "日本語のテキスト、中文。", "emoji 🐱🚀👍🏽", "full\u3000width ｆｕｌｌ",
               "no\u00a0break", "ﬁ ligature ① ²", "Œuvre — “quotes” …", "x" * 40]


def sentencepiece_json(tok, added, adds_bos):
    """A tokenizers.Tokenizer for tok's sentencepiece model that encodes as chat.Tokenizer.encode: transformers'
    conversion of the model (pieces, BPE merges or unigram scores, byte fallback, user-defined pieces, the dummy
    prefix on every chunk between special tokens under legacy, else only at the start of the text), and chat.Tokenizer's
    treatment of a chunk's leading space, which stands for the dummy prefix (it never becomes a second one);
    `added` ({id: token}) as special tokens, the BOS prepended when adds_bos."""
    try:
        from tokenizers import AddedToken, Regex, normalizers, processors
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        extractor = SentencePieceExtractor(str(tok.path))
        fast = SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, extractor.extract(None)["vocab"],
                                                           legacy=tok.legacy)
    except Exception as e:  # noqa: BLE001  transformers missing, or its protobuf cannot read the model: each says why
        raise ExportError(f"{tok.path}: cannot convert the sentencepiece model to tokenizer.json, which the export "
                          f"needs to load without converting ({type(e).__name__}: {e})") from e
    spec = extractor.proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:  # trailing spaces go and runs fold to one; a leading one is the dummy prefix
        steps += [normalizers.Replace(Regex(" +\\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if not spec.add_dummy_prefix:  # chat.Tokenizer drops a chunk's leading space, the prefix this model never adds
        steps.append(normalizers.Replace(Regex("\\A "), ""))
    elif not spec.remove_extra_whitespaces:  # a lone space is a dummy prefix with nothing after it
        steps.append(normalizers.Replace(Regex("\\A \\z"), ""))
    if spec.add_dummy_prefix and tok.legacy:  # sentencepiece prefixes text that starts with a literal U+2581 too
        steps.append(normalizers.Replace(Regex("\\A\u2581"), "\u2581\u2581"))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    fast.normalizer = normalizers.Sequence(steps)
    single, pair = ("$A:0", "$A:0 $B:1") if not adds_bos else (f"{tok.bos}:0 $A:0", f"{tok.bos}:0 $A:0 {tok.bos}:1 $B:1")
    fast.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                        special_tokens=[(tok.bos, tok.bos_id)] if adds_bos else [])
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(added.items())])
    misplaced = {t: fast.token_to_id(t) for i, t in added.items() if fast.token_to_id(t) != i}
    if misplaced:
        raise ExportError(f"{tok.path}: the converted tokenizer.json holds {misplaced} (token: id), not at the ids "
                          f"tokenizer_config.json's added_tokens_decoder gives them")
    return fast


def check_sentencepiece_json(tok, fast, after_tag):
    """Refuse a converted tokenizer that encodes a probe other than training does: PROBE_TEXTS alone and between
    special tokens, every template chat.Tokenizer can write rendered over them (less plain's <image>), and each probe
    after the BOS and the tags, where training starts a fresh chunk and the chat template writes after_tag."""
    texts = PROBE_TEXTS + [a + special + b for special in tok.specials for a, b in zip(PROBE_TEXTS, PROBE_TEXTS[1:])]
    conv = [{"from": role, "value": text} for role, text in zip(["human", "gpt"] * len(PROBE_TEXTS), PROBE_TEXTS)]
    for template in chat.TEMPLATES:
        with contextlib.suppress(ValueError):  # a template the tokenizer cannot write is never trained on
            chat.check_template(template, tok)
            texts.append("".join(text for text, _ in chat.render(template, conv, tok)).replace(chat.IMAGE_TAG, ""))
    cases = [(text, tok.encode(text)) for text in texts]
    fresh = [text for text in PROBE_TEXTS if not text.startswith(" ")]  # contents are trimmed around a tag
    starts = [s for s in (tok.bos, chat.IMAGE_TAG, VIDEO_TAG) if s and fast.token_to_id(s) is not None]
    cases += [(s + after_tag + text, [fast.token_to_id(s)] + tok.encode(text)) for s in starts for text in fresh]
    for text, expected in cases:
        got = fast.encode(text, add_special_tokens=False).ids
        if got != expected:
            at = next(i for i, (a, b) in enumerate(zip([*got, None], [*expected, None])) if a != b)
            theirs = [fast.id_to_token(i) for i in got[at:at + 4]]
            ours = [tok.sp.id_to_piece(i) for i in expected[at:at + 4]]
            raise ExportError(f"{tok.path}: the tokenizer.json converted from it splits {text[:60]!r} into {theirs} at "
                              f"token {at}, where training's sentencepiece tokenizer (legacy={tok.legacy}) gives {ours}; "
                              f"refusing an export whose fast and slow tokenizers disagree")


def writes_bos(template):
    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    return "\x04" in "".join(t for t, _ in chat.TEMPLATES[template](conv, bos="\x04"))


def without_bos(post, bos):
    """A tokenizer.json post-processor less the BOS its TemplateProcessing prepends."""
    if post.get("type") == "Sequence":
        return post | {"processors": [without_bos(p, bos) for p in post["processors"]]}
    if post.get("type") != "TemplateProcessing":
        return post
    keep = lambda items: [x for x in items if x.get("SpecialToken", {}).get("id") != bos]  # noqa: E731
    return post | {"single": keep(post.get("single", [])), "pair": keep(post.get("pair", [])),
                   "special_tokens": {k: v for k, v in post.get("special_tokens", {}).items() if k != bos}}


def write_generation_config(directory, tok, template):
    """generation_config.json (merged into one carried along) that stops where our sampler stops: the template's
    end of turn, and the EOS."""
    path = Path(directory, "generation_config.json")
    generation = json.loads(path.read_text()) if path.exists() else {}
    before = generation.get("eos_token_id")
    stops = ([chat.stop_token_id(template, tok)] if template else []) + [tok.eos_id]
    stops += before if isinstance(before, list) else [before]
    stops = list(dict.fromkeys(i for i in stops if i is not None and i >= 0))
    generation |= {"bos_token_id": tok.bos_id if tok.bos_id >= 0 else None, "pad_token_id": tok.pad_id,
                   "eos_token_id": stops[0] if len(stops) == 1 else stops}
    path.write_text(json.dumps(generation, indent=2))
