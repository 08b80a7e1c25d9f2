"""
Benchmarks in the loop: lmms-eval's image tasks scored on the model's own greedy answers, from the parquet files their
publishers ship (docs/training.md "Benchmarks"). Each task's prompt, answer parsing and metrics are lmms-eval 0.7.3's
as its task files define them and as `lmms-eval eval --model llava_hf` runs them (the question after one image in a
user turn, the model's chat template, greedy decoding to the EOS, reasoning blocks cut and the answer stripped),
written here; tests/test_benchmarks.py holds them to lmms-eval itself.

Answers are batched: prompts left-padded to a multiple of BUCKET tokens and batches filled to batch_size rows, so a
row's answer does not depend on the rows beside it, every rank (under torchrun) answers its slice, and XLA compiles
one prefill and one decode step per prompt bucket and answer length.
"""

import atexit
import difflib
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

import chat
import storage
from images import load_image, normalize_images
from model import left_pad
from parallel import autocast, gathered_for_generation, print0
from progress import progress

BUCKET = 64  # prompts are left-padded to a multiple of this many tokens
STOP_EVERY = 16  # XLA: every this many answer tokens, stop when every row has ended (not all max_new_tokens)
REASONING_TAGS = (("<think>", "</think>"), ("<analysis>", "</analysis>"))  # `lmms-eval eval`'s --reasoning_tags


# -----------------------------------------------------------------------------
# the answers lmms-eval reads: the EOS ends them (llava_hf stops there), special tokens dropped, reasoning cut


def answer_text(tok, tokens, stop):
    """The text of generated tokens up to `stop`, as lmms-eval reads it: special tokens skipped in decoding, blocks
    between reasoning tags cut (a lone closing tag: what follows it), the rest stripped."""
    tokens = tokens[: tokens.index(stop)] if stop in tokens else tokens
    special = set(tok.specials.values()) | ({tok.sp.unk_id()} if tok.sp is not None else set())
    text = tok.decode([t for t in tokens if t not in special])
    for start, end in REASONING_TAGS:
        while start in text and end in text[text.find(start):]:
            at = text.find(start)
            text = text[:at] + text[text.find(end, at) + len(end):]
        if end in text and start not in text:
            text = text.rsplit(end, 1)[-1]
    return text.strip()


# -----------------------------------------------------------------------------
# the tasks: prompt, per-sample score, aggregate (lmms_eval/tasks/<task>/utils.py and yaml)


def yes_no(text):
    """MME's reading of an answer (Otter's): 'yes', 'no' or 'other'."""
    text = text.lower().strip().replace(".", "")
    if text in ("yes", "no"):
        return text
    if len(text) == 1:
        return {"y": "yes", "n": "no"}.get(text, "other")
    return "yes" if "yes" in text[:4] else "no" if "no" in text[:4] else "other"


MME_PERCEPTION = {"existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork",
                  "OCR"}
MME_COGNITION = {"commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning"}


def mme_prompt(row):
    return row["question"].strip().replace(" Please answer yes or no.", "") + \
        "\nAnswer the question using a single word or phrase."


def mme_score(row, answer):
    score = float(yes_no(answer) == row["answer"].lower().strip().replace(".", ""))
    kind = "perception" if row["category"] in MME_PERCEPTION else "cognition" if row["category"] in MME_COGNITION \
        else None
    return {"score": score, "kind": kind, "category": row["category"], "question_id": row["question_id"]}


def mme_aggregate(records):
    """Per category: the mean over its images of accuracy + accuracy+ (both questions of an image right), in
    percent; perception and cognition: the sums over their categories (at most 2000 and 800)."""
    by_image = defaultdict(list)
    for r in records:
        by_image[r["kind"], r["category"], r["question_id"]].append(r["score"])
    categories = defaultdict(list)
    for (kind, category, _), scores in by_image.items():
        categories[kind, category].append(100 * sum(scores) / len(scores) + 100 * (sum(scores) == len(scores)))
    out = defaultdict(float)
    for (kind, _), per_image in categories.items():
        if kind is not None:
            out[kind] += sum(per_image) / len(per_image)
    return dict(out)


def pope_score(row, answer):
    return {"score": float(answer.lower().strip() == row["answer"].lower().strip()),
            "said": answer.lower().strip(), "truth": row["answer"].lower().strip()}


