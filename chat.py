"""
The text side of data.py: the tokenizer wrapper (sentencepiece tokenizer.model, or an HF tokenizer.json) and the
chat templates (plain, vicuna_v1, llama_2, llama_3, chatml, qwen2_5, smollm2, smollm3, qwen3, qwen3_instruct,
gemma3) that turn a LLaVA conversation into ids and labels, with the image placeholders expanded. Split from data.py
(over its budget), which re-exports every name here.
"""

import json
import re
from pathlib import Path

import storage

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"  # LLaVA-OneVision's placeholder for a video's frames
IMAGE_TAG_RE, TAGS_RE = re.compile(f"({IMAGE_TAG})"), re.compile(f"({IMAGE_TAG}|{VIDEO_TAG})")

def tokenizer_file(path):
    """The tokenizer file that path names: itself, or the tokenizer.model or tokenizer.json in the folder it names (a
    local folder, or a bucket URL whose name does not end in .model or .json)."""
    folder = Path(path).is_dir() if not storage.is_url(path) else not storage.name(path).endswith((".model", ".json"))
    if folder:
        found = [storage.join(path, n) for n in ("tokenizer.model", "tokenizer.json")
                 if storage.exists(storage.join(path, n))]
        path = found[0] if found else storage.join(path, "tokenizer.model")
    path = path if storage.is_url(path) else Path(path)
    if not storage.exists(path):
        raise FileNotFoundError(f"{path}: no tokenizer.model or tokenizer.json")
    return path


class Tokenizer:
    """A sentencepiece tokenizer.model, or an HF tokenizer.json through the optional `tokenizers` package.

    Special strings such as "<s>" and "</s>" inside text map to their ids. `bos`/`eos` are the tokenizer's
    own strings (None when it has none, as Qwen2 has no BOS); templates write those, never a literal "<s>".
    sentencepiece `legacy` (transformers' LlamaTokenizer flag; read from tokenizer_config.json beside the
    model, else True as older LLaMA/Vicuna checkpoints assume): text starts as if after a space (the
    dummy prefix, so one leading space is dropped) at the start of the prompt and after each <image>
    (LLaVA tokenizes those chunks separately); legacy=True adds it after every special token too, legacy=False
    does not ("</s>USER" -> "</s>", "US"...). Both match LlamaTokenizer's ids (tests)."""

    def __init__(self, path, legacy=None):
        # a local path or a bucket URL (storage.py): the files are read whole, as bytes and text, which sentencepiece
        # and tokenizers take directly: a tokenizer in a bucket needs no local copy
        self.path = path = tokenizer_file(path)
        config_path = storage.join(storage.parent(path), "tokenizer_config.json")
        config = json.loads(storage.read_text(config_path)) if storage.exists(config_path) else {}
        self.legacy = config.get("legacy", True) if legacy is None else legacy
        if storage.name(path).endswith(".model"):
            import sentencepiece as spm

            self.sp = spm.SentencePieceProcessor(model_proto=storage.read_bytes(path))
            self.vocab_size = self.sp.get_piece_size()
            self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
            self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else 0
            # BOS/EOS and chat markers such as <|eot_id|> or Gemma's <start_of_turn> map straight to their ids
            pieces = {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}
            markers = r"</?s>|<\|[a-z_]+\|>|<(?:start|end)_of_turn>"
            self.specials = {p: i for p, i in pieces.items() if re.fullmatch(markers, p)}
            self.specials |= {self.sp.id_to_piece(i): i for i in (self.bos_id, self.eos_id) if i >= 0}
            self.unk_len = len(self.sp.encode(self.sp.id_to_piece(self.sp.unk_id())))
        else:
            from tokenizers import Tokenizer as HFTokenizer

            self.sp = None
            self.hf = HFTokenizer.from_str(storage.read_text(path))
            self.vocab_size = self.hf.get_vocab_size()
            self.specials = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items()}
            # BOS: tokenizer_config.json's, else what the tokenizer's post-processor prepends (Llama-3 does, Qwen2 not)
            added = self.hf.encode("a", add_special_tokens=True).ids
            plain = self.hf.encode("a", add_special_tokens=False).ids
            prepended = added[0] if len(added) > len(plain) and added[0] in self.specials.values() else -1
            find = lambda *names: next((self.specials[n] for n in names if n in self.specials), -1)  # noqa: E731
            named = lambda key: self.specials.get(token_content(config.get(key)), -1)  # noqa: E731
            self.bos_id = named("bos_token") if "bos_token" in config else prepended
            self.eos_id = named("eos_token") if "eos_token" in config else \
                find("</s>", "<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")
            self.pad_id = max(named("pad_token"), 0) if config.get("pad_token") else \
                max(find("<pad>", "<|finetune_right_pad_id|>", "<|endoftext|>", "</s>"), 0)
        names = {i: s for s, i in self.specials.items()}
        self.bos, self.eos = names.get(self.bos_id), names.get(self.eos_id)
        alternatives = "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True))
        self.special_re = re.compile(f"({alternatives})") if self.specials else None

    def encode(self, text, prefix=True):
        """Ids of text; special strings become their ids. prefix=False: text continues a prompt (see class doc)."""
        ids, after_special = [], False
        for part in self.special_re.split(text) if self.special_re else [text]:
            if part in self.specials:
                ids.append(self.specials[part])
                after_special = True
            elif part and self.sp is not None:
                if (prefix and not after_special) or (after_special and self.legacy) or part.startswith(" "):
                    ids += self.sp.encode(part[1:] if part.startswith(" ") else part)
                else:  # no dummy prefix: encode after an unknown piece and drop it, as LlamaTokenizer(legacy=False)
                    ids += self.sp.encode(self.sp.id_to_piece(self.sp.unk_id()) + part)[self.unk_len :]
            elif part:
                ids += self.hf.encode(part, add_special_tokens=False).ids
        return ids

    def decode(self, ids):
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.sp.decode(ids) if self.sp is not None else self.hf.decode(ids, skip_special_tokens=False)


