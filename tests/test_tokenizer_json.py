"""The tokenizer.json an export writes beside a sentencepiece tokenizer.model: loaded by transformers with the model
file gone, it gives training's ids (chat.Tokenizer, the template encoder) on odd text and on every template, for
both legacy settings; loading it converts nothing, so it works where transformers' slow->fast conversion fails
(protobuf 6); a tokenizer whose fast and slow ids cannot agree is refused. References: transformers' AutoTokenizer
and apply_chat_template, sentencepiece's own encode, transformers' LlamaTokenizer built from tokenizer.model."""

import importlib
import json
import shutil
import subprocess
import sys

import pytest
from test_templates import CORPUS

import chat
import processor
from shapes import train_tokenizer

# name -> how the model is trained: LLaMA-2's recipe (BPE, byte fallback, digits split, no normalisation), the
# demo's (unigram over NFKC with extra whitespace removed, chat markers as user-defined pieces), and a BPE with no
# dummy prefix and no byte fallback (unknown characters), at three sizes
RECIPES = {
    "bpe": dict(model_type="bpe", vocab_size=420, byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
                remove_extra_whitespaces=False, normalization_rule_name="identity", character_coverage=1.0),
    "unigram": None,  # shapes.train_tokenizer
    "no-prefix": dict(model_type="bpe", vocab_size=380, add_dummy_prefix=False, character_coverage=0.98),
}
TEXTS = ["Describe the image.", " one space before", "  two spaces before", "after ", "after   three",
         "in  between   runs", "line\nbreak", "\nnewline first", "\n\n\nthree newlines", "ends in newlines\n\n",
         " \n mixed \n ", "tab\tseparated", "Numbers 1234567 and 2.718 and -42", "déjà vu, naïve, Ångström, e\u0301",
         "CJK 你好，世界 こんにちは 한국어", "emoji 🐈‍⬛🎉 👩🏽‍💻", "non\u00a0breaking and ideographic\u3000space",
         "ﬁﬂ ① ｗｉｄｅ", "MiXeD CaSe?!", " ", "   "]
UNSEEN = ("emoji", "ﬁﬂ")  # texts the models never saw in training: byte fallback, or unknown pieces
# a conversation whose turns meet as LLaVA's data has them (no space at either end of a message)
CONVERSATION = [{"from": "human", "value": "What is in this picture?\n<image>"},
                {"from": "gpt", "value": "A cat, 3 dogs and 12 birds.\n\nThat's all  🐦"},
                {"from": "human", "value": "Où sont-ils ? Et les 2 autres…"}, {"from": "gpt", "value": "在公园里。"}]


def train(root, recipe):
    import sentencepiece as spm

    root.mkdir()
    corpus = CORPUS + [text for text in TEXTS if not text.startswith(UNSEEN)]
    if RECIPES[recipe] is None:
        train_tokenizer(corpus, root / "tokenizer", 520)
    else:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_prefix=str(root / "tokenizer"),
                                       unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
                                       **RECIPES[recipe])
    (root / "tokenizer.vocab").unlink()
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    return {recipe: train(root / recipe, recipe) for recipe in RECIPES}


def export(models, recipe, legacy, out, template="vicuna_v1"):
    """The tokenizer files to-hf writes for a model whose <image> and <video> sit two past the vocabulary."""
    shutil.copytree(models[recipe], out)
    if legacy is not None:
        (out / "tokenizer_config.json").write_text(json.dumps({"legacy": legacy}))
    tok = chat.Tokenizer(out)
    exported = processor.export_tokenizer(out, tok.vocab_size + 2, tok.vocab_size + 3, template)
    return tok, exported


def without_model(directory):
    (directory / "tokenizer.model").unlink()
    return directory


@pytest.mark.parametrize("recipe,legacy", [("bpe", True), ("bpe", False), ("unigram", True), ("unigram", False),
                                           ("no-prefix", True)])  # no-prefix, legacy=False: refused (below)