def pope_aggregate(records):
    """Accuracy, precision, recall and F1 of 'yes' (an answer must be exactly yes or no), and lmms-eval's yes_ratio,
    which is the ground truth's share of 'yes'; answered_yes is the model's."""
    pairs = [(r["said"], r["truth"]) for r in records]
    tp, fp = pairs.count(("yes", "yes")), pairs.count(("yes", "no"))
    fn = pairs.count(("no", "yes"))
    precision = tp / (tp + fp) if tp + fp else 0
    recall = tp / (tp + fn) if tp + fn else 0
    truths = [t for _, t in pairs if t in ("yes", "no")]
    return {"accuracy": sum(r["score"] for r in records) / len(records), "precision": precision, "recall": recall,
            "f1": 2 * precision * recall / (precision + recall) if precision + recall else 0,
            "yes_ratio": truths.count("yes") / len(truths) if truths else 0,
            "answered_yes": sum(s == "yes" for s, _ in pairs) / len(pairs)}


def scienceqa_prompt(row):
    choices = "\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(row["choices"]))
    context = f"Context: {row['hint']}\n" if row["hint"] else ""
    return f"{context}{row['question']}\n{choices}\nAnswer with the option's letter from the given choices directly."


def scienceqa_score(row, answer):
    """Right when the answer is the letter (any case), or starts with the capital letter and a full stop."""
    target = chr(65 + row["answer"]).lower()
    right = answer.lower() == target or (len(answer) >= 2 and answer[0].isupper() and answer[1] == "."
                                         and answer[0].lower() == target)
    return {"score": float(right)}


def mean_score(records):
    return {"exact_match": sum(r["score"] for r in records) / len(records)}


def present(value):
    """A field parquet holds: not null, not NaN, not the string 'nan' (MMBench's missing hints and options)."""
    return value is not None and value == value and value != "nan"


def mmbench_options(row):
    """{letter: option} of the options an MMBench row has (A to E)."""
    return {c: row[c] for c in "ABCDE" if row.get(c) and present(row[c])}


def mmbench_prompt(row):
    options = "There are several options:\n" + "\n".join(f"{c}. {o}" for c, o in mmbench_options(row).items())
    question = f"{row['hint']} {row['question']} {options}" if present(row["hint"]) else f"{row['question']} {options}"
    return f"{question}\n\nAnswer with the option's letter from the given choices directly."


def mmbench_score(row, answer):
    return {"index": int(row["index"]), "answer": row["answer"], "prediction": answer, "category": row["category"],
            "options": {c: row[c] for c in "ABCD" if c in row and row[c] is not None and row[c] == row[c]}}


def letter_by_format(answer):
    """MMBench's can_infer_option: the one letter A-E written as a word, bare or in one punctuation form."""
    words = [w.strip() for w in answer.split()]
    if sum(c in words for c in "ABCDE") == 1 and not ("A" in words and len(words) > 3):  # 'A' may be the article
        return next(c for c in "ABCDE" if c in words)
    for before, after in (("", "."), ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."), (":", ""),
                          (":", ","), (":", "."), (":", ")"), (":", ").")):
        if sum(before + c + after in words for c in "ABCDE") == 1:
            return next(c for c in "ABCDE" if before + c + after in words)
    return None


def letter_by_text(answer, options):
    """MMBench's can_infer_text: the one option whose text the answer contains."""
    found = [c for c, text in options.items() if str(text).lower() in answer.lower()]
    return found[0] if len(found) == 1 else None


def mmbench_aggregate(records):
    """Circular accuracy in percent: a question counts when it and each of its circular shifts (index + k x 10^6) are
    answered right; a letter is read from the words, else from an option's text, else by mcq_letter."""
    groups = defaultdict(list)
    for r in sorted(records, key=lambda r: r["index"]):
        groups[r["index"] % 1_000_000].append(r)
    hits = [circular_hit(groups[r["index"]]) for r in records if r["index"] < 1_000_000]
    return {"accuracy": 100 * sum(hits) / len(hits)} if hits else {}


def circular_hit(group):
    read = [letter_by_format(r["prediction"]) or letter_by_text(r["prediction"], r["options"]) for r in group]
    if any(letter and letter != r["answer"] for letter, r in zip(read, group)):
        return 0
    return int(all(letter or mcq_letter(r["prediction"], sorted(r["options"])) == r["answer"]
                   for letter, r in zip(read, group)))


