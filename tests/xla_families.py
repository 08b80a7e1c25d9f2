"""Every parameter's gradient of one train.py micro-step of a tiny Qwen3-, Gemma 2- and Gemma 3-shaped VLM, on CPU
eager and on torch_xla SPMD over a mesh that shards all three axes (2 x 2 x 2 over CPU_NUM_DEVICES=8), with SDPA and
with blockwise attention (torch_xla's scan over the key blocks: per-layer windows, soft-caps and per-layer RoPE
inside it), packed rows. Run by test_families.py: python tests/xla_families.py SHAPES_DIR OUT_FILE."""

import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import config  # noqa: E402
import objectives  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from model import build_model  # noqa: E402
from xla_grads import batch, read  # noqa: E402

MESH = [2, 2, 2]
GEMMA = dict(norm_offset=1.0, sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=True, query_scale=24**-0.5,
             sliding_window=8, sliding_layers=[0])
FAMILIES = {  # the debug model's LLM (2 layers, width 64, 4 heads, 2 KV heads) with each family's switches
    "qwen3": dict(qk_norm=True, head_dim=24, sliding_window=8, sliding_layers=[1], tie_embeddings=True),
    "gemma2": GEMMA | dict(attn_softcap=2.0, final_softcap=3.0, tie_embeddings=True),
    "gemma3": GEMMA | dict(qk_norm=True, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                           local_rope_theta=1e4, tie_embeddings=True),
}


def micro_step(env, cfg, mcfg, b, attention):
    model = build_model(mcfg, seed=0)
    model.loss_chunk, model.recompute = 40, parallel.checkpoint_fn(env.kind)
    window = mcfg.llm.sliding_window
    model.llm.attention_kernel = parallel.attention_kernel(attention, 16, env, window, mcfg.llm.attn_softcap)
    model = parallel.shard(model, env)
    b = env.to_device(b)
    count = (b["labels"][:, 1:] != -100).sum().float()
    return train.forward_backward(model, b, env, cfg, 1 / count, objectives.OBJECTIVES["sft"]).detach(), model


def main(shapes, out):
    cfg = config.load_config([str(ROOT / "configs/debug.py"), f"--mesh={MESH}", "--stage=2"])
    base = config.model_config(cfg)
    cpu, xla = parallel.Env(cfg | {"device": "cpu"}), parallel.Env(cfg | {"device": "xla"})
    results = {}
    for family, switches in FAMILIES.items():
        mcfg = replace(base, llm=replace(base.llm, **switches))
        b = batch(shapes, True, mcfg)
        for attention in ("dense", "blockwise"):
            xla_step = micro_step(xla, cfg, mcfg, b, attention)
            xla.step_end()
            results[family, attention] = {"xla": read(*xla_step), "cpu": read(*micro_step(cpu, cfg, mcfg, b, attention))}
            print(family, attention, flush=True)
    torch.save(results, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
