"""
The data exactly as training will see it, before a thousand GPU-hours are spent on it: one source (shards, a tar, or
a LLaVA JSON or parquet / Arrow rows as pack would write them, with pack's video settings) sample by sample, or a
mixture's sources against their shares. Drops are named by the loader's reasons (what train.py logs).

    python data.py audit SHARDS|JSON|PARQUET [--images DIR] [--config configs/x.py] [--hf-tokenizer DIR] [--min-kept F]
"""

import base64
import difflib
import io
import json
import os
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

import storage
from chat import (IMAGE_TAG, TEMPLATES, DropSample, Tokenizer, check_template, conversation_problem,
                  encode_conversation, render, tokenize, turns)
from images import image_hw, image_tiles, load_image
from loader import ShardStream, image_layouts, pack_rows, sample_conversation, sample_images, supervised_tokens
from pack import prepare_record
from progress import progress as progress_bar
from shards import ShardReader, Skips, all_sample_offsets, shard_files
from sources import SUFFIXES, JsonRecords, ParquetRows


# -----------------------------------------------------------------------------
# audit: the data exactly as training will see it, before a thousand GPU-hours are spent on it


def table_source(source):
    """Whether source names parquet / Arrow rows (a file, a glob, or a folder of them that is no shard folder)."""
    text = str(source)
    if text.endswith(SUFFIXES) or any(c in text for c in "*?["):
        return True
    folder = Path(text)
    return not storage.is_url(text) and folder.is_dir() and not (folder / ".nv-meta").exists() and \
        not any(folder.glob("*.tar")) and any(p.name.endswith(SUFFIXES) for p in folder.iterdir())


def read_records(make):
    """(records, their count) of a source pack reads, its refusals (sources.py's "pack: ...") as audit's."""
    try:
        records = make()
        return records, records.count()
    except SystemExit as e:
        if isinstance(e.code, str) and e.code.startswith("pack: "):
            raise SystemExit(f"audit: {e.code.removeprefix('pack: ').removeprefix('--parquet ')}") from None
        raise


def audit_sources(source, images_dir, split, video=None, columns=None):
    """(how many, an iterator of (where, members) or (where, drop reason) in source order): shards as the loader reads
    them (from a local folder or tar, or from a bucket), a LLaVA JSON/JSONL or parquet / Arrow rows as pack would write
    them (video: pack's video.VideoSettings; columns: pack's --columns)."""
    if table_source(source):
        rows, n = read_records(lambda: ParquetRows([str(source)], columns))
        return n, json_samples(rows, video)
    if not storage.is_url(source) and Path(source).is_file() and Path(source).suffix != ".tar":
        if images_dir is None or not Path(images_dir).is_dir():
            raise SystemExit(f"audit: {source} is a LLaVA JSON: --images must name its image folder (got {images_dir})")
        records, n = read_records(lambda: JsonRecords(source, images_dir))
        return n, json_samples(records, video)
    if not storage.is_url(source) and not Path(source).exists():
        raise SystemExit(f"audit: {source}: no such shard folder, tar or JSON file")
    try:  # an unfinished or inconsistent folder is refused as the loader refuses it
        files = shard_files(source, split)
        offsets = all_sample_offsets(files)
    except (FileNotFoundError, ValueError, storage.StorageError) as e:
        raise SystemExit(f"audit: {e}") from None
    index = [(i, start, end) for i, path in enumerate(files) for start, end in offsets[path]]
    return len(index), shard_samples(files, index)


def json_samples(records, video=None):
    for i, (rec, images) in enumerate(records):
        if rec is None:  # (where, reason)
            yield images
            continue
        sample, reason = prepare_record((i, rec, images, video))
        where = str(rec.get("id", i)) if isinstance(rec, dict) else f"record {i}"
        yield where, reason or {ext: b for ext, b in sample.items() if b is not None}


def shard_samples(files, index):
    names = [storage.name(path) for path in files]
    reader = ShardReader(list(files), index)  # a bucket's samples fetched ahead, by byte range
    reader.ahead(range(len(index)))
    try:
        for sample, (shard, _, _) in enumerate(index):
            key, members = reader.read(sample)
            yield f"{names[shard]}:{key}", members
    finally:
        reader.forget()


