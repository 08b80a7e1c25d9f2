"""Prompt text and labels against references nobody here wrote: transformers' apply_chat_template with the
published jinja templates, transformers' LlamaTokenizer (legacy True/False), and a re-statement of
haotian-liu/LLaVA's preprocess_multimodal / preprocess_v1 / preprocess_plain (llava/train/train.py,
llava/conversation.py, llava/mm_utils.py tokenizer_image_token) run with transformers tokenizers."""

import json

import pytest

import chat

# -----------------------------------------------------------------------------
# three tokenizer families, built here: nothing downloads

CORPUS = ["A chat between a curious user and an artificial intelligence assistant. USER: What is in the image? "
          "ASSISTANT: A black cat sits on a red sofa.", "Describe the scene in detail.\nThere are two dogs.",
          "[INST] <<SYS>> You are a helpful language and vision assistant. <</SYS>> [/INST] What color? Black.",
          "user assistant system Answer briefly. Where is it? On the left, next to 3 cups."] * 30


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A LLaMA-style sentencepiece model (BPE, byte fallback, dummy prefix, no whitespace folding)."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_prefix=str(d / "tokenizer"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, remove_extra_whitespaces=False,
                                   normalization_rule_name="identity", character_coverage=1.0, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    return d


def hf_llama(sp_dir, legacy):
    """transformers' own LlamaTokenizer built from the sentencepiece model, with tokenizer_config's legacy flag."""
    from transformers import AutoTokenizer

    (sp_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "legacy": legacy, "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>", "add_bos_token": True}))
    return AutoTokenizer.from_pretrained(sp_dir), chat.Tokenizer(sp_dir / "tokenizer.model")


