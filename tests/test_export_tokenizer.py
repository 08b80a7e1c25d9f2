"""convert.py to-hf exports used as the ecosystem uses them (issue 21, part 1): AutoProcessor on an image and a
chat-templated prompt, then transformers' LLaVA / LLaVA-NeXT / OneVision model on the processor's output.
References: transformers' own tokenizers built from our files (a sentencepiece tokenizer.model converted on load,
Llama-3- and Qwen2-style tokenizer.json), its processors, apply_chat_template and generate. Tokenizers are the
three families of test_templates.py, with and without tokenizer_config.json, prepending a BOS or not."""

import io
import json
import shutil

import pytest
import torch
from test_templates import CORPUS, LLAMA3_SPECIALS, QWEN2_SPECIALS, bpe_dir

import chat
import convert
import hf_config
from model import build_model
from model_config import vlm_preset
from model_files import load_model, save_model
from shapes import train_tokenizer

SP_CONFIG = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
             "pad_token": None, "add_bos_token": True, "add_eos_token": False}
# name -> (family, tokenizer_config.json or None, BOS prepended by the tokenizer.json's post-processor)
TOKENIZERS = {
    "sp": ("sp", None, None),  # Vicuna / Llama-2 style files as old checkpoints ship them: legacy by default
    "sp-vicuna-config": ("sp", SP_CONFIG | {"legacy": False}, None),  # lmsys/vicuna-7b-v1.5's settings
    "sp-no-bos-added": ("sp", SP_CONFIG | {"legacy": False, "add_bos_token": False}, None),
    "sp-legacy-config": ("sp", SP_CONFIG | {"legacy": True, "pad_token": "<unk>"}, None),
    "sp-shapes": ("sp-markers", None, None),  # the demo's: unigram, chat markers as user-defined pieces
    "llama3": ("llama3", None, "<|begin_of_text|>"),
    "llama3-config": ("llama3", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                                 "eos_token": "<|eot_id|>"}, "<|begin_of_text|>"),
    "llama3-no-bos-added": ("llama3", {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, None),
    # Llama-3 with ChatML's markers added (Hermes- and Dolphin-style fine-tunes): chatml writes no BOS, yet it prepends one
    "llama3-chatml": ("llama3-chatml", None, "<|begin_of_text|>"),
    "qwen2": ("qwen2", None, None),
    "qwen2-config": ("qwen2", {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                               "pad_token": "<|endoftext|>", "added_tokens_decoder": {
                                   str(i): {"content": t, "special": True} for i, t in enumerate(QWEN2_SPECIALS)}}, None),
}
TEMPLATES = {"sp": ["vicuna_v1", "llama_2", "plain"], "sp-markers": ["llama_3", "vicuna_v1", "llama_2", "plain"],
             "llama3": ["llama_3", "vicuna_v1", "llama_2", "plain"], "llama3-chatml": ["chatml", "llama_3"],
             "qwen2": ["chatml", "vicuna_v1", "plain"]}
IMAGE_SIZE = (333, 500)  # (width, height) of the photo: not a multiple of anything