def token_content(token):
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
LLAMA2_SYSTEM = ("You are a helpful language and vision assistant. You are able to understand the visual content "
                 "that the user provides, and assist the user with a variety of tasks using natural language.")


def image_first(text):
    """LLaVA's preprocess_multimodal: a turn holding one <image> becomes "<image>\\n" + its stripped text.
    Several tags stay where they are (LLaVA-NeXT's preprocess_multimodal moves only a lone one)."""
    if text.count(IMAGE_TAG) != 1:
        return text
    return (IMAGE_TAG + "\n" + text.replace(IMAGE_TAG, "").strip()).strip()


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def turns(conv):
    """(role, text) with role 'system', 'user' or 'assistant'; LLaVA's human/gpt accepted; <image> moved
    to the front of its turn, as LLaVA's training data pipeline does for every template."""
    return [(ROLES[t["from"]], image_first(t["value"])) for t in conv]


# Each template maps a conversation to pieces (text, is_target); "".join(text) is the published
# prompt string. Pieces are tokenized one by one, so a label boundary can never drift from the text.
# bos/eos are the tokenizer's own strings ("" when it has none): render() passes them; the defaults
# are Llama-2/Vicuna's, so the strings read as published.


def template_plain(conv, system=None, bos="<s>", eos="</s>"):
    # LLaVA stage 1: the image, then the caption; the question text is not used
    answer = next(text for role, text in turns(conv) if role == "assistant")
    return [(bos, False), (IMAGE_TAG, False), (answer + "\n", True)]


def template_vicuna_v1(conv, system=None, bos="<s>", eos="</s>"):
    # haotian-liu/LLaVA conv_vicuna_v1: messages as they are (no strip), sep " ", sep2 EOS
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system or VICUNA_SYSTEM)
    pieces, prompt = [(bos, False)], sys_text + " "
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            prompt += f"USER: {text} ASSISTANT:"
        else:
            pieces += [(prompt, False), (f" {text}{eos}", True)]
            prompt = ""
    return pieces + ([(prompt, False)] if prompt.strip() else [])


def template_llama_2(conv, system=None, bos="<s>", eos="</s>"):
    # Meta's Llama-2 chat jinja: the system block joins the first user message, each message .strip()ped
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system or LLAMA2_SYSTEM)
    pieces, first = [], True
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            if first and sys_text:
                text = f"<<SYS>>\n{sys_text}\n<</SYS>>\n\n{text}"
            pieces += [(bos, False), (f"[INST] {text.strip()} [/INST]", False)]
            first = False
        else:
            pieces.append((f" {text.strip()} {eos}", True))
    return pieces


