"""What each source of a mixture really gave a run (train.py's samples/, trained/, dropped/ and tokens/ figures, its
end-of-run summary), checked against the batches themselves decoded without mixture.py, and the audit's prediction
of them (audit.audit_mixture); the held-out figures only val splits give; a mixture changed mid-run."""

import json
from pathlib import Path

import pytest
from conftest import ROOT, run_log

import pack
from loader import DROP_REASONS, Loader, ShardStream
from mixture import Mixture

TAGS = ("alpha", "beta", "gamma")


def text_source(folder, tag, n, val=0, long=lambda i: False):
    """n text-only samples tagged `tag` in their question (and val more), answers of 1-9 words, so that packing 4 a
    row leaves some without room; those i that long(i) holds with a question too long for any seq_len used here."""
    def question(i):
        return f"question {i} of {tag}" + (" and" + " more words" * 40 if long(i) else "")

    records = [{"id": f"{'val' if i >= n else 'tr'}-{tag}-{i}",
                "conversations": [{"from": "human", "value": question(i)},
                                  {"from": "gpt", "value": " ".join(["blue"] * (1 + i % 9))}]} for i in range(n + val)]
    folder.parent.mkdir(parents=True, exist_ok=True)
    (folder.parent / f"{tag}.json").write_text(json.dumps(records))
    pack.pack(folder.parent / f"{tag}.json", folder.parent, folder, shard_size=24,
              val_ids=lambda i: str(i).startswith("val"), overwrite=True)
    return folder


@pytest.fixture(scope="module")
def four(shapes_data, tmp_path_factory):
    """(mixture spec, shapes dataset): alpha (37 + 5 val), beta (a lone .tar of 24: no val split), gamma (60 + 6
    val, every 7th question too long to train) and the shapes demo's images, weighted 2 : 1 : 1 : 3."""
    shapes = shapes_data(n=400, seed=0, val_fraction=0.1)
    root = tmp_path_factory.mktemp("four")
    alpha = text_source(root / "alpha", "alpha", 37, val=5)
    beta = text_source(root / "beta", "beta", 50)
    gamma = text_source(root / "gamma", "gamma", 60, val=6, long=lambda i: i % 7 == 6)
    spec = [{"path": str(alpha), "weight": 2, "name": "alpha"},
            {"path": str(sorted(beta.glob("*.tar"))[0]), "weight": 1, "name": "beta"},
            {"path": str(gamma), "weight": 1, "name": "gamma"},
            {"path": str(shapes / "shards"), "weight": 3, "name": "shapes"}]
    return spec, shapes


RUN = ["--pack=4", "--batch_size=8", "--micro_batch_size=8", "--seq_len=48", "--max_iters=4", "--log_interval=2",
       "--num_workers=2", "--eval_interval=4", "--eval_iters=1", "--ckpt_interval=0", "--final_accuracy_samples=0"]


def stream_of(spec, shapes, rank=0, world=1, rows=8, group=0):
    return ShardStream(spec, shapes / "tokenizer.model", batch_size=rows, seq_len=48, image_size=28,
                       image_token_id=512, n_image_tokens=4, template="llama_3", pack=4, rank=rank, world_size=world,
                       group=group)


def decoded_figures(batches, stream):
    """{samples|trained|dropped|tokens: {source: n}} of batches, decoded without mixture.py: a sample's source is the
    dataset folder (or tar) its shard lies in; a trained one is a segment of a packed row (position 0 starts it) that
    has supervised labels, its source the tag in its text (an image placeholder: shapes); its tokens are its labels
    that are not -100, as the loss counts them (labels[:, 1:])."""
    tok = stream.tok
    out = {kind: dict.fromkeys((*TAGS, "shapes"), 0) for kind in ("samples", "trained", "tokens")}
    for b in batches:
        for sample in b["sample_id"].tolist():
            tar = Path(stream.files[stream.index[sample][0]])
            name = next((t for t in TAGS if t in (tar.name, tar.parent.name)), "shapes")
            out["samples"][name] += 1
        for row in range(b["input_ids"].shape[0]):
            starts = (b["position_ids"][row] == 0).nonzero().flatten().tolist() + [b["input_ids"].shape[1]]
            for a, z in zip(starts, starts[1:]):
                ids, labels = b["input_ids"][row, a:z], b["labels"][row, a:z]
                supervised = int((labels != -100).sum()) - int(a == 0 and labels[0] != -100)
                if not (labels != -100).any():
                    continue  # the padding tail
                text = tok.decode([t for t in ids.tolist() if t < 512])
                name = "shapes" if (ids == 512).any() else next(t for t in TAGS if f"of {t}" in text)
                out["trained"][name] += 1
                out["tokens"][name] += supervised
    out["dropped"] = {k: out["samples"][k] - out["trained"][k] for k in out["samples"]}
    return out