def test_tokenizer_json_alone_gives_trainings_ids_on_odd_text(models, tmp_path, recipe, legacy):
    """Spaces at either end and in runs, newlines, digits, accents, CJK, emoji, alone and around each special token:
    the fast tokenizer from tokenizer.json, tokenizer.model removed, gives chat.Tokenizer's ids (the BOS prepended),
    and decodes ids to sentencepiece's text."""
    from transformers import AutoTokenizer

    tok, _ = export(models, recipe, legacy, tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(without_model(tmp_path / "tok"))
    assert hf.is_fast and hf.convert_tokens_to_ids(["<image>", "<video>"]) == [tok.vocab_size + 2, tok.vocab_size + 3]
    for text in TEXTS + [a + special + b for special in tok.specials for a, b in zip(TEXTS, TEXTS[3:])]:
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text), text
        assert hf(text).input_ids == [tok.bos_id] + tok.encode(text), text
    if recipe != "no-prefix":  # answers read back as sample.py prints them (sentencepiece writes an unknown as " ⁇ ")
        for text in TEXTS + ["A cat.</s>", "Two.</s> Three"]:
            assert hf.decode(tok.encode(text), skip_special_tokens=True) == tok.decode(tok.encode(text)), text
    if legacy and recipe != "no-prefix":  # text that starts with sentencepiece's own space mark (under legacy=False
        # tokenizer.json gives one "▁" where training gives two: its normalizer cannot tell a chunk's place)
        assert hf("\u2581mark", add_special_tokens=False).input_ids == tok.encode("\u2581mark")


# training tokenizes an answer apart from the "\n" before it; under NFKC that newline is a space in the joined prompt,
# so the answer's first word gains a "▁" there (whatever the tokenizer files: the rendered string differs)
JOINED_DIFFERS = pytest.mark.xfail(strict=True, reason="NFKC turns the newline before an answer into a space")
TEMPLATE_CASES = [pytest.param(recipe, legacy, template, marks=[JOINED_DIFFERS] * (
                      recipe == "unigram" and (template in ("chatml", "qwen2_5", "smollm2", "smollm3", "qwen3",
                                                            "qwen3_instruct", "gemma3") or
                                               (template == "llama_3" and not legacy))))
                  for recipe, templates in [("bpe", ["plain", "vicuna_v1", "llama_2"]), ("unigram", list(chat.TEMPLATES))]
                  for legacy in (True, False) for template in templates]


@pytest.mark.parametrize("recipe,legacy,template", TEMPLATE_CASES)
def test_tokenizer_json_alone_gives_trainings_ids_on_every_template(models, tmp_path, recipe, legacy, template):
    """transformers' apply_chat_template on the exported chat template, the image first in the first turn, then the
    fast tokenizer from tokenizer.json (tokenizer.model removed): training's ids for the conversation, and sample.py's
    for the generation prompt, with the image tag at the model's id."""
    from transformers import AutoTokenizer

    tok, exported = export(models, recipe, legacy, tmp_path / "tok", template)
    hf = AutoTokenizer.from_pretrained(without_model(tmp_path / "tok"))
    jinja = processor.chat_template(template, **processor.template_strings(exported))
    image_id = tok.vocab_size + 2
    for conv in [CONVERSATION[:2]] if template == "plain" else [CONVERSATION, CONVERSATION[:1]]:
        messages = [{"role": {"human": "user", "gpt": "assistant"}[turn["from"]],
                     "content": [{"type": "text", "text": turn["value"]}]} for turn in conv]
        messages[0]["content"] = [{"type": "image"}, {"type": "text", "text": conv[0]["value"].replace("<image>", "")}]
        prompt = len(conv) == 1
        rendered = hf.apply_chat_template(messages, chat_template=jinja, tokenize=False, add_generation_prompt=prompt)
        if prompt:  # sample.py's prompt
            ids, _ = chat.tokenize([(chat.generation_prompt(template, conv[0]["value"], tok), False)], tok, image_id, 1)
        else:
            ids, _, _ = chat.encode_conversation(conv, True, template, tok, 4096, image_id, 1)
        assert hf(rendered).input_ids == ids, rendered


