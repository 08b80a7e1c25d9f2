"""
Training checkpoints: write (atomically, manifest last, optionally from a detached writer that outlives the
trainer's kill), verify, find the newest good one, prune, resume. train.py calls these; convert.py reads the
model part of a checkpoint directory.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import convert
from parallel import place_like, print0

# checkpoints: out_dir/step-XXXXXX/ holds model.safetensors + config.json (convert.py reads it),
# optimizer.safetensors + optimizer.json, rng.safetensors and state.json; written to a temporary
# directory and renamed, so a crash mid-write leaves the previous checkpoint as the newest. manifest.json (sizes and
# sha256 of the other files) is written last; resume takes the newest checkpoint that matches its manifest.
MANIFEST = "manifest.json"


def full_state(model, raw, optimizer, env):
    """Model and optimizer state by parameter name. Under SPMD the tensors stay sharded on the device: the
    writer gathers one at a time, so a host never holds more than one full tensor (a 7B-13B model saves on a pod)."""
    if env.kind == "xla":
        names = {p: n for n, p in raw.named_parameters()}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[p] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return raw.state_dict(), {"state": {names[p]: s for p, s in optimizer.state.items()}, "param_groups": groups}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True) if env.distributed else StateDictOptions()
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def checkpoints(out):
    """out_dir's step-N directories, oldest first: N of any width (step-1000000 follows step-999999)."""
    found = [(int(m.group(1)), p) for p in Path(out).glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))]
    return [p for _, p in sorted(found) if p.is_dir()]


def file_sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def sha256_all(files):
    """sha256 of several files at once: hashlib releases the GIL, so shards and the optimizer file hash in parallel."""
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(file_sha256, files))


def write_manifest(path):
    """manifest.json: the size and sha256 of every file in checkpoint directory `path`, read back from disk.
    Written last, so a checkpoint without one is incomplete; resume checks every file against it."""
    path = Path(path)
    names = [f for f in sorted(path.iterdir()) if f.is_file() and f.name != MANIFEST]
    files = {f.name: {"size": f.stat().st_size, "sha256": digest} for f, digest in zip(names, sha256_all(names))}
    tmp = path / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=2))
    tmp.rename(path / MANIFEST)


