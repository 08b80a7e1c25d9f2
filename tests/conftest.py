import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from buckets import (gcs_bucket, gcs_proxy, gcs_server, s3_bucket, s3_proxy, s3_server,  # noqa: F401  the servers' fixtures
                     unconditional_gcs_bucket, unconditional_gcs_server)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # two workers on two cores: a second thread each only oversubscribes them


def tiny_hf_llava(vocab=512, image_token=511, rope_parameters=None, vision_layer=-2, strategy="default", kv_heads=2,
                  image_size=28, seed=0):
    """A random, tiny transformers LlavaForConditionalGeneration: 2 layers, width 64, 28 px images."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              image_size=image_size, patch_size=14, projection_dim=32)
    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                       rms_norm_eps=1e-5, **({"rope_parameters": rope_parameters} if rope_parameters else {}))
    n_tokens = (image_size // 14) ** 2 + (strategy == "full")
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token, image_seq_length=n_tokens,
                      vision_feature_layer=vision_layer, vision_feature_select_strategy=strategy)
    model = LlavaForConditionalGeneration(cfg).eval()
    # HF initialises norms to 1 and biases to 0; perturb them so a mixed-up key cannot hide
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "layrnorm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def image_batch(model_cfg_n_tokens, image_token, vocab, batch=2, seq=16, image_at=2, image_size=28, seed=1):
    """input_ids with one run of image placeholders per row, random pixels, and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, image_token if image_token < vocab else vocab, (batch, seq), generator=g)
    ids[:, image_at:image_at + model_cfg_n_tokens] = image_token
    pixels = torch.randn(batch, 3, image_size, image_size, generator=g)
    labels = ids.clone()
    labels[:, : image_at + model_cfg_n_tokens] = -100
    return ids, pixels, labels


def load_cleanly(cls, folder, caplog):
    """cls.from_pretrained(folder), asserting that transformers found every key and said no warning."""
    import transformers

    transformers.logging.enable_propagation()  # transformers' logger does not reach caplog otherwise
    try:
        with caplog.at_level("WARNING"):
            loaded, info = cls.from_pretrained(folder, output_loading_info=True)
    finally:
        transformers.logging.disable_propagation()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    return loaded


@pytest.fixture
def hf_llava_dir(tmp_path):
    model = tiny_hf_llava()
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


# -----------------------------------------------------------------------------
# long self-contained subprocesses (the XLA gradient matrix, the compiled-program audit, ...) start with the session,
# at low priority, beside the rest of the suite; their fixtures wait. Under pytest-xdist (make test: -n 3) the first
# worker starts them in a folder every worker sees, and a fixture on either worker waits for its job's exit status

BACKGROUND = {}  # module name -> Popen, in the process that started it


def worker():
    return os.environ.get("PYTEST_XDIST_WORKER", "gw0")


def shared_folder(tmp_path_factory):
    """A folder every xdist worker of this session sees (each worker's basetemp is a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


class SharedFolders:
    """What start_background(tmp_path_factory) is given: mktemp(name) in the shared folder."""

    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        (path := self.root / "background" / name).mkdir(parents=True, exist_ok=True)
        return path


def start_in_background(name, cmd, env, folder):
    """Run cmd at nice 10, its stdout and stderr to folder/log.txt and its exit status to folder/returncode, for the
    test module `name` to wait for (folder/../name.folder names the folder)."""
    (folder.parent / f"{name}.folder").write_text(str(folder))
    script = '"$@" > "$0/log.txt" 2>&1; echo $? > "$0/returncode.tmp"; mv "$0/returncode.tmp" "$0/returncode"'
    BACKGROUND[name] = subprocess.Popen(["nice", "-n", "10", "sh", "-c", script, str(folder), *map(str, cmd)], env=env,
                                        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def wait_for_background(name, timeout):
    """The folder of module `name`'s background job once it has exited 0 (on whichever worker started it)."""
    pointer = SharedFolders(BACKGROUND_ROOT[0]).root / "background" / f"{name}.folder"
    t0 = time.monotonic()
    while not pointer.exists() and time.monotonic() - t0 < 120:  # the first worker starts it with its session
        time.sleep(1)
    folder = Path(pointer.read_text())
    while not (folder / "returncode").exists():
        if time.monotonic() - t0 > timeout:
            if name in BACKGROUND:
                BACKGROUND[name].kill()
            raise AssertionError(f"{name}'s background job still running after {timeout} s: "
                                 + (folder / "log.txt").read_text()[-8000:])
        time.sleep(1)
    assert (folder / "returncode").read_text().strip() == "0", (folder / "log.txt").read_text()[-8000:]
    return folder


BACKGROUND_ROOT = []  # the shared folder of this session