@pytest.mark.parametrize("recipe", ["bpe", "unigram"])
def test_tokenizer_json_agrees_with_sentencepiece_and_transformers_own_conversion(models, tmp_path, recipe):
    """References nobody here wrote: sentencepiece's own encode on text that starts a prompt (no special token, no
    leading space, where chat.Tokenizer is sentencepiece itself), and for the BPE model transformers' LlamaTokenizer
    built from tokenizer.model on load (what exports held before), for both legacy settings; they differ only where
    training does (a chunk that is a lone space)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(models[recipe] / "tokenizer.model"))
    for legacy in (True, False):
        tok, _ = export(models, recipe, legacy, tmp_path / f"legacy-{legacy}")
        hf = AutoTokenizer.from_pretrained(without_model(tmp_path / f"legacy-{legacy}"))
        for text in [t for t in TEXTS if not t.startswith(" ")]:
            assert hf(text, add_special_tokens=False).input_ids == sp.encode(text), (legacy, text)
        if recipe == "bpe":
            (tmp_path / "slow").mkdir(exist_ok=True)
            shutil.copy(models[recipe] / "tokenizer.model", tmp_path / "slow")
            (tmp_path / "slow/tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "LlamaTokenizer", "legacy": legacy, "bos_token": "<s>", "eos_token": "</s>",
                 "unk_token": "<unk>", "add_bos_token": True}))
            slow = AutoTokenizer.from_pretrained(tmp_path / "slow")
            for text in TEXTS + [a + "</s>" + b for a, b in zip(TEXTS, TEXTS[1:])]:
                if " " in text.split("</s>"):  # a chunk that is one space: LlamaTokenizer writes "▁", training nothing
                    assert hf(text).input_ids == [tok.bos_id] + tok.encode(text) != slow(text).input_ids, text
                else:
                    assert hf(text).input_ids == slow(text).input_ids, (legacy, text)


def block_conversion(monkeypatch):
    """transformers' slow->fast conversion raises, as under protobuf 6: its sentencepiece route, the protobuf import,
    and the TikToken fallback that then misreads tokenizer.model."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    # the module itself: transformers' package attribute of that name becomes the function once it has been used
    conversion = importlib.import_module("transformers.convert_slow_tokenizer")

    def incompatible(*args, **kwargs):
        raise TypeError("Detected incompatible Protobuf Gencode/Runtime versions when loading sentencepiece_model.proto")

    for owner, name in [(conversion, "import_protobuf"), (conversion, "convert_slow_tokenizer"),
                        (conversion.SentencePieceExtractor, "__init__"), (conversion.SpmConverter, "__init__"),
                        (TokenizersBackend, "_convert_from_sentencepiece"), (TokenizersBackend, "_convert_from_tiktoken")]:
        monkeypatch.setattr(owner, name, incompatible)


def test_a_load_that_cannot_convert_never_converts(models, tmp_path, monkeypatch):
    """With the conversion raising, the export (tokenizer.model still beside tokenizer.json) loads all the same and
    gives training's ids; a directory with tokenizer.model alone does not load (the patch bites)."""
    from transformers import AutoTokenizer

    tok, _ = export(models, "unigram", None, tmp_path / "export", template="llama_3")
    block_conversion(monkeypatch)
    hf = AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "<|start_header_id|>user<|end_header_id|>\n\n Where is the  red circle?<|eot_id|>"
    assert hf(text).input_ids == [tok.bos_id] + tok.encode(text)
    shutil.copytree(tmp_path / "export", tmp_path / "model-only")
    (tmp_path / "model-only/tokenizer.json").unlink()
    with pytest.raises(Exception, match="incompatible Protobuf"):
        AutoTokenizer.from_pretrained(tmp_path / "model-only")


