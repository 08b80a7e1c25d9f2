"""Prompt text and labels against references nobody here wrote: transformers' apply_chat_template with the
published jinja templates, transformers' LlamaTokenizer (legacy True/False), and a re-statement of
haotian-liu/LLaVA's preprocess_multimodal / preprocess_v1 / preprocess_plain (llava/train/train.py,
llava/conversation.py, llava/mm_utils.py tokenizer_image_token) run with transformers tokenizers."""

import json
import re

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


# text where Qwen3's and Gemma's templates put a label boundary, after "\n\n" (the empty think block) and after
# "model\n", so that the tokenizers learn merges there and a boundary in the wrong place changes the ids
CHAT_CORPUS = CORPUS + ["user\nmodel\nThe user asks about the image\n\nA black cat\n\n\nTwo dogs, left.\n\n"] * 30
# Qwen2's split regex, which Qwen2.5 and Qwen3 ship: "\n\n" stays one piece before a word, where GPT-2's splits it
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tokenizer.json laid out as Qwen3's (NFC, Qwen's split then byte-level BPE, <think> and </think> added but not
    special) and its published tokenizer_config.json, which transformers reads as Qwen2Tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("qwen3")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CHAT_CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=QWEN2_SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "errors": "replace", "split_special_tokens": False}))
    return AutoTokenizer.from_pretrained(d), chat.Tokenizer(d)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A sentencepiece model laid out as Gemma 3's (BPE, byte fallback, no dummy prefix, whitespace kept, <pad> <eos>
    <bos> <unk> at 0-3, the turn markers user-defined pieces): transformers converts it as GemmaTokenizer, chat.Tokenizer
    reads it with sentencepiece, as it reads the tokenizer.model a Gemma 3 checkpoint ships."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("gemma3")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CHAT_CORPUS), model_prefix=str(d / "tokenizer"), vocab_size=420,
                                   model_type="bpe", byte_fallback=True, add_dummy_prefix=False,
                                   remove_extra_whitespaces=False, normalization_rule_name="identity",
                                   allow_whitespace_only_pieces=True, split_digits=True, character_coverage=1.0,
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                                   bos_piece="<bos>", unk_piece="<unk>",
                                   user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], num_threads=1, minloglevel=2)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
         "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "spaces_between_special_tokens": False}))
    return AutoTokenizer.from_pretrained(d), chat.Tokenizer(d / "tokenizer.model")


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
# Qwen3-0.6B's and Qwen3-1.7B's tokenizer_config.json chat_template (the hybrid-thinking release; the 2507 models
# ship others), verbatim, tools branches included
QWEN3_JINJA = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501
# google/gemma-3-*-it's chat_template, verbatim: its newlines inside quotes are real ones, as the JSON decodes them
GEMMA3_JINJA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}"""  # noqa: E501
SYSTEM = " You are a helpful language and vision assistant.\n"
DATED = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"

CASES = [("llama_3", LLAMA3_JINJA, "llama3", None), ("llama_3", LLAMA3_JINJA, "llama3", SYSTEM),
         ("llama_3", LLAMA31_JINJA, "llama3", SYSTEM), ("chatml", QWEN2_JINJA, "qwen2", None),
         ("chatml", QWEN2_JINJA, "qwen2", SYSTEM), ("llama_2", LLAMA2_JINJA, "sentencepiece", SYSTEM),
         ("qwen3", QWEN3_JINJA, "qwen3", None), ("qwen3", QWEN3_JINJA, "qwen3", SYSTEM),
         ("gemma3", GEMMA3_JINJA, "gemma3", None), ("gemma3", GEMMA3_JINJA, "gemma3", SYSTEM)]
# Qwen3 answers with reasoning, as distilled data writes them: in an earlier turn (the jinja cuts it) and in the last
# (kept), an empty block, newlines around the reasoning and after </think>, a </think> without its <think>; two answers
# after the last question (the first keeps its reasoning too), a tool's response (not a question), no question at all
THINKING = [
    [("human", "<image>\nWhat is it?"), ("gpt", "<think>\nA cat on a sofa.\n</think>\n\nA black cat.")],
    [("human", "Describe it.\n<image>"), ("gpt", "<think>\n\nTwo dogs, left.\n\n</think>\n\n\nThere are two dogs."),
     ("human", "What color?"), ("gpt", "<think>\n\n</think>\n\nBlack.")],
    [("human", "Where is it?"), ("gpt", "It is here.</think>\n\nOn the left."), ("human", "<image>\nAnd now?"),
     ("gpt", "<think>\nLook right.\n</think>\nOn the right.  ")],
    [("human", "<image>\nCount the cups."), ("gpt", "<think>\nOne, two, three.\n</think>\n\n3 cups."), ("human", "Sure?"),
     ("gpt", " Yes.")],
    [("human", "<image>\nWhat is it?"), ("gpt", "<think>\nA cat.\n</think>\n\nA cat."),
     ("gpt", "<think>\nIt is black.\n</think>\n\nBlack.")],
    [("human", "How many cups?"), ("gpt", "<think>\nCount them.\n</think>\n\nLet me count."),
     ("human", "<tool_response>\n3\n</tool_response>"), ("gpt", "3 cups.")],
    [("gpt", "<think>\nGreet.\n</think>\n\nHello.")],
]
EMPTY_THINK = "<think>\n\n</think>\n\n"


def qwen3_answers(rendered):
    """Each assistant turn of Qwen3's rendering with its <|im_end|>, less an empty think block: what training supervises."""
    return [a.removeprefix(EMPTY_THINK) for a in re.findall(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", rendered, re.S)]


def runs(ids, labels):
    """The supervised stretches of a tokenized conversation, each a list of ids."""
    out, previous = [], -100
    for token, label in zip(ids, labels):
        if label != -100:
            if previous == -100:
                out.append([])
            out[-1].append(token)
        previous = label
    return out


def questions(turns):
    return sum(r == "human" for r, _ in turns)


@pytest.mark.parametrize("template,jinja,family,system", CASES)
def test_template_equals_published_jinja_in_text_and_ids(sp_dir, llama3, qwen2, qwen3, gemma3, template, jinja, family,
                                                         system):
    hf, tok = {"sentencepiece": hf_llama(sp_dir, True), "llama3": llama3, "qwen2": qwen2, "qwen3": qwen3,
               "gemma3": gemma3}[family]
    for turns in CONVERSATIONS + (THINKING if template == "qwen3" else []):
        if template == "qwen3" and questions(turns) != 1:  # earlier answers differ by design: the test below
            continue
        turns = llava_multimodal(turns)  # LLaVA's data pipeline moves <image> first for every template
        want = hf.apply_chat_template(as_messages(turns, system), chat_template=jinja, tokenize=False)
        our_system = DATED + system.strip() if jinja is LLAMA31_JINJA else system
        pieces = chat.render(template, as_conv(turns), tok, system=our_system)
        assert "".join(t for t, _ in pieces) == want
        text_only = [(r, v.replace("<image>", "")) for r, v in turns]
        want_text = hf.apply_chat_template(as_messages(text_only, system), chat_template=jinja, tokenize=False)
        want_ids = hf(want_text, add_special_tokens=False).input_ids
        ids, labels = chat.tokenize(chat.render(template, as_conv(text_only), tok, system=our_system), tok, -1, 0)
        assert ids == want_ids
        answers = [v.strip() if template != "chatml" else v for r, v in text_only if r == "gpt"]
        if template == "qwen3":  # reasoning cut or kept, as the jinja shows each answer
            answers = [a.removesuffix("<|im_end|>") for a in qwen3_answers(want_text)]
        end = {"llama_3": "<|eot_id|>", "chatml": "<|im_end|>", "llama_2": tok.eos, "qwen3": "<|im_end|>",
               "gemma3": "<end_of_turn>"}[template]
        supervised = [i for i in labels if i != -100]
        assert supervised.count(tok.specials[end]) == len(answers)  # each turn's end is trained: the model stops
        assert tok.decode([i for i in supervised if i != tok.specials[end]]).replace(" ", "") == \
            "".join(answers).replace(" ", "")


def before_each_answer(pieces):
    """The text before each supervised piece of a rendering, and that piece."""
    out, text = [], ""
    for piece, target in pieces:
        if target:
            out.append((text, piece))
        text += piece
    return out


@pytest.mark.parametrize("system", [None, SYSTEM])
def test_qwen3_trains_each_answer_after_the_prompt_that_asks_for_it(qwen3, system):
    """Each answer is trained after exactly the generation prompt of the conversation up to it: the exported template's
    (what the model is asked with); for the first question that is Qwen3's published jinja's, the empty think block
    (enable_thinking=False) before an answer without reasoning, none before one that writes its reasoning; the last
    question's turn is the jinja's, and the ids are the tokenizer's."""
    import processor

    hf, tok = qwen3
    exported = processor.chat_template("qwen3", **processor.template_strings((tok, False)))
    trained = []
    for turns in THINKING + CONVERSATIONS:
        turns = [(r, v.replace("<image>", "")) for r, v in llava_multimodal(turns)]
        pieces = chat.render("qwen3", as_conv(turns), tok, system=system)
        text = "".join(t for t, _ in pieces)
        ids, labels = chat.tokenize(pieces, tok, -1, 0)
        assert ids == hf(text, add_special_tokens=False).input_ids
        trained.append([tok.decode(run) for run in runs(ids, labels)])
        answers = [i for i, (r, _) in enumerate(turns) if r == "gpt"]
        for i, (before, answer) in zip(answers, before_each_answer(pieces)):
            if not questions(turns[:i]):  # an answer to no question has no prompt to ask for it
                continue
            thinks = answer.startswith("<think>")
            asked = as_messages(turns[:i], system)
            prompt = hf.apply_chat_template(asked, chat_template=exported, tokenize=False, add_generation_prompt=True)
            assert before == (prompt.removesuffix(EMPTY_THINK) if thinks else prompt)
            if questions(turns[:i]) == 1 and turns[0][0] == "human":
                assert before == hf.apply_chat_template(asked, chat_template=QWEN3_JINJA, tokenize=False,
                                                        add_generation_prompt=True, enable_thinking=thinks)
        last = max(i for i, (r, _) in enumerate(turns) if r == "human") if questions(turns) else 0
        published = hf.apply_chat_template(as_messages(turns, system), chat_template=QWEN3_JINJA, tokenize=False)
        tail = "<|im_start|>user\n" + turns[last][1] + "<|im_end|>\n" if questions(turns) else ""
        if tail:
            assert text.split(tail)[-1] == published.split(tail)[-1]
    # reasoning written in any turn is trained after "<|im_start|>assistant\n" (where a thinking model starts it); an
    # answer without it (a written empty block too) starts after the empty block, untrained, stripped of leading newlines
    assert trained[0] == ["<think>\nA cat on a sofa.\n</think>\n\nA black cat.<|im_end|>"]
    assert trained[1] == ["<think>\nTwo dogs, left.\n</think>\n\nThere are two dogs.<|im_end|>", "Black.<|im_end|>"]
    assert trained[2] == ["<think>\nIt is here.\n</think>\n\nOn the left.<|im_end|>",
                          "<think>\nLook right.\n</think>\n\nOn the right.  <|im_end|>"]
    assert trained[3] == ["<think>\nOne, two, three.\n</think>\n\n3 cups.<|im_end|>", " Yes.<|im_end|>"]
    assert trained[4] == ["<think>\nA cat.\n</think>\n\nA cat.<|im_end|>",
                          "<think>\nIt is black.\n</think>\n\nBlack.<|im_end|>"]
    assert trained[5] == ["<think>\nCount them.\n</think>\n\nLet me count.<|im_end|>", "3 cups.<|im_end|>"]
    assert trained[6] == ["<think>\nGreet.\n</think>\n\nHello.<|im_end|>"]
    assert trained[8] == [" There are two dogs.\n<|im_end|>", "Red.  <|im_end|>", "On the left.<|im_end|>"]


GENERATION = [("llama_3", LLAMA3_JINJA, "llama3"), ("chatml", QWEN2_JINJA, "qwen2"), ("qwen3", QWEN3_JINJA, "qwen3"),
              ("gemma3", GEMMA3_JINJA, "gemma3")]
END_OF_TURN = {"llama_3": "<|eot_id|>", "chatml": "<|im_end|>", "qwen3": "<|im_end|>", "gemma3": "<end_of_turn>"}


@pytest.mark.parametrize("template,jinja,family", GENERATION)
def test_generation_prompt_equals_published_jinja_and_the_training_prompt(llama3, qwen2, qwen3, gemma3, template, jinja,
                                                                          family):
    """sample.py's prompt is the jinja's add_generation_prompt (Qwen3's with enable_thinking=False, whose empty think
    block training puts before the last answer), token for token the ids training puts before that answer, and what
    the chat template an export writes renders; the sampler stops at the token that ends each trained answer."""
    import processor

    hf, tok = {"llama3": llama3, "qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3}[family]
    exported = processor.chat_template(template, **processor.template_strings((tok, False)))
    for question in ["<image>\nWhat is shown in this image?", " Where is it? ", "<image>\n<image>\nWhich is red?"]:
        messages = [{"role": "user", "content": question}]
        want = hf.apply_chat_template(messages, chat_template=jinja, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False)
        prompt = chat.generation_prompt(template, question, tok)
        assert prompt == want
        assert hf.apply_chat_template(messages, chat_template=exported, tokenize=False, add_generation_prompt=True) == want
        history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}] + messages
        if template != "qwen3":  # its earlier answers follow the empty block the jinja drops (the test above)
            assert hf.apply_chat_template(history, chat_template=exported, tokenize=False, add_generation_prompt=True) \
                == hf.apply_chat_template(history, chat_template=jinja, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False)
        conv = [{"from": "human", "value": question}, {"from": "gpt", "value": "A black cat."}]
        ids, _ = chat.tokenize([(prompt, False)], tok, -1, 2)
        assert ids == chat.prompt_and_answer(conv, True, template, tok, -1, 2)[0]
        text = want.replace("<image>", "")
        assert chat.tokenize([(text, False)], tok, -1, 0)[0] == hf(text, add_special_tokens=False).input_ids
    stop = chat.stop_token_id(template, tok)
    assert stop == hf.convert_tokens_to_ids(END_OF_TURN[template])  # Gemma's is not its EOS
    _, labels, _ = chat.encode_conversation(as_conv(CONVERSATIONS[1]), True, template, tok, 4096, -1, 1)
    assert [run[-1] for run in runs(labels, labels)] == [stop] * 3


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


def test_qwen3_and_gemma3_need_their_own_tokenizers(llama3, qwen2, qwen3, gemma3):
    with pytest.raises(ValueError, match="'qwen3' needs <think>, </think> as special tokens"):
        chat.check_template("qwen3", qwen2[1])  # Qwen2.5's has ChatML's markers, not the think block's
    with pytest.raises(ValueError, match="'gemma3' needs <start_of_turn>, <end_of_turn>, a BOS token"):
        chat.check_template("gemma3", qwen3[1])
    with pytest.raises(ValueError, match="'gemma3' needs <start_of_turn>, <end_of_turn> as"):
        chat.check_template("gemma3", llama3[1])
    chat.check_template("qwen3", qwen3[1])
    chat.check_template("gemma3", gemma3[1])
    assert (gemma3[1].bos, gemma3[1].eos) == ("<bos>", "<eos>")  # read from the sentencepiece model
