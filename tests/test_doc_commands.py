"""The commands README.md and docs/*.md show work as written, in order, and never undo one another.

Every shell block (an indented or fenced code block whose first command line runs python, torchrun, make, a script,
pip or export) runs, in the order a reader meets them (README, then docs/ by name), on a fresh copy of the working
tree (what git tracks or would track, with .venv shared by a link), except a block whose last line before it is
`<!-- skip: REASON -->` (a GPU, a TPU, a bucket, real weights or data): pytest shows it skipped with its reason.
They run shortened, by a `python` (and `make`) first on PATH that rewrites the arguments, so that no program
carries a test hook: `data.py shapes` draws at most SHORT_N samples, `train.py` runs its steps on batches of
SHORT_BATCH, and `sample.py --image` of an image a short draw has not made asks about the folder's last one (a
held-out image, as the full draw's last is). That run is marked full (`make test-full`); what make test checks of
the same commands is static: no command draws or trains into a folder an earlier one wrote, the post-training
demos' `prepare` steps write only folders of their own, and each demo's chain is in docs/post-training.md."""

import ast
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

SHORT_N = 600  # samples a shortened `data.py shapes` draws (10% held out)
SHORT_BATCH = 2  # rows a shortened train.py step reads (every step of the run as written still runs)
BLOCK_TIMEOUT_S = 1200
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(.+?)\s*-->\s*$")
COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:python|torchrun|make|scripts/|pip|export)\b")
POST_TRAINING_DEMOS = ("dpo_shapes", "reward_shapes", "grpo_shapes", "ppo_shapes")


