"""Where an image goes in the prompt: LLaVA records with the <image> tag before the question, after it, or absent
(one image or several, with a system turn or not) are packed, read back by the loader and rendered by every template;
the reference is transformers' apply_chat_template on the same conversation in the llava-hf form (the user turn's
content [{"type": "image"}, ..., {"type": "text"}]) with the chat template our exports ship (processor.py)."""

import io
import json

import pytest
from PIL import Image

import chat
import loader
import model_files
import pack
import processor

SYSTEM = "Answer in one word."
QUESTION, ANSWER, FOLLOW_UP, SECOND_ANSWER = "Is it raining?", "No.", "And the colour of the sky?", "Grey."
PLACEMENTS = {"before": lambda tags: tags + QUESTION, "after": lambda tags: f"{QUESTION} {tags}".rstrip(),
              "absent": lambda tags: QUESTION}


def record(system, placement, n_images):
    tags = "<image>\n" * n_images
    turns = [("human", PLACEMENTS[placement](tags)), ("gpt", ANSWER), ("human", FOLLOW_UP), ("gpt", SECOND_ANSWER)]
    conv = ([{"from": "system", "value": system}] if system else []) + [{"from": r, "value": v} for r, v in turns]
    images = [f"{i}.jpg" for i in range(n_images)]
    return {"id": f"{bool(system)}-{placement}-{n_images}", "image": images[0] if n_images == 1 else images,
            "conversations": conv}


CASES = [(system, placement, n) for system in (None, SYSTEM) for placement in PLACEMENTS for n in (1, 2)]


def hf_messages(system, placement, n_images):
    """The same conversation as transformers' multimodal chat messages. One tag after the question moves to the
    front of its turn (LLaVA's preprocess_multimodal), which is what the content list renders; several written tags
    stay where they are (LLaVA-NeXT's rule), so that message keeps its text as written."""
    if placement == "after" and n_images > 1:
        user = PLACEMENTS[placement]("<image>\n" * n_images)
    else:
        user = [{"type": "image"}] * n_images + [{"type": "text", "text": QUESTION}]
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": FOLLOW_UP}, {"role": "assistant", "content": SECOND_ANSWER}]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Every case packed by pack.py and read back by the loader: {case id: conversation as training reads it}."""
    d = tmp_path_factory.mktemp("tags")
    (d / "images").mkdir()
    for i, (w, h) in enumerate([(37, 23), (29, 41)]):
        Image.new("RGB", (w, h), (40 * i, 90, 200)).save(d / "images" / f"{i}.jpg")
    records = [record(*case) for case in CASES]
    (d / "d.json").write_text(json.dumps(records))
    skips = pack.pack(d / "d.json", d / "images", d / "shards", shard_size=100)
    from test_data import bpe_tokenizer

    tok = bpe_tokenizer(d)
    stream = loader.ShardStream(d / "shards", tok, 1, 256, 28, tok.vocab_size, 4, template="chatml")
    read = {}
    for i in range(len(stream)):
        _, conv, kind, blobs = stream.read_conversation(i)
        read[json.loads(stream.read(i)[1]["json"])["id"]] = (conv, stream.encode(i) if len(blobs) == 1 else None)
    return read, tok, skips


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))


@pytest.mark.parametrize("template", sorted(chat.TEMPLATES))
@pytest.mark.parametrize("system,placement,n_images", CASES)
def test_packed_image_lands_where_the_chat_template_puts_it(packed, hf_tokenizer, template, system, placement,
                                                            n_images):
    read, _, skips = packed
    key = record(system, placement, n_images)["id"]
    assert key in read, f"pack dropped it: {skips.summary()}"
    conv, _ = read[key]
    ours = "".join(t for t, _ in chat.render(template, conv))
    want = hf_tokenizer.apply_chat_template(hf_messages(system, placement, n_images), tokenize=False,
                                            chat_template=processor.chat_template(template))
    assert ours == want
    if template != "plain":  # plain shows no question and no system text
        assert ours.count(SYSTEM) == bool(system) and ours.index("<image>") > ours.find(SYSTEM)
        assert ours.index(QUESTION) - ours.index("<image>") <= len("<image>\n<image> ") * n_images or \
            placement == "after"


