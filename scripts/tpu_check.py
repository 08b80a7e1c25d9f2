"""The TPU verdict, run by scripts/tpu_check.sh on one TPU VM (v4-8, v5e-8): a table of

1. attention: SDPA ('dense') against attention='blockwise' and torch_xla's Pallas kernels ('flash', 'splash') on one
   Qwen2-7B decoder layer at 2k, 8k and 32k tokens a row, one row a chip, bf16: the loss and every gradient against
   dense (blockwise where dense cannot fit), within 1e-2 (the gradients' relative norm over every parameter); the
   compiled program's peak memory a chip (the device's peak so far where no buffer assignment is dumped); the step
   time; dense is not run where its T x T scores cannot fit a chip;
2. one training step of each TPU recipe (LLaVA-1.5 stage 1, LLaVA-NeXT-7B, OneVision-7B) at their real widths and
   lengths, 2 layers deep, through train.py itself on a few synthetic shapes samples;
3. the compile count after warm-up, as the batches' packing and tiles vary;
4. a checkpoint saved at step 2 and resumed: step 3's loss as without the stop;
5. DPO, GRPO and PPO through their OneVision configs (from a OneVision-shaped checkpoint of random weights): 3 steps,
   the compile count after warm-up, and step 2 resumed.

--cpu runs a dry version on 4 CPU XLA devices (tiny widths, 1 layer, 320 tokens, fp32 for the attention check):
the tests run it. The Pallas kernels then report their refusal. Exit status 1 when any check fails. Not yet run on a
TPU: the Pallas rows, the TPU figures and the 10-minute budget are unverified.
"""

import argparse
import importlib.util
import json
import math
import re
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import config  # noqa: E402
import model_files  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from model import build_model  # noqa: E402
from model_config import vlm_preset  # noqa: E402

KERNELS = ("dense", "blockwise", "flash", "splash")
LENGTHS = {"tpu": (2048, 8192, 32768), "cpu": (320,)}
# the recipes and the preset each starts from (their init_from is a converted checkpoint; here: random weights)
RECIPES = {"configs/tpu_pretrain.py": "llava-1.5-7b", "configs/llava_next_7b.py": "llava-next-vicuna-7b",
           "configs/onevision_qwen2_7b.py": "llava-onevision-qwen2-7b"}
# the objectives after SFT, each from a OneVision-shaped checkpoint of the same widths (random weights) and the
# settings a dry run changes: how much is generated, GRPO's group, and PPO's mini-batch (a step's prompts)
OBJECTIVES = {"configs/dpo_onevision.py": ["--dpo_reference={init}", "--data_dir={shapes}/preference"],
              # a reward model, not the config's exact match: random weights would score every completion 0
              "configs/grpo_onevision.py": ["--grpo_reward={judge}", "--grpo_max_new_tokens={new}", "--grpo_group=4"],
              "configs/ppo_onevision.py": ["--grpo_reward={judge}", "--grpo_reference={init}",
                                           "--grpo_max_new_tokens={new}", "--ppo_mini_batch_size={rows}"]}
# --cpu: one layer a tower (the compiles are most of its time), tiny widths
TINY_VISION = {"image_size": 28, "patch_size": 14, "dim": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64}
TINY_LLM = {"vocab_size": 576, "dim": 64, "n_layers": 1, "n_heads": 4, "ffn_dim": 128}


class Verdict:
    def __init__(self):
        self.rows, self.start = [], time.perf_counter()

    def add(self, check, setting, result, verdict):
        self.rows.append({"check": check, "setting": setting, "result": result, "verdict": verdict})
        print(f"[{time.perf_counter() - self.start:.0f} s] {verdict:5} {check} | {setting} | {result}", flush=True)

    def table(self):
        lines = ["| check | setting | result | verdict |", "|---|---|---|---|"]
        return "\n".join(lines + [f"| {r['check']} | {r['setting']} | {r['result']} | {r['verdict']} |"
                                  for r in self.rows])