def template_llama_3(conv, system=None, bos="<|begin_of_text|>", eos="</s>"):
    # Meta-Llama-3-Instruct's jinja: every message trimmed; the turn ends with <|eot_id|>, not the EOS
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system)
    pieces = [(bos, False)]
    if sys_text:
        pieces.append((f"<|start_header_id|>system<|end_header_id|>\n\n{sys_text.strip()}<|eot_id|>", False))
    for role, text in (t for t in ts if t[0] != "system"):
        header = f"<|start_header_id|>{role}<|end_header_id|>\n\n"
        if role == "user":
            pieces.append((header + text.strip() + "<|eot_id|>", False))
        else:
            pieces += [(header, False), (text.strip() + "<|eot_id|>", True)]
    return pieces


QWEN2_SYSTEM = "You are a helpful assistant."  # Qwen2-Instruct's (and LLaVA-OneVision's conv_qwen)
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOLLM3_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."  # its /no_think default
# SmolLM3's jinja writes strftime_now("%d %B %Y"), the day it renders: training fixes it (docs/model.md), so that a
# sample tokenizes the same on every day and every resume, and the exported template writes the same date
SMOLLM3_DATE = "08 July 2025"  # the day SmolLM3-3B was published
SMOLLM3_HEADER = ("<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: {date}\n"
                  "Reasoning Mode: /no_think\n\n## Custom Instructions\n\n{instructions}\n\n")


def chatml(conv, system):
    # ChatML: no BOS, messages as they are, a system turn only where there is a system text
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system)
    pieces = [] if sys_text is None else [(f"<|im_start|>system\n{sys_text}<|im_end|>\n", False)]
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            pieces.append((f"<|im_start|>user\n{text}<|im_end|>\n", False))
        else:
            pieces += [("<|im_start|>assistant\n", False), (f"{text}<|im_end|>", True), ("\n", False)]
    return pieces


def template_chatml(conv, system=None, bos="", eos="</s>"):
    # Qwen2-Instruct's jinja: its default system prompt where the record has none
    return chatml(conv, system or QWEN2_SYSTEM)


def template_qwen2_5(conv, system=None, bos="", eos="</s>"):
    # Qwen2.5-Instruct's jinja (its no-tools path): Qwen2's with its own default system prompt
    return chatml(conv, system or QWEN25_SYSTEM)


def template_smollm2(conv, system=None, bos="", eos="</s>"):
    # SmolLM2-Instruct's jinja: Qwen2's with SmolLM's default system prompt
    return chatml(conv, system or SMOLLM2_SYSTEM)


def template_qwen3_instruct(conv, system=None, bos="", eos="</s>"):
    # Qwen3-Instruct-2507's and Qwen3-VL-Instruct's jinja (no think block, no tools): ChatML, no default system prompt
    return chatml(conv, system)


def template_smollm3(conv, system=None, bos="", eos="</s>"):
    # SmolLM3-3B's jinja in /no_think mode, no tools: a metadata block (the date fixed: SMOLLM3_DATE), the system text
    # (less /think and /no_think, right-stripped) as its custom instructions, else its /no_think default, and no
    # <|im_end|> after it (the jinja writes that only with tools); every answer, left-stripped of newlines, after an
    # empty think block with one newline, which is prompt: the generation prompt writes it
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system) or ""
    instructions = sys_text.replace("/no_think", "").replace("/think", "").rstrip() or SMOLLM3_SYSTEM
    pieces = [(SMOLLM3_HEADER.format(date=SMOLLM3_DATE, instructions=instructions), False)]
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            pieces.append((f"<|im_start|>user\n{text}<|im_end|>\n", False))
        else:
            pieces += [("<|im_start|>assistant\n<think>\n\n</think>\n", False), (text.lstrip("\n") + "<|im_end|>", True),
                       ("\n", False)]
    return pieces