def tokenizer_dir(root, name):
    import sentencepiece as spm

    family, config, bos = TOKENIZERS[name]
    d = root / name
    if family == "sp":
        d.mkdir()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(d / "tokenizer"),
                                       vocab_size=400, model_type="bpe", byte_fallback=True,
                                       remove_extra_whitespaces=False, normalization_rule_name="identity",
                                       character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                                       minloglevel=2)
        (d / "tokenizer.vocab").unlink()
    elif family == "sp-markers":
        d.mkdir()
        train_tokenizer(CORPUS, d / "tokenizer", 400)
    else:
        specials = {"llama3": LLAMA3_SPECIALS, "llama3-chatml": LLAMA3_SPECIALS + QWEN2_SPECIALS}
        bpe_dir(d, specials.get(family, QWEN2_SPECIALS), bos=bos)
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def checkpoint(root, name, kind="llava"):
    """A tiny llavax checkpoint of `kind` (llava, llava_next, llava_onevision) holding tokenizer `name`'s files, its
    <image> (and OneVision's <video>) right after the tokenizer's vocabulary."""
    from test_convert import TINY_PINPOINTS

    tok_dir = root / name if (root / name).exists() else tokenizer_dir(root, name)
    tok = chat.Tokenizer(tok_dir)
    extra = {"llava": {}, "llava_next": {"anyres": "anyres", "grid_pinpoints": TINY_PINPOINTS},
             "llava_onevision": {"anyres": "anyres_max_2", "grid_pinpoints": TINY_PINPOINTS,
                                 "video_token_id": tok.vocab_size + 1, "vision_select": "cls_patch", "vision_layer": -1,
                                 "vision": {"kind": "siglip", "act": "gelu_pytorch_tanh"}}}[kind]
    cfg = vlm_preset("debug").with_overrides({"image_token_id": tok.vocab_size,
                                              "llm": {"vocab_size": -(-(tok.vocab_size + 2) // 64) * 64}} | extra)
    save_model(build_model(cfg, seed=0), root / f"{name}-{kind}", tokenizer_dir=tok_dir)
    return root / f"{name}-{kind}", tok, cfg


def image():
    from PIL import Image
    from test_convert import photo

    return Image.open(io.BytesIO(photo(*IMAGE_SIZE)))


def messages_of(conv):
    """An HF chat of a llavax conversation: the image as a content item before the text, as llava-hf's examples
    write it (the tag goes, with the whitespace around it)."""
    out = []
    for turn in conv:
        role, text = {"human": "user", "gpt": "assistant"}[turn["from"]], turn["value"]
        if chat.IMAGE_TAG in text:
            content = [{"type": "image"}, {"type": "text", "text": text.replace(chat.IMAGE_TAG, "").strip()}]
        else:
            content = [{"type": "text", "text": text}]
        out.append({"role": role, "content": content})
    return out


# conversations as LLaVA's data has them: the tag after the question, spaces and newlines around the text, several turns
CONVERSATIONS = [
    [{"from": "human", "value": "What is shown in this image?\n<image>"},
     {"from": "gpt", "value": "A black cat sits on a red sofa."}],
    [{"from": "human", "value": "<image>\nDescribe the scene in detail. "}, {"from": "gpt", "value": "There are two dogs."},
     {"from": "human", "value": "What color is the sofa?"}, {"from": "gpt", "value": "Red.  "}],
]


@pytest.fixture(scope="module")
def llava_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return root, {name: checkpoint(root, name) for name in TOKENIZERS}


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_processor_on_the_chat_template_gives_the_ids_training_uses(llava_checkpoints, tmp_path, name):
    """For every template the tokenizer can write: processor(text=apply_chat_template(chat), images=...), from the
    export's tokenizer.json with a sentencepiece tokenizer.model taken away, gives the
    ids data.encode_conversation trains on (one BOS, <image> expanded at the model's id), the generation prompt
    gives sample.py's ids, and the tokenizer and generation config stop on the template's end of turn and our EOS."""
    from transformers import AutoProcessor, GenerationConfig

    root, checkpoints = llava_checkpoints
    ckpt, tok, cfg = checkpoints[name]
    for template in TEMPLATES[TOKENIZERS[name][0]]:
        out = tmp_path / template
        convert.main(["to-hf", "--ckpt", str(ckpt), "--out", str(out), "--template", template, "--image-mode", "pad"])
        assert (out / "tokenizer.json").exists()
        (out / "tokenizer.model").unlink(missing_ok=True)  # a sentencepiece export loads from tokenizer.json alone
        processor = AutoProcessor.from_pretrained(out)
        assert processor.tokenizer.convert_tokens_to_ids(chat.IMAGE_TAG) == cfg.image_token_id
        for conv in CONVERSATIONS[:1] if template == "plain" else CONVERSATIONS:
            messages = messages_of(conv)
            theirs = processor(text=processor.apply_chat_template(messages), images=image(), return_tensors="pt")
            ids, _, _ = chat.encode_conversation(conv, True, template, tok, 1024, cfg.image_token_id,
                                                 cfg.n_image_tokens)
            assert theirs.input_ids[0].tolist() == ids, (template, conv)
            question = messages[:1]
            theirs = processor(text=processor.apply_chat_template(question, add_generation_prompt=True),
                               images=image(), return_tensors="pt")
            trained, _ = chat.prompt_and_answer(conv, True, template, tok, cfg.image_token_id, cfg.n_image_tokens)
            prompt = chat.generation_prompt(template, conv[0]["value"], tok)  # sample.py's
            asked, _ = chat.tokenize([(prompt, False)], tok, cfg.image_token_id, cfg.n_image_tokens)
            assert theirs.input_ids[0].tolist() == asked == trained[:len(asked)], (template, "generation prompt")
        assert (processor.tokenizer.bos_token, processor.tokenizer.eos_token) == (tok.bos, tok.eos)
        assert processor.tokenizer.eos_token_id == tok.eos_id
        stops = GenerationConfig.from_pretrained(out).eos_token_id
        assert chat.stop_token_id(template, tok) in (stops if isinstance(stops, list) else [stops])


class StopAt:
    """A logits processor that forces `token` at generation step `step` (and leaves other steps alone)."""

    def __init__(self, prompt_len, step, token):
        self.prompt_len, self.step, self.token = prompt_len, step, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len == self.step:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0
        return scores


@pytest.mark.parametrize("name", ["sp", "sp-shapes"])
def test_processor_loads_where_transformers_cannot_convert_sentencepiece(llava_checkpoints, tmp_path, monkeypatch, name):
    """With transformers' slow->fast conversion raising, as it does under protobuf 6 (lmms-eval's environment), the
    sentencepiece export still opens in AutoProcessor, because loading it converts nothing, and gives training's ids."""
    from test_tokenizer_json import block_conversion
    from transformers import AutoProcessor

    root, checkpoints = llava_checkpoints
    ckpt, tok, cfg = checkpoints[name]
    template = "llama_3" if name == "sp-shapes" else "vicuna_v1"
    convert.main(["to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--template", template])
    block_conversion(monkeypatch)
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    conv = CONVERSATIONS[1]
    theirs = processor(text=processor.apply_chat_template(messages_of(conv)), images=image(), return_tensors="pt")
    ids, _, _ = chat.encode_conversation(conv, True, template, tok, 1024, cfg.image_token_id, cfg.n_image_tokens)
    assert theirs.input_ids[0].tolist() == ids and ids.count(cfg.image_token_id) == cfg.n_image_tokens


@pytest.mark.parametrize("kind", ["llava", "llava_next", "llava_onevision"])
def test_export_runs_in_transformers_from_the_processor_output(llava_checkpoints, tmp_path, kind):
    """LLaVA-1.5, NeXT and OneVision exports with a sentencepiece, a Llama-3 and a Qwen2 tokenizer: AutoProcessor
    on a 333x500 photo and a chat-templated prompt puts as many image tokens as the model takes (the issue: a
    sentencepiece export put none), the model's logits on it are ours within 1e-4, and generate runs and stops on
    the template's end of turn."""
    import transformers as tf
    from test_convert import onevision_processor

    from anyres import image_layout, place_images

    root, checkpoints = llava_checkpoints
    for name, template in [("sp", "vicuna_v1"), ("llama3", "llama_3"), ("qwen2", "chatml")]:
        ckpt, tok, cfg = checkpoints[name] if kind == "llava" else checkpoint(root, name, kind)
        out = tmp_path / name
        convert.main(["to-hf", "--ckpt", str(ckpt), "--out", str(out), "--template", template, "--image-mode", "pad"])
        processor = onevision_processor(out) if kind == "llava_onevision" else tf.AutoProcessor.from_pretrained(out)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is at the top?"}]}]
        prompt = processor.tokenizer.apply_chat_template(messages, chat_template=(out / "chat_template.jinja").read_text(),
                                                         tokenize=False, add_generation_prompt=True)
        inputs = processor(text=prompt, images=image(), return_tensors="pt")
        ids = inputs.input_ids
        hf = getattr(tf, hf_config.HF_ARCHITECTURES[kind]).from_pretrained(out).eval()
        ours = load_model(out).eval()
        with torch.no_grad():
            expect = hf(**inputs).logits
            if kind == "llava":
                assert int((ids == cfg.image_token_id).sum()) == cfg.n_image_tokens, name
                mine = ours(ids, inputs.pixel_values)[0]
            else:
                layout = image_layout(cfg, IMAGE_SIZE[1], IMAGE_SIZE[0])
                assert int((ids == cfg.image_token_id).sum()) == len(layout[1]), name
                image_index, image_weight = place_images(ids[0], [layout], cfg)
                mine = ours(ids, inputs.pixel_values, image_index=image_index[None], image_weight=image_weight[None])[0]
        assert (mine - expect).abs().max() <= 1e-4, name
        stop = chat.stop_token_id(template, tok)
        generated = hf.generate(**inputs, max_new_tokens=6, do_sample=False,
                                logits_processor=tf.LogitsProcessorList([StopAt(ids.shape[1], 2, stop)]))
        assert generated.shape[1] == ids.shape[1] + 3 and generated[0, -1] == stop, name  # stopped there


def test_from_hf_carries_a_transformers5_save_pretrained_processor(llava_checkpoints, tmp_path):
    """AutoProcessor.save_pretrained (transformers 5 nests the image processor in processor_config.json and writes
    no preprocessor_config.json) -> from-hf -> to-hf keeps the template and the image mode, not vicuna_v1 and pad."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    root, checkpoints = llava_checkpoints
    ckpt, tok, cfg = checkpoints["llama3"]
    convert.main(["to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--template", "llama_3",
                  "--image-mode", "crop"])
    saved = tmp_path / "saved"
    AutoProcessor.from_pretrained(tmp_path / "hf").save_pretrained(saved)
    LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").save_pretrained(saved)
    assert not (saved / "preprocessor_config.json").exists()  # what this test is about
    convert.main(["from-hf", "--llava", str(saved), "--out", str(tmp_path / "ours")])
    convert.main(["to-hf", "--ckpt", str(tmp_path / "ours"), "--out", str(tmp_path / "back")])
    processor = AutoProcessor.from_pretrained(tmp_path / "back")
    assert not processor.image_processor.do_pad and processor.image_processor.do_center_crop  # crop, not pad
    messages = messages_of(CONVERSATIONS[1])
    theirs = processor(text=processor.apply_chat_template(messages), images=image(), return_tensors="pt")
    ids, _, _ = chat.encode_conversation(CONVERSATIONS[1], True, "llama_3", tok, 1024, cfg.image_token_id,
                                         cfg.n_image_tokens)
    assert theirs.input_ids[0].tolist() == ids
    shutil.rmtree(saved)


@pytest.mark.parametrize("name", ["sp", "qwen2"])
def test_tags_past_a_gap_in_the_ids_land_at_the_models_ids(llava_checkpoints, tmp_path, name):
    """An <image> (and <video>) id a few past the tokenizer's vocabulary: the tokenizers library numbers added
    tokens from the end of the vocabulary up, whatever ids the files write, so transformers had them at the wrong
    ids unless the ids in between are taken."""
    from transformers import AutoTokenizer

    import processor

    root, _ = llava_checkpoints
    shutil.copytree(root / name, tmp_path / "tok")
    tok = chat.Tokenizer(tmp_path / "tok")
    processor.export_tokenizer(tmp_path / "tok", tok.vocab_size + 5, tok.vocab_size + 7, "vicuna_v1")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert theirs.convert_tokens_to_ids([chat.IMAGE_TAG, processor.VIDEO_TAG]) == [tok.vocab_size + 5, tok.vocab_size + 7]
    assert theirs("a <image> b<video>").input_ids.count(tok.vocab_size + 5) == 1
