"""
Curves of a training run, or of several overlaid (a ratio ablation), from their log.jsonl: train loss raw and smoothed,
held-out loss by source, benchmark scores, learning rate, grad norm, tokens/s and data wait. One line a run, named by
its out_dir. Reads nothing but log.jsonl, local or in a bucket; needs matplotlib (pip install matplotlib).

    python plot.py out/shapes                              # curves.png
    python plot.py out/mix-3to1 out/mix-1to1 --out ablation.png
    python plot.py gs://BUCKET/run --smoothing 0.9
"""

import argparse
import io
import json
import math

import storage

# (title, the log's keys, y-axis scale) of the panels of every training run; held-out loss and benchmarks follow loss
PANELS = [("train loss", ["loss"], "linear"), ("learning rate", ["lr"], "linear"), ("grad norm", ["grad_norm"], "log"),
          ("tokens/s", ["tokens_per_s"], "linear"), ("data wait (% of step time)", ["data_wait"], "linear")]
PANEL_SIZE, DPI, COLUMNS = (4.8, 3.2), 100, 3


def read_log(out_dir):
    """{key: {step: value}} of a run's numbers. A resumed run's lines supersede the earlier run's from the step it
    went back to: their values at later steps are dropped (the branch it left), at the same step replaced."""
    path = storage.join(out_dir, "log.jsonl")
    if not storage.exists(path):
        raise SystemExit(f"plot: {out_dir}: no log.jsonl there (is it a train.py out_dir?)")
    series, last = {}, -math.inf
    for line in storage.read_text(path).splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a copy: the others still plot
            continue
        if not isinstance(event, dict) or not isinstance(event.get("step"), int):  # not a line train.py writes
            continue
        step = event["step"]
        if step < last:
            for values in series.values():
                for later in [s for s in values if s > step]:
                    del values[later]
        last = step
        for key, value in event.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    series.setdefault(key, {})[step] = value
                else:  # a NaN loss: no point, and none left from the earlier run at its step
                    series.get(key, {}).pop(step, None)
    return series


def smoothed(values, weight):
    """TensorBoard's smoothing: an exponential moving average, debiased at the start (weight 0: the raw values)."""
    out, average = [], 0.0
    for i, v in enumerate(values):
        average = weight * average + (1 - weight) * v
        out.append(average / (1 - weight ** (i + 1)) if weight < 1 else v)
    return out


def run_names(out_dirs):
    """Each out_dir's last component, or its whole path where two runs share one."""
    names = [storage.name(str(d).rstrip("/")) for d in out_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, out_dirs)]


def panels(runs):
    """[(title, [(run index, key), ...], y scale)] in the figure's order: only what some run logged."""
    keys = sorted({k for series in runs for k in series})
    held_out = [k for k in keys if k == "val_loss" or k.startswith("val_loss/")]
    bench = [k for k in keys if k.startswith("bench/")]
    out = PANELS[:1] + ([("held-out loss", held_out, "linear")] if held_out else []) + \
        [(" ".join(k.split("/")[1:]), [k], "linear") for k in bench] + PANELS[1:]  # "bench/pope/f1": "pope f1"
    return [(title, ks, scale) for title, ks, scale in out if any(k in series for series in runs for k in ks)]


def plot(out_dirs, smoothing=0.6):
    """The matplotlib Figure of these runs' curves: a panel a quantity, a colour a run (a line style a source)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("plot: needs matplotlib (pip install matplotlib)") from None
    runs, names = [read_log(d) for d in out_dirs], run_names(out_dirs)
    shown = panels(runs)
    if not shown:
        raise SystemExit(f"plot: nothing to plot: no training line in the log of {', '.join(map(str, out_dirs))}")
    rows = -(-len(shown) // COLUMNS)
    fig = Figure(figsize=(PANEL_SIZE[0] * COLUMNS, PANEL_SIZE[1] * rows), dpi=DPI, layout="constrained")
    for i, (title, keys, scale) in enumerate(shown):
        ax = fig.add_subplot(rows, COLUMNS, i + 1)
        ax.set(title=title, xlabel="step", yscale=scale)
        for r, (series, name) in enumerate(zip(runs, names)):
            for j, key in enumerate(k for k in keys if k in series):
                steps = sorted(series[key])
                values = [series[key][s] * (100 if key == "data_wait" else 1) for s in steps]
                source = key.partition("/")[2] or "all sources"  # val_loss/NAME: NAME
                label = name if len(keys) == 1 else f"{name}: {source}" if len(runs) > 1 else source
                if key == "loss":  # the raw values faint behind the smoothed line, which carries the run's label
                    ax.plot(steps, values, color=f"C{r}", alpha=0.3, linewidth=0.8, label="_raw")
                    values = smoothed(values, smoothing)
                ax.plot(steps, values, color=f"C{r}", linestyle=["-", "--", ":", "-."][j % 4], label=label,
                        marker="o" if len(steps) == 1 else None)
        if len(runs) > 1 or len(keys) > 1:
            ax.legend(fontsize="small")
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description="PNG curves of train.py runs from their log.jsonl (local or gs:// s3://)")
    p.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="a run's out_dir; several are overlaid")
    p.add_argument("--out", default="curves.png", help="the PNG to write, a local path or a bucket URL")
    p.add_argument("--smoothing", type=float, default=0.6, help="train loss smoothing, 0 (none) to below 1")
    args = p.parse_args(argv)
    if not 0 <= args.smoothing < 1:
        raise SystemExit(f"plot: --smoothing {args.smoothing} is not in [0, 1)")
    try:
        fig = plot(args.out_dirs, args.smoothing)
        png = io.BytesIO()
        fig.savefig(png, format="png")
        storage.write_bytes(args.out, png.getvalue())
    except storage.StorageError as e:
        raise SystemExit(f"plot: {e}") from None
    print(f"plot: {args.out} ({len(fig.axes)} panels, {len(args.out_dirs)} run(s))")


if __name__ == "__main__":
    main()