def pytest_collection_modifyitems(config, items):
    """The longest modules first (as make test measured them): pytest-xdist's --dist loadfile sends whole modules to
    its workers in this order with --no-loadscope-reorder (make test), so that none is left running alone at the end;
    xdist's own order, by number of tests, left the long modules of few tests (SLURM's, the leases') to the end."""
    first = ["test_doc_commands.py",  # under make test-full: the docs' blocks, the longest of all
             "test_xla.py", "test_bucket_checkpoint.py", "test_train.py", "test_lease.py", "test_scripts.py",
             "test_checkpoint.py", "test_grpo.py", "test_compile_cache.py", "test_family_objectives.py",
             "test_storage_stall.py", "test_families.py", "test_bucket_keys.py", "test_bucket_data.py", "test_integrity.py",
             "test_mixture.py", "test_mixture_figures.py", "test_dpo.py", "test_storage.py", "test_speed_levers.py",
             "test_convert.py",
             "test_bucket_models.py", "test_video.py", "test_benchmarks.py", "test_front_door.py", "test_sources.py",
             "test_mixture_edges.py", "test_progress.py", "test_plot.py"]
    items.sort(key=lambda item: first.index(item.path.name) if item.path.name in first else len(first))


@pytest.fixture(scope="session", autouse=True)
def background(request, tmp_path_factory):
    """The first worker starts each selected module's start_background(folders), and every worker the fork server
    of the command-line tests (tests/forkserver.py) if they import it; at the end of its session the first worker
    waits for what it started (another worker may still need it), or kills it after a failure with -x."""
    BACKGROUND_ROOT.append(shared_folder(tmp_path_factory))
    if "forkserver" in sys.modules:
        sys.modules["forkserver"].start()
    if worker() == "gw0":  # a module's job only when a selected test waits for it (its BACKGROUND_FIXTURE)
        needed = {item.module for item in request.session.items
                  if getattr(item.module, "BACKGROUND_FIXTURE", None) in getattr(item, "fixturenames", ())}
        for module in needed:
            if module.__name__ not in BACKGROUND:
                module.start_background(SharedFolders(BACKGROUND_ROOT[0]))
    yield
    for proc in BACKGROUND.values():
        if proc.poll() is None and not request.session.shouldfail and not request.session.shouldstop:
            proc.wait(timeout=1800)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def checkpoint_tensors(step_dir, prefix=""):
    """{DCP key: tensor} of a training step directory (model.* weights, optim.state.* moments), read back whole."""
    import checkpoint
    import model_files

    return {k: model_files.SavedTensor(step_dir, k, m).detach() for k, m in checkpoint.saved_tensors(step_dir).items()
            if k.startswith(prefix) and hasattr(m, "size")}


def checkpoint_bytes(step_dir, prefix="model."):
    """The bytes of every tensor under prefix, in key order: equal exactly when the tensors are bit-identical."""
    tensors = checkpoint_tensors(step_dir, prefix)
    return b"".join(k.encode() + tensors[k].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    for k in sorted(tensors))


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory):
    """shapes_data(n, seed=0, val_fraction=0.1, ...): the shapes demo's data (shapes.make_shapes) in a folder, drawn once
    a session for each set of arguments."""
    from shapes import make_shapes

    made = {}

    def draw(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = tmp_path_factory.mktemp("shapes")
            make_shapes(made[key], **kw)
        return made[key]

    return draw


# -----------------------------------------------------------------------------
# a run's log, and the same run on XLA's CPU devices

XLA_CPU = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_NUM_THREADS": "1",
           "XLA_FLAGS": "--xla_backend_optimization_level=0"}


def run_log(out_dir, key=None):
    """The events train.py logged in out_dir (those holding `key`)."""
    events = [json.loads(line) for line in (Path(out_dir) / "log.jsonl").read_text().splitlines()]
    return [e for e in events if key is None or key in e]


def train_on_xla(args, timeout=900, env=None):
    """train.py with these arguments under XLA SPMD on 4 CPU devices, in its own process; its completed process."""
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, args), "--device=xla"], capture_output=True,
                       text=True, env=os.environ | XLA_CPU | (env or {}), cwd=ROOT, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def assert_same_logs(cpu, xla, keys, rtol=1e-4):
    """The same logged figures, step by step, and a compile count that stays flat after the second step."""
    assert [e["step"] for e in cpu] == [e["step"] for e in xla] and cpu
    for want, got in zip(cpu, xla):
        for k in keys:
            assert abs(got[k] - want[k]) <= rtol * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
    compiles = [e["xla_compiles"] for e in xla]
    assert compiles[1] == compiles[-1], compiles


# -----------------------------------------------------------------------------
# make test's wall time: a whole-suite session (no test paths named, no -k, at most -m "not full") that takes over
# LLAVAX_SUITE_WARN_S seconds ends with one line naming its five slowest modules. Under pytest-xdist the controller
# gets every worker's reports, so it sums them all; the workers print nothing.

SUITE_WARN_S = float(os.environ.get("LLAVAX_SUITE_WARN_S", 12 * 60))
SUITE_START, MODULE_S = [time.monotonic()], {}  # the session's start; test module -> seconds of setup, call, teardown


def pytest_sessionstart(session):
    SUITE_START[0] = time.monotonic()


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    MODULE_S[module] = MODULE_S.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    took = time.monotonic() - SUITE_START[0]
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword \
        and config.option.markexpr in ("", "not full")
    if whole and took > SUITE_WARN_S and not hasattr(config, "workerinput"):
        slowest = sorted(MODULE_S.items(), key=lambda kv: -kv[1])[:5]
        terminalreporter.write_line(f"warning: the suite took {took / 60:.1f} min, over {SUITE_WARN_S / 60:g} min; slowest "
                                    "modules: " + ", ".join(f"{m} {s:.0f} s" for m, s in slowest), yellow=True)
