"""
Backends for train.py, applied after freezing, checkpointing and compile: torchrun (DDP or FSDP2, CUDA or
CPU/gloo) and torch_xla SPMD over a (dp, fsdp, tp) device mesh. The model knows nothing of them.

Under torchrun each process is a rank that averages gradients with the others. Under SPMD there is one
process per host running one program over every device: tensors are global, the compiler inserts the
collectives from the sharding annotations below, and each host reads its own part of the data.
"""

import functools
import importlib.util
import os
import re
import resource
import sys
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import storage
from attention import blockwise_attention, loop_scan
from lora import is_lora_parameter
from model import param_group

AXES = ("dp", "fsdp", "tp")
BATCH = ("dp", "fsdp")  # the batch dimension of inputs and activations is split over both data axes


def start_compile_cache(folder):
    """torch_xla's persistent compilation cache in `folder` ('' = a folder of this host's, per torch_xla version, on
    a TPU; 'none' = off), set before anything compiles: a restart (a preemption, the babysitter) loads the programs
    its predecessor compiled. A folder that cannot be made is a warning and no cache; an entry that cannot be read
    (another torch_xla or libtpu, a cut file) is compiled afresh, which torch_xla does itself. torch_xla's CPU
    devices write entries but cannot load them: there '' is off. (the folder, or '', and why there is none)."""
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():  # this process compiled already (tpu_check.py runs
        # train.main after its own checks): its cache, if it set one, stays
        return os.environ.get("XLA_PERSISTENT_CACHE_PATH", ""), "this process compiled before one was set"
    if folder == "none":
        return "", "compile_cache_dir='none'"
    if not folder and xr.device_type() == "CPU":
        return "", "CPU devices cannot load one"
    folder = str(Path(folder or Path.home() / ".cache" / "llavax" / f"xla-{torch_xla.__version__}").expanduser())
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe = Path(folder) / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        print(f"xla: compile_cache_dir {folder} cannot be written ({e.strerror or e}): compiling without a cache",
              file=sys.stderr, flush=True)
        return "", "its folder cannot be written"
    xr.initialize_cache(folder, readonly=False)
    return folder, ""


def compile_cache_mirror(env, out):
    """Where this host's compile cache is kept beside a bucket out_dir (out/xla-cache/VERSION/host-R), or None: a
    recreated spot VM starts with an empty disk, and its run finds there what its predecessor compiled."""
    if not env.compile_cache or not storage.is_url(out):
        return None
    import torch_xla

    return storage.join(out, "xla-cache", torch_xla.__version__, f"host-{env.rank}")


def pull_compile_cache(env, mirror):
    """Before anything compiles: the mirror's entries this host's cache lacks, copied in. The names this cache now
    holds; an entry that cannot be copied (gone meanwhile, not an object) is skipped with a warning and compiles."""
    if mirror is None:
        return set()
    try:
        names = storage.ls(mirror)
    except (OSError, storage.StorageError) as e:
        print(f"xla: warning: the compile cache in {mirror} could not be listed ({e}): compiling", file=sys.stderr,
              flush=True)
        return set()
    found, failed = set(), []
    for name in names:
        local = Path(env.compile_cache) / name
        try:
            if not local.exists():
                storage.write_bytes(local, storage.read_bytes(storage.join(mirror, name), big=True))
            found.add(name)
        except (OSError, storage.StorageError) as e:
            failed.append(f"{name} ({e})")
    if failed:
        print(f"xla: warning: {len(failed)} entr{'y' if len(failed) == 1 else 'ies'} of the compile cache in {mirror} "
              f"could not be copied, compiled instead: {failed[0]}", file=sys.stderr, flush=True)
    if found:
        print(f"xla: {len(found)} compiled program(s) from {mirror}", flush=True)
    return found


def push_compile_cache(env, mirror, pushed):
    """The entries this host compiled since the last push, uploaded to the mirror (after each periodic checkpoint; not
    at a stop, whose notice is the checkpoint's); a failure is a warning: the next push tries again."""
    if mirror is None:
        return
    try:
        for entry in sorted(Path(env.compile_cache).iterdir()):
            if entry.name not in pushed and not entry.name.startswith(".") and entry.is_file():
                storage.upload(entry, storage.join(mirror, entry.name))
                pushed.add(entry.name)
    except (OSError, storage.StorageError) as e:
        print(f"xla: warning: the compile cache could not be kept in {mirror} ({e}); the next checkpoint tries again",
              file=sys.stderr, flush=True)