def doc_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def code_blocks(text):
    """[(first line number, lines, skip reason or None)] of a markdown text's fenced and indented code blocks."""
    lines, blocks, i = text.splitlines(), [], 0
    before = lambda k: next((x for x in reversed(lines[:k]) if x.strip()), "")  # noqa: E731  last non-blank line
    reason = lambda k: (m.group(1) if (m := SKIP.match(before(k))) else None)  # noqa: E731
    after_blank = True
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```")), len(lines))
            blocks.append((i + 2, lines[i + 1 : end], reason(i)))
            i, after_blank = end + 1, False
        elif after_blank and line.startswith("    ") and line.strip() and not re.match(r"\s*([-*]|\d+\.) ", before(i)):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            body = [x[4:] for x in lines[i:end]]
            while body and not body[-1].strip():
                body.pop()
            blocks.append((i + 1, body, reason(i)))
            i, after_blank = end, True
        else:
            after_blank, i = not line.strip(), i + 1
    return blocks


def commands(block):
    """The command lines of a block, continuation lines joined, comment lines dropped."""
    out, pending = [], ""
    for line in block:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
            continue
        out.append(pending)
        pending = ""
    return out


def shell_blocks():
    """[(where, command lines, skip reason or None)] of every shell block, in reading order."""
    found = []
    for path in doc_files():
        for line, block, reason in code_blocks(path.read_text()):
            lines = commands(block)
            if lines and COMMAND.match(lines[0]):
                found.append((f"{path.relative_to(ROOT)}:{line}", lines, reason))
    return found


# -----------------------------------------------------------------------------
# what a command writes, read from its words: the folders `data.py shapes`, `dpo.py pairs` and train.py write


def config_values(path):
    """The top-level `key = literal` assignments of a config file."""
    values = {}
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return values


def written(command, root=ROOT):
    """The folders one command line writes: [(folder, what)] (what: 'data' or 'run')."""
    words = shlex.split(command.split(" #")[0])
    if words[:2] == ["make", "demo"]:
        return [("data/shapes", "data"), ("out/shapes", "run")]
    program = next((w for w in words if w.endswith(".py")), None)
    if program is None:
        return []
    after = words[words.index(program) + 1 :]
    flag = lambda name: next((after[k + 1] for k, w in enumerate(after[:-1]) if w == name), None)  # noqa: E731
    if program == "data.py" and after[:1] == ["shapes"] or program == "dpo.py" and after[:1] == ["pairs"]:
        return [(flag("--out").rstrip("/"), "data")]
    if program == "train.py":
        out_dir = config_values(ROOT / "config.py")["out_dir"]
        for word in after:
            if word.endswith(".py"):
                out_dir = config_values(root / word).get("out_dir", out_dir)
            elif word.startswith("--out_dir="):
                out_dir = word.split("=", 1)[1]
        return [(out_dir.rstrip("/"), "run")]
    return []


def test_the_docs_commands_in_order_never_write_a_folder_twice():
    """Run in order, README's and docs' blocks never redraw a dataset or retrain into a folder an earlier block made
    (the mixture step once redrew the two-image step's data/shapes2 with another tokenizer)."""
    seen, twice = {}, []
    for where, lines, reason in shell_blocks():
        if reason:
            continue
        for line in lines:
            for folder, what in written(line):
                if folder in seen and not (what == "run" and "--resume" in line):
                    twice.append(f"{where}: `{line}` writes {folder}, which {seen[folder]} wrote")
                seen.setdefault(folder, f"{where} `{line}`")
    assert not twice, "\n".join(twice)


def test_the_post_training_demos_prepare_only_folders_of_their_own():
    """Each post-training demo's `prepare` steps write neither the main demo's data/shapes nor any folder another
    config's steps write (unless both run the same command there), and docs/post-training.md shows each chain in
    order, ending with the demo's own run."""
    writers, clashes = {}, []
    for config in sorted((ROOT / "configs").glob("*.py")):
        for step in config_values(config).get("prepare", []):
            for folder, _ in written(step):
                writers.setdefault(folder, {}).setdefault(step, []).append(config.stem)
    for folder, steps in writers.items():
        demos = {c for names in steps.values() for c in names if c in POST_TRAINING_DEMOS}
        if demos and (folder == "data/shapes" or folder.startswith("data/shapes/") or len(steps) > 1):
            clashes.append(f"{folder}: written by {steps}")
    assert not clashes, "\n".join(clashes)
    shown = [line for where, lines, _ in shell_blocks() if where.startswith("docs/post-training.md")
             for line in lines]
    for demo in POST_TRAINING_DEMOS:
        chain = [*config_values(ROOT / f"configs/{demo}.py")["prepare"], f"python train.py configs/{demo}.py"]
        start = next((k for k, line in enumerate(shown) if line.split(" #")[0].strip() == chain[0]), None)
        assert start is not None, f"docs/post-training.md has no block starting {demo}'s chain: {chain[0]}"
        got = [line.split(" #")[0].strip() for line in shown[start : start + len(chain)]]
        assert got == chain, f"docs/post-training.md shows {demo}'s chain as {got}, where its config says {chain}"


def test_shapes_refuses_a_folder_that_holds_a_shapes_dataset_unless_overwrite(tmp_path, capsys):
    """`data.py shapes` into a folder that holds one is one sentence, and the folder is untouched; --overwrite
    replaces it whole (no image, split or preference set of the old draw left behind)."""
    import data

    out = tmp_path / "shapes"
    data.main(["shapes", "--out", str(out), "--n", "12", "--preference"])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as e:
        data.main(["shapes", "--out", str(out), "--n", "10", "--seed", "1"])
    said = str(e.value)
    assert said.startswith(f"shapes: {out} already holds a shapes dataset") and "--overwrite" in said, said
    assert "\n" not in said and before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    data.main(["shapes", "--out", str(out), "--n", "10", "--seed", "1", "--overwrite"])
    assert len(list((out / "images").iterdir())) == 10 and not (out / "preference").exists()
    assert sum(json_counts(out / "shards").values()) == 10


def test_shapes_never_touches_a_folder_of_other_files_even_with_overwrite(tmp_path):
    """Someone's own data given as --out (a LLaVA JSON and its images; shards pack made, with their tokenizer) is
    refused, --overwrite or not, and not a byte of it changes: shapes writes only into an empty folder or its own."""
    import data

    mine, packed = tmp_path / "mine", tmp_path / "packed"
    (mine / "images").mkdir(parents=True)
    (mine / "images" / "000000.png").write_bytes(b"a photo")  # the name a draw's first image has
    (mine / "images" / "cat.jpg").write_bytes(b"a cat")
    (mine / "data.json").write_text("[]")
    (packed / "shards").mkdir(parents=True)
    (packed / "shards" / "shard-000000.tar").write_bytes(b"a shard")  # pack's name, not the shapes demo's
    (packed / "tokenizer.model").write_bytes(b"a tokenizer")
    for out in (mine, packed):
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        for overwrite in ([], ["--overwrite"]):
            with pytest.raises(SystemExit) as e:
                data.main(["shapes", "--out", str(out), "--n", "10", *overwrite])
            said = str(e.value)
            assert said.startswith(f"shapes: {out} holds what the shapes demo does not write (") and "\n" not in said
            assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}, said


def test_make_demo_draws_again_a_draw_that_was_stopped(tmp_path):
    """make demo after a draw stopped before its .info.json (Ctrl-C while packing) draws it again: without
    --overwrite, shapes would refuse the folder the stopped draw left, and make demo would stop there every time."""
    import data

    for name in ("Makefile", "requirements.txt", "requirements-dev.txt"):
        shutil.copy2(ROOT / name, tmp_path / name)  # mtimes kept: setup is up to date
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    shapes = tmp_path / "data" / "shapes"
    data.main(["shapes", "--out", str(shapes), "--n", "12"])
    (shapes / "shards" / ".nv-meta" / ".info.json").unlink()
    py = tmp_path / "py"  # data.py shapes, shortened (the last --n counts); train.py not run
    py.write_text(f'#!/bin/sh\n[ "$1" = data.py ] || exit 0\nshift\n'
                  f'exec {ROOT / ".venv/bin/python"} {ROOT / "data.py"} "$@" --n 10\n')
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    r = subprocess.run(["make", "demo", f"PY={py}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sum(json_counts(shapes / "shards").values()) == 10 and len(list((shapes / "images").iterdir())) == 10


def test_make_setup_asks_no_package_index_when_everything_is_installed(tmp_path):
    """`make demo` works offline once its packages are installed: setup's recipe, run because the requirements are
    newer than .venv's stamp, asks the index nothing (a local server stands in for it and counts the requests; pip
    upgrading itself, or checking its version, would ask it). It touches .venv/.installed, as any make would."""
    import http.server
    import threading

    asked = []

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in ("Makefile", "requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / name, tmp_path / name)  # new mtimes: the stamp is out of date
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    index = f"http://127.0.0.1:{server.server_address[1]}/simple"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MAKE"))}
    env |= {"PIP_INDEX_URL": index, "PIP_EXTRA_INDEX_URL": index, "PIP_RETRIES": "0", "PIP_TIMEOUT": "5",
            "UV_DEFAULT_INDEX": index, "UV_HTTP_RETRIES": "0"}  # uv reads no pip settings
    try:
        r = subprocess.run(["make", "setup"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pip install" in r.stdout and not asked, f"setup asked the index for {asked}:\n{r.stdout}"


def json_counts(folder):
    import json

    return json.loads((folder / ".nv-meta" / ".info.json").read_text())["shard_counts"]


# -----------------------------------------------------------------------------
# the blocks themselves, run in order on a copy (make test-full)

SHORTEN = r'''#!{python}
# the docs test's shortening: rewrite the arguments, then run the real interpreter
import os, re, sys
from pathlib import Path

args = sys.argv[1:]
program = Path(args[0]).name if args else ""
if program == "data.py" and args[1:2] == ["shapes"]:
    if "--n" in args:
        k = args.index("--n") + 1
        args[k] = str(min(int(args[k]), {short_n}))
    else:
        args += ["--n", "{short_n}"]
elif program == "train.py" and "--help" not in args and "-h" not in args:
    args += ["--batch_size={batch}", "--micro_batch_size={batch}", "--ppo_mini_batch_size={batch}"]
elif program == "sample.py" and "--image" in args:
    k = args.index("--image") + 1
    while k < len(args) and not args[k].startswith("--"):
        image = Path(args[k])
        if not image.exists() and image.parent.is_dir():
            args[k] = str(sorted(image.parent.iterdir())[-1])
        k += 1
os.execv({python!r}, [{python!r}, *args])
'''


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory):
    """A copy of the working tree's files (git's tracked and untracked-not-ignored), .venv linked, and a bin folder
    whose python and make shorten the runs."""
    root = tmp_path_factory.mktemp("docs") / "llavax"
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, root / name)  # mtimes kept: make sees .venv's stamp as up to date
    (root / ".venv").symlink_to(ROOT / ".venv")
    bin_dir = root.parent / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(SHORTEN.format(python=str(ROOT / ".venv/bin/python"), short_n=SHORT_N, batch=SHORT_BATCH))
    make = bin_dir / "make"
    make.write_text(f'#!/bin/sh\nexec {shutil.which("make")} PY={python} "$@"\n')
    for f in (python, make):
        f.chmod(0o755)
    return root, bin_dir


BLOCKS = shell_blocks()


@pytest.mark.full
@pytest.mark.parametrize("where,lines,reason", [pytest.param(*b, id=b[0]) for b in BLOCKS])
def test_a_docs_block_runs_as_written(fresh_copy, where, lines, reason):
    if reason:
        pytest.skip(f"{where}: {reason}")
    root, bin_dir = fresh_copy
    env = os.environ | {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                        "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    r = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=BLOCK_TIMEOUT_S)
    assert r.returncode == 0, f"{where} failed (exit {r.returncode}):\n{script}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_every_shell_block_is_found_with_its_skip_reason():
    """The extraction itself: README's quick start is a shell block that runs, its 7B recipe one that is skipped."""
    by_first = {lines[0].split(" #")[0].strip(): (where, reason) for where, lines, reason in BLOCKS}
    assert by_first["make demo"][1] is None
    assert "python data.py shapes --out data/shapes2 --images 2" in by_first
    assert any(first.startswith("python convert.py from-hf --llm vicuna-7b-v1.5") and reason
               for first, (_, reason) in by_first.items())
    assert all(where.split(":")[0] in {str(p.relative_to(ROOT)) for p in doc_files()} for where, _ in by_first.values())
