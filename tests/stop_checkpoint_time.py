"""How long a stop checkpoint holds the training process, for BENCHMARKS.md (not a test).

    python tests/stop_checkpoint_time.py PRESET OUT_DIR [LLM_LAYERS]

Builds PRESET (LLM_LAYERS overrides its LLM depth) as stage 2 trains it, with AdamW moments, on the GPU if there is
one, and times (1) a synchronous save_checkpoint (rank 0 writes the whole state: what torchrun's 30 s must cover
without the detached writer) and the os.sync() after it, and (2) what the detached stop checkpoint needs inside the
grace period: the state copied to host memory and the fork of the writer. The 7B recipe's figures are printed from
its parameter count."""

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint  # noqa: E402
import train  # noqa: E402
from model import build_model, vlm_preset  # noqa: E402
from parallel import Env  # noqa: E402


def state_bytes(cfg):
    with torch.device("meta"):
        model = build_model(cfg, device="meta", init=False)
    train.freeze(model, 2)
    weights = sum(p.numel() for p in model.parameters()) * 4  # fp32 master weights
    moments = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 * 2  # AdamW exp_avg, exp_avg_sq
    return weights, moments


def main(preset, out, llm_layers=0):
    w, m = state_bytes(vlm_preset("llava-1.5-7b"))
    print(f"llava-1.5-7b stage 2: weights {w / 1e9:.1f} GB + AdamW moments {m / 1e9:.1f} GB = {(w + m) / 1e9:.1f} GB")
    vcfg = vlm_preset(preset)
    if llm_layers:
        vcfg = replace(vcfg, llm=replace(vcfg.llm, n_layers=int(llm_layers)))
    cfg = dict(train.DEFAULTS) | {"stage": 2, "keep_last": 0, "tokenizer": ""}
    env = Env(cfg)
    raw = build_model(vcfg, device=env.device, seed=0)
    train.freeze(raw, 2)
    optimizer = train.make_optimizer(raw, cfg, env)
    for p in raw.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()  # the moments exist
    w, m = sum(p.numel() for p in raw.parameters()) * 4, sum(p.numel() for p in raw.parameters() if p.requires_grad) * 8
    loader = SimpleNamespace(state_dict=lambda: {})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train.save_checkpoint(out / "step-000001", raw, raw, optimizer, loader, 1, cfg, env)
    t_write = time.perf_counter() - t0
    os.sync()
    t_synced = time.perf_counter() - t0
    # the detached stop checkpoint: state to host memory, then the fork; the writer then works on its own
    if env.kind == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    msd, osd = checkpoint.full_state(raw, raw, optimizer, env)
    host = [v.cpu() for v in msd.values()] + [v.cpu() for s in osd["state"].values() for v in s.values()]
    t_host = time.perf_counter() - t0
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    t_fork = time.perf_counter() - t0 - t_host
    os.waitpid(pid, 0)
    print(json.dumps({"preset": preset, "llm_layers": vcfg.llm.n_layers, "device": str(env.device),
                      "state_gb": round((w + m) / 1e9, 2), "write_s": round(t_write, 2),
                      "write_and_sync_s": round(t_synced, 2), "write_gb_per_s": round((w + m) / 1e9 / t_synced, 2),
                      "to_host_s": round(t_host, 2), "fork_s": round(t_fork, 3), "host_tensors": len(host)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
