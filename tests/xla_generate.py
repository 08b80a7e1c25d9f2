"""generate(static=True) under torch_xla SPMD on CPU virtual devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4), for
test_grpo.py: python tests/xla_generate.py prints JSON: per call, the tokens on XLA and on CPU eager and the number of
graphs the call compiled."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import build_model, left_pad  # noqa: E402
from model_config import vlm_preset


def main():
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    mesh = xs.Mesh(np.arange(4), (4, 1), ("data", "model"))
    cfg = vlm_preset("debug").with_overrides({"llm": {"vocab_size": 96}, "image_token_id": 90})
    cpu = build_model(cfg, seed=0).eval()
    xla = build_model(cfg, seed=0).eval().to(torch_xla.device())
    suppress = torch.arange(96) >= 80
    g = torch.Generator().manual_seed(0)
    results = []
    for call, max_new in enumerate([3, 12, 12]):  # prompts of 2 to 9 tokens in a bucket of 10
        prompts = [torch.randint(3, 80, (n,), generator=g).tolist() for n in (2, 9, 5, 7, 3, 9, 4, 6)]
        ids, mask = left_pad(prompts, 0, length=10)
        kw = {"max_new_tokens": max_new, "temperature": 1.5, "top_p": 0.9, "eos_id": 5, "static": True}
        want = cpu.generate(ids, attention_mask=mask, suppress=suppress, generator=torch.Generator().manual_seed(call),
                            **kw)
        ids, mask = (t.to(torch_xla.device()) for t in (ids, mask))
        for t in (ids, mask):
            xs.mark_sharding(t, mesh, ("data", None))
        before = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
        got = xla.generate(ids, attention_mask=mask, suppress=suppress.to(ids.device), after_token=torch_xla.sync,
                           generator=torch.Generator().manual_seed(call), **kw)
        xs.mark_sharding(got, mesh, (None, None))  # fetched replicated: a sharded fetch compiles a gather
        got = got.cpu()
        results.append({"max_new": max_new, "cpu": want.tolist(), "xla": got.tolist(),
                        "compiles": met.metric_data("CompileTime")[0] - before})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