def verify_checkpoint(path):
    """None when checkpoint directory `path` is complete and unchanged since it was written, else the reason."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        expected = {name: (int(f["size"]), str(f["sha256"])) for name, f in files.items()}
    except FileNotFoundError:
        return f"no {MANIFEST} (written last: the write did not finish, or it is not a llavax training checkpoint)"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name in ("state.json", "config.json", "optimizer.safetensors"):
        if name not in expected:
            return f"{MANIFEST} does not list {name}"
    for name, (size, _) in expected.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, {size} when written (truncated or overwritten)"
    for (name, (_, digest)), now in zip(expected.items(), sha256_all([path / n for n in expected])):
        if now != digest:
            return f"{name} differs from its sha256 when written (corrupted on disk or edited)"
    return None


def newest_good_checkpoint(out, env):
    """The newest checkpoint that verifies. Newer ones that do not are renamed step-N.corrupt-T (kept for a look,
    out of the way of this run's own step-N) with the reason printed. Decided by rank 0 and broadcast."""
    choice = [None, []]  # the good one, [(a bad one, why)]
    if env.master:
        for path in reversed(checkpoints(out)):
            reason = verify_checkpoint(path)
            if reason is None:
                choice[0] = str(path)
                break
            choice[1].append((str(path), reason))
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None and choice[1]:
        raise SystemExit(f"resume: no checkpoint in {out} verifies:\n" + "".join(f"  {p}: {why}\n" for p, why in choice[1])
                         + "move them away to start from scratch, or point init_from at a good one")
    for bad, why in choice[1]:
        print0(env, f"resume: skipping {bad}: {why}")
        if env.master:
            Path(bad).rename(f"{bad}.corrupt-{int(time.time())}")
    if dist.is_initialized():
        dist.barrier()
    return Path(choice[0]) if choice[0] else None


def prune_checkpoints(out, newest, keep_last):
    """Keep the keep_last newest checkpoints up to `newest` (just written and verified); never touch a newer one."""
    upto = [p for p in checkpoints(out) if int(p.name[5:]) <= int(newest.name[5:])]
    for old in upto[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)


WRITER_PID = ".stop-writer.pid"  # in out_dir while a detached stop-checkpoint writer runs


def write_detached(write, out):
    """Run write() in a forked child in its own session, and wait for it while we live. torchrun SIGKILLs its
    workers 30 s after it forwards SIGTERM (REFERENCES.md 7) and a 7B state takes longer to write; its killpg
    does not reach another session, so the checkpoint is finished from the host snapshot the fork holds."""
    with warnings.catch_warnings():  # Python 3.12 warns on any fork of a threaded process: the child runs no threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            torch.set_num_threads(1)  # as DataLoader workers do: a forked child must not reuse the parent's pool
            write()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    (out / WRITER_PID).write_text(str(pid))
    _, status = os.waitpid(pid, 0)
    (out / WRITER_PID).unlink(missing_ok=True)
    if status:
        raise SystemExit(f"the stop checkpoint writer (pid {pid}) failed (exit {os.waitstatus_to_exitcode(status)}); "
                         "see its traceback above. The previous checkpoint is the newest")


def wait_for_stop_writer(out):
    """A run killed while its detached writer still worked left WRITER_PID: wait for that checkpoint to finish."""
    marker = Path(out) / WRITER_PID
    pid = int(marker.read_text() or 0) if marker.exists() else 0
    while pid and Path(f"/proc/{pid}").exists() and b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
        print(f"waiting for the stop checkpoint writer of the previous run (pid {pid}) to finish", flush=True)
        time.sleep(2)
    marker.unlink(missing_ok=True)


def save_checkpoint(path, model, raw, optimizer, loader, it, cfg, env, detach=False):
    """detach (the stop checkpoint): the state is snapshot to host memory and written by write_detached."""
    msd, osd = full_state(model, raw, optimizer, env)
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state(env.device)} if env.kind == "cuda" else {})
    ranks = [None] * env.world
    if env.distributed:
        dist.all_gather_object(ranks, rng)
    else:
        ranks = [rng]
    nonfinite = []
    if env.master or env.kind == "xla":  # torchrun gathers to rank 0 only; SPMD tensors are global on every host
        tied = raw.cfg.llm.tie_embeddings
        weights = {k: v.detach() for k, v in msd.items() if not (tied and k == "llm.output.weight")}
        moments = {f"{name}/{k}": v.detach().reshape(-1) if k == "step" else v.detach()
                   for name, s in osd["state"].items() for k, v in s.items()}
        tensors = weights | {k: v for k, v in moments.items() if not k.endswith("/step")}  # XLA keeps steps on the host
        finite = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).cpu().tolist()  # one sync
        nonfinite = [k for k, ok in zip(tensors, finite) if not ok]
    if env.agree(bool(nonfinite)):  # never write (and so never prune for) a checkpoint of non-finite weights
        found = checkpoints(path.parent)
        raise SystemExit(f"step {it}: not writing {path.name}: non-finite values in {nonfinite[:3] or 'the state'}"
                         f"{' and more' if len(nonfinite) > 3 else ''}. The last checkpoint is "
                         f"{found[-1] if found else 'none'}; resume from it with a lower lr")
    detach = detach and env.kind != "xla"  # XLA: every host gathers each tensor in step with host 0's writes
    if env.master:
        if detach:  # on CPU this copies nothing: the fork is the snapshot
            weights, moments = {k: v.cpu() for k, v in weights.items()}, {k: v.cpu() for k, v in moments.items()}

        def fill(tmp):
            convert.write_weights(weights, tmp)
            (tmp / "config.json").write_text(json.dumps(raw.cfg.to_dict(), indent=2))
            convert.write_safetensors(moments, tmp / "optimizer.safetensors")
            (tmp / "optimizer.json").write_text(json.dumps({"param_groups": osd["param_groups"]}, indent=2))
            convert.write_safetensors({f"rank{r}.{k}": v for r, s in enumerate(ranks) for k, v in s.items()},
                                      tmp / "rng.safetensors")
            for name in ("tokenizer.model", "tokenizer.json"):
                if Path(cfg["tokenizer"]).name == name and Path(cfg["tokenizer"]).exists():
                    shutil.copy(cfg["tokenizer"], tmp / name)
            (tmp / "state.json").write_text(json.dumps({"iter": it, "loader": loader.state_dict(), "config": cfg,
                                                        "world": env.world}, indent=2))
            write_manifest(tmp)  # last: its presence means every other file is complete

        def write():
            time.sleep(float(os.environ.get("LLAVAX_TEST_SLOW_CHECKPOINT", "0")))  # tests only: a slow disk
            convert.write_dir(path, fill)
            prune_checkpoints(path.parent, path, cfg["keep_last"])

        if detach:
            write_detached(write, path.parent)
        else:
            write()
    elif env.kind == "xla":  # every host takes part in gathering each tensor, in the same order; host 0 writes
        for t in [*weights.values(), *moments.values()]:
            t.cpu()
    if dist.is_initialized():
        dist.barrier()