def packed_rows(rows, T, seed, vocab):
    """Random tokens in rows packed with samples of uneven lengths (position_ids restart at each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, T), generator=g)
    positions = torch.empty(rows, T, dtype=torch.long)
    for r in range(rows):
        cuts = sorted(set(torch.randint(1, T, (4,), generator=g).tolist()))
        for a, b in zip([0, *cuts], [*cuts, T]):
            positions[r, a:b] = torch.arange(b - a)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


# -----------------------------------------------------------------------------
# 1. attention kernels


def program_peak(dump, before):
    """The per-device heap peak of the largest program compiled since `before` (XLA's buffer-assignment dump), or None
    where the backend wrote none."""
    new = sorted(set(dump.glob("*buffer-assignment.txt")) - before, key=lambda p: p.stat().st_size)
    found = re.search(r"peak usage: ([\d ]+) bytes", new[-1].read_text()) if new else None
    return int(found.group(1).replace(" ", "")) if found else None


def attention_step(mcfg, kernel, block, b, env, dtype, dump):
    """Two forward-backward passes; (loss, gradients on the device, seconds of the second, peak bytes)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    model = build_model(mcfg, seed=0)
    parallel.shard_spmd(model, env)
    model.llm.attention_kernel = parallel.attention_kernel(kernel, block, env)
    count = (b["labels"][:, 1:] != -100).sum()
    torch_xla.sync()  # count is data from here on, or the second pass would compile another program
    before = set(dump.glob("*buffer-assignment.txt")) if dump else set()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            _, loss = model(b["input_ids"], None, b["labels"], "sum", b["position_ids"])
        (loss / count).backward()
        torch_xla.sync()
        xm.wait_device_ops()
        seconds = time.perf_counter() - start
    peak = program_peak(dump, before) if dump else None
    if peak is None and xr.device_type() == "TPU":
        peak = xm.get_memory_info(env.device)["peak_bytes_used"]  # the process's so far: an upper bound
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    return float(env.to_host(loss.detach() / count)), grads, seconds, peak


def grad_error(grads, ref):
    """|g - g_ref| / |g_ref| over every parameter's gradient together, computed on the device."""
    diff = sum((grads[n].float() - g.float()).pow(2).sum() for n, g in ref.items())
    return float((diff / sum(g.float().pow(2).sum() for g in ref.values())).sqrt().cpu())


def check_attention(verdict, env, cpu, dump):
    """Each kernel on the same packed rows, against the first that ran (dense where its scores fit). --cpu: fp32 and
    tiny (the plumbing; tests/test_xla_attention.py holds blockwise to 1e-5 there); on a TPU bf16 within 1e-2."""
    rows = env.n_devices
    dtype, tolerance, block = ("float32", 1e-4, 128) if cpu else ("bfloat16", 1e-2, 512)
    preset = "debug" if cpu else "llava-onevision-qwen2-7b"
    llm = TINY_LLM | {"n_layers": 1, "n_kv_heads": 2, "max_seq_len": 1024} if cpu else {"n_layers": 1, "vocab_size": 1024}
    mcfg = vlm_preset(preset).with_overrides({"llm": llm, "vision": {"n_layers": 1}, "image_token_id": 1000})
    c, hbm = mcfg.llm, None if cpu else parallel_hbm(env)
    for T in LENGTHS["cpu" if cpu else "tpu"]:
        b = env.to_device(packed_rows(rows, T, seed=T, vocab=min(c.vocab_size, 1000)))
        ref = None
        for kernel in KERNELS:
            setting = f"{kernel}, {T} tokens x {rows} rows, {dtype}"
            scores = c.n_heads * T * T * 4 * 3  # fp32 scores, probabilities and their gradient, a row a chip
            if kernel == "dense" and hbm and scores > 0.8 * hbm:
                verdict.add("attention", setting, f"not run: its T x T scores need {scores / 2**30:.0f} GiB a chip, "
                                                  f"the chip has {hbm / 2**30:.0f}", "SKIP")
                continue
            try:
                loss, grads, seconds, peak = attention_step(mcfg, kernel, block, b, env, dtype, dump)
            except SystemExit as e:  # refused: not a TPU, or no Pallas extra
                verdict.add("attention", setting, f"refused: {e}", "SKIP")
                continue
            except Exception as e:  # noqa: BLE001  the verdict names it; the other checks still run
                out_of_memory = kernel == "dense" and "RESOURCE_EXHAUSTED" in str(e)  # what the bounded kernels avoid
                verdict.add("attention", setting, failure(e), "SKIP" if out_of_memory else "FAIL")
                continue
            figures = f"loss {loss:.5f}, {seconds:.3f} s a step, peak {'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}"
            if ref is None:
                ref = (kernel, loss, grads)
                verdict.add("attention", setting, f"{figures} (the reference)", "PASS" if math.isfinite(loss) else "FAIL")
                continue
            loss_err, err = abs(loss - ref[1]) / abs(ref[1]), grad_error(grads, ref[2])
            verdict.add("attention", setting, f"{figures}; against {ref[0]}: loss {loss_err:.1e}, gradients {err:.1e}",
                        "PASS" if loss_err <= tolerance and err <= tolerance else "FAIL")


def parallel_hbm(env):
    import torch_xla.core.xla_model as xm

    try:
        return xm.get_memory_info(env.device)["bytes_limit"]
    except RuntimeError:
        return None


# -----------------------------------------------------------------------------
# 2-4. the recipes through train.py


def recipe_args(recipe, preset, shapes, out, rows, cpu):
    """train.py's arguments: the recipe, 2 layers deep (--cpu: 1 and tiny), on the shapes samples, a row a device."""
    vlm = vlm_preset(preset)
    if cpu:  # the recipe's kind of model (tower, GQA, anyres, video token) at tiny widths and 28 px tiles
        overrides = {"vision": TINY_VISION, "image_token_id": 512,
                     "llm": TINY_LLM | {"n_kv_heads": 2 if vlm.llm.n_kv_heads < vlm.llm.n_heads else 4}}
        if vlm.video_token_id is not None:
            overrides["video_token_id"] = 513
        if vlm.anyres:
            overrides["grid_pinpoints"] = [[28, 56], [56, 28], [56, 56]]
        shape = ["--seq_len=256"]
    else:
        overrides, shape = {"llm": {"n_layers": 2}, "vision": {"n_layers": 2}}, []
    # the bounded attention these lengths need: splash where the Pallas kernels are (a TPU with jax), else blockwise
    attention = "splash" if not cpu and importlib.util.find_spec("jax") else "blockwise"
    return [str(ROOT / recipe), f"--model={preset}", f"--model_overrides={overrides!r}", "--init_from=scratch",
            "--device=xla", "--mesh=[1,-1,1]", f"--data_dir={shapes / 'shards'}",
            f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={out}", f"--batch_size={rows}",
            f"--micro_batch_size={rows}", "--warmup_iters=1", "--lr_decay_iters=4", "--log_interval=1",
            "--eval_interval=0", "--final_accuracy_samples=0", f"--num_workers={0 if cpu else 1}",
            f"--attention={attention}", *shape]


def losses(out):
    return [e for e in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in e]


def check_recipes(verdict, env, cpu, work):
    from shapes import make_shapes

    shapes = work / "shapes"
    make_shapes(shapes, n=120, seed=0, val_fraction=0.1, preference=True)
    rows, resumable = env.n_devices, "configs/onevision_qwen2_7b.py"
    for recipe, preset in RECIPES.items():
        # OneVision's run saves step 2, for the checkpoint check (a save compiles nothing: local shards are written)
        saves = ["--ckpt_interval=2", "--keep_last=5"] if recipe == resumable else ["--ckpt_interval=0"]
        three_steps(verdict, "recipe step", recipe, f"{recipe} ({preset}, {'1 layer, tiny' if cpu else '2 layers'})",
                    recipe_args(recipe, preset, shapes, work / Path(recipe).stem, rows, cpu) + saves)
    check_checkpoint(verdict, work, shapes, rows, cpu, resumable)
    check_objectives(verdict, env, cpu, work, shapes)


def three_steps(verdict, check, recipe, setting, argv):
    """train.py for 3 steps with argv: a row for its losses, and one for its compile count, which grows at steps 1
    and 2 (the second sees AdamW's state), then stays: one program whatever the packing and tiles. Whether it ran."""
    try:
        start = time.perf_counter()
        train.main(argv + ["--max_iters=3"])
        seconds, log = time.perf_counter() - start, losses(Path(config.load_config(argv)["out_dir"]))
    except (Exception, SystemExit) as e:  # noqa: BLE001  the verdict names it; the other checks still run
        verdict.add(check, recipe, failure(e), "FAIL")
        return False
    finite = len(log) == 3 and all(math.isfinite(e["loss"]) for e in log)
    verdict.add(check, setting, "losses " + " ".join(f"{e['loss']:.4f}" for e in log) +
                f"; 3 steps in {seconds:.0f} s with compiles", "PASS" if finite else "FAIL")
    compiles = [e["xla_compiles"] for e in log]
    verdict.add("compiles after warm-up", recipe, f"running total after each step: {compiles}",
                "PASS" if len(compiles) == 3 and compiles[1] == compiles[2] else "FAIL")
    return True


def check_objectives(verdict, env, cpu, work, shapes):
    """DPO, GRPO and PPO through their OneVision configs as written (objective, loss, bounded attention, tiles), at the
    recipe's dry widths: 3 steps, the compile count after warm-up, and step 2 resumed."""
    from model import build_model

    rows, preset = env.n_devices, "llava-onevision-qwen2-7b"
    probe = config.load_config(recipe_args("configs/onevision_qwen2_7b.py", preset, shapes, work / "probe", rows, cpu))
    vlm = vlm_preset(preset).with_overrides(probe["model_overrides"])
    init, judge = work / "ov-init", work / "ov-judge"  # the SFT checkpoint, and a reward model of its layout
    model_files.save_model(build_model(vlm, seed=0), init)
    model_files.save_model(build_model(vlm.with_overrides({"reward_head": True}), seed=5), judge)
    fill = {"init": init, "judge": judge, "shapes": shapes, "rows": rows, "new": 4 if cpu else 64}
    for recipe, extra in OBJECTIVES.items():
        name = Path(recipe).stem
        argv = recipe_args(recipe, preset, shapes, work / name, rows, cpu) + [f"--init_from={init}"] + \
            [a.format(**fill) for a in extra]
        if three_steps(verdict, "objective step", recipe, f"{recipe} ({'1 layer, tiny' if cpu else '2 layers'})",
                       argv + ["--ckpt_interval=2", "--keep_last=5"]):
            check_checkpoint(verdict, work, shapes, rows, cpu, recipe, argv)


def check_checkpoint(verdict, work, shapes, rows, cpu, recipe, argv=None):
    """A run resumes the recipe run's step 2 and trains step 3 again: the same loss."""
    saved, resumed = work / Path(recipe).stem, work / f"resumed-{Path(recipe).stem}"
    argv = argv or recipe_args(recipe, RECIPES[recipe], shapes, resumed, rows, cpu)
    try:
        resumed.mkdir()
        shutil.copytree(saved / "step-000002", resumed / "step-000002")
        train.main(argv + [f"--out_dir={resumed}", "--max_iters=3", "--ckpt_interval=0", "--resume=True"])
        straight, again = losses(saved)[-1], losses(resumed)[-1]
    except (Exception, SystemExit) as e:  # noqa: BLE001
        verdict.add("checkpoint", recipe, failure(e), "FAIL")
        return
    # and the gradient's norm: GRPO's loss is about 0 on policy (its advantages are centred in each group)
    same = again["step"] == straight["step"] == 3 and all(abs(again[k] - straight[k]) <= 1e-4 * abs(straight[k])
                                                          for k in ("loss", "grad_norm"))
    # a TPU host's compile cache (on by default there): the resumed run loads what the first compiled
    cache = (f"; {again['xla_cache_hit']} program(s) loaded from the compile cache, {again['xla_compile_s']:.0f} s "
             f"compiling (the first run: {straight['xla_compile_s']:.0f} s)" if "xla_cache_hit" in again else "")
    verdict.add("checkpoint", f"{recipe}: saved at step 2, resumed", f"step 3's loss {again['loss']:.6f}, grad norm "
                f"{again['grad_norm']:.6f}; without the stop {straight['loss']:.6f}, {straight['grad_norm']:.6f}" + cache,
                "PASS" if same else "FAIL")


def failure(e):
    traceback.print_exc()
    return f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the dry version on CPU XLA devices (PJRT_DEVICE=CPU)")
    p.add_argument("--out", required=True, help="folder for the verdict (verdict.md, verdict.json) and the runs")
    p.add_argument("--dump", default="", help="the XLA_FLAGS --xla_dump_to folder, for the programs' peak memory")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config.load_config(["--device=xla", "--mesh=[1,-1,1]"])
    env = parallel.Env(cfg)
    verdict = Verdict()
    print(f"tpu_check: {env.n_devices} XLA devices ({'CPU, dry run' if args.cpu else 'TPU'})", flush=True)
    check_attention(verdict, env, args.cpu, Path(args.dump) if args.dump else None)
    check_recipes(verdict, env, args.cpu, out / "runs")
    (out / "verdict.md").write_text(verdict.table() + "\n")
    (out / "verdict.json").write_text(json.dumps(verdict.rows, indent=1))
    print("\n" + verdict.table())
    failed = [r for r in verdict.rows if r["verdict"] == "FAIL"]
    print(f"\ntpu_check: {len(verdict.rows) - len(failed)} of {len(verdict.rows)} checks pass or are skipped; "
          f"{len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
