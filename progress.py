"""
What a long command and a training run show while they go: progress bars (tqdm on a terminal, a plain line now and
then in a log file), a run's elapsed time and ETA (RunClock), and its TensorBoard event files.
"""

import math
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

import storage

# -----------------------------------------------------------------------------
# progress bars


def clock_text(seconds):
    """1:02:03 (hours, minutes, seconds); '?' before anything is known."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(max(0.0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress(iterable=None, total=None, desc="", unit="it", unit_scale=False, disable=False, every_s=5.0, file=None,
             **bar_options):
    """A progress bar over `iterable` (or one driven by .update(n)): tqdm's where `file` (stderr) is a terminal; in a
    log file or a batch job's output, where tqdm's redraws would pile up, a plain line every `every_s` seconds at first,
    then further apart (PlainProgress). bar_options (position, leave, ...) are tqdm's."""
    file = file or sys.stderr
    if disable or not hasattr(file, "isatty") or file.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable, file=file,
                    **bar_options)
    return PlainProgress(iterable, total, desc, unit, unit_scale, every_s, file)


class PlainProgress:
    """tqdm's bar as plain lines: the count, the rate and the time left, a line `every_s` seconds and then every 5% of
    the elapsed time (a day's job prints about 150 lines, not thousands), and one at the end if any was printed: "done
    in" only when all was gone through, else "interrupted after" (an exception, Ctrl-C) or "stopped after"."""

    def __init__(self, iterable, total, desc, unit, unit_scale, every_s, file):
        self.iterable, self.desc, self.unit, self.unit_scale, self.every_s, self.file = \
            iterable, desc, unit, unit_scale, every_s, file
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.n, self.printed, self.managed = total, 0, False, False
        self.t0 = self.last = time.perf_counter()

    def __iter__(self):
        ended = "stopped"  # a loop that broke off (GeneratorExit), unless it had all the items it was counted for
        try:
            for item in self.iterable:
                yield item
                self.update()
            ended = "done"
        except (Exception, KeyboardInterrupt):
            ended = "interrupted"
            raise
        finally:  # in a `with`, a loop left early ends with it: an exception in its body is told apart there
            if not (self.managed and ended == "stopped"):
                self.close(ended)

    def __enter__(self):
        self.managed = True
        return self

    def __exit__(self, kind, *exc):
        self.close("stopped" if kind is None else "interrupted")

    def update(self, n=1):
        self.n += n
        now = time.perf_counter()
        if now - self.last >= max(self.every_s, 0.05 * (now - self.t0)):
            self.last = now
            self.show(now)

    def close(self, ended="done"):
        if self.printed:  # a short job says nothing, as it would have nothing to watch
            done = ended == "done" or (ended == "stopped" and (self.total is None or self.n >= self.total))
            self.show(time.perf_counter(), done=True if done else ended)
            self.printed = False

    def count(self, n):
        if self.unit_scale:
            return tqdm.format_sizeof(n, divisor=1024 if self.unit == "B" else 1000)
        return f"{n:,}" if isinstance(n, int) else f"{n:,.3g}" if n < 100 else f"{n:,.0f}"

    def show(self, now, done=False):
        """A line; done: True at the end of it all, or how it ended early ("interrupted", "stopped")."""
        elapsed = now - self.t0
        rate = self.n / elapsed if elapsed > 0 else 0.0
        of = f"/{self.count(self.total)}" if self.total else ""
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        left = f", {clock_text((self.total - self.n) / rate if rate else None)} left" if self.total and not done else ""
        print(f"{self.desc + ': ' if self.desc else ''}{self.count(self.n)}{of} {self.unit}{share}, "
              f"{self.count(rate)} {self.unit}/s, {self.ending(done)} {clock_text(elapsed)}{left}",
              file=self.file, flush=True)
        self.printed = True

    @staticmethod
    def ending(done):
        return "done in" if done is True else f"{done} after" if done else "elapsed"


# -----------------------------------------------------------------------------
# a training run's clock