def audit_table(capsys, cfg_path, *extra):
    import data

    with pytest.raises(SystemExit) as stop:
        data.main(["audit", "--config", str(cfg_path), "--progress", "0", *extra])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| source"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in (*TAGS, "shapes"):
            rows[cells[0]] = dict(zip(columns, cells))
    return stop.value.code, rows, out


def audit_config(path, spec, shapes, **keys):
    text = (ROOT / "configs/debug.py").read_text() + f"data_dir = {spec!r}\n"
    text += f"tokenizer = {str(shapes / 'tokenizer.model')!r}\n"
    text += "".join(f"{k} = {v!r}\n" for k, v in keys.items())
    path.write_text(text)
    return path


def test_a_packed_four_source_run_logs_what_its_batches_fed_and_the_audit_predicts_it(four, tmp_path, capsys):
    from test_train import args, run

    spec, shapes = four
    out = tmp_path / "run"
    r = run(args(shapes, out, f"--data_dir={spec!r}", *RUN))
    stream = stream_of(spec, shapes)
    batches = [stream.batch(k) for k in range(4)]  # the run's 4 steps: 32 samples each, packed 4 a row
    want = decoded_figures(batches, stream)
    assert want["dropped"]["shapes"] > 0 and sum(want["dropped"].values()) < 4 * 32, want  # the packer drops some
    logged = [e for e in run_log(out, "samples/alpha") if e["step"] == 4][-1]
    for kind in ("samples", "trained", "dropped", "tokens"):
        assert {n: logged[f"{kind}/{n}"] for n in want[kind]} == want[kind], (kind, logged)
    # each drop by its reason: gamma's too-long questions (known from the raw records) and the packer's
    long = sum(1 for b in batches for s in b["sample_id"].tolist() if "more words" in stream.read(s)[1]["json"].decode())
    assert logged.get("dropped/gamma/no_supervised_tokens", 0) == long > 0  # cut at seq_len before its answer
    for n in want["dropped"]:
        assert sum(v for k, v in logged.items() if k.startswith(f"dropped/{n}/")) == want["dropped"][n]
    # the end-of-run summary says the same, a line a source
    for n in want["samples"]:
        assert f"data: source {n}: {want['samples'][n]:,} samples drawn, {want['trained'][n]:,} trained, " \
               f"{want['dropped'][n]:,} dropped" in r.stdout, r.stdout[-3000:]
        assert f", {want['tokens'][n]:,} supervised tokens" in r.stdout
    # held out only from val splits: the lone .tar has none, said once; the others' val losses are logged
    assert r.stdout.count("val: no held-out figures for beta (a lone .tar") == 1, r.stdout[-3000:]
    val = run_log(out, "val_loss")[-1]
    assert "val_loss/beta" not in val and {"val_loss/alpha", "val_loss/gamma", "val_loss/shapes"} <= set(val)
    # the audit's prediction of the same run: its table's figures are the run's
    code, rows, said = audit_table(capsys, audit_config(tmp_path / "cfg.py", spec, shapes, pack=4, seq_len=48,
                                                         max_iters=4))
    assert "4 steps x 8 rows x pack 4 = 128 samples drawn" in said, said
    for n in want["samples"]:
        got = {k: int(rows[n][c].replace(",", "")) for k, c in
               (("samples", "drawn"), ("trained", "trained"), ("dropped", "dropped"), ("tokens", "supervised"))}
        assert got == {k: want[k][n] for k in got}, (n, got, rows[n])
        assert float(rows[n]["epochs"]) == pytest.approx(want["samples"][n] / len(
            Mixture(spec).orders[[s["name"] for s in spec].index(n)].kept), abs=0.006)
    assert code == 0 and "gamma: " in said and "no_supervised_tokens" in said


def test_the_audit_reads_the_batches_each_rank_packs(four, tmp_path, capsys):
    """2 ranks of 4 rows each pack their own 16 samples: other drops than 1 rank of 8 rows, and the audit says them."""
    spec, shapes = four
    totals = {}
    for rank in range(2):
        loader = Loader(stream_of(spec, shapes, rank, 2, rows=4))
        batches = iter(loader)
        for _ in range(3):  # 3 steps: batch_size 8 = 4 rows x 2 ranks
            next(batches)
        loader.tokens_total += loader.tokens
        loader.dropped_total += loader.dropped
        for kind, by_name in loader.totals().items():
            for name, v in by_name.items():
                if kind == "dropped":
                    v = sum(v.values())
                totals.setdefault(kind, {})[name] = totals.get(kind, {}).get(name, 0) + v
    cfg = audit_config(tmp_path / "cfg.py", spec, shapes, pack=4, seq_len=48, max_iters=3, micro_batch_size=4)
    code, rows, said = audit_table(capsys, cfg, "--world-size", "2")
    assert "by 2 rank(s) in batches of 4 rows" in said, said
    for n in rows:
        # samples drawn are counted once over the ranks (each rank's loader counts the global draws)
        assert int(rows[n]["drawn"].replace(",", "")) == totals["samples"][n] // 2
        assert int(rows[n]["dropped"].replace(",", "")) == totals["dropped"][n]
        assert int(rows[n]["supervised"].replace(",", "")) == totals["tokens"][n]