def pack_time_skips(source):
    """{reason: (count, first ids)} of the records pack refused when it wrote the shard folder `source`, as its
    .nv-meta/llavax.json records them; {} for a JSON source, a bare tar, or a folder that records none."""
    meta = storage.join(source, ".nv-meta", "llavax.json")
    if str(source).endswith((".tar", ".json", ".jsonl")) or not storage.exists(meta):
        return {}
    recorded = json.loads(storage.read_text(meta))
    first = recorded.get("skipped_first", {})
    return {reason: (n, first.get(reason, [])) for reason, n in recorded.get("skipped", {}).items()}


def hf_chat_tokenizer(directory):
    """transformers' tokenizer from DIR, which must hold a chat template."""
    d = Path(directory)
    if not (d / "tokenizer_config.json").is_file():
        raise SystemExit(f"audit: --hf-tokenizer {d}: no tokenizer_config.json there")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001  transformers raises many types for a bad folder
        raise SystemExit(f"audit: --hf-tokenizer {d}: transformers cannot load it ({type(e).__name__}: {e})") from None
    if not getattr(hf, "chat_template", None):
        raise SystemExit(f"audit: --hf-tokenizer {d}: its tokenizer_config.json has no chat_template")
    return hf


def differences(expected, got):
    """[(position in expected, expected text, got text)] for every span where two strings differ."""
    # the common prefix and suffix first, so the first difference reported is where the strings part
    start = len(os.path.commonprefix([expected, got]))
    end = len(os.path.commonprefix([expected[start:][::-1], got[start:][::-1]]))
    a, b = expected[start : len(expected) - end], got[start : len(got) - end]
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return [(start + i1, a[i1:i2], b[j1:j2]) for op, i1, i2, j1, j2 in ops if op != "equal"]