def template_qwen3(conv, system=None, bos="", eos="</s>"):
    # Qwen3's jinja (the hybrid-thinking models, 0.6B to 235B): ChatML with no default system prompt. Every answer is
    # written as that jinja writes the last one, the one the model is asked for: its <think>...</think> kept and
    # trained, or, when it has none, after the empty think block the enable_thinking=False generation prompt writes
    # (prompt, not target). The jinja itself cuts the reasoning from answers before the last question and writes no
    # empty block there, so an earlier answer would be trained where the model never generates from; here the text
    # before each answer is the generation prompt of the conversation up to its question (as TRL's Qwen3 training
    # template and SmolLM3's /no_think do), and the last question's turn equals the jinja's.
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system)
    pieces = [] if sys_text is None else [(f"<|im_start|>system\n{sys_text}<|im_end|>\n", False)]
    for role, text in (t for t in ts if t[0] != "system"):
        if role == "user":
            pieces.append((f"<|im_start|>user\n{text}<|im_end|>\n", False))
            continue
        reasoning = ""
        if "</think>" in text:  # the jinja's split, string for string
            reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            text = text.split("</think>")[-1].lstrip("\n")
        head, text = "<|im_start|>assistant\n", text.lstrip("\n")
        if reasoning:  # reasoning has no "\n" left at either end to strip
            text = f"<think>\n{reasoning}\n</think>\n\n{text}"
        else:
            head += "<think>\n\n</think>\n\n"
        pieces += [(head, False), (f"{text}<|im_end|>", True), ("\n", False)]
    return pieces


def template_gemma3(conv, system=None, bos="<bos>", eos="<eos>"):
    # Gemma 3's jinja: BOS, no system turn (its text and a blank line open the first turn), messages trimmed, the
    # assistant's role written "model"
    ts = turns(conv)
    sys_text = next((t for r, t in ts if r == "system"), system)
    prefix = "" if sys_text is None else sys_text + "\n\n"
    pieces = [(bos, False)]
    for i, (role, text) in enumerate(t for t in ts if t[0] != "system"):
        first = prefix if i == 0 else ""
        if role == "user":
            pieces.append((f"<start_of_turn>user\n{first}{text.strip()}<end_of_turn>\n", False))
        else:
            pieces += [(f"<start_of_turn>model\n{first}", False), (f"{text.strip()}<end_of_turn>", True), ("\n", False)]
    return pieces


TEMPLATES = {"plain": template_plain, "vicuna_v1": template_vicuna_v1, "llama_2": template_llama_2,
             "llama_3": template_llama_3, "chatml": template_chatml, "qwen2_5": template_qwen2_5,
             "smollm2": template_smollm2, "smollm3": template_smollm3, "qwen3": template_qwen3,
             "qwen3_instruct": template_qwen3_instruct, "gemma3": template_gemma3}
# the markers a template writes that must be single special tokens of the tokenizer (Qwen3's <think> and </think>
# are added tokens, not special ones, yet a tokenizer without them would spell them out)
TEMPLATE_SPECIALS = {"llama_3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                     **dict.fromkeys(("chatml", "qwen2_5", "smollm2", "qwen3_instruct"), ("<|im_start|>", "<|im_end|>")),
                     "smollm3": ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                     "qwen3": ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                     "gemma3": ("<start_of_turn>", "<end_of_turn>")}
# the token that ends an assistant turn, where it is not the EOS
END_OF_TURN = {"llama_3": "<|eot_id|>", "gemma3": "<end_of_turn>",
               **dict.fromkeys(("chatml", "qwen2_5", "smollm2", "smollm3", "qwen3", "qwen3_instruct"), "<|im_end|>")}
# the template each language-model preset (model_config.LLM_PRESETS) was published with; docs/model.md names the
# sources. debug and tinyllama-1.1b (bench.py's shape) have none
PRESET_TEMPLATES = {"vicuna-7b": "vicuna_v1", "vicuna-13b": "vicuna_v1", "llama3-8b": "llama_3",
                    **{f"qwen2-{s}": "chatml" for s in ("0.5b", "7b")},
                    **{f"qwen2.5-{s}": "qwen2_5" for s in ("0.5b", "1.5b", "3b", "7b")},
                    **{f"qwen3-{s}": "qwen3" for s in ("0.6b", "1.7b", "4b", "8b")},
                    **{f"gemma-3-{s}": "gemma3" for s in ("1b", "4b", "12b")},
                    **{f"smollm2-{s}": "smollm2" for s in ("135m", "360m", "1.7b")}, "smollm3-3b": "smollm3"}