NO_CONVERTERS = """import json, sys
for name in ("sentencepiece", "google", "google.protobuf", "tiktoken"):
    sys.modules[name] = None  # cannot be imported
from transformers import AutoTokenizer
try:
    AutoTokenizer.from_pretrained(sys.argv[2])
    model_only = "loaded"
except Exception as e:
    model_only = type(e).__name__
print(json.dumps([AutoTokenizer.from_pretrained(sys.argv[1])(sys.argv[3]).input_ids, model_only]))
"""


def test_the_export_loads_where_sentencepiece_protobuf_and_tiktoken_cannot_be_imported(models, tmp_path):
    """A fresh interpreter in which none of the converters' libraries imports: the export opens in AutoTokenizer
    with training's ids, where tokenizer.model alone cannot be opened."""
    tok, _ = export(models, "bpe", False, tmp_path / "export")
    (tmp_path / "model-only").mkdir()
    shutil.copy(tmp_path / "export/tokenizer.model", tmp_path / "model-only")
    text = "USER: Où est le chat ?</s>ASSISTANT:  sous la table, 2 fois\n"
    run = subprocess.run([sys.executable, "-c", NO_CONVERTERS, str(tmp_path / "export"), str(tmp_path / "model-only"),
                          text], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ids, model_only = json.loads(run.stdout.splitlines()[-1])
    assert ids == [tok.bos_id] + tok.encode(text) and model_only != "loaded"


def test_carried_through_from_hf_the_export_is_written_again_alike(models, tmp_path):
    """to-hf, then from-hf (which carries every tokenizer file into our checkpoint), then to-hf again: training still
    reads tokenizer.model with the same legacy flag, and the second tokenizer.json is the first."""
    from model_files import copy_tokenizer

    tok, _ = export(models, "bpe", False, tmp_path / "first")
    first = (tmp_path / "first/tokenizer.json").read_text()
    (tmp_path / "again").mkdir()
    copy_tokenizer(tmp_path / "first", tmp_path / "again")
    carried = chat.Tokenizer(tmp_path / "again")
    assert carried.sp is not None and carried.legacy is False
    assert all(carried.encode(text) == tok.encode(text) for text in TEXTS)
    processor.export_tokenizer(tmp_path / "again", tok.vocab_size + 2, tok.vocab_size + 3, "vicuna_v1")
    assert (tmp_path / "again/tokenizer.json").read_text() == first


def test_a_tokenizer_whose_fast_and_slow_ids_disagree_is_refused(models, tmp_path):
    """A model with no dummy prefix over NFKC, under legacy=False: after a special token training encodes "\\n..." as
    " ..." (the newline folded into a space it keeps), at the start of the text as "..." (stripped); one tokenizer.json
    cannot do both, so to-hf refuses in one sentence naming the checkpoint's tokenizer.model, and writes nothing."""
    import convert
    from model import build_model
    from model_config import vlm_preset
    from model_files import save_model

    shutil.copytree(models["no-prefix"], tmp_path / "tok")
    (tmp_path / "tok/tokenizer_config.json").write_text(json.dumps({"legacy": False}))
    tok = chat.Tokenizer(tmp_path / "tok")
    cfg = vlm_preset("debug").with_overrides({"image_token_id": tok.vocab_size, "llm": {"vocab_size": 448}})
    save_model(build_model(cfg, seed=0), tmp_path / "ckpt", tokenizer_dir=tmp_path / "tok")
    with pytest.raises(SystemExit) as refused:
        convert.main(["to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--template", "llama_2",
                      "--image-mode", "pad"])
    message = str(refused.value.code)
    assert message.startswith(f"convert: error: {tmp_path / 'ckpt/tokenizer.model'}: ") and message.endswith("disagree")
    assert "\n" not in message and not (tmp_path / "hf").exists()