ANSWER_PHRASES = ("the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
                  "best answer is", "the correct option is", "correct option is", "the best option is", "best option is",
                  "the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select",
                  "i pick", "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选",
                  "答えは")
FORMATS = {"start": 10, "end": 9, "phrase": 7, "parentheses": 6, "period": 5, "colon": 4, "right_paren": 3, "space": 2,
           "fallback": 0}  # lmms-eval's mcq_extract: the higher wins, then the later position


def mcq_letter(response, letters=tuple("ABCDEFGH")):
    """lmms-eval's extract_mcq_answer: the choice letter a free-form answer gives, or ''."""
    if not response or not response.strip():
        return ""
    text = response.strip()
    for char in ",.!?;:'\"":
        text = text.strip(char)
    text = f" {text} "
    found = [(c, text.rfind(form.format(c)), kind) for kind, form in (("parentheses", "({})"), ("period", "{}."),
                                                                     ("colon", "{}:"), ("right_paren", "{})"),
                                                                     ("space", "{} "))
             for c in letters if form.format(c) in text]
    lower = text.lower()
    for phrase in ANSWER_PHRASES:
        if (at := lower.find(phrase)) != -1:
            found += [(c, text.find(c, at + len(phrase)), "phrase") for c in letters if text.find(c, at + len(phrase)) != -1]
    bare = text.strip()
    found += [(c, 0, "start") for c in letters if bare.startswith(c) and (len(bare) == 1 or not bare[1].isalpha())]
    found += [(c, len(text) - 1, "end") for c in letters if bare.endswith(c) and (len(bare) == 1 or not bare[-2].isalpha())]
    if not found:
        found = [(c, text.rfind(c), "fallback") for c in letters if c in text]
    return max(found, key=lambda f: (FORMATS[f[2]], f[1]))[0] if found else ""


def mmstar_prompt(row):
    return row["question"].strip().replace(" Please answer yes or no.", "") + \
        "\nAnswer with the option's letter from the given choices directly"


def mmstar_score(row, answer):
    return {"score": float(mcq_letter(answer, "ABCD") == row["answer"].strip().upper()), "category": row["category"],
            "l2_category": row["l2_category"]}


def mmstar_aggregate(records):
    """Per category and over all ('average'): the mean of its sub-categories' accuracies."""
    out = {}
    for name in sorted({r["category"] for r in records}) + ["average"]:
        per_l2 = defaultdict(list)
        for r in records:
            if name in ("average", r["category"]):
                per_l2[r["l2_category"]].append(r["score"])
        out[name] = sum(sum(s) / len(s) for s in per_l2.values()) / len(per_l2)
    return out


def relaxed_correct(answer, target):
    """ChartQA's relaxed accuracy: a number within 5% of a non-zero numeric target, else the same text in any case."""
    def number(text):
        try:
            return float(text.rstrip("%")) / 100 if text.endswith("%") else float(text)
        except ValueError:
            return None

    said, truth = number(answer), number(target)
    if said is not None and truth:
        return abs(said - truth) / abs(truth) <= 0.05
    return answer.lower() == target.lower()


def chartqa_score(row, answer):
    return {"score": float(relaxed_correct(answer, row["answer"])), "human": row["type"] == "human_test"}


def chartqa_aggregate(records):
    out = {"relaxed_overall": sum(r["score"] for r in records) / len(records)}
    for name, human in (("relaxed_human_split", True), ("relaxed_augmented_split", False)):
        split = [r["score"] for r in records if r["human"] == human]
        if split:
            out[name] = sum(split) / len(split)
    return out


@dataclass
class Task:
    dataset: str  # the Hub dataset, downloaded under benchmark_dir/<its name>
    files: str  # its parquet files there (a glob)
    columns: dict  # what the task reads (besides the image), each column's kind in the dataset: KINDS
    max_new_tokens: int  # lmms-eval's generation_kwargs; llava_hf's 1024 where the task sets none
    prompt: Callable  # row -> the question after the image
    score: Callable  # (row, answer) -> {"score": ...} and what aggregate needs
    aggregate: Callable  # [records] -> {metric: value}
    sample_id: str  # the dataset's own id column
    values: dict = field(default_factory=dict)  # {column: the values it takes in the dataset, as written or folded}