def check_template(template, tok):
    """Raise ValueError when `tok` cannot write `template` exactly (a marker it would split into characters)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose from {sorted(TEMPLATES)}")
    missing = [m for m in TEMPLATE_SPECIALS.get(template, ()) if m not in tok.specials]
    if template in ("vicuna_v1", "llama_2") and tok.eos is None:
        missing.append("an EOS token")
    if template == "gemma3" and tok.bos is None:  # Gemma's jinja writes it, and Gemma degrades without it
        missing.append("a BOS token")
    if missing:
        raise ValueError(f"template {template!r} needs {', '.join(missing)} as special tokens, and tokenizer "
                         f"{tok.path} has none: pick the template the tokenizer was made for")


def render(template, conv, tok=None, system=None):
    """TEMPLATES[template] with the tokenizer's own BOS/EOS strings (the published defaults without a tokenizer)."""
    kw = {"bos": tok.bos or "", "eos": tok.eos or ""} if tok is not None else {}
    return TEMPLATES[template](conv, system, **kw)


def generation_prompt(template, question, tok=None):
    """The prompt string for asking `question` at inference, ending where the answer starts."""
    pieces = render(template, [{"from": "human", "value": question}, {"from": "gpt", "value": "\x00"}], tok)
    text = "".join(t for t, _ in pieces)
    return text[: text.index("\x00")].rstrip(" ")


def tokenize(pieces, tok, image_token_id, n_image_tokens, video_token_id=None):
    """(ids, labels): each <image> becomes n_image_tokens image ids; labels are -100 outside targets.
    The ids equal the tokenizer's on the joined string, split at <image> as LLaVA's tokenizer_image_token does.
    n_image_tokens may be a list, one count a tag in order (anyres: each image's own); with video_token_id,
    <video> is a tag too and becomes video ids."""
    counts = iter(n_image_tokens) if isinstance(n_image_tokens, list) else None
    tags = TAGS_RE if video_token_id is not None else IMAGE_TAG_RE
    ids, labels, prefix = [], [], True
    for text, target in pieces:
        for j, chunk in enumerate(tags.split(text)):
            if j % 2:  # a tag (the split keeps them)
                n = next(counts, 0) if counts else n_image_tokens
                ids += [video_token_id if chunk == VIDEO_TAG else image_token_id] * n
                labels += [-100] * n
                prefix = True  # LLaVA tokenizes the text after an image as a new call
            elif chunk:
                # a prompt written whole (generation_prompt) starts with the BOS the templates give their own piece:
                # the text after it starts afresh, as after the BOS LLaVA's tokenizer adds (sentencepiece legacy=False)
                lead = tok.bos if prefix and tok.bos and chunk.startswith(tok.bos) else ""
                t = ([tok.specials[lead]] if lead else []) + tok.encode(chunk[len(lead):], prefix)
                ids += t
                labels += t if target else [-100] * len(t)
                if t and not (prefix and chunk == tok.bos):  # a BOS the tokenizer adds leaves the text at its start
                    prefix = tok.legacy and t[-1] in tok.specials.values()
    return ids, labels


def encode_conversation(conv, has_image, template, tok, seq_len, image_token_id, n_image_tokens, video_token_id=None):
    """(ids, labels, truncated) or raise DropSample. Rule: cut the tail to seq_len; drop the sample if that
    would cut into its image tokens or leave no supervised token. n_image_tokens: an int, or a list with each
    image's count (anyres), whose length must be the number of tags the template writes."""
    if template == "plain" and not has_image:
        raise DropSample("plain_template_without_image")
    pieces = render(template, conv, tok)
    if isinstance(n_image_tokens, list):
        tags = IMAGE_TAG_RE if video_token_id is None else TAGS_RE
        n_tags = sum(len(tags.findall(text)) for text, _ in pieces)
        if n_tags != len(n_image_tokens):
            raise DropSample(f"image_tag_count_mismatch ({n_tags} tags for {len(n_image_tokens)} images)")
    ids, labels = tokenize(pieces, tok, image_token_id, n_image_tokens, video_token_id)
    image_positions = [i for i, t in enumerate(ids) if t == image_token_id or t == video_token_id]
    expected = sum(n_image_tokens) if isinstance(n_image_tokens, list) else n_image_tokens * has_image
    if len(image_positions) != expected:
        raise DropSample("image_tag_mismatch")
    truncated = len(ids) > seq_len
    if image_positions and image_positions[-1] >= seq_len:
        raise DropSample("image_beyond_seq_len")
    ids, labels = ids[:seq_len], labels[:seq_len]
    if all(x == -100 for x in labels[1:]):  # the first label never counts: nothing predicts it
        raise DropSample("no_supervised_tokens")
    return ids, labels, truncated


class DropSample(Exception):
    pass


