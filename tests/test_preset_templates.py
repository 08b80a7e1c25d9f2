"""Each language-model preset's chat template against the template its model was published with, rendered and
tokenized by transformers' apply_chat_template: Qwen2.5-Instruct's, SmolLM2-Instruct's, SmolLM3-3B's (/no_think) and
the plain ChatML of Qwen3-VL-Instruct and Qwen3-Instruct-2507, with and without a system turn, over several turns and
with the generation prompt; the template an export writes renders the same."""

import pytest

import chat
import model_config
import processor
from test_templates import CONVERSATIONS, QWEN2_JINJA, QWEN3_JINJA, SYSTEM, as_conv, as_messages, llava_multimodal, qwen2, qwen3  # noqa: F401,E501

# Qwen/Qwen2.5-*-Instruct's tokenizer_config.json chat_template, verbatim, tools branches included
QWEN25_JINJA = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501
# HuggingFaceTB/SmolLM2-*-Instruct's, verbatim: Qwen2's with SmolLM's system prompt
SMOLLM2_JINJA = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                 "<|im_end|>\n' }}"
                 "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen/Qwen3-VL-*-Instruct's, its text path (string contents; no tools, no vision items): plain ChatML with no default
# system prompt, as Qwen3-*-Instruct-2507's renders a conversation without reasoning
QWEN3_VL_JINJA = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""
# HuggingFaceTB/SmolLM3-3B's, verbatim (the /think persona, xml and python tools, /system_override included)
SMOLLM3_JINJA = r"""{# ───── defaults ───── #}
{%- if enable_thinking is not defined -%}
{%- set enable_thinking = true -%}
{%- endif -%}

{# ───── reasoning mode ───── #}
{%- if enable_thinking -%}
{%- set reasoning_mode = "/think" -%}
{%- else -%}
{%- set reasoning_mode = "/no_think" -%}
{%- endif -%}

{# ───── header (system message) ───── #}
{{- "<|im_start|>system\n" -}}

{%- if messages[0].role == "system" -%}
{%- set system_message = messages[0].content -%}
{%- if "/no_think" in system_message -%}
{%- set reasoning_mode = "/no_think" -%}
{%- elif "/think" in system_message -%}
{%- set reasoning_mode = "/think" -%}
{%- endif -%}
{%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}

{%- if "/system_override" in system_message -%}
{{- custom_instructions.replace("/system_override", "").rstrip() -}}
{{- "<|im_end|>\n" -}}
{%- else -%}
{{- "## Metadata\n\n" -}}
{{- "Knowledge Cutoff Date: June 2025\n" -}}
{%- set today = strftime_now("%d %B %Y") -%}
{{- "Today Date: " ~ today ~ "\n" -}}
{{- "Reasoning Mode: " + reasoning_mode + "\n\n" -}}

{{- "## Custom Instructions\n\n" -}}
{%- if custom_instructions -%}
{{- custom_instructions + "\n\n" -}}
{%- elif reasoning_mode == "/think" -%}
{{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly exploring questions through a systematic thinking process before providing the final precise and accurate solutions. This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, backtracking, and iteration to develop well-considered thinking process. Please structure your response into two main sections: Thought and Solution using the specified format: <think> Thought section </think> Solution section. In the Thought section, detail your reasoning process in steps. Each step should include detailed considerations such as analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the current steps, refining any errors, and revisiting previous steps. In the Solution section, based on various attempts, explorations, and reflections from the Thought section, systematically present the final solution that you deem correct. The Solution section should be logical, accurate, and concise and detail necessary steps needed to reach the conclusion.\n\n" -}}
{%- else -%}
{{- "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\n\n" -}}
{%- endif -%}

{%- if xml_tools or python_tools -%}
{{- "### Tools\n\n" -}}
{%- if xml_tools -%}
{%- set ns = namespace(xml_tool_string="You may call one or more functions to assist with the user query.\nYou are provided with function signatures within <tools></tools> XML tags:\n\n<tools>\n") -%}
{%- for tool in xml_tools[:] -%} {# The slicing makes sure that xml_tools is a list #}
{%- set ns.xml_tool_string = ns.xml_tool_string ~ (tool | string) ~ "\n" -%}
{%- endfor -%}
{%- set xml_tool_string = ns.xml_tool_string + "</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" -%}
{{- xml_tool_string -}}
{%- endif -%}
{%- if python_tools -%}
{%- set ns = namespace(python_tool_string="When you send a message containing Python code between '<code>' and '</code>' tags, it will be executed in a stateful Jupyter notebook environment, and you will then be given the output to continued reasoning in an agentic loop.\n\nYou can use the following tools in your python code like regular functions:\n<tools>\n") -%}
{%- for tool in python_tools[:] -%} {# The slicing makes sure that python_tools is a list #}
{%- set ns.python_tool_string = ns.python_tool_string ~ (tool | string) ~ "\n" -%}
{%- endfor -%}
{%- set python_tool_string = ns.python_tool_string + "</tools>\n\nThe state persists between code executions: so variables that you define in one step are still available thereafter." -%}
{{- python_tool_string -}}
{%- endif -%}
{{- "\n\n" -}}
{{- "<|im_end|>\n" -}}
{%- endif -%}
{%- endif -%}
{# ───── main loop ───── #}
{%- for message in messages -%}
{%- set content = message.content if message.content is string else "" -%}
{%- if message.role == "user" -%}
{{ "<|im_start|>" + message.role + "\n"  + content + "<|im_end|>\n" }}
{%- elif message.role == "assistant" -%}
{% generation %}
{%- if reasoning_mode == "/think" -%}
{{ "<|im_start|>assistant\n" + content.lstrip("\n") + "<|im_end|>\n" }}
{%- else -%}
{{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n" + content.lstrip("\n") + "<|im_end|>\n" }}
{%- endif -%}
{% endgeneration %}
{%- elif message.role == "tool" -%}
{{ "<|im_start|>" + "user\n"  + content + "<|im_end|>\n" }}
{%- endif -%}
{%- endfor -%}
{# ───── generation prompt ───── #}
{%- if add_generation_prompt -%}
{%- if reasoning_mode == "/think" -%}
{{ "<|im_start|>assistant\n" }}
{%- else -%}
{{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n"  }}
{%- endif -%}
{%- endif -%}"""  # noqa: E501
PUBLISHED = {"qwen2_5": QWEN25_JINJA, "smollm2": SMOLLM2_JINJA, "qwen3_instruct": QWEN3_VL_JINJA, "smollm3": SMOLLM3_JINJA,
             "chatml": QWEN2_JINJA, "qwen3": QWEN3_JINJA}


