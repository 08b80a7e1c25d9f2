"""model_overrides: fields derived from others follow their inputs, checked against transformers' own configs."""

import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

import config
from model import build_model

DEMO = []  # train.py's defaults: the shapes demo
WIDE = ["--model=debug", "--model_overrides={'llm': {'dim': 256, 'ffn_dim': 512}, 'vision': {'image_size': 42}}"]
NARROW = ["--model=debug", "--model_overrides={'llm': {'n_heads': 2, 'n_kv_heads': 1}}"]


def hf_shapes(c):
    """Layer 0's weight shapes in transformers' LlamaForCausalLM of the same hyperparameters (its own head_dim rule)."""
    cfg = HFLlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim, num_hidden_layers=1,
                        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads)
    with torch.device("meta"):
        attn = LlamaForCausalLM(cfg).model.layers[0].self_attn
    return [tuple(getattr(attn, f"{n}_proj").weight.shape) for n in "qkvo"]


@pytest.mark.parametrize("argv", [DEMO, WIDE, NARROW], ids=["shapes-demo", "widened-debug", "fewer-heads"])
def test_overrides_rederive_head_dim(argv):
    c = config.model_config(config.load_config(argv))
    with torch.device("meta"):
        model = build_model(c, device="meta", init=False)
    attn = model.llm.layers[0].attention
    assert [tuple(w.weight.shape) for w in (attn.wq, attn.wk, attn.wv, attn.wo)] == hf_shapes(c.llm)
    assert c.llm.head_dim == c.llm.dim // c.llm.n_heads
    assert model.llm.rope_cos.shape[-1] == c.llm.head_dim
    assert c.n_image_tokens == (c.vision.image_size // c.vision.patch_size) ** 2


def test_demo_and_widened_values():
    demo = config.model_config(config.load_config(DEMO))
    assert (demo.llm.head_dim, demo.llm.n_kv_heads, demo.n_image_tokens) == (32, 4, 9)
    wide = config.model_config(config.load_config(WIDE))
    assert (wide.llm.head_dim, wide.llm.n_kv_heads, wide.n_image_tokens) == (64, 2, 9)  # debug's GQA (2 kv heads) kept


def test_explicit_head_dim_and_mha_kv_heads():
    # an explicit head_dim wins (Gemma-style); a preset without GQA keeps n_kv_heads = n_heads when n_heads changes
    c = config.model_config(config.load_config(["--model=llava-1.5-7b", "--model_overrides={'llm': {'n_heads': 16}}"]))
    assert (c.llm.head_dim, c.llm.n_kv_heads) == (256, 16)
    c = config.model_config(config.load_config(["--model=debug", "--model_overrides={'llm': {'dim': 128, 'head_dim': 8}}"]))
    assert c.llm.head_dim == 8


def test_bad_override_is_a_clear_error():
    with pytest.raises(SystemExit, match="model_overrides.*unknown LlamaConfig keys \\['heads'\\]"):
        config.model_config(config.load_config(["--model_overrides={'llm': {'heads': 8}}"]))