def encode_preference(conv, has_image, template, tok, seq_len, image_token_id, n_image_tokens, video_token_id=None):
    """((chosen ids, labels), (rejected ids, labels), truncated) of a preference sample: its last turn is the chosen
    answer and holds the rejected one under "rejected" (as pack.py writes them). Only that final answer is
    supervised (earlier answers are prompt, as in TRL); a pair whose answer would start past seq_len is dropped."""
    last = conv[-1]
    pair, truncated = [], False
    for answer in (last["value"], last["rejected"]):
        answered = conv[:-1] + [{"from": last["from"], "value": answer}]
        ids, labels, _ = encode_conversation(answered, has_image, template, tok, 1 << 30, image_token_id, n_image_tokens,
                                             video_token_id)
        start = max(i for i, label in enumerate(labels) if label != -100)  # the answer's last supervised token,
        while start > 0 and labels[start - 1] != -100:  # then back to the first of its run (ChatML leaves a "\n")
            start -= 1
        if start >= seq_len:
            raise DropSample(f"answer_beyond_seq_len ({start} prompt tokens, seq_len {seq_len})")
        truncated |= len(ids) > seq_len
        pair.append((ids[:seq_len], [-100] * start + labels[start:seq_len]))
    return pair[0], pair[1], truncated


def prompt_and_answer(conv, has_image, template, tok, image_token_id, n_image_tokens):
    """The ids the model sees before the first answer (exactly as in training) and that answer's text."""
    ids, labels = tokenize(render(template, conv, tok), tok, image_token_id, n_image_tokens)
    first = next(i for i, lab in enumerate(labels) if lab != -100)
    return ids[:first], next(t for r, t in turns(conv) if r == "assistant")


def stop_token_id(template, tok):
    """The token that ends an assistant turn in `template`."""
    marker = END_OF_TURN.get(template)
    ids = tok.encode(marker) if marker else []
    return ids[-1] if len(ids) and tok.decode(ids[-1:]) == marker else tok.eos_id


def decode_answer(tok, tokens, stop):
    """The text of generated (or supervised) token ids up to the stop token."""
    return tok.decode(tokens[: tokens.index(stop)] if stop in tokens else tokens).strip()


def conversation_problem(conv):
    """Why a conversation cannot be trained on, as a counted reason, or None. Used by pack and by the loader."""
    if not isinstance(conv, list) or not all(isinstance(t, dict) and "from" in t and "value" in t for t in conv):
        return "malformed_conversations"
    if not all(isinstance(t["from"], str) and t["from"] in ROLES for t in conv):
        return "unknown_role"  # ShareGPT's "chatgpt" or "bing", a capitalised "Human", a list
    if not all(isinstance(t["value"], str) for t in conv):
        return "non_text_value"  # null or a list would train on the text "None" or "['a', 'b']"
    try:
        "".join(t["value"] for t in conv).encode()
    except UnicodeEncodeError:
        return "invalid_unicode"  # a lone surrogate (JSON "\\ud800") has no UTF-8 form
    answers = [t["value"] for t in conv if ROLES[t["from"]] == "assistant"]
    if not answers:
        return "no_gpt_turn"
    return None if answers[0].strip() else "empty_answer"


def place_image_tags(conv, tag, n):
    """The conversation with its images where chat templates put them: n untagged images (LLaVA's records may omit
    the tag) as n tags at the front of the first user turn, as transformers' llava-hf templates render
    [{"type": "image"}, ..., {"type": "text"}]; so do tags written in a system turn (llavax's pack put an untagged
    image there in older versions), which no chat template renders. Written tags elsewhere stay. No user turn: one
    holding only the tags goes before the first answer."""
    conv = [dict(t) for t in conv]  # other keys a turn carries (a preference pair's "rejected") stay
    n_front = 0 if any(tag in t["value"] for t in conv) else n
    for t in (t for t in conv if ROLES[t["from"]] == "system" and tag in t["value"]):
        n_front += t["value"].count(tag)
        t["value"] = t["value"].replace(tag + "\n", "").replace(tag, "")
    if not n_front:
        return conv
    user = next((t for t in conv if ROLES[t["from"]] == "user"), None)
    if user is None:
        user = {"from": "human", "value": ""}
        conv.insert(next(i for i, t in enumerate(conv) if ROLES[t["from"]] == "assistant"), user)
    user["value"] = (tag + "\n") * n_front + user["value"]
    return conv