@pytest.mark.parametrize("system", [None, SYSTEM])
def test_loader_ids_put_the_image_tokens_in_the_first_user_turn(packed, system):
    """The loader's ids for an untagged image (chatml, a Qwen2-style BPE tokenizer) equal transformers' tokenizer on
    transformers' rendering, with the image's tokens in place of <image>."""
    from transformers import PreTrainedTokenizerFast

    read, tok, _ = packed
    _, (ids, _, _) = read[record(system, "absent", 1)["id"]]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok.path))
    text = hf.apply_chat_template(hf_messages(system, "absent", 1), tokenize=False,
                                  chat_template=processor.chat_template("chatml"))
    before, after = text.split("<image>")
    assert ids == hf(before, add_special_tokens=False).input_ids + [tok.vocab_size] * 4 + \
        hf(after, add_special_tokens=False).input_ids


def test_reader_moves_a_tag_old_shards_kept_in_the_system_turn(hf_tokenizer):
    """Shards packed before this fix hold an untagged image's tag in the system turn; the reader (loader, audit,
    train.py's evaluation) moves it to the first question. Foreign conversations with no tag get one there too."""
    buf = io.BytesIO()
    Image.new("RGB", (31, 17)).save(buf, "JPEG")
    old = [{"from": "system", "value": "<image>\n" + SYSTEM}, {"from": "human", "value": QUESTION},
           {"from": "gpt", "value": ANSWER}, {"from": "human", "value": FOLLOW_UP}, {"from": "gpt", "value": SECOND_ANSWER}]
    untagged = [dict(t, value=t["value"].replace("<image>\n", "")) for t in old]
    want = hf_tokenizer.apply_chat_template(hf_messages(SYSTEM, "absent", 1), tokenize=False,
                                            chat_template=processor.chat_template("chatml"))
    for conv in (old, untagged):
        members = {"jpg": buf.getvalue(), "json": json.dumps({"conversations": conv}).encode()}
        read, image = loader.sample_conversation(members)
        assert "".join(t for t, _ in chat.render("chatml", read)) == want and image == buf.getvalue()
    several = {"0.jpg": buf.getvalue(), "1.jpg": buf.getvalue(), "txt": b"Grey.", "json": b'{"question": "Sky?"}'}
    assert loader.sample_conversation(several)[0][0]["value"] == "<image>\n<image>\nSky?"


def test_sample_puts_one_image_before_the_question_wherever_the_prompt_has_its_tag(tmp_path, packed, monkeypatch,
                                                                                   hf_tokenizer):
    """sample.py adds the tag only to a prompt without one; a prompt holding it (before or after the question) gets
    the same single run of image tokens, the one transformers' generation prompt gives; two tags for one image is
    a one-line error."""
    import sample
    from model import build_model
    from model_config import vlm_preset

    _, tok, _ = packed
    cfg = vlm_preset("debug").with_overrides({"image_token_id": tok.vocab_size,
                                              "llm": {"vocab_size": -(-(tok.vocab_size + 1) // 64) * 64}})
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "ckpt", tokenizer_dir=tok.path.parent)
    Image.new("RGB", (45, 31), (200, 30, 60)).save(tmp_path / "a.jpg")
    seen = []
    monkeypatch.setattr(sample, "answer", lambda args, model, template, tok, ids, mask, pixels, extra:
                        seen.append(ids[0].tolist()))
    common = ["--ckpt", str(tmp_path / "ckpt"), "--image", str(tmp_path / "a.jpg"), "--template", "chatml",
              "--device", "cpu"]
    for prompt in (QUESTION, f"<image>\n{QUESTION}", f"{QUESTION} <image>"):
        sample.main(common + ["--prompt", prompt])
    text = hf_tokenizer.apply_chat_template(hf_messages(None, "absent", 1)[:1], tokenize=False, add_generation_prompt=True,
                                            chat_template=processor.chat_template("chatml"))
    before, after = text.split("<image>")
    want = tok.encode(before) + [cfg.image_token_id] * cfg.n_image_tokens + tok.encode(after)
    assert seen == [want] * 3
    with pytest.raises(SystemExit, match="has 2 <image> tags for 1 image"):
        sample.main(common + ["--prompt", "<image> <image> Which?"])
