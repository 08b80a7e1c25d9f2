"""plot.py: the curves of a real run's log.jsonl, several runs overlaid (one line a run), the PNG opened and checked,
runs read from S3 and GCS servers."""

import io
import json
import sys

import pytest
from conftest import ROOT
from PIL import Image

import plot
import storage
import train

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def runs(shapes_data, tmp_path_factory):
    """Run a: 12 steps of the debug model, held-out loss every 4. Run b: a's log as a mixture run with benchmarks
    would write it (its losses lower, each source's held-out loss, two benchmark scores at each evaluation)."""
    shapes, base = shapes_data(n=400, seed=0, val_fraction=0.1), tmp_path_factory.mktemp("runs")
    a, b = base / "a", base / "b"
    train.main([str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'shards'}",
                f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={a}", "--max_iters=12", "--log_interval=2",
                "--eval_interval=4", "--ckpt_interval=0"])
    lines = []
    for line in (a / "log.jsonl").read_text().splitlines():
        event = json.loads(line)
        if "loss" in event:
            event["loss"] *= 0.8
        if "val_loss" in event:
            event |= {"val_loss/shapes": event["val_loss"] * 0.9, "val_loss/shapes2": event["val_loss"] * 1.1,
                      "bench/pope/f1": event["step"] / 20, "bench/mme/perception": 100.0 * event["step"]}
        lines.append(json.dumps(event))
    b.mkdir()
    (b / "log.jsonl").write_text("\n".join(lines) + "\n")
    return a, b


def labelled(ax):
    """{label: (x, y)} of an axes' lines that the legend names."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def logged(out_dir, key):
    events = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    return {e["step"]: e[key] for e in events if e.get(key) is not None}


def test_each_quantity_is_a_panel_with_one_line_a_run(runs):
    a, b = runs
    fig = plot.plot([a, b])
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert list(axes) == ["train loss", "held-out loss", "mme perception", "pope f1", "learning rate", "grad norm",
                          "tokens/s", "data wait (% of step time)"]
    for title, key in [("learning rate", "lr"), ("grad norm", "grad_norm"), ("tokens/s", "tokens_per_s")]:
        lines = labelled(axes[title])
        assert list(lines) == ["a", "b"] and all(len(ax_line.get_xdata()) for ax_line in axes[title].get_lines())
        assert lines["a"] == (list(logged(a, key)), list(logged(a, key).values()))
    wait = labelled(axes["data wait (% of step time)"])["a"][1]
    assert wait == pytest.approx([100 * v for v in logged(a, "data_wait").values()])
    # train loss: each run's raw values faint behind its smoothed line, which alone is named
    loss = axes["train loss"]
    assert len(loss.get_lines()) == 4 and list(labelled(loss)) == ["a", "b"]
    raw = list(logged(a, "loss").values())
    smooth = labelled(loss)["a"][1]
    assert smooth[0] == pytest.approx(raw[0]) and smooth[1] == pytest.approx((0.6 * 0.4 * raw[0] + 0.4 * raw[1]) / 0.64)
    assert list(labelled(axes["held-out loss"])) == ["a: all sources", "b: all sources", "b: shapes", "b: shapes2"]
    assert labelled(axes["pope f1"]) == {"b": ([4, 8, 12], [0.2, 0.4, 0.6])}


def test_the_png_is_the_figure(runs, tmp_path, capsys):
    a, _ = runs
    plot.main([str(a), "--out", str(tmp_path / "curves.png")])
    assert "curves.png (6 panels, 1 run(s))" in capsys.readouterr().out
    png = Image.open(tmp_path / "curves.png")
    png.load()  # decodes whole
    assert png.format == "PNG" and png.size == (3 * 480, 2 * 320)
    assert len(set(png.convert("L").getdata())) > 10  # drawn, not blank


def test_runs_in_buckets_overlay_named_by_their_paths(runs, s3_bucket, gcs_bucket):
    a, _ = runs
    for bucket in (s3_bucket, gcs_bucket):
        storage.write_bytes(f"{bucket}/run/log.jsonl", (a / "log.jsonl").read_bytes())
    fig = plot.plot([f"{s3_bucket}/run", f"{gcs_bucket}/run"])
    assert list(labelled(fig.axes[0])) == [f"{s3_bucket}/run", f"{gcs_bucket}/run"]  # two runs named "run"
    plot.main([f"{s3_bucket}/run/", "--out", f"{s3_bucket}/curves.png"])
    assert Image.open(io.BytesIO(storage.read_bytes(f"{s3_bucket}/curves.png"))).size == (3 * 480, 2 * 320)


def test_what_cannot_be_plotted_is_one_sentence(runs, tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"^plot: .*: no log\.jsonl there"):
        plot.main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    (tmp_path / "log.jsonl").write_text('{"step": 1, "nonfinite_skipped": true}\n{"step": 2, "lo')  # a cut line
    with pytest.raises(SystemExit, match=r"^plot: nothing to plot"):
        plot.main([str(tmp_path)])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as where matplotlib is not installed
    with pytest.raises(SystemExit, match=r"^plot: needs matplotlib \(pip install matplotlib\)$"):
        plot.main([str(runs[0])])


def test_a_resumed_run_plots_the_branch_it_kept(tmp_path):
    """A run that went on to step 20, resumed from its step-10 checkpoint (at a longer log interval, its first line a
    NaN loss), then cut short: the curve is steps 2-10 of the first run and the resumed run's after, with no point of
    the branch it left; lines that are not train.py's (JSON but no object, no step) are passed over."""
    first = [{"step": s, "loss": 10.0 - s / 10, "grad_norm": 1.0} for s in range(2, 22, 2)]
    resumed = [{"step": 12, "loss": float("nan")}] + [{"step": s, "loss": 5.0 - s / 10} for s in range(16, 30, 4)]
    lines = [json.dumps(e) for e in first + resumed] + ["[1, 2]", '{"loss": 1.0}', '{"step": 30, "lo']
    (tmp_path / "log.jsonl").write_text("\n".join(lines))
    loss = plot.read_log(tmp_path)["loss"]
    assert loss == {s: 10.0 - s / 10 for s in range(2, 12, 2)} | {s: 5.0 - s / 10 for s in range(16, 30, 4)}
    plot.main([str(tmp_path), "--out", str(tmp_path / "x.png")])