def test_a_source_that_can_never_train_is_refused_before_the_model_is_built(shapes_data, tmp_path):
    from test_train import args, run

    two = shapes_data(n=120, seed=0, val_fraction=0.1, images=2)  # two images a sample, and max_tiles = 0
    r = run(args(two, tmp_path / "out", "--max_iters=2"), check=False)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "none of its samples can train with this run's settings" in r.stderr and "multi_needs_max_tiles" in \
        r.stderr and "model:" not in r.stdout, (r.stdout[-2000:], r.stderr)


def test_a_source_that_trains_nothing_in_a_log_interval_is_said(four, tmp_path):
    """gamma2 keeps 1 sample that trains and 29 whose question is too long: the probe lets it in, and the log says
    each interval in which all it drew dropped."""
    from test_train import args, run

    spec, shapes = four
    gamma2 = text_source(tmp_path / "gamma2", "gamma", 30, long=lambda i: i > 0)  # only question 0 is short
    mix = spec[:1] + [{"path": str(gamma2), "weight": 1, "name": "gamma2"}]
    out = tmp_path / "run"
    r = run(args(shapes, out, f"--data_dir={mix!r}", "--pack=4", "--seq_len=48", "--max_iters=4", "--log_interval=1",
                 "--eval_interval=0"))
    events = run_log(out, "samples/gamma2")
    quiet = [e["step"] for before, e in zip([{"samples/gamma2": 0, "tokens/gamma2": 0}] + events, events)
             if e["samples/gamma2"] > before["samples/gamma2"] and e["tokens/gamma2"] == before["tokens/gamma2"]]
    assert quiet, events
    for step in quiet:
        assert f"step {step}: source gamma2 trained no token in this log interval: all " in r.stdout, r.stdout[-3000:]
    assert r.stdout.count("source gamma2 trained no token") == len(quiet)


# -----------------------------------------------------------------------------
# a mixture changed mid-run: what the epoch under way repeats and skips, or an epoch restarted


def repeat_spec(spec, names):
    return [{"path": s["path"], "repeat": 1, "name": s["name"]} for s in spec if s["name"] in names]


def read_samples(loader, n_batches):
    it = iter(loader)
    return [s for _ in range(n_batches) for s in next(it)["sample_id"].tolist()]


def identity(stream, sample):
    """(dataset file, key) of a sample: the same sample whatever mixture reads it."""
    return Path(stream.files[stream.index[sample][0]]).resolve(), stream.read(sample)[0]