def bpe_dir(tmp_path, specials, bos=None):
    """A byte-level BPE tokenizer.json shaped like Llama-3 (bos=<|begin_of_text|> prepended) or Qwen2 (no BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tmp_path.mkdir(exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def hf_fast(d, **special):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), **special)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    d = bpe_dir(tmp_path_factory.mktemp("llama3"), LLAMA3_SPECIALS, bos="<|begin_of_text|>")
    return hf_fast(d, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), chat.Tokenizer(d)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    d = bpe_dir(tmp_path_factory.mktemp("qwen2"), QWEN2_SPECIALS)
    return hf_fast(d, eos_token="<|im_end|>", pad_token="<|endoftext|>"), chat.Tokenizer(d)


# conversations as they occur in llava_v1_5_mix665k and ShareGPT-style data: the image after the question,
# leading/trailing spaces and newlines, several turns, text-only
CONVERSATIONS = [
    [("human", "What is shown in this image?\n<image>"), ("gpt", "A black cat sits on a red sofa.")],
    [("human", "<image>\nDescribe the scene in detail. "), ("gpt", " There are two dogs.\n"),
     ("human", "\nWhat color is the sofa?"), ("gpt", "Red.  "), ("human", "Where is it?"), ("gpt", "On the left.")],
    [("human", "  Answer briefly.\n\nWhere is it? <image>  "), ("gpt", "\nOn the left, next to 3 cups.\n")],
    [("human", "Describe the scene in detail."), ("gpt", "There are two dogs."), ("human", " What color? "),
     ("gpt", "Black.")],
]


def as_conv(turns):
    return [{"from": r, "value": v} for r, v in turns]


def as_messages(turns, system=None):
    return ([{"role": "system", "content": system}] if system else []) + \
           [{"role": {"human": "user", "gpt": "assistant"}[r], "content": v} for r, v in turns]


# -----------------------------------------------------------------------------
# haotian-liu/LLaVA, re-stated (train.py preprocess_multimodal / preprocess_plain / preprocess_v1, mm_utils.py
# tokenizer_image_token, conversation.py conv_vicuna_v1 and conv_llava_llama_2 get_prompt)

IGNORE, IMAGE = -100, -200


def llava_multimodal(turns):
    out = []
    for role, value in turns:
        if "<image>" in value:
            value = ("<image>\n" + value.replace("<image>", "").strip()).strip()
        out.append((role, value))
    return out


def llava_image_tokens(prompt, tokenizer):
    chunks = [tokenizer(chunk).input_ids for chunk in prompt.split("<image>")]
    ids, offset = [], 0
    if chunks and chunks[0] and chunks[0][0] == tokenizer.bos_token_id:
        offset = 1
        ids.append(chunks[0][0])
    for i, chunk in enumerate(chunks):
        if i:
            ids += ([IMAGE] * (offset + 1))[offset:]  # the separator is sliced like the chunks
        ids += chunk[offset:]
    return ids


def llava_plain(turns, tokenizer):
    prompt = "<image>" + turns[1][1] + "\n"
    ids = llava_image_tokens(prompt, tokenizer)
    labels = list(ids)
    n = len(llava_image_tokens("<image>", tokenizer))
    return ids, [IGNORE] * n + labels[n:]


def llava_vicuna_prompt(turns):
    out = chat.VICUNA_SYSTEM + " "
    for i, (role, value) in enumerate(turns):
        out += {"human": "USER", "gpt": "ASSISTANT"}[role] + ": " + value + (" " if i % 2 == 0 else "</s>")
    return out


def llava_v1(turns, tokenizer, has_image):
    prompt = llava_vicuna_prompt(turns)
    tok = (lambda s: llava_image_tokens(s, tokenizer)) if has_image else (lambda s: tokenizer(s).input_ids)
    ids = tok(prompt)
    labels, cur = list(ids), 1
    labels[:1] = [IGNORE]
    for i, rou in enumerate(prompt.split("</s>")):
        if rou == "":
            break
        parts = rou.split(" ASSISTANT: ")
        if len(parts) != 2:
            break
        parts[0] += " ASSISTANT: "
        round_len, instruction_len = len(tok(rou)), len(tok(parts[0])) - 2
        if i != 0 and not tokenizer.legacy:  # LLaVA's correction for tokenizers >= 0.14
            round_len, instruction_len = round_len - 1, instruction_len - 1
        labels[cur : cur + instruction_len] = [IGNORE] * instruction_len
        cur += round_len
    labels[cur:] = [IGNORE] * (len(labels) - cur)
    assert cur == len(ids), "LLaVA itself reports a tokenization mismatch here"
    return ids, labels


def llava_llama_2_prompt(turns):
    out = ""
    for i, (_, value) in enumerate(turns):
        if i == 0:
            value = f"<<SYS>>\n{chat.LLAMA2_SYSTEM}\n<</SYS>>\n\n" + value
        out += f"<s>[INST] {value} [/INST]" if i % 2 == 0 else f" {value} </s>"
    return out.lstrip("<s>")


# -----------------------------------------------------------------------------
# <image> moves to the front of its turn; vicuna_v1 and plain give LLaVA's ids and labels


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("n", range(len(CONVERSATIONS)))
def test_vicuna_v1_ids_and_labels_equal_llavas_preprocess_v1(sp_dir, legacy, n):
    hf, tok = hf_llama(sp_dir, legacy)
    turns = llava_multimodal(CONVERSATIONS[n])
    has_image = any("<image>" in v for _, v in turns)
    ids, labels, _ = chat.encode_conversation(as_conv(CONVERSATIONS[n]), has_image, "vicuna_v1", tok, 4096, IMAGE, 1)
    want_ids, want_labels = llava_v1(turns, hf, has_image)
    assert ids == want_ids
    assert labels == want_labels
    assert "".join(t for t, _ in chat.render("vicuna_v1", as_conv(CONVERSATIONS[n]), tok)) == \
        "<s>" + llava_vicuna_prompt(turns)


@pytest.mark.parametrize("family", ["sentencepiece", "llama3", "qwen2"])
@pytest.mark.parametrize("n", [0, 2])
def test_plain_uses_the_tokenizers_own_bos_like_llavas_preprocess_plain(sp_dir, llama3, qwen2, family, n):
    hf, tok = {"sentencepiece": hf_llama(sp_dir, False), "llama3": llama3, "qwen2": qwen2}[family]
    turns = llava_multimodal(CONVERSATIONS[n])
    ids, labels, _ = chat.encode_conversation(as_conv(CONVERSATIONS[n]), True, "plain", tok, 4096, IMAGE, 1)
    assert (ids, labels) == llava_plain(turns, hf)
    assert "<s>" not in tok.decode([i for i in ids if i >= 0]) or family == "sentencepiece"


def test_image_moves_to_the_front_of_its_turn():
    c = as_conv(CONVERSATIONS[0])
    assert "".join(t for t, _ in chat.render("vicuna_v1", c)).endswith(
        " USER: <image>\nWhat is shown in this image? ASSISTANT: A black cat sits on a red sofa.</s>")
    assert chat.image_first("  <image>  ") == "<image>" and chat.image_first("a <image> b") == "<image>\na  b"


def test_llama_2_string_equals_llavas_conversation_for_stripped_messages(sp_dir):
    _, tok = hf_llama(sp_dir, True)
    for turns in CONVERSATIONS:
        turns = [(r, v.strip()) for r, v in llava_multimodal(turns)]  # LLaVA's llama_2 does not strip; Meta's does
        ours = "".join(t for t, _ in chat.render("llama_2", as_conv(turns), tok))
        assert ours == "<s>" + llava_llama_2_prompt(turns)


# -----------------------------------------------------------------------------
# the published jinja chat templates, rendered and tokenized by transformers

LLAMA3_JINJA = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Llama-3.1-Instruct's, reduced to its no-tools path (the tool branches are not reached without tools)
LLAMA31_JINJA = ("{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = \"26 Jul 2024\" %}"
                 "{%- endif %}{%- if messages[0]['role'] == 'system' %}"
                 "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
                 "{%- else %}{%- set system_message = \"\" %}{%- endif %}"
                 "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
                 "{{- \"Cutting Knowledge Date: December 2023\\n\" }}{{- \"Today Date: \" + date_string + \"\\n\\n\" }}"
                 "{{- system_message }}{{- \"<|eot_id|>\" }}{%- for message in messages %}"
                 "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
                 " + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
                 "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLAMA2_JINJA = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
                "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
                "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
                "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
                "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
                "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
                "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
QWEN2_JINJA = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
               "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
               "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEM = " You are a helpful language and vision assistant.\n"
DATED = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"

CASES = [("llama_3", LLAMA3_JINJA, "llama3", None), ("llama_3", LLAMA3_JINJA, "llama3", SYSTEM),
         ("llama_3", LLAMA31_JINJA, "llama3", SYSTEM), ("chatml", QWEN2_JINJA, "qwen2", None),
         ("chatml", QWEN2_JINJA, "qwen2", SYSTEM), ("llama_2", LLAMA2_JINJA, "sentencepiece", SYSTEM)]


@pytest.mark.parametrize("template,jinja,family,system", CASES)
def test_template_equals_published_jinja_in_text_and_ids(sp_dir, llama3, qwen2, template, jinja, family, system):
    hf, tok = {"sentencepiece": hf_llama(sp_dir, True), "llama3": llama3, "qwen2": qwen2}[family]
    for turns in CONVERSATIONS:
        turns = llava_multimodal(turns)  # LLaVA's data pipeline moves <image> first for every template
        want = hf.apply_chat_template(as_messages(turns, system), chat_template=jinja, tokenize=False)
        our_system = DATED + system.strip() if jinja is LLAMA31_JINJA else system
        pieces = chat.render(template, as_conv(turns), tok, system=our_system)
        assert "".join(t for t, _ in pieces) == want
        text_only = [(r, v.replace("<image>", "")) for r, v in turns]
        want_ids = hf(hf.apply_chat_template(as_messages(text_only, system), chat_template=jinja, tokenize=False),
                      add_special_tokens=False).input_ids
        ids, labels = chat.tokenize(chat.render(template, as_conv(text_only), tok, system=our_system), tok, -1, 0)
        assert ids == want_ids
        answers = [v.strip() if template != "chatml" else v for r, v in text_only if r == "gpt"]
        end = {"llama_3": "<|eot_id|>", "chatml": "<|im_end|>", "llama_2": tok.eos}[template]
        supervised = [i for i in labels if i != -100]
        assert supervised.count(tok.specials[end]) == len(answers)  # each turn's end is trained: the model stops
        assert tok.decode([i for i in supervised if i != tok.specials[end]]).replace(" ", "") == \
            "".join(answers).replace(" ", "")


# -----------------------------------------------------------------------------
# the tokenizer wrapper: BOS/EOS, sentencepiece legacy, templates that a tokenizer cannot write


@pytest.mark.parametrize("legacy", [True, False])
def test_sentencepiece_wrapper_equals_llama_tokenizer_for_both_legacy_settings(sp_dir, legacy):
    hf, tok = hf_llama(sp_dir, legacy)
    assert tok.legacy is legacy  # read from tokenizer_config.json
    texts = ["Hello world", " Hello", "<s>What color?</s> USER: Black.\nOk", "</s>USER: x", "\nWhat is it?",
             "a  b ", "USER: <image>", "Red.</s></s>Done  "]
    for text in texts:
        assert tok.encode(text) == hf(text, add_special_tokens=False).input_ids, text
    if not legacy:  # the difference the flag makes: no "▁" after a special token
        assert tok.encode("</s>USER") != chat.Tokenizer(sp_dir / "tokenizer.model", legacy=True).encode("</s>USER")


def test_bos_and_eos_are_the_tokenizers_own(sp_dir, llama3, qwen2):
    assert (hf_llama(sp_dir, True)[1].bos, hf_llama(sp_dir, True)[1].eos) == ("<s>", "</s>")
    assert llama3[1].bos == "<|begin_of_text|>" and llama3[1].bos_id == llama3[0].bos_token_id
    assert qwen2[1].bos is None and qwen2[1].bos_id == -1 and qwen2[1].eos == "<|im_end|>"
    assert chat.generation_prompt("plain", "<image>\nWhat?", qwen2[1]) == "<image>"


def test_a_template_the_tokenizer_cannot_write_is_refused(sp_dir, qwen2):
    _, tok = hf_llama(sp_dir, True)
    with pytest.raises(ValueError, match=r"template 'chatml' needs <\|im_start\|>, <\|im_end\|>"):
        chat.check_template("chatml", tok)
    with pytest.raises(ValueError, match="'llama_3' needs <.start_header_id.>"):
        chat.check_template("llama_3", qwen2[1])
    chat.check_template("chatml", qwen2[1])
