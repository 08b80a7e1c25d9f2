"""progress.py: progress bars (tqdm on a terminal, a few plain lines in a log file), a run's ETA against its own
wall time, TensorBoard's event files read back with tensorboard's EventAccumulator; sample.py's batches."""

import contextlib
import io
import json
import sys
import time

import pytest
from conftest import ROOT, run_log

import checkpoint_writer
import data
import progress
import sample
import storage
import train
from progress import PlainProgress, RunClock, TensorBoard, runs_between

STEP_S, EVAL_S, SAVE_S = 0.1, 0.4, 0.3  # what a step, an evaluation and a checkpoint's blocking part cost (eta_run)


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=400, seed=0, val_fraction=0.1)


class FakeClock:
    """time.perf_counter for progress.py: `tick` seconds pass between two readings."""

    def __init__(self, tick=0.0):
        self.now, self.tick = 1000.0, tick

    def __call__(self):
        self.now += self.tick
        return self.now


# -----------------------------------------------------------------------------
# progress bars


@pytest.mark.parametrize("items", [1000, 86_400])
def test_a_log_file_gets_a_line_every_few_seconds_then_further_apart(monkeypatch, items):
    """One item a second: a line every 5 s at first, then every 5% of the elapsed time; a day's job prints about 150
    lines, not the 17,000 that a line every 5 s would, nor tqdm's redraws."""
    monkeypatch.setattr(progress.time, "perf_counter", FakeClock(tick=1.0))
    out = io.StringIO()
    assert list(progress.progress(range(items), desc="packing x.json", unit="rec", file=out)) == list(range(items))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and 10 < len(lines) < (80 if items == 1000 else 200), len(lines)
    assert lines[0].startswith("packing x.json: 5/") and "rec/s" in lines[0] and "left" in lines[0], lines[0]
    done = [int(line.split(" ")[2].split("/")[0].replace(",", "")) for line in lines[:-1]]
    gaps = [b - a for a, b in zip(done, done[1:])]
    assert min(gaps) >= 5  # never more often than every_s
    assert lines[-1].startswith(f"packing x.json: {items:,}/{items:,} rec (100%)") and "done in" in lines[-1]


def test_a_short_job_in_a_log_file_prints_nothing_and_a_terminal_gets_tqdm(monkeypatch):
    out = io.StringIO()
    assert sum(progress.progress(range(50), desc="audit", file=out)) == sum(range(50)) and out.getvalue() == ""

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    bar = progress.progress(range(3), desc="audit", file=Terminal())
    assert not isinstance(bar, PlainProgress) and type(bar).__name__ == "tqdm"
    assert list(bar) == [0, 1, 2]


def test_update_driven_bytes_read_as_sizes_and_a_loop_that_breaks_off_ends_its_lines(monkeypatch):
    monkeypatch.setattr(progress.time, "perf_counter", FakeClock(tick=3.0))
    out = io.StringIO()
    with progress.progress(total=10 * 2**30, unit="B", unit_scale=True, desc="reading ckpt", file=out) as bar:
        for _ in range(10):
            bar.update(2**30)
    assert out.getvalue().startswith("reading ckpt: 2.00G/10.0G B (20%), "), out.getvalue()
    out = io.StringIO()
    for i in progress.progress(range(100), desc="audit", file=out):
        if i == 20:
            break
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("audit: 20/100 it (20%)") and "stopped after" in last and "done" not in out.getvalue()


def test_an_interrupted_loop_says_interrupted_never_done(monkeypatch):
    """Ctrl-C (or SIGTERM made KeyboardInterrupt) in the source or in the loop's body: the last line says interrupted
    (before, "done in 0:00:17" ended an interrupted pack's log)."""
    monkeypatch.setattr(progress.time, "perf_counter", FakeClock(tick=1.0))

    def records():
        yield from range(30)
        raise KeyboardInterrupt

    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        for _ in progress.progress(records(), total=100, desc="packing x.json", unit="rec", file=out):
            pass
    assert out.getvalue().splitlines()[-1].startswith("packing x.json: 30/100 rec (30%)") and \
        "interrupted after" in out.getvalue().splitlines()[-1] and "done" not in out.getvalue()
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt), progress.progress(range(100), desc="packing", unit="rec", file=out) as bar:
        for i in bar:
            if i == 40:
                raise KeyboardInterrupt
    assert "interrupted after" in out.getvalue().splitlines()[-1] and "done" not in out.getvalue()