def test_a_changed_mixture_says_what_its_epoch_repeats_and_skips_or_restarts_it(four, capsys):
    """alpha + gamma (repeat 1: each kept sample once an epoch) for 3 batches of 32, then alpha + beta + gamma. Going
    on from position 96 repeats and skips samples of the epoch under way, each as the log line says (counted here
    from the samples both runs read); restart_epoch reads every sample of the new mixture once in its first epoch."""
    spec, shapes = four
    old, new = repeat_spec(spec, ("alpha", "gamma")), repeat_spec(spec, ("alpha", "beta", "gamma"))
    before = Loader(stream_of(old, shapes))
    seen = [identity(before.stream, s) for s in read_samples(before, 3)]
    state = before.state_dict()
    went_on = Loader(stream_of(new, shapes))
    went_on.load_state_dict(state, allow_new_data=True)
    said = capsys.readouterr().err
    mix = went_on.stream.mixture
    epoch = mix.blend.epoch_len  # 37 + 24 + 60: the new mixture's epoch, under way at 96
    ahead = [identity(went_on.stream, s) for s in read_samples(went_on, -(-(epoch - 96) // 32))][: epoch - 96]
    for i, name in enumerate(mix.names()):
        kept = {identity(went_on.stream, mix.bases[i] + int(k)) for k in mix.orders[i].kept}
        mine_ahead, mine_seen = kept & set(ahead), kept & set(seen)
        repeats, skips = len(mine_ahead & mine_seen), len(kept - mine_ahead - mine_seen)
        assert f"{name} will repeat {repeats} and skip {skips} of its {len(kept)}" in said, said
    assert "the new mixture is read from global position 96" in said and "will skip 0" not in said.split("beta")[1][:30]
    # restart_epoch: the new mixture's first epoch starts at 96: every sample it keeps read exactly once there
    restarted = Loader(stream_of(new, shapes), mixture_change="restart_epoch")
    restarted.load_state_dict(state, allow_new_data=True)
    assert "starts its first epoch at global position 96" in capsys.readouterr().err
    got = [identity(restarted.stream, s) for s in read_samples(restarted, -(-epoch // 32))][:epoch]
    assert len(set(got)) == len(got) == epoch
    # and a resume of the restarted run keeps its origin: the same samples follow
    again = Loader(stream_of(new, shapes), mixture_change="restart_epoch")
    again.load_state_dict(restarted.state_dict())
    assert read_samples(again, 2) == read_samples(restarted, 2) and restarted.state_dict()["origin"] == 96


def test_a_changed_grouped_mixture_counts_its_repeats_and_skips_in_the_order_it_reads(four, capsys):
    """group_by_modality_length reads each source's samples of a modality in an order of their own, not the
    ungrouped one: the repeats and skips the log says are counted in it (shapes' were off by chance before)."""
    spec, shapes = four
    old, new = repeat_spec(spec, ("alpha", "shapes")), repeat_spec(spec, ("alpha", "gamma", "shapes"))
    before = Loader(stream_of(old, shapes, group=32))
    seen = {identity(before.stream, s) for s in read_samples(before, 3)}
    went_on = Loader(stream_of(new, shapes, group=32))
    went_on.load_state_dict(before.state_dict(), allow_new_data=True)
    said = capsys.readouterr().err
    mix = went_on.stream.mixture
    ahead = [identity(went_on.stream, s) for s in read_samples(went_on, 40)]
    for i, name in enumerate(mix.names()):  # each source's pass under way: its next draws until it ends
        kept = {identity(went_on.stream, mix.bases[i] + int(k)) for k in mix.orders[i].kept}
        left = len(kept) - int(mix.counts_before(96)[i]) % len(kept)
        mine = [x for x in ahead if x in kept]
        assert len(mine) >= left
        repeats, skips = len(set(mine[:left]) & seen), len(kept - set(mine[:left]) - seen)
        assert f"{name} will repeat {repeats} and skip {skips} of its {len(kept)}" in said, said


def test_mixture_change_is_a_config_key_train_py_uses(four, tmp_path):
    from test_train import args, run

    spec, shapes = four
    old, new = repeat_spec(spec, ("alpha", "gamma")), repeat_spec(spec, ("alpha", "beta", "gamma"))
    out = tmp_path / "run"
    base = ["--pack=4", "--seq_len=48", "--eval_interval=0", "--ckpt_interval=2", "--log_interval=2"]
    run(args(shapes, out, f"--data_dir={old!r}", "--max_iters=2", "--skip_steps=[(0, 1)]", *base))
    # the skipped step's samples are read, not trained: dropped/NAME/skip_steps, and no tokens of theirs
    first, logged = stream_of(old, shapes).batch(0), run_log(out, "samples/alpha")[-1]
    assert sum(v for k, v in logged.items() if k.endswith("/skip_steps")) == int((first["drop_reason"] == 0).sum()) > 0
    assert sum(v for k, v in logged.items() if k.startswith("tokens/")) == \
        int((stream_of(old, shapes).batch(1)["labels"][:, 1:] != -100).sum())
    r = run(args(shapes, out, f"--data_dir={new!r}", "--max_iters=4", "--resume=True", "--mixture_change='restart_epoch'",
                 "--allow_config_change=['data_dir']", *base))
    assert "starts its first epoch at global position 64" in r.stdout + r.stderr, r.stderr[-2000:]
    assert json.loads((out / "step-000004/state.json").read_text())["loader"]["origin"] == 64
    r = run(args(shapes, tmp_path / "bad", "--mixture_change='again'"), check=False)
    assert r.returncode == 1 and "mixture_change must be 'continue' or 'restart_epoch'" in r.stderr


def test_every_drop_reason_the_code_raises_has_its_figure():
    """dropped/NAME/REASON: each reason a DropSample or conversation_problem names is one of DROP_REASONS (else its
    samples would be counted under 'other')."""
    import re

    raised = set()
    for f in ("chat.py", "loader.py"):
        raised |= set(re.findall(r'DropSample\(f?"([a-z_]+)', (ROOT / f).read_text()))
        raised |= set(re.findall(r'return "([a-z_]+)"', (ROOT / f).read_text()))
    raised -= {"plain", "image", "multi", "video"}  # the kinds sample_images returns, not reasons
    assert raised and raised <= set(DROP_REASONS), raised - set(DROP_REASONS)