def show_prompt(pieces, ids, labels, image_token_id, color):
    """The prompt string with supervised spans in ⟦...⟧ (green on a tty), each <image> with its token positions,
    and newlines shown as ↵."""
    mark = ("\x1b[32m", "\x1b[0m", "\x1b[36m", "\x1b[0m") if color else ("⟦", "⟧", "⟨", "⟩")
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    runs = []
    for k, i in enumerate(positions):
        if k and i == positions[k - 1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    out = ""
    for text, target in pieces:
        parts = text.split(IMAGE_TAG)
        for j, chunk in enumerate(parts):
            if j:
                a, b = runs.pop(0) if runs else ("?", "?")
                out += f"{mark[2]}<image> = tokens {a}..{b}{mark[3]}"
            chunk = chunk.replace("\n", "↵\n")
            out += f"{mark[0]}{chunk}{mark[1]}" if target and chunk else chunk
    return out, f"{len(ids)} tokens, {sum(1 for x in labels[1:] if x != -100)} supervised"


def sheet_layout(image_size):
    """(scale, tile width, tile height, image left/top margin) of a contact sheet: images scaled up by a whole number."""
    scale = max(1, 160 // image_size)
    side = image_size * scale
    return scale, side + 8 * 3 + 520, side + 16, 8


def contact_sheet(tiles, image_size, path):
    """One tile per sample: its image as the model sees it (normalised, then mapped back to pixels), beside its
    question and answer. PNG, or HTML with the PNG embedded when `path` ends in .html."""
    scale, tile_w, tile_h, margin = sheet_layout(image_size)
    sheet = Image.new("RGB", (tile_w, tile_h * max(1, len(tiles))), (255, 255, 255))
    draw, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    side = image_size * scale
    for i, (where, pixels, lines) in enumerate(tiles):
        top = i * tile_h
        if pixels is None:
            draw.rectangle([margin, top + margin, margin + side - 1, top + margin + side - 1], fill=(200, 200, 200))
            draw.text((margin + 4, top + margin + 4), "no image", fill=(0, 0, 0), font=font)
        else:
            shown = pixels.permute(1, 2, 0).numpy()  # the uint8 image the model normalises: what it sees
            img = Image.fromarray(np.ascontiguousarray(shown)).resize((side, side), Image.NEAREST)
            sheet.paste(img, (margin, top + margin))
        draw.rectangle([margin - 1, top + margin - 1, margin + side, top + margin + side], outline=(0, 0, 0))
        text = "\n".join([where] + [w for line in lines for w in textwrap.wrap(line, 84) or [""]][:12])
        draw.text((side + 2 * margin, top + margin), text, fill=(0, 0, 0), font=font)
        draw.line([0, top + tile_h - 1, tile_w, top + tile_h - 1], fill=(180, 180, 180))
    path = Path(path)
    if path.suffix == ".html":
        buf = io.BytesIO()
        sheet.save(buf, format="PNG")
        path.write_text(f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">\n')
    else:
        sheet.save(path)
    return sheet


def padding_share(lengths, seq_len, rows, pack):
    """(padding share, samples that find no room) for batches built as the loader builds them: `rows` rows of
    seq_len tokens, each a sample (pack=0) or packed from pack x rows samples by pack_rows. None = dropped sample;
    the stream wraps round, so the last batch is filled from the start."""
    per_batch = rows * pack if pack else rows
    if not lengths:
        return 1.0, 0
    n = -(-len(lengths) // per_batch) * per_batch
    cyclic = (lengths * (n // len(lengths) + 1))[:n]
    tokens = no_room = 0
    for b in range(0, n, per_batch):
        chunk = [x for x in cyclic[b : b + per_batch] if x]
        if pack:
            where, _ = pack_rows(chunk, rows, seq_len)
            tokens += sum(x for x, w in zip(chunk, where) if w is not None)
            no_room += sum(w is None for w in where) if b < len(lengths) else 0
        else:
            tokens += sum(chunk)
    return 1 - tokens / (n // per_batch * rows * seq_len), no_room


def audit(source, tokenizer, template, seq_len, image_size, n_image_tokens, image_token_id, image_mode="pad",
          images_dir=None, split="train", pack=0, rows=8, show=4, limit=0, sheet=None, hf_tokenizer=None,
          progress=5.0, out=None, vlm=None, max_tiles=0, video=None, columns=None, min_kept=0.0):
    """Print what training would get from `source`; returns the exit status (1: samples with no supervised tokens, a
    template that disagrees with the HF chat template, or fewer samples kept than min_kept of all, and none at all).
    video, columns: how pack reads a JSON's video files and parquet's columns (video.VideoSettings, --columns)."""
    if template not in TEMPLATES:
        raise SystemExit(f"audit: unknown template {template!r}; choose from {sorted(TEMPLATES)}")
    try:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    except Exception as e:  # noqa: BLE001  a bad file raises whatever sentencepiece/tokenizers raise
        raise SystemExit(f"audit: --tokenizer {tokenizer}: cannot load it ({type(e).__name__}: {e})") from None
    try:
        check_template(template, tok)
    except ValueError as e:
        raise SystemExit(f"audit: {e}") from None
    hf = hf_chat_tokenizer(hf_tokenizer) if hf_tokenizer else None
    out = out or sys.stdout
    color = out.isatty()
    p = lambda *a: print(*a, file=out)  # noqa: E731
    packing = f"packed {pack} samples a row into {rows} rows" if pack else "unpacked"
    p(f"audit: {source} ({split}), template {template}, seq_len {seq_len}, {packing}, "
      f"images {image_size} px {image_mode}, {n_image_tokens} image tokens (id {image_token_id})")
    outcomes, skips, lengths, supervised, tiles, pairs = Counter(), Skips(), [], 0, [], 0
    mismatched, n_compared = [], 0
    total, samples = audit_sources(source, images_dir, split, video, columns)
    samples = progress_bar(samples, min(total, limit or total), "audit", "sample", disable=not progress, every_s=progress)
    for n, (where, members) in enumerate(samples):
        if limit and n >= limit:
            break
        shown, pieces, pixels, qa, outcome = n < show, None, None, [], "kept"
        try:
            if isinstance(members, str):  # refused at pack time: the loader never sees it
                raise DropSample(members)
            conv, image = sample_conversation(members)
            if problem := conversation_problem(conv):  # as the loader checks a foreign shard's conversation
                raise DropSample(problem)
            pieces = render(template, conv, tok)
            qa = [f"{r[0].upper()}: {t.replace(IMAGE_TAG, '').strip()}" for r, t in turns(conv)]
            if hf is not None:  # before any seq_len cut: the template is compared whatever becomes of the sample
                got, n_compared = "".join(t for t, _ in pieces), n_compared + 1
                try:
                    expected = hf.apply_chat_template([{"role": r, "content": t} for r, t in turns(conv)],
                                                      tokenize=False)
                except Exception as e:  # noqa: BLE001  jinja's raise_exception (e.g. roles out of order), or a bug
                    expected = f"<apply_chat_template raised {type(e).__name__}: {e}>"
                if expected != got:
                    mismatched.append((where, differences(expected, got)))
            if max_tiles:  # tile slots (anyres, several images, video), as ShardStream(max_tiles=...) reads them
                kind, blobs = sample_images(members)
                if kind == "video" and vlm.video_token_id is None:  # the loader's check, before the layouts refuse it
                    raise DropSample(f"video_without_video_token ({len(blobs)} frames; the model has no "
                                     "video_token_id)")
                layouts = image_layouts(vlm, kind, [image_hw(b) for b in blobs])
                if sum(n for n, _, _ in layouts) > max_tiles:
                    raise DropSample(f"too_many_tiles ({sum(n for n, _, _ in layouts)} tiles, max_tiles {max_tiles})")
                pixels = image_tiles(blobs[0], vlm, kind, image_mode, vlm.vision.image_stats[0])[0] if blobs else None
                ids, labels, truncated = encode_conversation(conv, bool(blobs), template, tok, seq_len, image_token_id,
                                                             [len(index) for _, index, _ in layouts],
                                                             vlm.video_token_id)
            else:
                kind, blobs = sample_images(members)
                if len(blobs) > 1 or kind == "video":  # as the loader without tile slots drops them (one frame too)
                    raise DropSample(f"{kind}_needs_max_tiles ({len(blobs)} images or frames: set max_tiles > 0)")
                tower = {"mean": vlm.vision.image_stats[0], "resample": vlm.vision.resample} if vlm else {}
                pixels = load_image(image, image_size, image_mode, **tower) if image is not None else None
                ids, labels, truncated = encode_conversation(conv, image is not None, template, tok, seq_len,
                                                             image_token_id, n_image_tokens)
        except Exception as e:  # noqa: BLE001  a foreign shard's bad JSON, image or roles: counted, as the loader does
            outcome = str(e).split(" ")[0] if isinstance(e, DropSample) else "unreadable_sample"
            outcomes[outcome] += 1
            skips.add(outcome, where)
            lengths += [None] * (not isinstance(members, str))
            if shown:
                why = e if isinstance(e, DropSample) else f"unreadable_sample: {type(e).__name__}: {e}"
                p(f"\n--- {n}: {where}: dropped {'at pack time ' * isinstance(members, str)}({why})")
                if pieces is not None:
                    ids, labels = tokenize(pieces, tok, image_token_id, n_image_tokens)
                    text, tail = show_prompt(pieces, ids, labels, image_token_id, color)
                    p(f"{text}\n(in full: {tail})")
        else:
            outcomes["kept"] += 1
            outcomes["truncated"] += truncated
            lengths.append(len(ids))
            supervised += sum(1 for x in labels[1:] if x != -100)
            if shown:
                text, tail = show_prompt(pieces, ids, labels, image_token_id, color)
                if truncated:  # the marks above are the template's; the cut is shown as the text it loses
                    lost = tokenize(pieces, tok, image_token_id, n_image_tokens)[0][seq_len:]
                    text += f"\n(cut at seq_len {seq_len}: {len(lost)} tokens lost: {tok.decode(lost)!r})"
                p(f"\n--- {n}: {where}: {tail}\n{text}")
                if "rejected" in conv[-1]:
                    p(f"(preference pair: the answer above is chosen; rejected: {conv[-1]['rejected']!r})")
            pairs += "rejected" in conv[-1]
        if shown:
            tiles.append((f"{where}: {outcome}", pixels, qa))
    kept = [x for x in lengths if x]
    at_pack = pack_time_skips(source)  # not in the shards: the whole dataset's, either split
    total = sum(outcomes.values()) - outcomes["truncated"] + (0 if limit else sum(n for n, _ in at_pack.values()))
    p(f"\nsamples: {total}\n  kept: {outcomes['kept']} (truncated to seq_len: {outcomes['truncated']})")
    if pairs:
        p(f"  preference pairs (chosen and rejected answers, objective='dpo'): {pairs} of the kept")
    for reason in sorted(set(outcomes) - {"kept", "truncated"}):
        p(f"  dropped, {reason}: {outcomes[reason]} (first: {', '.join(skips.examples[reason])})")
    for reason, (n, first) in sorted(at_pack.items()):
        p(f"  dropped at pack time, {reason}: {n}" + (f" (first: {', '.join(first)})" if first else ""))
    if kept:
        pct = np.percentile(kept, [0, 50, 90, 99, 100])
        p("lengths (tokens): " + "  ".join(f"{k} {v:.0f}" for k, v in zip(("min", "p50", "p90", "p99", "max"), pct))
          + f"  mean {np.mean(kept):.1f}")
        share, no_room = padding_share(lengths, seq_len, rows, pack)
        p(f"padding: {share:.1%} of the tokens in {'packed ' if pack else ''}batches of {rows} x {seq_len}"
          + (f"; {no_room} samples find no room in their batch (lower pack)" if no_room else "")
          + f"\nsupervised: {supervised} tokens, {supervised / sum(kept):.1%} of the sample tokens")
    status = 0
    if outcomes["kept"] < max(min_kept * total, 1e-9):  # none kept fails whatever min_kept says
        p(f"FAIL: {outcomes['kept']} of {total} samples would train"
          + (f", under --min-kept {min_kept:g}" if outcomes["kept"] else ""))
        status = 1
    if outcomes["no_supervised_tokens"]:
        p(f"FAIL: {outcomes['no_supervised_tokens']} samples have no supervised token within seq_len {seq_len}")
        status = 1
    if hf is not None:
        p(f"chat template: {n_compared - len(mismatched)} of {n_compared} samples render as {hf_tokenizer}'s "
          f"apply_chat_template does")
        for where, diffs in mismatched[:3]:
            p(f"  {where}: differences at (position: expected -> got)")
            for pos, expected, got in diffs:
                p(f"    {pos}: {expected!r} -> {got!r}")
        if len(mismatched) > 3:
            p(f"  ... and {len(mismatched) - 3} more (first: {', '.join(w for w, _ in mismatched[3:8])})")
        if mismatched:
            p(f"FAIL: template {template} disagrees with the chat template of {hf_tokenizer} on {len(mismatched)} "
              "samples")
            status = 1
    if sheet:
        contact_sheet(tiles, image_size, sheet)
        p(f"contact sheet: {sheet} ({len(tiles)} samples)")
    return status


# -----------------------------------------------------------------------------
# auditing a mixture: each source's share of the samples against its share of the tokens


def sample_figures(stream, sample):
    """(drop reason or None, tokens, image tiles, supervised tokens, images) of one sample as the loader encodes it."""
    try:
        e = stream.encode(sample)
    except DropSample as why:
        return str(why).split(" ")[0], 0, 0, 0, 0
    images = (len(e[3]) if stream.max_tiles else 1) if e[2] is not None else 0
    tiles = len(e[2]) if stream.max_tiles and e[2] is not None else images  # one a row's image without tile slots
    return None, len(e[0][0] if stream.preference else e[0]), tiles, supervised_tokens(e, stream.preference), images


def simulate_run(stream, batches, world_size, progress=5.0):
    """{source index: Counter(drawn, trained, tokens, supervised, images, and a count for each drop reason)} of
    each rank's first `batches` batches, built as the loader builds them: rank r's batch k reads the global positions
    (k N + i) W + r (N samples a batch), and with pack its samples go into its rows first-fit (loader.pack_rows), the
    ones that find no room dropped (no_room_in_pack). Each sample is encoded once."""
    mix, n, cache = stream.mixture, stream.samples_per_batch, {}
    figures = {i: Counter() for i in range(len(mix.sources))}
    for k in progress_bar(range(batches), desc="audit", unit="batch", disable=not progress, every_s=progress):
        for rank in range(world_size):
            ids = [mix.sample_at((k * n + i) * world_size + rank) for i in range(n)]
            for sample in ids:
                if sample not in cache:
                    cache[sample] = sample_figures(stream, sample)
            fates = [cache[sample][0] for sample in ids]
            if stream.pack:  # the packer's drops: the samples left once the rows are full
                kept = [i for i, why in enumerate(fates) if why is None]
                where, _ = pack_rows([cache[ids[i]][1] for i in kept], stream.batch_size, stream.seq_len,
                                     [cache[ids[i]][2] for i in kept] if stream.max_tiles else None, stream.max_tiles)
                for i, w in zip(kept, where):
                    fates[i] = "no_room_in_pack" if w is None else None
            for sample, why in zip(ids, fates):
                f = figures[mix.source_of(sample)]
                f["drawn"] += 1
                if why is not None:
                    f[why] += 1
                    continue
                _, tokens, tiles, supervised, images = cache[sample]
                f.update(trained=1, tokens=tokens, supervised=supervised, images=images, tiles=tiles)
    return figures


RUN_FIGURES = ("drawn", "trained", "tokens", "supervised", "images", "tiles")


def audit_mixture(data_dir, stream_args, steps, batch_size, limit=0, progress=5.0, seed=0, out=None, split="train",
                  world_size=1):
    """Print a table of data_dir's sources (mixture.py) as a run of `steps` steps of batch_size rows (global) reads
    them: stream_args as train.py gives its loader (batch_size: the rows of one rank's batch, pack, seq_len,
    max_tiles), world_size ranks. Per source: samples kept and left out by take rules, and of the run's draws (its
    batches simulated, the packer's drops included) the samples drawn, trained and dropped, their tokens, supervised
    tokens (what train.py logs as tokens/NAME), images and tiles, and the epochs of what it keeps; limit > 0 simulates
    only the batches that hold the run's first `limit` samples and scales the figures. Returns the exit status (1: a
    source that trains none of the samples it draws)."""
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    rows, pack = stream_args["batch_size"], stream_args.get("pack", 0)
    if batch_size % (rows * world_size):
        raise SystemExit(f"audit: batch_size={batch_size} is not a multiple of micro_batch_size x ranks = {rows} x "
                         f"{world_size}, as train.py requires")
    try:
        stream = ShardStream(data_dir, split=split, seed=seed, **stream_args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"audit: {e}") from None
    mix, status = stream.mixture, 0
    batches = steps * batch_size // (rows * world_size)  # each rank's: steps x micro-steps
    simulated = min(batches, -(-limit // (stream.samples_per_batch * world_size))) if limit else batches
    figures = simulate_run(stream, simulated, world_size, progress)
    scale = batches / max(1, simulated)
    total = steps * batch_size * max(1, pack)
    rule = "weights" if mix.sources[0].weight is not None else "repeats" if split == "train" else f"{split} splits"
    p(f"audit: a mixture of {len(mix.sources)} sources ({rule}), {steps} steps x {batch_size} rows"
      + (f" x pack {pack}" if pack else "") + f" = {total:,} samples drawn, by {world_size} rank(s) in batches of "
      f"{rows} rows (seq_len {stream.seq_len}, max_tiles {stream.max_tiles})"
      + (f"; the first {simulated} of each rank's {batches} batches simulated, the figures scaled to all"
         if simulated < batches else ""))
    if mix.left_out_line():  # the recipe's never-published sources, not there: which, and the share they held
        p(f"audit: {mix.left_out_line()}")
    p("| source | rule | samples kept | left out by take | drawn | trained | dropped | tokens | supervised | images | "
      "tiles | share of samples | share of tokens | epochs |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    all_tokens = sum(f["tokens"] for f in figures.values())
    rows_out, reasons_out = [], []
    for i, source in enumerate(mix.sources):
        f, n_kept = figures[i], len(mix.orders[i].kept)
        left_out = int(mix.ends[i] - mix.bases[i]) - n_kept
        reasons = {k: v for k, v in f.items() if k not in RUN_FIGURES}
        dropped = sum(reasons.values())
        rule = f"weight {source.weight:g}" if source.weight is not None else f"repeat {source.repeat:g}" \
            if source.repeat is not None else "held out"
        rule += f", take {source.take}" if source.take != "all" else ""
        p(f"| {source.name} | {rule} | {n_kept:,} | {left_out:,} | {f['drawn'] * scale:,.0f} | "
          f"{f['trained'] * scale:,.0f} | {dropped * scale:,.0f} | {f['tokens'] * scale:,.0f} | "
          f"{f['supervised'] * scale:,.0f} | {f['images'] * scale:,.0f} | {f['tiles'] * scale:,.0f} | "
          f"{f['drawn'] / max(1, sum(g['drawn'] for g in figures.values())):.1%} | "
          f"{f['tokens'] / max(1, all_tokens):.1%} | {f['drawn'] * scale / n_kept:.2f} |")
        status |= bool(f["drawn"]) and not f["trained"]
        if dropped:
            reasons_out.append(f"  {source.name}: {dropped * scale:,.0f} of its {f['drawn'] * scale:,.0f} samples drawn "
                               "drop (" + ", ".join(f"{r} {k * scale:,.0f}" for r, k in sorted(reasons.items())) + ")")
        rows_out.append(n_kept + left_out)
    p(f"take rules leave out {sum(rows_out) - sum(mix.kept_sizes):,} of {sum(rows_out):,} samples")
    for line in reasons_out:
        p(line)
    p("drawn, trained, dropped and supervised are what train.py logs as samples/, trained/, dropped/ and tokens/NAME")
    return status