# a column's kind as its publisher's parquet holds it: (the arrow types it may have, whether a row may be null)
KINDS = {"text": ("a string", False), "text or null": ("a string", True), "integer": ("an integer", False),
         "texts": ("a list of strings", False)}
T, N = "text", "text or null"
YES_NO = {"yes", "no"}


def folded(value):
    """A yes/no answer as MME and POPE compare it: in lower case, stripped, without full stops."""
    return value.lower().strip().replace(".", "") if isinstance(value, str) else value


TASKS = {
    "mme": Task("lmms-lab/MME", "data/test-*.parquet", {"question_id": T, "question": T, "answer": T, "category": T}, 16,
                mme_prompt, mme_score, mme_aggregate, "question_id",
                {"answer": YES_NO, "category": MME_PERCEPTION | MME_COGNITION}),
    "pope": Task("lmms-lab/POPE", "data/test-*.parquet", {"question_id": T, "question": T, "answer": T}, 128,
                 lambda row: row["question"].strip() + "\nAnswer the question using a single word or phrase.",
                 pope_score, pope_aggregate, "question_id", {"answer": YES_NO}),
    "scienceqa_img": Task("lmms-lab/ScienceQA", "ScienceQA-IMG/test-*.parquet",
                          {"question": T, "choices": "texts", "answer": "integer", "hint": N}, 16, scienceqa_prompt,
                          scienceqa_score, mean_score, None),
    "mmbench_en_dev": Task("lmms-lab/MMBench", "en/dev-*.parquet",
                           {"index": "integer", "question": T, "hint": N, "A": T, "B": T, "C": N, "D": N, "answer": T,
                            "category": T}, 1024, mmbench_prompt, mmbench_score, mmbench_aggregate, "index",
                           {"answer": set("ABCDE")}),
    "mmstar": Task("Lin-Chen/MMStar", "mmstar.parquet",
                   {"index": "integer", "question": T, "answer": T, "category": T, "l2_category": T}, 1024,
                   mmstar_prompt, mmstar_score, mmstar_aggregate, "index", {"answer": set("ABCD")}),
    "chartqa": Task("lmms-lab/ChartQA", "data/test-*.parquet", {"question": T, "answer": T, "type": T}, 16,
                    lambda row: row["question"] + "\nAnswer the question with a single word.",
                    chartqa_score, chartqa_aggregate, None, {"type": {"human_test", "augmented_test"}}),
}


# -----------------------------------------------------------------------------
# files: found and checked at start, read at each run


@dataclass
class Benchmark:
    name: str
    task: Task
    files: list


def find(spec, benchmark_dir):
    """A Benchmark from a config entry: a task name (its files where the Hub download puts them under benchmark_dir),
    or 'name=PATH' (a parquet file, or a folder holding the published layout or parquet files)."""
    name, _, path = spec.partition("=")
    if name not in TASKS:
        near = difflib.get_close_matches(name.lower(), TASKS, n=1)
        raise ValueError(f"unknown benchmark {name!r}{f' (did you mean {near[0]!r}?)' if near else ''}; choose from "
                         f"{', '.join(TASKS)}")
    task = TASKS[name]
    where = path or storage.join(benchmark_dir, task.dataset.split("/")[1])
    if str(where).endswith(".parquet"):
        files = [where] if storage.exists(where) else []
    else:  # the download's root, the split's own folder (ScienceQA-IMG/ also holds train and validation), or any
        files = storage.glob(where, task.files) or storage.glob(where, task.files.rsplit("/", 1)[-1]) or \
            storage.glob(where, "*.parquet")
    if not files:
        raise ValueError(f"{name}: no {task.files} in {where} (download {task.dataset}: docs/training.md "
                         f"\"Benchmarks\"), nor any .parquet file there")
    return Benchmark(name, task, files)


COPIES = {}  # a benchmark file in a bucket -> its copy in the temporary folder, downloaded once a process


def parquet_file(path):
    """A benchmark file opened with pyarrow. One in a bucket is downloaded once a process (the start's checks and
    every pass read that copy), into a temporary folder removed at exit."""
    import pyarrow.parquet as pq

    if storage.is_url(path):
        if path not in COPIES:
            folder = tempfile.mkdtemp(prefix="llavax-benchmark-")
            atexit.register(shutil.rmtree, folder, True)
            copy = os.path.join(folder, storage.name(path))
            with open(copy, "wb") as f:
                f.write(storage.read_bytes(path, big=True))
            COPIES[path] = copy
        path = COPIES[path]
    return pq.ParquetFile(str(path))


