"""The bounded-memory attention (attention='blockwise') on torch_xla SPMD over CPU_NUM_DEVICES=4, for
test_xla_attention.py: python tests/xla_attention.py DUMP_DIR OUT.json (XLA_FLAGS must dump into DUMP_DIR).

- parity: a tiny VLM's loss and every gradient, blockwise on XLA (mesh 1x2x2: rows over fsdp, heads over tp) against
  the dense SDPA path on CPU eager, in fp32: causal, packed rows of odd lengths, GQA, Qwen2's sliding window, T not a
  multiple of the block, under torch_xla's activation checkpointing;
- memory: the per-device peak of the compiled train step (XLA's buffer assignment, as tests/xla_audit.py reads it) of
  a 1-layer model at T = 2k..16k, blockwise and dense (compiled, never run);
- compiles: five steps whose packing and tiles differ, one compiled program;
- the Pallas kernels' refusal on a CPU XLA device.
"""

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import config  # noqa: E402
import parallel  # noqa: E402
from model import build_model  # noqa: E402
from model_config import vlm_preset  # noqa: E402
from xla_audit import peak_bytes  # noqa: E402

TINY_VISION = {"image_size": 28, "patch_size": 14, "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}
# (name, llm overrides, T, block, packed, torch_xla's activation checkpointing): 300 tokens are not a multiple of any
# block; the window is in layer 1 only
WINDOW = {"n_heads": 4, "n_kv_heads": 2, "sliding_window": 45, "sliding_layers": [1]}
PARITY = [
    ("causal", {"n_heads": 4, "n_kv_heads": 4}, 300, 128, False, False),
    ("gqa", {"n_heads": 4, "n_kv_heads": 2}, 300, 64, True, False),
    ("window", WINDOW, 300, 64, True, False),
    ("one_block", {"n_heads": 4, "n_kv_heads": 1}, 100, 128, True, False),
    ("checkpointed", WINDOW, 300, 64, True, True),
]
MEMORY_T = (2048, 4096, 8192, 16384)
MEMORY_LLM = {"vocab_size": 256, "dim": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 128,
              "max_seq_len": 16384}


def model_config(llm):
    return vlm_preset("debug").with_overrides({"vision": TINY_VISION, "image_token_id": 250,
                                               "llm": {"vocab_size": 256, "dim": 64, "n_layers": 2, "ffn_dim": 128,
                                                       "max_seq_len": 16384} | llm})


def packed_rows(rows, T, seed, packed=True, vocab=250):
    """input_ids, labels, position_ids of rows packed with samples of random (odd, uneven) lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, T), generator=g)
    if not packed:
        return {"input_ids": ids, "labels": ids.clone()}
    positions = torch.empty(rows, T, dtype=torch.long)
    for r in range(rows):
        cuts = sorted(set(torch.randint(1, T, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist()))
        starts = [0, *cuts]
        for a, b in zip(starts, [*cuts, T]):
            positions[r, a:b] = torch.arange(b - a)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def loss_and_grads(model, b):
    count = (b["labels"][:, 1:] != -100).sum()
    _, loss = model(b["input_ids"], None, b["labels"], "sum", b.get("position_ids"))
    loss = loss / count
    loss.backward()
    return loss


def parity(env_xla):
    results = {}
    for name, llm, T, block, packed, checkpointed in PARITY:
        mcfg = model_config(llm)
        b = packed_rows(4, T, seed=len(results), packed=packed)
        cpu = build_model(mcfg, seed=0)
        loss_cpu = loss_and_grads(cpu, b)
        xla = build_model(mcfg, seed=0)
        parallel.set_checkpointing(xla, parallel.checkpoint_fn("xla") if checkpointed else None)
        parallel.shard_spmd(xla, env_xla)
        xla.llm.attention_kernel = parallel.attention_kernel("blockwise", block, env_xla)
        loss_xla = loss_and_grads(xla, env_xla.to_device(b))
        env_xla.step_end()
        grads = {n: (p.grad, dict(cpu.named_parameters())[n].grad) for n, p in xla.named_parameters()
                 if p.grad is not None}
        results[name] = {"loss": [float(loss_xla.detach().cpu()), float(loss_cpu)],
                         "grad_err": max(float((g.cpu() - c).abs().max() / c.abs().max().clamp(min=1e-12))
                                         for g, c in grads.values()),
                         "n_grads": len(grads), "n_params": sum(1 for _ in cpu.parameters())}
        print("parity", name, results[name], flush=True)
    return results


def compiled_peak(dump, tensors):
    """Compile (never run) the graph computing `tensors`; its per-device heap peak from the buffer assignment."""
    import torch_xla

    before = set(dump.glob("*buffer-assignment.txt"))
    torch_xla._XLAC._xla_warm_up_cache(tensors, [])
    new = sorted(set(dump.glob("*buffer-assignment.txt")) - before, key=lambda p: p.stat().st_size)
    return peak_bytes(new[-1].read_text())


def memory(env_xla, dump):
    """Per-device peak bytes of a 1-layer model's forward and backward at each T, 4 rows over fsdp (one a device)."""
    import torch_xla

    mcfg = vlm_preset("debug").with_overrides({"vision": TINY_VISION, "image_token_id": 250, "llm": MEMORY_LLM})
    results = {"blockwise": {}, "dense": {}}
    for kind, lengths in (("blockwise", MEMORY_T), ("dense", MEMORY_T[:2])):
        for T in lengths:
            model = build_model(mcfg, seed=0)
            parallel.shard_spmd(model, env_xla)
            model.llm.attention_kernel = parallel.attention_kernel(kind, 512, env_xla)
            b = env_xla.to_device(packed_rows(4, T, seed=T))
            torch_xla.sync()
            loss = loss_and_grads(model, b)
            results[kind][T] = compiled_peak(dump, [loss] + [p.grad for p in model.parameters() if p.grad is not None])
            print("memory", kind, T, results[kind][T], flush=True)
            del model, b, loss  # nothing of it runs
    return results


def compiles(env_xla):
    """Steps of a tiled, packed VLM (OneVision-style: anyres features placed by index) whose packing and tiles differ
    each step; the XLA compile count after each."""
    import torch_xla
    import torch_xla.debug.metrics as met

    mcfg = model_config({"n_heads": 4, "n_kv_heads": 2})
    model = build_model(mcfg, seed=0)
    parallel.shard_spmd(model, env_xla)
    model.llm.attention_kernel = parallel.attention_kernel("blockwise", 64, env_xla)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    counts, rows, T, slots, taps = [], 4, 200, 12, 4
    table = 1 + slots * mcfg.n_image_tokens  # place_features' table: image_newline, then every slot's features
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        b = packed_rows(rows, T, seed=100 + step)
        n_image = int(torch.randint(10, 120, (), generator=g))  # this step's placeholders: tiles and their count vary
        b["input_ids"][:, :n_image] = mcfg.image_token_id
        b["labels"][:, :n_image] = -100
        b["image_index"] = torch.randint(0, table, (rows, T, taps), generator=g)
        b["image_weight"] = torch.rand(rows, T, taps, generator=g)
        b["pixel_values"] = torch.randn(rows, slots, 3, 28, 28, generator=g)  # each row's tile slots
        b = env_xla.to_device(b)
        _, loss = model(b["input_ids"], b["pixel_values"], b["labels"], "sum", b["position_ids"], b["image_index"],
                        b["image_weight"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        counts.append(met.metric_data("CompileTime")[0])
        print("compiles", step, counts[-1], float(loss.cpu()), flush=True)
    return counts


def refusals(env_xla):
    out = {}
    for kind in parallel.PALLAS:
        try:
            parallel.attention_kernel(kind, 512, env_xla)
            out[kind] = None
        except SystemExit as e:
            out[kind] = str(e)
    return out


def main(dump, out):
    cfg = config.load_config([str(ROOT / "configs/debug.py"), "--mesh=[1,2,2]", "--device=xla"])
    env = parallel.Env(cfg)
    t0, results = time.time(), {}
    results["refusals"] = refusals(env)
    results["parity"] = parity(env) if "--skip-parity" not in sys.argv else {}
    print(f"parity done {time.time() - t0:.0f}s", flush=True)
    env.mesh = parallel.make_mesh([1, 4, 1], [1, 1, 1], env.n_devices)  # memory and compiles: a row a device
    results["memory"] = memory(env, dump)
    print(f"memory done {time.time() - t0:.0f}s", flush=True)
    results["compiles"] = compiles(env)
    print(f"compiles done {time.time() - t0:.0f}s", flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
