"""lmms-eval 0.7.3, the reference for benchmarks.py, in a side venv of its own (installed once; lmms-eval pins
filelock < 4, which the project's venv cannot hold): the venv's packages are read through a .pth file, lmms-eval and
the few packages it imports that the venv lacks are installed into the side venv.

    python tests/lmms_eval_reference.py SIDE metrics IN_JSON OUT_JSON
        lmms-eval's process_results and aggregation functions on hand-made rows and answers
    python tests/lmms_eval_reference.py SIDE eval HF_DIR BENCH_DIR OUT_DIR LIMIT
        `lmms-eval eval --model llava_hf` on an export, its datasets read from BENCH_DIR's parquet files

Run with the venv's python; it runs itself again under the side venv's.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PINS = ["lmms-eval==0.7.3"]
DEPENDENCIES = ["filelock<4", "loguru", "sqlitedict", "evaluate", "pytablewriter", "sacrebleu", "scikit-learn",
                "tenacity", "pytz", "jsonlines", "decord", "openpyxl"]
# lmms-eval's task -> (the Hub dataset its yaml names, the folder and files tests/test_benchmarks.py writes)
DATASETS = {"lmms-lab-encoder/MME": "MME/data/test-*.parquet", "lmms-lab-encoder/POPE": "POPE/data/test-*.parquet",
            "lmms-lab-encoder/ScienceQA": "ScienceQA/ScienceQA-IMG/test-*.parquet",
            "lmms-lab-encoder/MMBench": "MMBench/en/dev-*.parquet", "Lin-Chen/MMStar": "MMStar/mmstar.parquet",
            "lmms-lab-encoder/ChartQA": "ChartQA/data/test-*.parquet"}
SPLITS = {"lmms-lab-encoder/MMBench": "dev", "Lin-Chen/MMStar": "val"}


def install(side):
    """The side venv, made once (again when the pins change)."""
    stamp = "\n".join(PINS + DEPENDENCIES)
    if (side / ".installed").exists() and (side / ".installed").read_text() == stamp:
        return
    shutil.rmtree(side, ignore_errors=True)
    side.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=side.name + ".", dir=side.parent))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
    uv = Path(sys.executable).parent / "uv"  # make setup's: no pip to install into the side venv, and 5x faster
    if uv.exists():
        pip = [str(uv), "pip", "install", "--quiet", "--python", str(tmp / "bin/python")]
    else:
        subprocess.run([str(tmp / "bin/python"), "-m", "ensurepip", "--upgrade"], check=True, capture_output=True)
        pip = [str(tmp / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    site = subprocess.run([str(tmp / "bin/python"), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")][0]
    Path(site, "llavax-venv.pth").write_text(ours + "\n")  # after the side venv's own: its filelock wins
    subprocess.run(pip + ["--no-deps", *PINS], check=True)
    subprocess.run(pip + DEPENDENCIES, check=True)
    (tmp / ".installed").write_text(stamp)
    try:
        tmp.rename(side)
    except OSError:  # another process installed it meanwhile
        shutil.rmtree(tmp)


# -----------------------------------------------------------------------------
# inside the side venv


def metrics(in_json, out_json):
    """{task: {metric: value}} from lmms-eval's functions on {task: [[row, answer], ...]}."""
    from types import SimpleNamespace

    from lmms_eval.tasks.chartqa import utils as chartqa
    from lmms_eval.tasks.mmbench import en_utils as mmbench
    from lmms_eval.tasks.mme import utils as mme
    from lmms_eval.tasks.mmstar import utils as mmstar
    from lmms_eval.tasks.pope import utils as pope
    from lmms_eval.tasks.scienceqa import utils as scienceqa

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731  lmms-eval's "mean" aggregation
    args = SimpleNamespace(output_path=str(Path(out_json).parent))
    tasks = {
        "mme": (mme.mme_process_results, lambda k: mme.mme_aggregate_results),
        "pope": (pope.pope_process_results, lambda k: getattr(pope, "pope_aggregate_" + k[len("pope_"):])),
        "scienceqa_img": (scienceqa.sqa_process_results, lambda k: mean),
        "mmbench_en_dev": (mmbench.mmbench_process_results,
                           lambda k: (lambda r: mmbench.mmbench_aggregate_dev_results_static(r, args))
                           if k == "gpt_eval_score" else None),
        "mmstar": (mmstar.mmstar_process_results, lambda k: mmstar.mmstar_aggregate_results),
        "chartqa": (chartqa.chartqa_process_results, lambda k: mean),
    }
    out = {}
    for task, cases in json.loads(Path(in_json).read_text()).items():
        process, aggregation = tasks[task]
        by_metric = {}
        for row, answer in cases:
            for key, value in process(row, [answer]).items():
                by_metric.setdefault(key, []).append(value)
        out[task] = {k: aggregation(k)(v) for k, v in by_metric.items() if aggregation(k) is not None}
    Path(out_json).write_text(json.dumps(out))


def evaluate(hf_dir, bench_dir, out_dir, limit):
    """lmms-eval's CLI, `lmms-eval eval` (its defaults: reasoning tags cut), datasets.load_dataset reading local files."""
    import datasets

    from lmms_eval.__main__ import cli_evaluate

    load = datasets.load_dataset

    def local(path, name=None, **kw):
        if path not in DATASETS:
            return load(path, name, **kw)
        files = sorted(str(p) for p in Path(bench_dir).glob(DATASETS[path]))
        return load("parquet", data_files={SPLITS.get(path, "test"): files}, cache_dir=str(Path(out_dir, "cache")))

    datasets.load_dataset = local
    sys.argv = ["lmms-eval", "--model", "llava_hf", "--model_args",
                f"pretrained={hf_dir},device=cpu,device_map=cpu,dtype=float32", "--tasks",
                "mme,pope,scienceqa_img,mmbench_en_dev_static,mmstar,chartqa", "--batch_size", "1", "--limit",
                str(limit), "--log_samples", "--output_path", str(out_dir)]
    cli_evaluate()
    if not [p for p in Path(out_dir).rglob("*_results.json") if "submissions" not in p.parts]:  # it exits 0 on errors
        raise SystemExit("lmms-eval wrote no results (its error is above)")


if __name__ == "__main__":
    side, mode, *rest = sys.argv[1:]
    side = Path(side)
    if Path(sys.prefix).resolve() != side.resolve():
        install(side)
        env = os.environ | {"USE_TORCH_XLA": "0", "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false",
                            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        sys.exit(subprocess.run([str(side / "bin/python"), __file__, *sys.argv[1:]], env=env).returncode)
    metrics(*rest) if mode == "metrics" else evaluate(*rest)