def test_pack_in_a_log_file_shows_no_redrawn_bar(shapes, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress.time, "perf_counter", FakeClock(tick=1.0))  # a record a second (a slow source)
    data.main(["pack", "--json", str(shapes / "shapes.json"), "--images", str(shapes / "images"), "--out",
               str(tmp_path / "shards")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("packing ")]
    assert "\r" not in err and 10 < len(lines) < 50 and lines[-1].startswith("packing ") and "400/400 rec (100%)" in \
        lines[-1], err


# -----------------------------------------------------------------------------
# the ETA's arithmetic


def loop_runs(first, last, every, at_end, besides=0):
    """The training loop's own test, step by step."""
    return sum(1 for s in range(first, last + 1) if (every and s % every == 0 and not (besides and s % besides == 0))
               or (at_end and s == last))


def test_runs_between_counts_the_passes_the_loop_runs():
    for first in range(0, 14):
        for every in range(0, 6):
            for besides in (0, 2, 3, 4):
                for at_end in (False, True):
                    assert runs_between(first, 13, every, at_end, besides) == loop_runs(first, 13, every, at_end,
                                                                                         besides), (first, every)


def test_eta_adds_steps_left_and_each_pass_by_its_measured_cost(monkeypatch):
    """Steps of 1 s after a 30 s first interval (compiles), evaluations of 5 s (the first 50 s: its compile),
    checkpoints of 2 s: the ETA at step 40 of 100 is 60 steps + 6 evaluations (40, 50, .., 90 and the last) + 3
    checkpoints (50, 75, 100) + the last write's background time."""
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    run = RunClock(0, 100, {"eval": (10, True), "ckpt": (25, True)}, end=lambda: 1.5)
    clock.now += 30  # steps 0-9
    assert run.eta(10) == pytest.approx(90 * 3 + 1.5)  # nothing but the steps measured yet
    for it in range(10, 40):
        if it % 10 == 0:
            t0 = clock.now
            clock.now += 50 if it == 10 else 5
            run.spent("eval", t0)
        if it == 25:
            t0 = clock.now
            clock.now += 2
            run.spent("ckpt", t0)
        clock.now += 1
    assert run.eta(40) == pytest.approx(60 * 1 + 7 * 5 + 3 * 2 + 1.5)
    assert run.elapsed() == pytest.approx(30 + 30 + 50 + 5 + 5 + 2)


def test_eta_leaves_out_skipped_steps(monkeypatch):
    """skip_steps [(20, 30), (50, 80)] of a resumed run (from step 10) to 100: steps of 1 s, the skipped ones ~free;
    at step 40 the steps left are the 30 of 40-49 and 80-99 that train, measured at 1 s each."""
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    run = RunClock(10, 100, {}, skip=[(20, 30), (50, 80)])
    clock.now += 5  # steps 10-14
    assert run.eta(15) == pytest.approx(75 * 1 - 30)
    clock.now += 5  # 15-19; 20-29 skipped
    clock.now += 10  # 30-39
    assert run.eta(40) == pytest.approx(30 * 1)
    assert run.trained(0, 100) == 60


# -----------------------------------------------------------------------------
# a real run: its ETA against its own clock, TensorBoard's files


class SteadyClock:
    """time.perf_counter for a run whose costs are fixed however loaded the machine is (a 2-core VM shared with other
    tests ran the same step 1x to 45x slower): real time passes 1000x slower, and each wrapped call costs `seconds`."""

    def __init__(self):
        self.real = time.perf_counter
        self.t0, self.added = self.real(), 0.0

    def __call__(self):
        return self.t0 + self.added + 1e-3 * (self.real() - self.t0)

    def costing(self, fn, seconds):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.added += seconds
            return out

        return call


@pytest.fixture(scope="module")
def eta_run(shapes, tmp_path_factory):
    """40 steps of the debug model, evaluated every 10, checkpointed every 15 and at the end, TensorBoard on; its
    steps, evaluations and checkpoints cost 0.1, 0.4 and 0.3 s on its clock."""
    out, said, clock = tmp_path_factory.mktemp("eta"), io.StringIO(), SteadyClock()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(said):
        mp.setattr(train, "train_step", clock.costing(train.train_step, STEP_S))
        mp.setattr(train, "evaluate_and_log", clock.costing(train.evaluate_and_log, EVAL_S))
        save = checkpoint_writer.Checkpointer.save

        def save_and_wait(checkpointer, *args, **kwargs):  # its write done in its cost, not beside the steps' costs
            save(checkpointer, *args, **kwargs)
            checkpointer.wait()

        mp.setattr(checkpoint_writer.Checkpointer, "save", clock.costing(save_and_wait, SAVE_S))
        mp.setattr(time, "perf_counter", clock)  # train.py's, checkpoint_writer.py's and progress.py's
        train.main([str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}",
                    f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={out}", "--max_iters=40",
                    "--log_interval=4", "--eval_interval=10", "--ckpt_interval=15", "--keep_last=5",
                    "--tensorboard_log=True"])
    (out / "stdout.txt").write_text(said.getvalue())
    return out