DECODED_ROWS = 4  # the rows whose images are decoded at start (each run decodes the rest)


def check(benchmark):
    """Each file is parquet and holds the task's columns, of the publisher's types, and an image column; every row's
    columns hold what the task reads (no null, a value the dataset has) and the first rows' images decode; the files
    hold a question. A problem is one sentence naming the file and the row."""
    n_rows, task = 0, benchmark.task
    for path in benchmark.files:
        try:
            parquet = parquet_file(path)
            schema, n_rows = parquet.schema_arrow, n_rows + parquet.metadata.num_rows
        except Exception as e:  # noqa: BLE001  pyarrow raises several kinds for a file that is not parquet
            raise ValueError(f"{benchmark.name}: {path} is not a readable parquet file ({type(e).__name__}: {e})") \
                from None
        missing = [c for c in (*task.columns, "image") if c not in schema.names]
        if missing:
            raise ValueError(f"{benchmark.name}: {path} lacks the column(s) {', '.join(missing)} that "
                             f"{task.dataset} has (it has {', '.join(sorted(schema.names))})")
        if not parquet.metadata.num_rows:  # an empty file's columns may have no type (said below if all are empty)
            continue
        for column, kind in [*task.columns.items(), ("image", "image")]:
            if not of_kind(schema.field(column).type, kind):
                said = "an image (datasets' Image: bytes and path, or bytes)" if kind == "image" else KINDS[kind][0]
                first = parquet.read_row_group(0, columns=[column]).column(0)[0].as_py()
                raise ValueError(f"{benchmark.name}: {path} row 0: {column} is {repr(first)[:40]}, of type "
                                 f"{schema.field(column).type}, where {task.dataset}'s {column} is {said}")
        first = 0
        for batch in parquet.iter_batches(batch_size=1024, columns=list(task.columns)):
            for i, row in enumerate(batch.to_pylist(), first):
                if problem := row_problem(task, row):
                    raise ValueError(f"{benchmark.name}: {path} row {i}: {problem}")
            first += batch.num_rows
        for i, row in enumerate(parquet.read_row_group(0, columns=["image"]).slice(0, DECODED_ROWS).to_pylist()):
            try:
                if (data := image_bytes(row)) is not None:  # None: a text-only row (ScienceQA-FULL's)
                    load_image(data, 16)
            except Exception as e:  # noqa: BLE001  PIL raises several kinds for bytes that are no image
                said = str(e).split(" <_io.")[0]  # PIL names the BytesIO it read
                raise ValueError(f"{benchmark.name}: {path} row {i}: its image cannot be read ({type(e).__name__}: "
                                 f"{said})") from None
    if not n_rows:
        raise ValueError(f"{benchmark.name}: {', '.join(map(str, benchmark.files))} hold(s) no rows")


def of_kind(arrow_type, kind):
    import pyarrow as pa

    text = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)  # noqa: E731
    if kind == "image":
        return pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type) or \
            pa.types.is_struct(arrow_type) and arrow_type.get_field_index("bytes") >= 0
    if kind == "integer":
        return pa.types.is_integer(arrow_type)
    if kind == "texts":
        return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and text(arrow_type.value_type)
    return text(arrow_type)


def row_problem(task, row):
    """What in a row (its task columns) the task cannot read, or None."""
    for column, kind in task.columns.items():
        if row[column] is None and not KINDS[kind][1]:
            return f"{column} is null"
        allowed = task.values.get(column)
        if allowed and row[column] is not None and row[column] not in allowed and folded(row[column]) not in allowed:
            return f"{column} is {row[column]!r}, not one of {task.dataset}'s ({', '.join(sorted(allowed))})"
        if kind == "texts" and None in row[column]:
            return f"{column} holds a null"
    return None


def read_rows(benchmark, limit=0):
    """The rows of a benchmark's files in order (the first `limit`, as lmms-eval's --limit), images as bytes."""
    rows = []
    for path in benchmark.files:
        for batch in parquet_file(path).iter_batches(batch_size=256, columns=[*benchmark.task.columns, "image"]):
            rows += batch.to_pylist()
            if limit and len(rows) >= limit:
                return rows[:limit]
    return rows