def published(hf, template, messages, **kw):
    """transformers' rendering of the published template; SmolLM3's in /no_think mode, its date (the day it renders,
    strftime_now) read as the one training fixes."""
    from datetime import datetime

    kw |= {"enable_thinking": False} if template == "smollm3" else {}
    text = hf.apply_chat_template(messages, chat_template=PUBLISHED[template], tokenize=False, **kw)
    if template == "smollm3":
        today = f"Today Date: {datetime.now().strftime('%d %B %Y')}\n"
        assert text.count(today) == 1
        text = text.replace(today, f"Today Date: {chat.SMOLLM3_DATE}\n")
    return text


def supervised_runs(ids, labels):
    out, previous = [], -100
    for token, label in zip(ids, labels):
        if label != -100:
            out += [[]] if previous == -100 else []
            out[-1].append(token)
        previous = label
    return out


@pytest.mark.parametrize("template", ["qwen2_5", "smollm2", "smollm3", "qwen3_instruct"])
@pytest.mark.parametrize("system", [None, SYSTEM])
def test_preset_template_equals_its_published_jinja(qwen2, qwen3, template, system):  # noqa: F811
    """Text, ids and trained answers equal the published template's over every conversation; each answer is trained
    right after the published generation prompt of the conversation up to it (these templates write earlier answers
    as they prompt for the last), and sample.py's prompt is that generation prompt."""
    hf, tok = qwen3 if template == "smollm3" else qwen2  # qwen2's splits "\n\n" where an answer starts with "\n"
    chat.check_template(template, tok)
    for turns in CONVERSATIONS:
        turns = [(r, v.replace("<image>", "")) for r, v in llava_multimodal(turns)]
        want = published(hf, template, as_messages(turns, system))
        pieces = chat.render(template, as_conv(turns), tok, system=system)
        assert "".join(t for t, _ in pieces) == want
        ids, labels = chat.tokenize(pieces, tok, -1, 0)
        assert ids == hf(want, add_special_tokens=False).input_ids
        trained = [tok.decode(run) for run in supervised_runs(ids, labels)]
        answers = [v for r, v in turns if r == "gpt"]
        assert trained == [(a.lstrip("\n") if template == "smollm3" else a) + "<|im_end|>" for a in answers]
        for k, answer in enumerate(i for i, (r, _) in enumerate(turns) if r == "gpt"):
            prompt = published(hf, template, as_messages(turns[:answer], system), add_generation_prompt=True)
            assert want.startswith(prompt)
            assert want[len(prompt):].startswith(answers[k].lstrip("\n") if template == "smollm3" else answers[k])
    for question in [" Where is it? ", "\nWhat is shown in this image?"]:
        messages = [{"role": "user", "content": question}]
        assert chat.generation_prompt(template, question, tok) == \
            published(hf, template, messages, add_generation_prompt=True)


@pytest.mark.parametrize("template", ["qwen2_5", "smollm2", "smollm3", "qwen3_instruct", "chatml"])
def test_the_exported_template_renders_the_published_one(qwen2, qwen3, template):  # noqa: F811
    """convert.py's chat_template.jinja renders what the published template renders: conversations with and without a
    system turn, and the generation prompt after a history."""
    hf, tok = qwen3 if template == "smollm3" else qwen2
    exported = processor.chat_template(template, **processor.template_strings((tok, False)))
    for turns in CONVERSATIONS:
        turns = [(r, v.replace("<image>", "")) for r, v in llava_multimodal(turns)]
        for system in (None, "Answer in one word."):
            messages = as_messages(turns, system)
            assert hf.apply_chat_template(messages, chat_template=exported, tokenize=False) == \
                published(hf, template, messages)
            history = messages[:-1]
            assert hf.apply_chat_template(history, chat_template=exported, tokenize=False, add_generation_prompt=True) \
                == published(hf, template, history, add_generation_prompt=True)


def test_every_instruct_preset_names_its_published_template():
    """Each language-model preset of a published chat model trains with its own template (docs/model.md)."""
    presets = set(model_config.LLM_PRESETS) - {"debug", "tinyllama-1.1b"}
    assert set(chat.PRESET_TEMPLATES) == presets
    assert {chat.PRESET_TEMPLATES[p] for p in ("qwen2.5-0.5b", "qwen2.5-7b", "smollm2-360m", "smollm3-3b", "qwen3-8b")} \
        == {"qwen2_5", "smollm2", "smollm3", "qwen3"}
    assert chat.PRESET_TEMPLATES["smollm2-135m"] == "smollm2" and chat.PRESET_TEMPLATES["qwen2-7b"] == "chatml"
    assert set(chat.PRESET_TEMPLATES.values()) <= set(chat.TEMPLATES)