class Env:
    """Where this process runs: device, ranks or hosts, and the few collectives the loop needs."""

    def __init__(self, cfg):
        kind = cfg["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
        if kind not in ("cpu", "cuda", "xla"):
            raise SystemExit(f"config: device must be '', 'cpu', 'cuda' or 'xla', got {kind!r}")
        self.kind, self.mesh, self.compile_cache = kind, None, ""
        self.cpu_group = None  # a gloo group beside CUDA's NCCL; None: the default group (if any) is on the CPU already
        # under torchrun: 'ddp' or 'fsdp'; bf16: bf16 compute over fp32 master weights (FSDP2's policy, else autocast)
        self.parallel, self.bf16 = cfg.get("parallel", "ddp"), cfg.get("dtype", "float32") == "bfloat16"
        if kind == "xla":
            import torch_xla
            import torch_xla.runtime as xr

            self.compile_cache, self.compile_cache_off = start_compile_cache(cfg.get("compile_cache_dir", ""))
            self.cache_warned = False
            xr.use_spmd()
            self.device = torch_xla.device()
            # hosts, not ranks: each reads its part of the data; gradients need no averaging (one program)
            self.rank, self.world, self.local_rank = xr.process_index(), xr.process_count(), 0
            self.n_devices = xr.global_runtime_device_count()
            self.mesh = make_mesh(cfg["mesh"], cfg["dcn_mesh"], self.n_devices)
            self.distributed, self.replicas = False, 1
            if self.world > 1:  # a CPU group over the hosts, only to agree on stopping
                import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

                dist.init_process_group("gloo", init_method="xla://")
        else:
            self.distributed = "RANK" in os.environ
            self.rank = int(os.environ.get("RANK", 0))
            self.world = self.replicas = int(os.environ.get("WORLD_SIZE", 1))
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
            self.n_devices = self.world
            self.device = torch.device(f"cuda:{self.local_rank}" if kind == "cuda" else "cpu")
            if kind == "cuda":
                torch.cuda.set_device(self.device)
            if self.distributed:
                # torchrun's c10d rendezvous hands a restarted group the store of the failed attempt, stale peer
                # addresses included (torch 2.9: the restart then fails to connect): one key prefix per attempt
                store, _, _ = next(dist.rendezvous("env://"))
                store = dist.PrefixStore(f"llavax/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
                # an hour, not NCCL's 10 minutes: a save waits for the checkpoint write still in flight
                dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=store, rank=self.rank,
                                        world_size=self.world, timeout=timedelta(minutes=60),
                                        device_id=self.device if kind == "cuda" else None)
                # a CPU group for stop-flag agreement, so checking it never waits on the GPU
                self.cpu_group = dist.new_group(backend="gloo") if kind == "cuda" else None
        self.master = self.rank == 0

    def sync(self):
        """Wait for the device (before reading a clock)."""
        if self.kind == "cuda":
            torch.cuda.synchronize()
        elif self.kind == "xla":
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()

    def step_end(self):
        """XLA records the step lazily: cut the graph here, so every step runs the same compiled program."""
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def optimizer_kwargs(self):
        return {"fused": True} if self.kind == "cuda" else {"foreach": True} if self.kind == "cpu" else {}

    def peak_flops(self):
        """The bf16 dense peak of a known GPU, per device; 0 elsewhere (no MFU)."""
        if self.kind != "cuda":
            return 0.0
        name = torch.cuda.get_device_name(self.device)
        known = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12), ("A10", 125e12))
        return next((peak for key, peak in known if key in name), 0.0)

    def peak_memory_gib(self):
        """The device's peak allocation (CUDA), else the process's peak resident memory."""
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def compiles(self):
        """XLA's compile count so far (a count that grows after warm-up means the step recompiles); None elsewhere."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        return (met.metric_data("CompileTime") or [0])[0]

    def compile_seconds(self):
        """Seconds XLA has spent compiling so far (None elsewhere): what a compile cache saves a restart."""
        if self.kind != "xla":
            return None
        import torch_xla.debug.metrics as met

        return (met.metric_data("CompileTime") or [0, 0])[1] / 1e9

    def cache_figures(self):
        """For the log: XLA's persistent compilation cache so far, xla_cache_{hit, miss, unreadable} (programs loaded,
        compiled and stored, found but not loadable and compiled afresh: said once); {} without a cache."""
        if self.kind != "xla" or not self.compile_cache:
            return {}
        import torch_xla.debug.metrics as met

        counts = {f"xla_cache_{name}": met.counter_value(f"PersistentCache{counter}") or 0
                  for name, counter in (("hit", "Hit"), ("miss", "Miss"), ("unreadable", "DeserializeFailure"))}
        if counts["xla_cache_unreadable"] and not self.cache_warned:
            self.cache_warned = True
            print0(self, f"xla: warning: {counts['xla_cache_unreadable']} compiled program(s) in {self.compile_cache} "
                   f"could not be read (another torch_xla or libtpu, or a cut file): compiled afresh")
        return counts

    def all_sum(self, t):
        if self.distributed:
            dist.all_reduce(t)
        return t  # under SPMD tensors are already global

    def host_sum(self, t):
        """A CPU tensor summed over every rank (or host): what each counted of the data it read."""
        if dist.is_initialized():
            dist.all_reduce(t, group=self.cpu_group)
        return t

    def gathered(self, obj):
        """[every rank's obj] in rank order, on every rank (picklable objects: answers, counts); [obj] alone, and
        under SPMD, where one process holds the host's data."""
        if not self.distributed:
            return [obj]
        parts = [None] * self.world
        dist.all_gather_object(parts, obj)
        return parts

    def agree(self, flag):
        """True on every rank (or host) if any says True."""
        if not dist.is_initialized():
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(t.item())

    def to_device(self, batch):
        """The model's inputs on the device; under SPMD the host's rows become its part of a global batch."""
        keys = [k for k in ("input_ids", "labels", "pixel_values", "position_ids", "image_index", "image_weight")
                if k in batch]
        return {k: self.place_rows(batch[k]) for k in keys}

    def place_rows(self, rows):
        """A host tensor of batch rows on the device; under SPMD the host's rows of a global batch, split over the
        data axes."""
        if self.kind != "xla":
            return rows.to(self.device, non_blocking=True)
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        spec = xs.ShardingSpec(self.mesh, (BATCH,) + (None,) * (rows.dim() - 1), minibatch=self.world > 1)
        return xm.send_cpu_data_to_device([rows], self.device, spec)[0]

    def to_host(self, t):
        """A device tensor on the host. Under SPMD it is made replicated inside its own graph first: fetching sharded
        data compiles a gathering program on every call."""
        if self.kind == "xla":
            import torch_xla.distributed.spmd as xs

            t = t + 0  # a node of the pending graph: data already on the device keeps its annotation
            xs.mark_sharding(t, self.mesh, (None,) * t.dim())
        return t.cpu()


def print0(env, *args):
    if env.master:
        print(*args, flush=True)


def checkpoint_fn(device_kind, policy="full", compile_backend=None):
    """The activation checkpointing function the model's blocks call: torch_xla's on XLA. policy 'selective' keeps
    the outputs of the matmuls and attention (SAVED_OPS) and recomputes the rest of a block (norms, activations,
    RoPE, residual adds, casts), so backward reruns no matmul. With a compile_backend it is compiled whole, the block
    inside it too: torch.compile skips (runs eagerly) a compiled block called under the policy's dispatch mode."""
    if device_kind == "xla":
        if policy != "full":
            raise SystemExit("config: checkpoint_policy='selective' is torch's (CUDA, CPU); torch_xla's checkpoint "
                             "recomputes whole blocks: use checkpoint_policy='full' under XLA")
        return _xla_checkpoint
    if policy == "full":
        return functools.partial(checkpoint, use_reentrant=False)
    selective = functools.partial(checkpoint, use_reentrant=False,
                                  context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
    return torch.compile(selective, backend=compile_backend) if compile_backend else selective


# what selective checkpointing keeps: torchtitan's op list (less its collectives), and every matmul where torchtitan
# keeps every other one: the matmuls, SDPA's fused kernels (output and logsumexp) and FlexAttention
SAVED_OPS = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable")} | {torch.ops.higher_order.flex_attention}


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _xla_checkpoint(fn, *args):
    # a block's bound __call__ (its hooks still run): torch_xla then puts the block's weights in the optimization
    # barrier before the recompute (as FSDPv2 does), so the compiler cannot reuse the forward's gathered copies
    import torch_xla.utils.checkpoint

    # and it is reentrant: a block whose input needs no gradient (a frozen embedding or patch layer below LoRA
    # adapters) gets none for its parameters either; such an input becomes a leaf that needs one (what HF's
    # enable_input_require_grads does for peft)
    block = isinstance(fn, torch.nn.Module)
    if block and torch.is_grad_enabled() and not args[0].requires_grad and any(p.requires_grad for p in fn.parameters()):
        args = (args[0].detach().requires_grad_(), *args[1:])
    return torch_xla.utils.checkpoint.checkpoint(fn.__call__ if block else fn, *args)


# -----------------------------------------------------------------------------
# attention: what the model calls in place of SDPA (Llama.attention_kernel), chosen once at setup

ATTENTION = ("dense", "blockwise", "flash", "splash", "bounded")
PALLAS = ("flash", "splash")


def pallas_refusal(kind, device):
    return (f"config: attention={kind!r} is torch_xla's Pallas kernel, which runs only on a TPU (device='xla' on a TPU "
            f"VM), not on {device}: use attention='blockwise' (bounded memory on every device) or 'dense'")


def attention_kernel(kind, block, env, window=None, softcap=None, blocks=""):
    """f(q, k, v, segments, window, scale, softcap) -> (B, H, T, hd) for Llama.attention_kernel, or None for SDPA
    ('dense': packed rows get a (B, 1, T, T) mask, or FlexAttention on CUDA with compiled blocks). window: the model's
    sliding window where it is shorter than the rows (torch_xla's flash kernel has none); softcap: its attention
    soft-cap (Gemma 2's; torch_xla's Pallas kernels have none); blocks: its VLMConfig.attention_blocks (Gemma 3's image
    blocks, which the blockwise kernel reads and torch_xla's Pallas kernels cannot)."""
    if kind == "bounded":  # the recipes' default: bounded memory wherever they run, the fastest kernel that has it
        pallas = on_tpu(env) and importlib.util.find_spec("jax") is not None
        kind = "splash" if pallas and not blocks else "blockwise"
        why = "a TPU" if kind == "splash" else "Pallas has no image blocks" if pallas else "no TPU with Pallas here"
        print0(env, f"attention='bounded': {kind} ({why})")
    if kind in PALLAS and blocks:
        raise SystemExit(f"config: attention={kind!r} (torch_xla's Pallas kernel) is causal only, and this model's "
                         f"tokens see each other both ways in blocks (attention_blocks={blocks!r}): use attention="
                         f"'blockwise' or 'dense'")
    if kind == "dense":
        return None
    if kind == "blockwise":
        return functools.partial(blockwise_attention, block=block, scan=_xla_scan if env.kind == "xla" else loop_scan)
    device = env.kind
    if env.kind == "xla":
        import torch_xla.runtime as xr

        device = f"an XLA {xr.device_type()} device"
    if device != "an XLA TPU device":
        raise SystemExit(pallas_refusal(kind, device))
    if importlib.util.find_spec("jax") is None:  # found, not imported: torch_xla must hold the TPU before JAX does
        raise SystemExit(f"config: attention={kind!r} needs torch_xla's Pallas extra (the kernels are JAX's): pip "
                         f"install 'torch_xla[pallas]' (jax, jaxlib)")
    if softcap:
        raise SystemExit(f"config: attention={kind!r} (torch_xla's Pallas kernel) cannot soft-cap the scores, and this "
                         f"model's attn_softcap is {softcap:g}: use attention='blockwise'")
    if kind == "flash" and window:
        raise SystemExit(f"config: attention='flash' has no sliding window, and this model's is {window} tokens, "
                         f"shorter than its rows: use attention='splash' or 'blockwise'")
    return functools.partial(_flash_attention if kind == "flash" else _splash_attention, mesh=env.mesh)


def on_tpu(env):
    if env.kind != "xla":
        return False
    import torch_xla.runtime as xr

    return xr.device_type() == "TPU"


def _xla_scan(fn, init, xs):
    from torch_xla.experimental.scan import scan

    # one XLA While over the key blocks; pure: each step function is traced once a shape, not at every layer and step
    return scan(fn, init, xs, is_fn_pure=True)


def _flash_attention(q, k, v, segments=None, window=None, scale=None, softcap=None, mesh=None):
    # as torchprime calls it: q scaled here, K/V repeated to every head (the kernel has no GQA), segment ids for packed
    # rows; batch over the data axes and heads over tp, each device running the kernel on its part
    from torch_xla.experimental.custom_kernel import flash_attention

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T, hd)
    ids = None if segments is None else segments.to(torch.int32)
    return flash_attention(q * (scale or q.shape[-1] ** -0.5), k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids,
                           sm_scale=1.0, partition_spec=(BATCH, "tp", None, None), mesh=mesh)


def _splash_attention(q, k, v, segments=None, window=None, scale=None, softcap=None, mesh=None):
    # GQA natively; torch_xla's wrapper wants the data axes named 'data' and 'fsdp', and takes its settings as JSON.
    # Its local mask sees `window` keys on each side: window - 1 back and the diagonal is Qwen2's (HF: kv > q - window)
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.splash_attention import SplashAttentionConfig, splash_attention

    named = xs.Mesh(mesh.device_ids, mesh.mesh_shape, ("data", "fsdp", "tp"))
    config = SplashAttentionConfig(mesh=str(named), qkv_partition_spec=(("data", "fsdp"), "tp", None, None),
                                   segment_ids_partition_spec=(("data", "fsdp"), None),
                                   attentiontype_local_sliding=bool(window),
                                   slide_window_size=window - 1 if window else None)
    ids = None if segments is None else segments.to(torch.int32)
    return splash_attention(q * (scale or q.shape[-1] ** -0.5), k, v, config.to_json(), decoder_segment_ids=ids,
                            causal=True)


def shard(model, env):
    if env.kind == "xla":
        return shard_spmd(model, env)
    if not env.distributed:
        return model
    if env.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[env.local_rank] if env.kind == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if env.bf16 else MixedPrecisionPolicy()
    for block in list(model.vision.blocks) + list(model.llm.layers):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


@contextmanager
def gathered_for_generation(model, whole=False):
    """Around generate(), which calls the root's own modules (embeddings, output layer, projector) outside any forward
    of the root, where FSDP2 gathers their weights: gathered here for the whole generation. Each block gathers its own
    in its forward hook and frees them after (one block at a time), or with whole=True all are gathered up front and
    kept until the end. Yields True when the ranks must decode in lockstep: with blocks freed after each use, every
    step all-gathers each block's weights, so no rank may run fewer steps than another (stop early)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield False
        return
    # FSDP2 takes the first module to run a forward as the root: before the first training forward, a block would
    # claim it (and the root's forward then fails). Its lazy init, which the root's forward runs, is not public in 2.9
    model._get_fsdp_state()._lazy_init()
    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for block in blocks if whole else []:  # gathered now, on every rank together: generation then needs no collective
        block.set_reshard_after_forward(False, recurse=False)
        block.unshard()
    model.unshard()
    try:
        yield not whole
    finally:
        model.reshard()
        for block in blocks if whole else []:
            block.set_reshard_after_forward(True, recurse=False)  # fully_shard's default for a module below the root
            block.reshard()


def autocast(env):
    # FSDP casts parameters itself; DDP, single-process and XLA runs keep fp32 weights and use autocast
    if env.bf16 and not (env.distributed and env.parallel == "fsdp"):
        return torch.autocast(env.kind, dtype=torch.bfloat16)
    return nullcontext()


def grad_sync(model, env, last):
    """Skip the gradient all-reduce on all but the last accumulation micro-step."""
    if env.distributed and env.parallel == "ddp" and not last:
        return model.no_sync()
    if env.distributed and env.parallel == "fsdp":
        model.set_requires_gradient_sync(last)
    return nullcontext()


# -----------------------------------------------------------------------------
# torch_xla SPMD: the mesh, the sharding rules, and sharded optimizer state


def make_mesh(shape, dcn_shape, n_devices):
    """(dp, fsdp, tp) over every device; one entry may be -1 to take what the others leave (EasyLM's mesh_dim).
    A dcn_mesh other than (1, 1, 1) spans slices: the product of both shapes per axis, slices on the outside."""
    import torch_xla.distributed.spmd as xs

    shape, dcn_shape = list(shape), list(dcn_shape)
    if len(shape) != 3 or len(dcn_shape) != 3 or shape.count(-1) > 1 or any(d == 0 or d < -1 for d in shape):
        raise SystemExit(f"config: mesh must be [dp, fsdp, tp] of positive sizes with at most one -1, got {shape}")
    n_slices = int(np.prod(dcn_shape))
    per_slice = n_devices // n_slices
    if -1 in shape:
        known = -int(np.prod(shape))
        if per_slice % known:
            raise SystemExit(f"config: mesh {shape} cannot cover {per_slice} devices a slice ({n_devices} in all)")
        shape[shape.index(-1)] = per_slice // known
    if int(np.prod(shape)) * n_slices != n_devices:
        raise SystemExit(f"config: mesh {shape} x dcn_mesh {dcn_shape} = {int(np.prod(shape)) * n_slices} devices, "
                         f"but there are {n_devices} devices")
    if n_slices > 1:
        return xs.HybridMesh(ici_mesh_shape=tuple(shape), dcn_mesh_shape=tuple(dcn_shape), axis_names=AXES)
    return xs.Mesh(np.arange(n_devices), tuple(shape), AXES)


# The first rule whose pattern matches a parameter's whole name gives its spec: one mesh axis (or None) per
# dimension. Weights are (out, in). FSDP shards one dimension of every matrix over `fsdp`; TP is Megatron's:
# attention heads and the MLP hidden dimension over `tp`, column-parallel in (out over tp), row-parallel out
# (in over tp), so each block needs one reduction. The embedding and the output layer split the vocabulary
# over tp (vocab-parallel), like Megatron; the output layer over fsdp too. Frozen towers are sharded the same
# way: a frozen 7B LLM in stage 1 must fit too. Norms, biases after a row-parallel layer and the class
# embedding are small and replicated.
SHARDING_RULES = [
    (r"llm\.tok_embeddings\.weight", ("tp", "fsdp")),
    # the output layer splits the vocabulary over both (as FSDPv2's largest-dimension rule does): each device's
    # logits need only its rows, where gathering the whole (vocab, dim) matrix per loss chunk set the audit's peak
    (r"llm\.output\.weight", (("tp", "fsdp"), None)),
    (r"llm\.layers\.\d+\.attention\.(wq|wk|wv)\.weight", ("tp", "fsdp")),
    (r"llm\.layers\.\d+\.attention\.(wq|wk|wv)\.bias", ("tp",)),
    (r"llm\.layers\.\d+\.attention\.wo\.weight", ("fsdp", "tp")),
    (r"llm\.layers\.\d+\.feed_forward\.(w1|w3)\.weight", ("tp", "fsdp")),
    (r"llm\.layers\.\d+\.feed_forward\.w2\.weight", ("fsdp", "tp")),
    (r"vision\.blocks\.\d+\.(attn\.(wq|wk|wv)|mlp\.c_fc)\.weight", ("tp", "fsdp")),
    (r"vision\.blocks\.\d+\.(attn\.(wq|wk|wv)|mlp\.c_fc)\.bias", ("tp",)),
    (r"vision\.blocks\.\d+\.(attn\.wo|mlp\.c_proj)\.weight", ("fsdp", "tp")),
    (r"vision\.conv1\.weight", ("fsdp", None, None, None)),
    (r"vision\.positional_embedding", (None, "fsdp")),
    (r"projector\.fc\.\d+\.weight", ("fsdp", None)),  # small: FSDP only
    # LoRA adapters: FSDP on the dimension they share with their layer, r whole and not over tp (small: the
    # compiler gathers them). r 128 on all of a 7B's LLM layers is 320M parameters: replicated, 5 GB of fp32 + Adam
    (r".*\.lora_A\.weight", (None, "fsdp")),
    (r".*\.lora_B\.weight", ("fsdp", None)),
    (r".*", None),  # replicated
]


def param_spec(name, ndim):
    for pattern, spec in SHARDING_RULES:
        if re.fullmatch(pattern, name):
            return (None,) * ndim if spec is None else spec
    raise AssertionError(name)  # the last rule matches everything


def shard_spmd(model, env):
    """Move to the XLA device, annotate every parameter by the rules, and keep block outputs batch-sharded."""
    import torch_xla.distributed.spmd as xs

    model.to(env.device)
    if model.cfg.llm.tie_embeddings:
        model.llm.output.weight = model.llm.tok_embeddings.weight
    for name, p in model.named_parameters():
        spec = param_spec(name, p.dim())
        xs.mark_sharding(p, env.mesh, spec)
        # the gradient carries its parameter's sharding, so it is stored sharded and a compiler with the rewrite (TPU's)
        # reduce-scatters it; XLA's CPU pipeline still all-reduces it whole, then slices (tests/test_xla_audit.py)
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(functools.partial(_shard_grad, mesh=env.mesh, spec=spec))

    # without these the compiler may replicate activations between blocks
    def batch_sharded(module, args, output):
        xs.mark_sharding(output, env.mesh, (BATCH, None, None))

    for block in list(model.vision.blocks) + list(model.llm.layers):
        block.register_forward_hook(batch_sharded)
        # FSDPv2's: a barrier on the block's gradients and input gradient once its backward is done, so the compiler
        # cannot interleave (and keep live together) the backward of several blocks (no change on XLA's CPU pipeline)
        xs.apply_backward_optimization_barrier(block)
    # and every layer's output is batch-sharded (its features over tp where the weight's output dimension is): left
    # to itself, GSPMD all-gathered activations (the images, image features, the ViT's) wherever they were smaller
    # than the FSDP-sharded weight that met them. Pinned, the weights are gathered instead: FSDP by construction.
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)) and name != "llm.output":
            features = "tp" if param_spec(f"{name}.weight", 2)[0] == "tp" and isinstance(module, torch.nn.Linear) else None
            module.register_forward_hook(functools.partial(_shard_output, mesh=env.mesh, features=features))
    return model


def _shard_output(module, args, output, mesh, features):
    import torch_xla.distributed.spmd as xs

    if isinstance(module, torch.nn.Conv2d):  # (B, D, h, w)
        xs.mark_sharding(output, mesh, (BATCH, None, None, None))
    else:  # (B, ..., D)
        xs.mark_sharding(output, mesh, (BATCH,) + (None,) * (output.dim() - 2) + (features,))


def _shard_grad(p, mesh, spec):
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(p.grad, mesh, spec)


def init_optimizer_state(raw, optimizer, env):
    """AdamW's moments created up front and sharded like their parameters (zeros_like would replicate them)."""
    if env.kind != "xla":
        return
    import torch_xla.distributed.spmd as xs

    for name, p in raw.named_parameters():
        if p.requires_grad:
            state = optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros(p.shape, dtype=p.dtype, device=env.device)
                xs.mark_sharding(state[key], env.mesh, param_spec(name, p.dim()))
            state["step"] = torch.tensor(0.0)


def place_like(t, name, env):
    """A CPU tensor (a loaded moment) on the XLA device, sharded like parameter `name`."""
    import torch_xla.distributed.spmd as xs

    t = t.to(env.device)
    xs.mark_sharding(t, env.mesh, param_spec(name, t.dim()))
    return t


def freeze(model, stage):
    """requires_grad by stage. ViT blocks above the selected layer and ln_post never reach the loss: frozen too.
    A part with LoRA adapters trains them alone."""
    trained = {0: ("vision", "projector", "llm"), 1: ("projector",), 2: ("projector", "llm")}[stage]
    n = model.cfg.vision.n_layers
    top = max(i if i >= 0 else n + 1 + i for i in model.cfg.vision_layers)
    adapted = {param_group(name) for name, _ in model.named_parameters() if is_lora_parameter(name)}
    for name, p in model.named_parameters():
        unused = (name.startswith("vision.ln_post") and not model.cfg.vision_post_norm) or \
            (name.startswith("vision.blocks.") and int(name.split(".")[2]) >= top)
        in_full = param_group(name) not in adapted or is_lora_parameter(name)
        p.requires_grad_(param_group(name) in trained and not unused and in_full)


def set_checkpointing(model, fn, every=1):
    """fn recomputes blocks 0, k, 2k, ... of each tower in backward (k = every); the others keep their activations."""
    for tower, blocks in ((model.vision, model.vision.blocks), (model.llm, model.llm.layers)):
        chosen = {id(b) for b in list(blocks)[::every]}
        tower.checkpoint = fn if fn is None or every == 1 else \
            (lambda block, *args, chosen=chosen: fn(block, *args) if id(block) in chosen else block(*args))


def store_frozen(model, dtype):
    """Frozen weights and biases of the Linear and Conv2d layers kept in `dtype` (bf16): the copy autocast makes of
    them at every use, made once, and their fp32 originals dropped. Embeddings, norms and the ViT's positional and
    class embeddings stay fp32: autocast does not cast them (the token embedding starts the fp32 residual stream)."""
    for p in frozen_matmul_weights(model):
        p.data = p.data.to(dtype)


def frozen_matmul_weights(model):
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}  # and a tied output
    return [p for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for p in (m.weight, m.bias)
            if p is not None and not p.requires_grad and id(p) not in embeddings]


def use_flex_attention(packed, device_kind, compiled, seq_len):
    """FlexAttention for packed rows needs CUDA and compiled blocks. Its kernels failed to compile on an H100 (torch
    2.11) for 96-token rows but ran for 128, 256 and 2048: whole 128-token blocks only, else SDPA with a dense mask."""
    return packed and device_kind == "cuda" and compiled and seq_len % 128 == 0


def compile_blocks(model):
    for block in list(model.vision.blocks) + list(model.llm.layers):
        block.compile()


def make_optimizer(raw, env, lr, betas, weight_decay, lr_scale):
    """AdamW over the trained parameters, a group per module (lr_scale: its multiplier) and per decay."""
    return torch.optim.AdamW(param_groups(raw, weight_decay, lr_scale), lr=lr, betas=betas, **env.optimizer_kwargs())


def param_groups(raw, weight_decay, lr_scale):
    """raw's trained parameters as AdamW's groups: one per module (lr_scale: its multiplier) and per decay."""
    groups = {}
    for name, p in raw.named_parameters():
        if p.requires_grad:
            module, decay = param_group(name), p.dim() >= 2  # no weight decay on norms, biases, image_newline
            g = groups.setdefault((module, decay), {"params": [], "lr_scale": lr_scale[module],
                                                    "weight_decay": weight_decay if decay else 0.0})
            g["params"].append(p)
    return list(groups.values())


def flops_per_sample(raw, stage, seq_tokens, n_tiles=1):
    """Model FLOPs of one sample (fwd + bwd) with n_tiles ViT views, docs/training.md "MFU": 6N trained, 4N frozen with
    gradients flowing through, 2N frozen with nothing upstream to train; attention 12*L*d*T (fwd+bwd), halved when
    causal."""
    cfg = raw.cfg
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    adapters = lambda m: sum(p.numel() for n, p in m.named_parameters() if is_lora_parameter(n))  # noqa: E731
    vit_lora, llm_lora = adapters(raw.vision.blocks), adapters(raw.llm)  # LoRA: 6N, its frozen base 4N
    vit_tokens = cfg.vision.n_patches + 1
    vit_mult = 4 if vit_lora else 6 if stage == 0 else 2
    vit_attention = (vit_mult * 2) * cfg.vision.n_layers * cfg.vision.dim * vit_tokens**2
    vit = ((vit_mult * (count(raw.vision.blocks) - vit_lora) + 6 * vit_lora) * vit_tokens + vit_attention) * n_tiles
    proj = 6 * count(raw.projector) * cfg.n_image_tokens * n_tiles
    llm_params = count(raw.llm) - raw.llm.tok_embeddings.weight.numel() * (not cfg.llm.tie_embeddings)
    llm_mult = 4 if llm_lora else 6 if stage in (0, 2) else 4
    llm = (llm_mult * (llm_params - llm_lora) + 6 * llm_lora) * seq_tokens + \
        6 * cfg.llm.n_layers * cfg.llm.n_heads * cfg.llm.head_dim * seq_tokens**2
    return vit + proj + llm