def test_eta_is_within_10_percent_over_the_second_half(eta_run, capsys):
    events = run_log(eta_run, "eta_s")
    assert events[-1]["step"] == 40 and (eta_run / "DONE").exists()
    # the run's end: the last line's time plus what it expected of the last checkpoint's write (a fixed cost here)
    end = {"elapsed_s": events[-1]["elapsed_s"] + events[-1]["eta_s"]}
    lines = [e for e in events if e["step"] >= 20]
    assert [e["step"] for e in lines] == [20, 24, 28, 32, 36, 40]
    for e in lines:
        left = end["elapsed_s"] - e["elapsed_s"]
        assert abs(e["eta_s"] - left) <= 0.1 * left, (e["step"], e["eta_s"], left)
    # it counted the evaluations and checkpoints: steps alone would leave out 3 x 0.4 s + 2 x 0.3 s at step 20
    assert lines[0]["eta_s"] > 20 * STEP_S + 3 * EVAL_S
    assert lines[0]["elapsed_s"] > 20 * STEP_S + EVAL_S + SAVE_S


def test_every_log_line_says_elapsed_and_eta(eta_run):
    said = (eta_run / "stdout.txt").read_text().splitlines()
    lines = [line for line in said if ": loss " in line]
    assert len(lines) == 10 and all(", elapsed 0:00:" in line and ", ETA 0:00:" in line for line in lines), lines
    assert "step 40: trained in 0:00:" in said[-1]


def test_tensorboard_holds_the_logged_numbers(eta_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(eta_run / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "data_wait", "eta_s", "elapsed_s"} <= tags
    for key in ("loss", "val_loss", "lr"):
        logged = {e["step"]: e[key] for e in run_log(eta_run, key)}
        read = {s.step: s.value for s in board.Scalars(key)}
        assert read.keys() == logged.keys() and all(read[s] == pytest.approx(logged[s], rel=1e-6) for s in read)


def test_tensorboard_of_a_resumed_run_hides_the_branch_it_left(tmp_path):
    """A run logged to step 20, resumed from its step-10 checkpoint: TensorBoard reads steps 2-10 of the first and the
    resumed run's after, not the first run's 12-20."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for resumed, steps, base in ((0, range(2, 22, 2), 100.0), (10, range(14, 30, 4), 0.0)):
        board = TensorBoard(tmp_path, resumed=resumed)
        for step in steps:
            board.add({"step": step, "loss": base + step})
        board.upload()
        board.writer.close()
    read = EventAccumulator(str(tmp_path / "tensorboard"))
    read.Reload()
    assert [(s.step, s.value) for s in read.Scalars("loss")] == \
        [(s, 100.0 + s) for s in range(2, 12, 2)] + [(s, float(s)) for s in range(14, 30, 4)]


def test_tensorboard_in_a_bucket_and_without_the_package(s3_bucket, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoard(f"{s3_bucket}/run")
    for step in (10, 20):
        board.add({"step": step, "loss": 1.0 / step, "nonfinite_skipped": True, "mfu": None})
        board.upload()  # the event file, whole, after each event
    (name,) = storage.ls(f"{s3_bucket}/run/tensorboard")
    (tmp_path / name).write_bytes(storage.read_bytes(f"{s3_bucket}/run/tensorboard/{name}"))
    read = EventAccumulator(str(tmp_path))
    read.Reload()
    assert read.Tags()["scalars"] == ["loss"] and [(s.step, s.value) for s in read.Scalars("loss")] == \
        [(10, pytest.approx(0.1)), (20, pytest.approx(0.05))]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as where tensorboard is not installed
    with pytest.raises(SystemExit, match=r"^config: tensorboard_log = True needs the tensorboard package"):
        TensorBoard(tmp_path)


# -----------------------------------------------------------------------------
# sample.py over many prompts


def test_sample_answers_batch_after_batch_as_in_one_batch(eta_run, shapes, capsys):
    prompts = ["How many circles are there?", "What color is the triangle?", "What is at the top left?",
               "Is the square left of the circle?", "How many squares are there?"]
    ask = ["--ckpt", str(eta_run / "step-000040"), "--image", str(shapes / "images/000003.png"), "--prompt", *prompts,
           "--max-new-tokens", "4"]
    sample.main(ask)
    whole = capsys.readouterr().out
    sample.main([*ask, "--batch-size", "2"])
    got = capsys.readouterr()
    assert got.out == whole and len(whole.splitlines()) == len(prompts)
    assert "\r" not in got.err  # a log file gets no redrawn bar


def test_run_log_lines_are_json(eta_run):  # what plot.py reads: one JSON object a line, each with its step
    assert all("step" in json.loads(line) for line in (eta_run / "log.jsonl").read_text().splitlines())