# keys whose change on resume would alter the data order, the batches or the model: refused unless listed in
# allow_config_change (the model itself always comes from the checkpoint). Every other key may change.
FIXED_ON_RESUME = ("seed", "batch_size", "micro_batch_size", "pack", "max_tiles", "seq_len", "data_dir", "tokenizer",
                   "template", "image_mode", "shuffle_block", "stage", "model", "model_overrides", "world")


def check_resume_config(path, cfg, env):
    """Say which keys differ from the checkpoint's config; stop if one that may not change did."""
    try:
        state = json.loads((path / "state.json").read_text())
        saved = state["config"] | {"world": state.get("world", env.world)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path / 'state.json'}: unreadable ({type(e).__name__}: {e})") from None
    now = json.loads(json.dumps(cfg | {"world": env.world}))  # tuples become lists, as in the saved one
    changed = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k] and k != "init_from"}
    refused = [k for k in changed if k in FIXED_ON_RESUME and k not in cfg["allow_config_change"]]
    for k, (a, b) in changed.items():
        verdict = "refused" if k in refused else "allowed by allow_config_change" if k in FIXED_ON_RESUME else "allowed"
        print0(env, f"resume: {k} changed from {a!r} to {b!r} ({verdict})")
    if refused:
        raise SystemExit(f"resume: {path} was trained with other {', '.join(refused)} (see above); these set the "
                         f"data order, the batches or the model. Resume with the same values, list the keys in "
                         f"--allow_config_change=[...] to accept the change, or start a new out_dir")


def load_checkpoint(path, model, raw, optimizer, loader, env):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    state = json.loads((path / "state.json").read_text())
    moments = load_file(path / "optimizer.safetensors")
    groups = json.loads((path / "optimizer.json").read_text())["param_groups"]
    osd = {"state": {}, "param_groups": groups}
    for key, v in moments.items():
        name, k = key.rsplit("/", 1)
        osd["state"].setdefault(name, {})[k] = v.reshape(()) if k == "step" else v
    if env.kind == "xla":  # each moment goes to the device sharded like its parameter
        params = dict(raw.named_parameters())
        unknown = sorted(set(osd["state"]) - {n for n, p in params.items() if p.requires_grad})
        if unknown or len(groups) != len(optimizer.param_groups):
            raise SystemExit(f"{path}: optimizer state does not fit this run (stage or model differ): "
                             f"{len(groups)} vs {len(optimizer.param_groups)} groups, unknown {unknown[:5]}")
        for name, s in osd["state"].items():
            optimizer.state[params[name]] = {k: v if k == "step" else place_like(v, name, env)
                                             for k, v in s.items()}
        for g, saved in zip(optimizer.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k not in ("params", "lr")})
    else:
        opts = StateDictOptions(full_state_dict=True) if env.distributed else StateDictOptions()
        set_optimizer_state_dict(model, optimizer, osd, options=opts)
    rng = load_file(path / "rng.safetensors")
    if f"rank{env.rank}.cpu" in rng:
        torch.set_rng_state(rng[f"rank{env.rank}.cpu"])
        if env.kind == "cuda" and f"rank{env.rank}.cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{env.rank}.cuda"], env.device)
    try:
        loader.load_state_dict(state["loader"])
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None
    return state["iter"]