def runs_between(first, last, every, at_end, besides=0):
    """How many of the steps first..last (both counted) a periodic pass runs at: the multiples of `every` (none when
    0) that are not multiples of `besides` (a pass that takes their place), and `last` when at_end."""
    def multiples(n):
        return last // n - (first - 1) // n if n else 0

    n = multiples(every) - (multiples(math.lcm(every, besides)) if every and besides else 0)
    counted = every and last % every == 0 and not (besides and last % besides == 0)
    return n + (1 if at_end and first <= last and not counted else 0)


class RunClock:
    """A training run's elapsed time and time left. The steps and the passes between them (evaluations, checkpoints:
    `passes` names each with (every, at_end, besides) as runs_between counts them) are timed apart. Time left after
    step `it` = steps left x seconds a step + for each pass, its runs from `it` on x its mean cost so far (a pass not
    run yet counts 0), + end() (seconds the run's end waits beyond its passes: the last checkpoint's background
    write). Seconds a step are measured from the first ETA asked: the steps before it hold start-up and compiles. Steps
    in `skip` ([(first, end), ...], skip_steps) train nothing and count neither in the steps measured nor in those left."""

    def __init__(self, start_step, max_iters, passes, since=None, end=lambda: 0.0, skip=()):
        self.loop_t0 = time.perf_counter()
        self.t0 = self.loop_t0 if since is None else since
        self.start, self.max_iters, self.passes, self.end, self.skip = start_step, max_iters, passes, end, skip
        self.costs = {name: [] for name in passes}
        self.mark = None  # (step, step seconds) at the first ETA

    def elapsed(self):
        return time.perf_counter() - self.t0

    def spent(self, name, t_start):
        """Records a run of pass `name` that began at perf_counter() t_start; returns its seconds."""
        seconds = time.perf_counter() - t_start
        self.costs.setdefault(name, []).append(seconds)
        return seconds

    def step_seconds(self):
        return time.perf_counter() - self.loop_t0 - sum(sum(c) for c in self.costs.values())

    def trained(self, first, last):
        """How many of the steps first..last-1 train."""
        return last - first - sum(max(0, min(end, last) - max(begin, first)) for begin, end in self.skip)

    def eta(self, it):
        """Seconds left after step `it` (the passes due at `it` not yet run) to the end of step max_iters's passes."""
        stepped = self.step_seconds()
        if self.mark is None or self.trained(self.mark[0], it) <= 0:
            self.mark = self.mark or (it, stepped)
            per_step = stepped / max(1, self.trained(self.start, it))
        else:
            per_step = (stepped - self.mark[1]) / self.trained(self.mark[0], it)
        left = self.trained(it, self.max_iters) * per_step + self.end()
        for name, schedule in self.passes.items():
            costs = self.costs[name][1:] or self.costs[name]  # the first of several held its compiles (XLA)
            if costs:
                left += runs_between(it, self.max_iters, *schedule) * sum(costs) / len(costs)
        return left


# -----------------------------------------------------------------------------
# TensorBoard


class TensorBoard:
    """The log's numbers as TensorBoard scalars (torch's SummaryWriter, tag = the log's key), in out_dir/tensorboard.
    The writer appends to a local folder; upload() copies its event files to out_dir whole, as the log is (a bucket or a
    Mountpoint for S3 mount cannot append). A run resumed from step `resumed` writes a new file that hides the earlier
    files' points after that step (SummaryWriter's purge_step): the branch the resumed run left."""

    def __init__(self, out_dir, resumed=0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SystemExit("config: tensorboard_log = True needs the tensorboard package (pip install tensorboard)") \
                from None
        self.folder = tempfile.TemporaryDirectory(prefix="llavax-tensorboard-")  # removed with this object
        self.out = storage.join(out_dir, "tensorboard")
        self.writer = SummaryWriter(self.folder.name, purge_step=resumed + 1 if resumed else None)

    def add(self, event):
        for key, value in event.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, event["step"])
        self.writer.flush()

    def upload(self):
        for path in sorted(Path(self.folder.name).iterdir()):
            storage.upload(path, storage.join(self.out, path.name))