def image_bytes(row):
    """The image of a row: datasets' Image feature is a struct {bytes, path}; a plain binary column is the bytes."""
    image = row["image"]
    if isinstance(image, dict) and image.get("bytes") is None and image.get("path"):  # not asked without its image
        raise ValueError(f"an image is a path ({image['path']}) without its bytes: use the files as published, "
                         f"images embedded")
    return image.get("bytes") if isinstance(image, dict) else image


def open_benchmarks(specs, benchmark_dir, max_tiles=0):
    """[Benchmark] of a config's entries, every file checked: one sentence (SystemExit) for the first problem."""
    if specs and max_tiles:
        raise SystemExit("benchmarks: questions are asked with one image a row (LLaVA-1.5's way); a model that tiles "
                         "images (max_tiles > 0) is not scored in the loop yet: leave benchmarks = [] for this run")
    found = []
    for spec in specs:
        try:
            found.append(find(spec, benchmark_dir))
            check(found[-1])
        except (ValueError, OSError) as e:
            raise SystemExit(f"benchmarks: {e}") from None
    return found


# -----------------------------------------------------------------------------
# answering: every rank its slice, in fixed shapes


@dataclass
class Asker:
    """What answering needs besides the model."""
    tok: object
    template: str
    image_mode: str
    batch_size: int
    limit: int = 0


def prompt_ids(asker, raw, question, has_image):
    text = chat.generation_prompt(asker.template, f"{chat.IMAGE_TAG}\n{question}" if has_image else question, asker.tok)
    ids, _ = chat.tokenize([(text, False)], asker.tok, raw.cfg.image_token_id, raw.cfg.n_image_tokens)
    return ids


