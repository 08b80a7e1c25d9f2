"""benchmarks.py: lmms-eval's tasks scored in llavax. The metric code against lmms-eval 0.7.3's own task functions on
hand-made answers; 2 ranks against 1 (score.py under torchrun, gloo); a missing or malformed file is one sentence
before anything trains, a failure during a run is one line and the run goes on; and (make test-full) the scores
train.py logs against `lmms-eval eval --model llava_hf` on the export of the same checkpoint, task for task. lmms-eval
runs in a side venv of its own (tests/lmms_eval_reference.py), installed once."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import forkserver
import pytest
import torch
from conftest import ROOT, run_log
from test_train import free_port

import benchmarks
import chat
import score as score_program
import storage
from model import build_model
from model_config import vlm_preset
from model_files import save_model


def side_dir():
    """Where tests/lmms_eval_reference.py keeps lmms-eval: beside the venv's packages, else in the temporary folder."""
    return Path(sys.prefix, "lmms-eval") if os.access(sys.prefix, os.W_OK) else \
        Path(tempfile.gettempdir(), "llavax-lmms-eval")


def reference(*args, timeout=1500):
    r = subprocess.run([sys.executable, str(ROOT / "tests/lmms_eval_reference.py"), str(side_dir()), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


# -----------------------------------------------------------------------------
# the metrics on hand-made answers, where each task's parsing has its corners

MME = [({"question_id": f"{c}/{i}.jpg", "category": c, "answer": a}, said)
       for c, i, a, said in [("existence", 1, "Yes", "Yes."), ("existence", 1, "No", "no"), ("existence", 2, "Yes", "y"),
                             ("existence", 2, "No", "Yesterday"), ("OCR", 3, "No", "No, it is not"), ("OCR", 3, "Yes", "N"),
                             ("code_reasoning", 4, "Yes", "maybe"), ("code_reasoning", 4, "No", "nope"),
                             ("commonsense_reasoning", 5, "Yes", "yes"), ("commonsense_reasoning", 5, "No", "no.")]]
POPE = [({"question_id": i, "answer": a}, said) for i, (a, said) in
        enumerate([("yes", "yes"), ("no", "Yes"), ("yes", "No"), ("no", "no"), ("yes", "yes."), ("no", "maybe")])]
SQA = [({"choices": ["cat", "dog", "bird"], "answer": a, "hint": "", "question": "q"}, said) for a, said in
       [(0, "A"), (1, "b"), (2, "C. bird"), (1, "The answer is B"), (0, "a."), (2, "c")]]
MMBENCH_ROWS = [(0, "A", "cat", "dog", "bird", "fish"), (1000000, "B", "fish", "cat", "dog", "bird"),
                (1, "C", "red", "blue", "green", None), (1000001, "A", "green", "red", "blue", None),
                (2, "B", "one", "two", "three", "four"), (3, "D", "up", "down", "left", "right")]
MMBENCH = [({"index": i, "answer": a, "A": o1, "B": o2, "C": o3, "D": o4, "question": "q", "hint": None,
             "source": "s", "split": "dev", "category": "cat" + str(i % 2), "L2-category": "l2"}, said)
           for (i, a, o1, o2, o3, o4), said in zip(MMBENCH_ROWS, ["A", "(B) cat", "green", "A", "The answer is B",
                                                                   "A big D"])]
MMSTAR = [({"index": i, "answer": a, "category": c, "l2_category": l2}, said) for i, (a, c, l2, said) in enumerate(
    [("A", "math", "geometry", "(A)"), ("B", "math", "geometry", "answer is C"),
     ("C", "math", "statistical reasoning", "C."),
     ("D", "coarse perception", "image emotion", "I think D is right"), ("A", "coarse perception", "image emotion", ""),
     ("B", "coarse perception", "image style & quality", "B")])]
CHARTQA = [({"type": t, "answer": a}, said) for t, a, said in
           [("human_test", "12", "12"), ("human_test", "12.5%", "0.126"), ("augmented_test", "40", "41"),
            ("augmented_test", "Yes", "yes"), ("human_test", "0", "0.0"), ("augmented_test", "abc", "ab c")]]
CASES = {"mme": MME, "pope": POPE, "scienceqa_img": SQA, "mmbench_en_dev": MMBENCH, "mmstar": MMSTAR, "chartqa": CHARTQA}
# our metric -> lmms-eval's
LMMS_NAMES = {"mme": {"perception": "mme_perception_score", "cognition": "mme_cognition_score"},
              "pope": {"accuracy": "pope_accuracy", "precision": "pope_precision", "recall": "pope_recall",
                       "f1": "pope_f1_score", "yes_ratio": "pope_yes_ratio"},
              "mmbench_en_dev": {"accuracy": "gpt_eval_score"}}


def ours(task, cases):
    return benchmarks.TASKS[task].aggregate([benchmarks.TASKS[task].score(row, said) for row, said in cases])


def assert_same_scores(mine, theirs, task):
    names = LMMS_NAMES.get(task, {})
    compared = {names.get(k, k): v for k, v in mine.items() if k != "answered_yes"}
    assert compared.keys() == theirs.keys(), (task, mine, theirs)
    for k, v in compared.items():
        assert abs(v - theirs[k]) <= 1e-9, (task, k, v, theirs[k])


def test_metrics_equal_lmms_evals_functions_on_hand_made_answers(tmp_path):
    """Each task's answer parsing (MME's yes/no, ScienceQA's letter rule, MMBench's circular letter reading, MMStar's
    MCQ extraction, ChartQA's relaxed accuracy) and aggregation equal lmms-eval's process_results and aggregation
    functions on the same rows and answers; and the answers vary enough that each score is neither 0 nor 1."""
    (tmp_path / "in.json").write_text(json.dumps(CASES))
    reference("metrics", tmp_path / "in.json", tmp_path / "out.json")
    theirs = json.loads((tmp_path / "out.json").read_text())
    for task, cases in CASES.items():
        mine = ours(task, cases)
        assert_same_scores(mine, theirs[task], task)
        records = [benchmarks.TASKS[task].score(row, said) for row, said in cases]
        assert {r["score"] for r in records} == {0.0, 1.0} if task != "mmbench_en_dev" else 0 < mine["accuracy"] < 100


def test_answer_text_cuts_reasoning_and_special_tokens(tmp_path):
    tok = chat.Tokenizer(answer_tokenizer(tmp_path))
    ids = tok.encode("<think>hmm</think> Yes ") + [tok.eos_id] + tok.encode("no")
    assert benchmarks.answer_text(tok, ids, tok.eos_id) == "Yes"
    assert benchmarks.answer_text(tok, tok.encode("a</analysis>B"), tok.eos_id) == "B"


# -----------------------------------------------------------------------------
# benchmark files in the published schemas (datasets' Image feature: a struct of bytes and path)


def photo(w, h, seed):
    from test_convert import photo as jpeg

    return {"bytes": jpeg(w, h, seed), "path": None}


SIZES = [(333, 500), (640, 480), (28, 28), (500, 375), (97, 64), (1024, 683)]


def write_parquet(path, columns, features):
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).to_parquet(str(path))


def write_benchmarks(root, n=12):
    """The six benchmarks under root as their Hub downloads lay them out, n questions each."""
    from datasets import Image, List, Value

    s, i64 = Value("string"), Value("int64")
    images = [photo(*SIZES[i % len(SIZES)], seed=i) for i in range(n)]
    yes_no = ["Yes", "No"] * (n // 2)
    mme_cats = ["existence", "existence", "OCR", "OCR", "code_reasoning", "code_reasoning"] * n
    write_parquet(root / "MME/data/test-00000-of-00001.parquet",
                  {"question_id": [f"{mme_cats[i]}/{i // 2}.png" for i in range(n)], "image": images,
                   "question": [f"Is there a {w} in the image? Please answer yes or no." for w in ["cat", "dog"] * (n // 2)],
                   "answer": yes_no, "category": mme_cats[:n]},
                  {"question_id": s, "image": Image(), "question": s, "answer": s, "category": s})
    write_parquet(root / "POPE/data/test-00000-of-00001.parquet",
                  {"id": [str(i) for i in range(n)], "question_id": [str(i) for i in range(n)],
                   "question": [f"Is there a {w} in the image?" for w in ["person", "car", "dog"] * n][:n],
                   "answer": [a.lower() for a in yes_no], "image_source": ["coco"] * n, "image": images,
                   "category": ["adversarial"] * n},
                  {"id": s, "question_id": s, "question": s, "answer": s, "image_source": s, "image": Image(),
                   "category": s})
    write_parquet(root / "ScienceQA/ScienceQA-IMG/test-00000-of-00001.parquet",
                  {"image": images, "question": ["Which animal is shown?"] * n,
                   "choices": [["cat", "dog", "bird"][: 2 + i % 2] for i in range(n)], "answer": [i % 2 for i in range(n)],
                   "hint": ["" if i % 3 else "Look closely." for i in range(n)], "task": ["closed choice"] * n,
                   "grade": ["grade2"] * n, "subject": ["natural science"] * n, "topic": ["biology"] * n,
                   "category": ["animals"] * n, "skill": ["identify"] * n, "lecture": [""] * n, "solution": [""] * n},
                  {"image": Image(), "question": s, "choices": List(s), "answer": Value("int8"), "hint": s, "task": s,
                   "grade": s, "subject": s, "topic": s, "category": s, "skill": s, "lecture": s, "solution": s})
    index = [i if i < n // 2 else 1_000_000 + i - n // 2 for i in range(n)]  # the second half: circular shifts
    write_parquet(root / "MMBench/en/dev-00000-of-00001.parquet",
                  {"index": index, "question": ["What is in the image?"] * n,
                   "hint": [None if i % 2 else "A photo." for i in range(n)], "A": ["cat"] * n, "B": ["dog"] * n,
                   "C": ["bird"] * n, "D": [None if i % 3 else "fish" for i in range(n)],
                   "answer": ["ABC"[i % 3] for i in range(n)], "category": ["object"] * n, "image": images,
                   "source": ["test"] * n, "L2-category": ["perception"] * n, "comment": [None] * n,
                   "split": ["dev"] * n},
                  {"index": i64, "question": s, "hint": s, "A": s, "B": s, "C": s, "D": s, "answer": s, "category": s,
                   "image": Image(), "source": s, "L2-category": s, "comment": s, "split": s})
    write_parquet(root / "MMStar/mmstar.parquet",
                  {"index": list(range(n)), "question": ["Which is it?\nOptions: A: cat, B: dog, C: bird, D: fish"] * n,
                   "image": images, "answer": ["ABCD"[i % 4] for i in range(n)],
                   "category": ["math", "coarse perception"] * (n // 2),
                   "l2_category": (["geometry", "image emotion", "statistical reasoning", "image style & quality"] * n)[:n],
                   "meta_info": [{"source": "test", "split": "val"}] * n},
                  {"index": i64, "question": s, "image": Image(), "answer": s, "category": s, "l2_category": s,
                   "meta_info": {"source": s, "split": s}})
    write_parquet(root / "ChartQA/data/test-00000-of-00001.parquet",
                  {"type": ["human_test", "augmented_test"] * (n // 2), "question": ["How many bars are there?"] * n,
                   "answer": [str(i) for i in range(n)], "image": images},
                  {"type": s, "question": s, "answer": s, "image": Image()})
    return root


ANSWERS = ["Yes", "No", "yes", "no", "A", "B", "C", "D", "3", "12"]  # what the tiny model can say, one token each


def answer_tokenizer(root):
    """A Vicuna-style sentencepiece tokenizer (BPE, byte fallback, legacy=False) that holds each of ANSWERS as a
    piece of its own."""
    import sentencepiece as spm
    from test_export_tokenizer import SP_CONFIG
    from test_templates import CORPUS

    root.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS + [" ".join(ANSWERS) + "."] * 60),
                                   model_prefix=str(root / "tokenizer"), vocab_size=400, model_type="bpe",
                                   byte_fallback=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
                                   character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
                                   minloglevel=2)
    (root / "tokenizer.vocab").unlink()
    (root / "tokenizer_config.json").write_text(json.dumps(SP_CONFIG | {"legacy": False}))
    return root


def tiny_checkpoint(root):
    """A random tiny LLaVA (vicuna_v1) that answers one of ANSWERS, or nothing, then stops: its output layer can say
    only those pieces and the EOS, and each of those pieces embeds to one large vector the EOS row points along, so
    after one of them the EOS wins. Its answers land in the tasks' label space (the scores are not all zero) and are
    short (lmms-eval answers one question at a time)."""
    tok_dir = answer_tokenizer(root / "tokenizer")
    tok = chat.Tokenizer(tok_dir)
    words = [tok.encode(f"{w}")[0] for w in ANSWERS if len(tok.encode(f"{w}")) == 1]
    assert len(words) >= 8, [tok.encode(w) for w in ANSWERS]
    cfg = vlm_preset("debug").with_overrides({"image_token_id": tok.vocab_size, "llm": {
        "vocab_size": -(-(tok.vocab_size + 1) // 64) * 64, "max_seq_len": 2048}})
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        said = torch.randn(cfg.llm.dim, generator=g)
        model.llm.tok_embeddings.weight[words] = 30 * said
        # the answer's first token: the part of the last hidden state that varies with image and question decides
        seen = last_hidden_states(model, tok, cfg)
        mean = seen.mean(0)
        varies = torch.linalg.svd(seen - mean, full_matrices=False).Vh[:len(words)]  # (words, dim)
        model.llm.output.weight.zero_()
        model.llm.output.weight[words] = mean / mean.norm() * 8 + varies * 40 / (seen - mean).norm(dim=1).mean()
        model.llm.output.weight[tok.eos_id] = 40 * said / said.norm()
    save_model(model, root / "ckpt", tokenizer_dir=tok_dir)
    (root / "ckpt/state.json").write_text(json.dumps({"config": {"template": "vicuna_v1", "image_mode": "pad"}}))
    return root / "ckpt"


def last_hidden_states(model, tok, cfg, n=24):
    """The final norm's output at the last prompt position of n benchmark-like questions about photos."""
    from images import load_image, normalize_images

    from model import left_pad

    rows = [chat.tokenize([(chat.generation_prompt("vicuna_v1", f"{chat.IMAGE_TAG}\nQuestion {i}: is it {i % 7}?\n"
                                                   "Answer with a word.", tok), False)], tok, cfg.image_token_id,
                          cfg.n_image_tokens)[0] for i in range(n)]
    ids, mask = left_pad(rows, tok.pad_id)
    pixels = torch.stack([load_image(photo(*SIZES[i % len(SIZES)], seed=100 + i)["bytes"], cfg.vision.image_size)
                          for i in range(n)])
    seen = []
    hook = model.llm.norm.register_forward_hook(lambda m, args, out: seen.append(out[:, -1]))
    model.generate(ids, normalize_images(pixels), max_new_tokens=1, attention_mask=mask)
    hook.remove()
    return seen[0].float()


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return tiny_checkpoint(root), write_benchmarks(root / "benchmarks")


def score(ckpt, bench_dir, out, nproc=1, extra=()):
    script = [str(ROOT / "score.py"), "--ckpt", str(ckpt), "--benchmarks", *benchmarks.TASKS, "--benchmark-dir",
              str(bench_dir), "--device", "cpu", "--out", str(out), *extra]
    cmd = [sys.executable, *script] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), *script]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), [json.loads(x) for x in out.read_text().splitlines()]


@pytest.mark.full  # a second launcher (torchrun, 2 ranks) through what the in-process runs here check
def test_two_ranks_score_as_one(scored, tmp_path):
    """score.py under torchrun (2 gloo ranks, each a slice of every benchmark, the answers gathered) gives the answers
    and scores of one process, and a JSONL line a question with its id, prompt, answer and score."""
    ckpt, bench_dir = scored
    one, one_lines = score(ckpt, bench_dir, tmp_path / "one.jsonl")
    two, two_lines = score(ckpt, bench_dir, tmp_path / "two.jsonl", nproc=2)
    assert one == two and one_lines == two_lines
    assert {k.split("/")[1] for k in one} == set(benchmarks.TASKS)
    assert len(one_lines) == 12 * len(benchmarks.TASKS)
    assert {"benchmark", "id", "prompt", "answer", "score"} <= one_lines[0].keys()
    assert any(line["score"] for line in one_lines) and not all(line["score"] for line in one_lines)


def test_score_never_overwrites_what_a_run_or_an_earlier_score_wrote(scored, tmp_path, capsys):
    """score.py on a run's step writes its answers beside it under a name of its own (CKPT.score.jsonl, then -2, ...),
    says where, and leaves the run's CKPT.benchmarks.jsonl (and an earlier score's answers) as they were."""
    ckpt, bench_dir = scored
    step = tmp_path / "out/step-000040"
    shutil.copytree(ckpt, step)
    runs = tmp_path / "out/step-000040.benchmarks.jsonl"
    runs.write_text("".join(json.dumps({"benchmark": b, "id": i}) + "\n" for b in ("mme", "pope") for i in range(40)))
    before = runs.read_text()
    said = []
    for _ in range(2):
        score_program.main(["--ckpt", str(step), "--benchmarks", "pope", "--benchmark-dir", str(bench_dir), "--device",
                            "cpu", "--limit", "5"])
        said.append(capsys.readouterr().out)
    assert runs.read_text() == before
    first, second = tmp_path / "out/step-000040.score.jsonl", tmp_path / "out/step-000040.score-2.jsonl"
    assert f"answers to {first}" in said[0] and "not overwritten" not in said[0], said[0]
    assert f"answers to {second} ({first} is there already: not overwritten)" in said[1], said[1]
    assert first.read_text() == second.read_text() and len(first.read_text().splitlines()) == 5


def test_a_benchmark_file_in_a_bucket_is_downloaded_once(scored, s3_proxy, s3_bucket):
    """A benchmark file in a bucket is downloaded once a process: the start's checks and every pass of the run read
    the same copy (moto behind a proxy that counts the requests)."""
    _, bench_dir = scored
    url = f"{s3_bucket}/bench/pope.parquet"
    storage.write_bytes(url, (bench_dir / "POPE/data/test-00000-of-00001.parquet").read_bytes())
    s3_proxy.requests.clear()
    found = benchmarks.open_benchmarks([f"pope={url}"], str(bench_dir))
    passes = [benchmarks.read_rows(found[0]) for _ in range(2)]
    assert len(passes[0]) == 12 and passes[0] == passes[1]
    gets = [r for r in s3_proxy.requests if r.startswith("GET ") and "pope.parquet" in r]
    assert len(gets) == 1, s3_proxy.requests


XLA_SCORE = """
import json, sys
import torch_xla.debug.metrics as met
import score
compiles = []
for _ in range(2):
    score.main(sys.argv[1:])
    compiles.append(met.metric_data("CompileTime")[0])
print(json.dumps(compiles))
"""


@pytest.mark.full  # four CPU devices compile each prompt bucket and answer length: about a minute
def test_xla_answers_as_cpu_and_a_second_pass_compiles_nothing(scored, tmp_path):
    """score.py under torch_xla SPMD (4 CPU devices, a global batch of 4 questions) gives the CPU eager run's answers
    and scores; a second pass in the same process compiles nothing new."""
    from conftest import XLA_CPU

    ckpt, bench_dir = scored
    common = ["--ckpt", str(ckpt), "--benchmarks", "mme", "pope", "scienceqa_img", "chartqa", "--benchmark-dir",
              str(bench_dir), "--batch-size", "4"]
    cpu = subprocess.run([sys.executable, str(ROOT / "score.py"), *common, "--device", "cpu", "--out",
                          str(tmp_path / "cpu.jsonl")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    xla = subprocess.run([sys.executable, "-c", XLA_SCORE, *common, "--device", "xla", "--out",
                          str(tmp_path / "xla.jsonl")], capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env=os.environ | XLA_CPU)
    assert xla.returncode == 0, xla.stderr[-3000:]
    said = xla.stdout.strip().splitlines()
    first, second = json.loads(said[-1])
    assert first > 0 and second == first, (first, second)
    assert json.loads(said[-2]) == json.loads(cpu.stdout.strip().splitlines()[-1])
    assert (tmp_path / "xla.jsonl").read_text() == (tmp_path / "cpu.jsonl").read_text()


def test_missing_or_malformed_benchmark_file_is_one_sentence(scored, tmp_path, shapes_data):
    """Before anything trains (no out_dir made): a benchmark whose files are not there, a file that is not parquet,
    one that lacks a column the task reads."""
    _, bench_dir = scored
    shapes = shapes_data(n=64, seed=0, val_fraction=0.1)
    r = forkserver.run([sys.executable, str(ROOT / "train.py"), str(ROOT / "configs/debug.py"),
                       f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}",
                       f"--out_dir={tmp_path / 'out'}", "--benchmarks=['mme']", f"--benchmark_dir={tmp_path}"],
                       os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and not (tmp_path / "out").exists()
    said = r.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("benchmarks: mme: no data/test-*.parquet in"), r.stderr[-2000:]
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(SystemExit, match=r"benchmarks: pope: .*bad.parquet is not a readable parquet file"):
        benchmarks.open_benchmarks([f"pope={tmp_path / 'bad.parquet'}"], tmp_path)
    with pytest.raises(SystemExit, match=r"benchmarks: chartqa: .* lacks the column\(s\) type that lmms-lab/ChartQA"):
        benchmarks.open_benchmarks([f"chartqa={bench_dir / 'POPE/data/test-00000-of-00001.parquet'}"], tmp_path)
    with pytest.raises(SystemExit, match="unknown benchmark 'mmmu'"):
        benchmarks.open_benchmarks(["mmmu"], tmp_path)


def test_a_split_folder_reads_its_split_a_near_name_is_suggested_and_an_empty_file_is_a_sentence(tmp_path):
    """A `name=FOLDER` entry naming the split's own folder (ScienceQA-IMG/, MMBench's en/, as published beside train,
    validation and test files) reads the evaluated split alone; a misspelt name gets the nearest; a path-only image is
    an error, not a question asked without its image."""
    import shutil

    root = write_benchmarks(tmp_path / "b", n=2)
    for folder, split, others in (("ScienceQA/ScienceQA-IMG", "test", ("train", "validation")), ("MMBench/en", "dev",
                                                                                                     ("test",))):
        for other in others:
            shutil.copy(root / folder / f"{split}-00000-of-00001.parquet", root / folder / f"{other}-00000-of-00001.parquet")
    assert [p.name for p in benchmarks.find(f"scienceqa_img={root / 'ScienceQA/ScienceQA-IMG'}", root).files] == \
        ["test-00000-of-00001.parquet"]
    assert [p.name for p in benchmarks.find(f"mmbench_en_dev={root / 'MMBench/en'}", root).files] == \
        ["dev-00000-of-00001.parquet"]
    for wrong, near in (("mmee", "mme"), ("MMStar", "mmstar"), ("scienceqa", "scienceqa_img")):
        with pytest.raises(SystemExit, match=f"unknown benchmark '{wrong}' \\(did you mean '{near}'\\?\\); choose from"):
            benchmarks.open_benchmarks([wrong], root)
    import pandas as pd

    pd.read_parquet(root / "POPE/data/test-00000-of-00001.parquet").iloc[:0].to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(SystemExit, match=r"^benchmarks: pope: .*empty.parquet hold\(s\) no rows$"):
        benchmarks.open_benchmarks([f"pope={tmp_path / 'empty.parquet'}"], root)
    with pytest.raises(ValueError, match="x.jpg"):
        benchmarks.image_bytes({"image": {"bytes": None, "path": "x.jpg"}})
    assert benchmarks.image_bytes({"image": None}) is None  # a text-only row (ScienceQA-FULL's)


def test_a_prompt_that_fits_is_asked_and_a_longer_one_is_not():
    """A prompt whose length bucket would pass max_seq_len is still asked (its bucket ends a token before the end);
    only one that leaves no room for an answer token is scored unanswered."""
    from types import SimpleNamespace

    env = SimpleNamespace(kind="cpu", world=1, rank=0)
    lengths = [65, 99, 100, 150, 30]
    planned, too_long = benchmarks.batches([([0] * n, None) for n in lengths], env, 4, 100, 16)
    assert too_long == [2, 3]
    assert sorted(i for _, _, numbers in planned for i in numbers) == [0, 1, 4]
    assert all(bucket + new <= 100 and new >= 1 and all(lengths[i] <= bucket for i in numbers)
               for bucket, new, numbers in planned)


def test_a_benchmark_file_the_task_cannot_read_is_one_sentence_at_start(tmp_path):
    """Before anything trains: a column of another type than the publisher's (POPE answers as integers, images as
    path strings), a null where the task reads a value, a value the dataset never has (an MME category that is not
    MME's, a POPE answer that is not yes or no), a path-only image, bytes that are no image: one sentence naming the
    file and the row. Each of these once trained the whole run and then failed in scoring or logged nothing."""
    import pandas as pd

    root = write_benchmarks(tmp_path / "b", n=12)
    assert [b.name for b in benchmarks.open_benchmarks(list(benchmarks.TASKS), root)] == list(benchmarks.TASKS)
    pope = pd.read_parquet(root / "POPE/data/test-00000-of-00001.parquet")
    mme = pd.read_parquet(root / "MME/data/test-00000-of-00001.parquet")
    sqa = pd.read_parquet(root / "ScienceQA/ScienceQA-IMG/test-00000-of-00001.parquet")
    html = {"bytes": b"<html><body>404 Not Found</body></html>", "path": None}
    cases = [("pope", pope.assign(answer=[1, 0] * 6), r"row 0: answer is 1, of type int64, where lmms-lab/POPE's answer "
              r"is a string$"),
             ("pope", pope.assign(answer=[None, *pope.answer[1:]]).astype({"answer": object}), "row 0: answer is null$"),
             ("pope", pope.assign(answer=[*pope.answer[:7], None, *pope.answer[8:]]), "row 7: answer is null$"),
             ("pope", pope.assign(answer=[*pope.answer[:3], "Maybe", *pope.answer[4:]]),
              r"row 3: answer is 'Maybe', not one of lmms-lab/POPE's \(no, yes\)$"),
             ("pope", pope.assign(image=[{"bytes": None, "path": f"COCO_val2014_{i:012d}.jpg"} for i in range(12)]),
              r"row 0: its image cannot be read \(ValueError: an image is a path \(COCO_val2014_000000000000.jpg\)"),
             ("pope", pope.assign(image=[f"COCO_val2014_{i:012d}.jpg" for i in range(12)]),
              "row 0: image is 'COCO_val2014_000000000000.jpg', of type (large_)?string, where lmms-lab/POPE's image is "
              "an image"),
             ("pope", pope.assign(image=[*pope.image[:2], html, *pope.image[3:]]),
              r"row 2: its image cannot be read \(UnidentifiedImageError: cannot identify image file\)$"),
             ("mme", mme.assign(category=["animals", "vehicles"] * 6), "row 0: category is 'animals', not one of "
              "lmms-lab/MME's \\(OCR, artwork, "),
             ("mme", mme.assign(category=[c.lower() for c in mme.category]), "row 2: category is 'ocr', not one of"),
             ("scienceqa_img", sqa.assign(choices=[["cat", None]] * 12), "row 0: choices holds a null$")]
    for k, (name, table, said) in enumerate(cases):
        path = tmp_path / f"{k}.parquet"
        table.to_parquet(path)
        with pytest.raises(SystemExit, match=f"^benchmarks: {name}: {path} {said}") as e:
            benchmarks.open_benchmarks([f"{name}={path}"], root)
        assert "\n" not in str(e.value)


def test_a_benchmark_whose_rows_cannot_be_scored_is_a_line(tmp_path, monkeypatch, capsys):
    """A row the task cannot score (a null answer, in a file changed after the start's check) fails its benchmark
    as one line; the next is still scored."""
    import pandas as pd

    import config
    from parallel import Env

    root = write_benchmarks(tmp_path / "b", n=4)
    table = pd.read_parquet(root / "POPE/data/test-00000-of-00001.parquet")
    table.loc[1, "answer"] = None
    table.to_parquet(tmp_path / "pope.parquet")
    monkeypatch.setattr(benchmarks, "answer_all", lambda raw, asker, env, bench, rows: (dict.fromkeys(range(len(rows)),
                                                                                                       "Yes"), 0))
    found = [benchmarks.find(f"pope={tmp_path / 'pope.parquet'}", root), *benchmarks.open_benchmarks(["mme"], root)]
    asker = benchmarks.Asker(None, "vicuna_v1", "pad", 4)
    scores = benchmarks.run_benchmarks(torch.nn.Linear(1, 1), found, asker, Env(config.DEFAULTS | {"device": "cpu"}))
    assert "benchmark pope failed in scoring (AttributeError" in capsys.readouterr().out
    assert set(scores) == {"bench/mme/perception"}  # its 4 questions: existence and OCR


def test_a_benchmark_that_gives_no_metric_is_a_line_not_an_empty_score(tmp_path, monkeypatch, capsys):
    """MMBench rows that are all circular shifts (index >= 10^6, say a file cut from the middle): its aggregate has
    no question to count; the line said `mmbench_en_dev:  (6 questions, 0 s)` and logged nothing. Now it says so."""
    import pandas as pd

    import config
    from parallel import Env

    root = write_benchmarks(tmp_path / "b", n=12)
    table = pd.read_parquet(root / "MMBench/en/dev-00000-of-00001.parquet")
    table[table["index"] >= 1_000_000].to_parquet(tmp_path / "shifts.parquet")
    monkeypatch.setattr(benchmarks, "answer_all", lambda raw, asker, env, bench, rows: (dict.fromkeys(range(len(rows)),
                                                                                                       "A"), 0))
    found = benchmarks.open_benchmarks([f"mmbench_en_dev={tmp_path / 'shifts.parquet'}", "mme"], root)
    asker = benchmarks.Asker(None, "vicuna_v1", "pad", 4)
    scores = benchmarks.run_benchmarks(torch.nn.Linear(1, 1), found, asker, Env(config.DEFAULTS | {"device": "cpu"}))
    said = capsys.readouterr().out
    assert "benchmark mmbench_en_dev gave no score: none of its 6 questions is one its metric counts" in said, said
    assert "mmbench_en_dev: " not in said and set(scores) == {"bench/mme/perception", "bench/mme/cognition"}


def test_a_failing_benchmark_is_a_line_and_the_run_goes_on(scored, tmp_path, shapes_data):
    """In a training run: scores at benchmark_interval and the end go to log.jsonl and the answers beside the
    checkpoint; a benchmark whose rows fail to be answered (an image past the rows decoded at start that is no image)
    fails as one line and the run finishes (DONE), the other benchmarks scored."""
    import pandas as pd

    _, bench_dir = scored
    broken = tmp_path / "sqa.parquet"
    table = pd.read_parquet(bench_dir / "ScienceQA/ScienceQA-IMG/test-00000-of-00001.parquet")
    table["image"] = [{"bytes": b"<html>404</html>", "path": None} if i == benchmarks.DECODED_ROWS else image
                      for i, image in enumerate(table["image"])]
    table.to_parquet(broken)
    shapes = shapes_data(n=64, seed=0, val_fraction=0.1)
    r = forkserver.run([sys.executable, str(ROOT / "train.py"), str(ROOT / "configs/debug.py"),
                       f"--data_dir={shapes / 'shards'}", f"--tokenizer={shapes / 'tokenizer.model'}",
                       f"--out_dir={tmp_path / 'out'}", "--max_iters=4", "--eval_interval=0", "--log_interval=2",
                       f"--benchmarks=['mme', 'scienceqa_img={broken}']", f"--benchmark_dir={bench_dir}",
                       "--benchmark_interval=2", f"--benchmark_limit={benchmarks.DECODED_ROWS + 1}",
                       "--final_accuracy_samples=0"],
                       os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    failed = [line for line in r.stdout.splitlines() if "benchmark scienceqa_img failed" in line]
    assert len(failed) == 2 and "UnidentifiedImageError" in failed[0], r.stdout[-3000:]
    scores = run_log(tmp_path / "out", "bench/mme/perception")
    assert [e["step"] for e in scores] == [2, 4] and (tmp_path / "out/DONE").exists()
    lines = (tmp_path / "out/step-000004.benchmarks.jsonl").read_text().splitlines()
    assert len(lines) == benchmarks.DECODED_ROWS + 1 and json.loads(lines[0])["benchmark"] == "mme"
    assert "benchmarks: mme perception" in r.stdout


# -----------------------------------------------------------------------------
# the reference: lmms-eval on the export of the same checkpoint


@pytest.mark.full  # lmms-eval's llava_hf answers one question at a time on CPU: minutes
def test_logged_scores_equal_lmms_eval_on_the_export(scored, tmp_path):
    """score.py (benchmarks.run_benchmarks, as train.py calls it) on a tiny checkpoint and six local benchmark files in
    the published schemas, against `lmms-eval eval --model llava_hf` on convert.py's export of it: each question's
    answer and each task's scores are lmms-eval's (mmbench_en_dev against its static, no-GPT scoring)."""
    import convert

    ckpt, bench_dir = scored
    convert.main(["to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")])
    mine, lines = score(ckpt, bench_dir, tmp_path / "ours.jsonl")
    reference("eval", tmp_path / "hf", bench_dir, tmp_path / "lmms", 12, timeout=3000)
    found = [p for p in (tmp_path / "lmms").rglob("*_results.json") if "submissions" not in p.parts]
    results = json.loads(found[0].read_text())["results"]
    for task in benchmarks.TASKS:
        theirs_task = "mmbench_en_dev_static" if task == "mmbench_en_dev" else task
        samples = next((tmp_path / "lmms").rglob(f"*_samples_{theirs_task}.jsonl")).read_text().splitlines()
        samples = [json.loads(s) for s in samples]
        theirs_said = {s["doc_id"]: (s["input"], s["filtered_resps"]) for s in samples}  # the prompt, the answer
        assert {line["doc_id"]: (line["prompt"], line["answer"]) for line in lines if line["benchmark"] == task} == \
            theirs_said, task
        theirs = {k.split(",")[0]: v for k, v in results[theirs_task].items() if k.endswith(",none")
                  and not k.startswith("submission") and "_stderr" not in k}
        assert_same_scores({k.split("/", 2)[2]: v for k, v in mine.items() if k.split("/")[1] == task}, theirs, task)

