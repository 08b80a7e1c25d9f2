"""The compiled-program audit of test_xla_audit.py: one stage-0 train step of a model whose weights dominate memory,
compiled by XLA for 8 CPU devices on several meshes (ours, and torch_xla's FSDPv2 on the same model), read back
from XLA's own dumps: the SPMD-partitioned HLO (collectives by kind and size) and its buffer assignment (the
per-device heap peak). Run as
    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" \
        python tests/xla_audit.py DIR OUT.json [dp,fsdp,tp ...] [fsdpv2]
"""

import functools
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import config  # noqa: E402
import parallel  # noqa: E402
import objectives  # noqa: E402
import train  # noqa: E402
from model import TransformerBlock, ViTBlock, build_model  # noqa: E402

# weights dominate: 4.5M parameters (18 MB fp32, 54 MB with AdamW's moments) against 8 rows of 40 tokens; sizes
# chosen so a batch dimension (8 rows, 320 or 40 tokens) never equals a weight's
MODEL = {"vision": {"image_size": 28, "patch_size": 14, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 256},
         "llm": {"vocab_size": 4096, "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 1024},
         "image_token_id": 4000}
ROWS, SEQ, VIT_TOKENS = 8, 40, 5
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s64": 8, "u8": 1, "s8": 1}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def shape_bytes(text):
    """Bytes of an HLO result shape such as f32[8,256]{1,0} or a tuple (f32[4], bf16[2,2])."""
    return sum(BYTES.get(t, 4) * int(torch.tensor([int(d) for d in dims.split(",") if d] or [1]).prod())
               for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", text))


def collectives(hlo):
    """(kind, result bytes, first result shape, its dtype) of every collective in an SPMD-partitioned HLO module's text."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?\S+ = (.+?) ([\w-]+)\(", line)
        if m and m.group(2).removesuffix("-start") in COLLECTIVES:
            dtype, dims = re.search(r"(\w+)\[([\d,]*)\]", m.group(1)).groups()
            kind = m.group(2).removesuffix("-start")
            found.append((kind, shape_bytes(m.group(1)), [int(d) for d in dims.split(",") if d], dtype))
    return found


def peak_bytes(buffer_assignment):
    """XLA's per-device heap peak, from the buffer-assignment dump's 'peak usage' line (parameters included)."""
    return int(re.search(r"peak usage: ([\d ]+) bytes", buffer_assignment).group(1).replace(" ", ""))


def local_bytes(tensors):
    import torch_xla

    shards = torch_xla._XLAC._get_local_shards(tensors)
    return sum(s[0][0].numel() * s[0][0].element_size() for s in shards)  # device 0's shard of each


def step(mesh_shape, fsdpv2):
    import torch_xla
    import torch_xla.core.xla_model

    cfg = config.load_config([f"--mesh={list(mesh_shape)}", "--device=xla", "--dtype=bfloat16", "--model=debug",
                             "--activation_checkpointing=True", f"--loss_chunk={ROWS * SEQ // 4}",
                             f"--model_overrides={MODEL}"])
    env = parallel.Env(cfg)
    model = build_model(config.model_config(cfg), seed=0)
    parallel.freeze(model, 0)
    model.loss_chunk, model.recompute = cfg["loss_chunk"], parallel.checkpoint_fn("xla")
    parallel.set_checkpointing(model, parallel.checkpoint_fn("xla"))  # as the TPU recipes
    if fsdpv2:  # torch_xla's own FSDP over SPMD, wrapping every block, on the same mesh
        from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock, ViTBlock})
        net = SpmdFullyShardedDataParallel(model, mesh=env.mesh, auto_wrap_policy=policy, shard_output=lambda o, m: None)
        model = net.module
    else:
        net = parallel.shard(model, env)
    optimizer = parallel.make_optimizer(model, env, cfg["lr"], (cfg["beta1"], cfg["beta2"]), cfg["weight_decay"],
                                         cfg["lr_scale"])
    parallel.init_optimizer_state(model, optimizer, env)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4000, (ROWS, SEQ), generator=g)
    ids[:, 1:5] = MODEL["image_token_id"]
    b = {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.randn(ROWS, 3, 28, 28, generator=g)}
    b = env.to_device(b)  # batch-sharded over (dp, fsdp) for both
    torch_xla.sync()
    count = (b["labels"][:, 1:] != -100).sum().float()
    train.forward_backward(net, b, env, cfg, 1 / count, objectives.OBJECTIVES["sft"])
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    torch_xla.sync()
    torch_xla.core.xla_model.wait_device_ops()
    params = [p for p in model.parameters()]
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {"param_bytes": local_bytes(params), "moment_bytes": local_bytes(moments),
            "full_param_bytes": sum(p.numel() * 4 for p in params)}


def main(dump, out, variants):
    results = {}
    for v in variants:
        before = set(dump.glob("*"))
        fsdpv2 = v == "fsdpv2"
        mesh = (1, 8, 1) if fsdpv2 else tuple(int(d) for d in v.split(","))
        r = step(mesh, fsdpv2)
        new = sorted(set(dump.glob("*")) - before)
        # the train step is the biggest module compiled for it
        hlo = max((p for p in new if p.name.endswith("after_optimizations.txt")), key=lambda p: p.stat().st_size)
        assignment = hlo.with_name(hlo.name.replace("after_optimizations.txt", "after_optimizations-buffer-assignment.txt"))
        found = collectives(hlo.read_text())
        r |= {"collectives": found, "peak_bytes": peak_bytes(assignment.read_text()), "module": hlo.name,
              "activation_bytes": ROWS * SEQ * MODEL["llm"]["dim"] * 4}
        results["fsdpv2" if fsdpv2 else "x".join(map(str, mesh))] = r
        print(v, {k: sum(1 for c, *_ in found if c == k) for k in COLLECTIVES}, r["peak_bytes"], flush=True)
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