def batches(questions, env, batch_size, max_seq_len, max_new_tokens):
    """[(length bucket, new tokens, [question numbers])] this rank answers, every batch of one bucket; and the
    numbers of the questions too long for the model. Under torchrun each rank takes every world-th question; under
    XLA every host builds the same global batches and places its own rows."""
    by_bucket, too_long = defaultdict(list), []
    for i, (ids, _) in enumerate(questions):
        bucket = min(-(-len(ids) // BUCKET) * BUCKET, max_seq_len - 1)  # past the end: the last that leaves a token
        if len(ids) > bucket:
            too_long.append(i)
        elif env.kind == "xla" or i % env.world == env.rank:
            by_bucket[bucket].append(i)
    return [(bucket, min(max_new_tokens, max_seq_len - bucket), numbers[k:k + batch_size])
            for bucket, numbers in sorted(by_bucket.items()) for k in range(0, len(numbers), batch_size)], too_long


@torch.no_grad()
def answer_batch(raw, asker, env, questions, bucket, new_tokens, stop):
    """Greedy answers (token lists) of up to batch_size questions, the batch filled with empty rows and left-padded to
    `bucket` tokens. Rows without an image get a blank one they never read."""
    size = raw.cfg.vision.image_size
    rows = [ids for ids, _ in questions] + [[]] * (asker.batch_size - len(questions))
    ids, mask = left_pad(rows, asker.tok.pad_id, length=bucket)
    blank = torch.zeros(3, size, size, dtype=torch.uint8)
    pixels = torch.stack([load_image(image, size, asker.image_mode, mean=raw.cfg.vision.image_stats[0],
                                     resample=raw.cfg.vision.resample) if image is not None else blank
                          for _, image in questions]
                         + [blank] * (asker.batch_size - len(questions)))
    if env.kind == "xla":  # each host places its part of the global batch
        part = slice(env.rank * asker.batch_size // env.world, (env.rank + 1) * asker.batch_size // env.world)
        ids, mask, pixels = (env.place_rows(t[part]) for t in (ids, mask, pixels))
    else:
        ids, mask, pixels = ids.to(env.device), mask.to(env.device), pixels.to(env.device)
    with autocast(env):
        out = raw.generate(ids, normalize_images(pixels, *raw.cfg.vision.image_stats), max_new_tokens=new_tokens,
                           eos_id=stop, attention_mask=mask, static=env.kind == "xla", stop_every=STOP_EVERY,
                           after_token=env.step_end if env.kind == "xla" else None)
    return (env.to_host(out) if env.kind == "xla" else out.cpu()).tolist()[: len(questions)]


def answer_all(raw, asker, env, benchmark, rows):
    """{question number: answer text} of this rank's slice (every question under XLA), and the number too long."""
    questions = [(prompt_ids(asker, raw, benchmark.task.prompt(row), image_bytes(row) is not None), image_bytes(row))
                 for row in rows]
    stop = chat.stop_token_id(asker.template, asker.tok)
    planned, too_long = batches(questions, env, asker.batch_size, raw.cfg.llm.max_seq_len,
                                benchmark.task.max_new_tokens)
    answers = dict.fromkeys(too_long, "")  # not asked: scored as an empty answer, so the denominators stay lmms-eval's
    shown = progress(planned, desc=f"benchmark {benchmark.name}", unit="batch", disable=not env.master)
    for bucket, new_tokens, numbers in shown:
        out = answer_batch(raw, asker, env, [questions[i] for i in numbers], bucket, new_tokens, stop)
        answers |= {i: answer_text(asker.tok, tokens, stop) for i, tokens in zip(numbers, out)}
    return answers, len(too_long)


def gathered(answers, env):
    """Every rank's answers, on every rank (under XLA each host has them all already)."""
    return {i: a for part in env.gathered(answers) for i, a in part.items()}


# -----------------------------------------------------------------------------
# a run: scores for the log, answers to a JSONL


def score(benchmark, rows, answers):
    """({metric: value}, [one JSONL record a question]) in file order."""
    task, records, lines = benchmark.task, [], []
    for i, row in enumerate(rows):
        records.append(task.score(row, answers[i]))
        lines.append({"benchmark": benchmark.name, "doc_id": i, "id": row.get(task.sample_id) if task.sample_id else i,
                      "prompt": task.prompt(row), "answer": answers[i], "target": row["answer"],
                      "score": records[-1]["score"] if "score" in records[-1] else None})
    return task.aggregate(records), lines


def run_benchmarks(raw, benchmarks, asker, env, answers_path=None, label=""):
    """{"bench/NAME/METRIC": value} over the benchmarks, each one's answers written to answers_path (JSONL, by the
    master). A benchmark that fails is one line, agreed over the ranks, and the others still run."""
    scores, lines = {}, []
    raw.eval()
    with gathered_for_generation(raw, whole=True):  # FSDP2: each rank answers its own questions, no collective
        for benchmark in benchmarks:
            t0, error = time.perf_counter(), None
            try:
                rows = read_rows(benchmark, asker.limit)
                answers, too_long = answer_all(raw, asker, env, benchmark, rows)
            except Exception as e:  # noqa: BLE001  a benchmark never stops a run
                error = f"{type(e).__name__}: {e}".splitlines()[0]
            if env.agree(error is not None):
                print0(env, f"{label}benchmark {benchmark.name} failed ({error or 'on another rank'}); going on")
                continue
            try:  # after the gather every rank holds the same rows and answers: each fails alike
                metrics, done = score(benchmark, rows, gathered(answers, env))
            except Exception as e:  # noqa: BLE001  a row the task cannot score (a null answer) does not stop the run
                print0(env, f"{label}benchmark {benchmark.name} failed in scoring ({type(e).__name__}: {e}); going on")
                continue
            lines += done
            if not metrics:  # MMBench rows all circular shifts, say: no question its metric counts
                print0(env, f"{label}benchmark {benchmark.name} gave no score: none of its {len(rows)} questions is one "
                       f"its metric counts; going on")
                continue
            scores |= {f"bench/{benchmark.name}/{k}": v for k, v in metrics.items()}
            print0(env, f"{label}{benchmark.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
                   + f" ({len(rows)} questions, {time.perf_counter() - t0:.0f} s"
                   + (f"; {too_long} longer than the model's max_seq_len, scored as unanswered" if too_long else "")
                   + ")")
    raw.train()
    if env.master and answers_path is not None and lines:
        storage.write_text(answers_path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return scores


def answers_beside(step_dir):
    """The JSONL of a step's answers, beside its checkpoint folder: step-000100.benchmarks.jsonl."""
    return storage.join(storage.parent(step_dir), storage.name(step_dir) + ".benchmarks.jsonl")


def summary(scores):
    """The end-of-run line of the scores, grouped by benchmark."""
    by_name = defaultdict(list)
    for key, value in scores.items():
        _, name, metric = key.split("/", 2)
        by_name[name].append(f"{metric} {value:.4g}")
    return "; ".join(f"{name} {', '.join(parts)}" for name, parts in by_name.items())

