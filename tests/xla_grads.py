"""Every parameter's gradient of one train.py micro-step, on CPU eager and on torch_xla SPMD (mesh 1x2x2 over
CPU_NUM_DEVICES=4), for stage x dtype x activation checkpointing x packing. Run by test_xla_grads.py:
python tests/xla_grads.py SHAPES_DIR OUT_FILE writes OUT_FILE (torch.save of the losses and gradients)."""

import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import config  # noqa: E402
import loader  # noqa: E402
import parallel  # noqa: E402
import objectives  # noqa: E402
import train  # noqa: E402
from model import build_model  # noqa: E402

MESH = [1, 2, 2]


def batch(shapes, packed, mcfg):
    """The first training batch of the debug config, as train.py reads it (4 rows, or 4 packed rows of 2 samples)."""
    stream = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=4, seq_len=96 if packed else 48,
                              image_size=mcfg.vision.image_size, image_token_id=mcfg.image_token_id,
                              n_image_tokens=mcfg.n_image_tokens, template="llama_3", pack=2 if packed else 0)
    return stream.batch(0)


def micro_step(env, cfg, mcfg, b, stage, checkpointing, packed):
    """train.py's micro-step on a fresh debug model; the loss and the model, whose .grad are still lazy on XLA."""
    model = build_model(mcfg, seed=0)
    parallel.freeze(model, stage)
    model.loss_chunk, model.recompute = (40 if packed else 0), parallel.checkpoint_fn(env.kind)
    parallel.set_checkpointing(model, parallel.checkpoint_fn(env.kind) if checkpointing else None)
    model = parallel.shard(model, env)
    b = env.to_device(b)
    count = (b["labels"][:, 1:] != -100).sum().float()
    return train.forward_backward(model, b, env, cfg, 1 / count, objectives.OBJECTIVES["sft"]).detach(), model


def read(loss, model):
    grads = {n: None if p.grad is None else p.grad.float().cpu() for n, p in model.named_parameters()}
    return float(loss.float().cpu()), grads


def main(shapes, out):
    cfg = config.load_config([str(ROOT / "configs/debug.py"), f"--mesh={MESH}"])
    mcfg = config.model_config(cfg)
    cpu, xla = parallel.Env(cfg | {"device": "cpu"}), parallel.Env(cfg | {"device": "xla"})
    batches = {packed: batch(shapes, packed, mcfg) for packed in (False, True)}
    combos = list(itertools.product((0, 1, 2), ("float32", "bfloat16"), (False, True), (False, True)))
    results, t0 = {}, time.time()
    for c in combos:  # one compile each; tracing all 24 into one program compiled far slower
        run = cfg | {"stage": c[0], "dtype": c[1]}
        xla_step = micro_step(xla, run, mcfg, batches[c[3]], *c[::2], c[3])
        xla.step_end()
        results[c] = {"xla": read(*xla_step), "cpu": read(*micro_step(cpu, run, mcfg, batches[c[3]], *c[::2], c[3]))}
        print(c, f"{time.time() - t0:.1f}s", flush=True)
    torch.save(results, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
