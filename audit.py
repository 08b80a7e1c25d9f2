"""
The data exactly as training will see it, before a thousand GPU-hours are spent on it: one source (shards, a tar, or
a LLaVA JSON as pack would write it) sample by sample, or a mixture's sources against their shares.

    python data.py audit SHARDS|JSON [--images DIR] [--config configs/x.py] [--hf-tokenizer DIR] [--sheet sheet.png]
"""

import base64
import difflib
import io
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
from loader import ShardStream, image_layouts, pack_rows, sample_conversation, sample_images
from pack import prepare_record
from shards import ShardReader, Skips, all_sample_offsets, log, shard_files
from sources import JsonRecords


# -----------------------------------------------------------------------------
# audit: the data exactly as training will see it, before a thousand GPU-hours are spent on it


def audit_sources(source, images_dir, split):
    """Yield (where, members) or (where, drop reason) in source order: shards as the loader reads them (from a local
    folder or tar, or from a bucket), a LLaVA JSON/JSONL as pack would write it."""
    if not storage.is_url(source) and Path(source).is_file() and Path(source).suffix != ".tar":
        if images_dir is None or not Path(images_dir).is_dir():
            raise SystemExit(f"audit: {source} is a LLaVA JSON: --images must name its image folder (got {images_dir})")
        for i, (rec, images) in enumerate(JsonRecords(source, images_dir)):
            if rec is None:  # (where, reason)
                yield images
                continue
            sample, reason = prepare_record((i, rec, images))
            where = str(rec.get("id", i)) if isinstance(rec, dict) else f"record {i}"
            yield where, reason or {ext: b for ext, b in sample.items() if b is not None}
        return
    if not storage.is_url(source) and not Path(source).exists():
        raise SystemExit(f"audit: {source}: no such shard folder, tar or JSON file")
    try:  # an unfinished or inconsistent folder is refused as the loader refuses it
        files = shard_files(source, split)
        offsets = all_sample_offsets(files)
    except (FileNotFoundError, ValueError, storage.StorageError) as e:
        raise SystemExit(f"audit: {e}") from None
    names = [storage.name(path) for path in files]
    index = [(i, start, end) for i, path in enumerate(files) for start, end in offsets[path]]
    reader = ShardReader(list(files), index)  # a bucket's samples fetched ahead, by byte range
    reader.ahead(range(len(index)))
    try:
        for sample, (shard, _, _) in enumerate(index):
            key, members = reader.read(sample)
            yield f"{names[shard]}:{key}", members
    finally:
        reader.forget()


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
          progress=1000, out=None, vlm=None, max_tiles=0):
    """Print what training would get from `source`; returns the exit status (1: samples with no supervised tokens,
    or a template that disagrees with the HF chat template)."""
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
    for n, (where, members) in enumerate(audit_sources(source, images_dir, split)):
        if limit and n >= limit:
            break
        if progress and n and n % progress == 0:
            log(f"audit: {n} samples")
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
                layouts = image_layouts(vlm, kind, [image_hw(b) for b in blobs])
                if sum(n for n, _, _ in layouts) > max_tiles:
                    raise DropSample(f"too_many_tiles ({sum(n for n, _, _ in layouts)} tiles, max_tiles {max_tiles})")
                pixels = image_tiles(blobs[0], vlm, kind, image_mode, vlm.vision.image_stats[0])[0] if blobs else None
                ids, labels, truncated = encode_conversation(conv, bool(blobs), template, tok, seq_len, image_token_id,
                                                             [len(index) for _, index, _ in layouts],
                                                             vlm.video_token_id)
            else:
                kind, blobs = sample_images(members)
                if len(blobs) > 1:  # as the loader without tile slots drops them
                    raise DropSample(f"{kind}_needs_max_tiles ({len(blobs)} images or frames: set max_tiles > 0)")
                pixels = load_image(image, image_size, image_mode) if image is not None else None
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
    total = sum(outcomes.values()) - outcomes["truncated"]
    p(f"\nsamples: {total}\n  kept: {outcomes['kept']} (truncated to seq_len: {outcomes['truncated']})")
    if pairs:
        p(f"  preference pairs (chosen and rejected answers, objective='dpo'): {pairs} of the kept")
    for reason in sorted(set(outcomes) - {"kept", "truncated"}):
        p(f"  dropped, {reason}: {outcomes[reason]} (first: {', '.join(skips.examples[reason])})")
    if kept:
        pct = np.percentile(kept, [0, 50, 90, 99, 100])
        p("lengths (tokens): " + "  ".join(f"{k} {v:.0f}" for k, v in zip(("min", "p50", "p90", "p99", "max"), pct))
          + f"  mean {np.mean(kept):.1f}")
        share, no_room = padding_share(lengths, seq_len, rows, pack)
        p(f"padding: {share:.1%} of the tokens in {'packed ' if pack else ''}batches of {rows} x {seq_len}"
          + (f"; {no_room} samples find no room in their batch (lower pack)" if no_room else "")
          + f"\nsupervised: {supervised} tokens, {supervised / sum(kept):.1%} of the sample tokens")
    status = 0
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


def audit_mixture(data_dir, stream_args, steps, batch_size, limit=0, progress=1000, seed=0, out=None, split="train"):
    """Print a table of data_dir's sources (mixture.py): samples kept and left out by take rules, tokens, supervised
    tokens, images and tiles (encoded as the loader encodes them: the first `limit` kept samples of each, scaled up),
    each source's share of the samples drawn against its share of the tokens, and the epochs of it that `steps` steps
    of batch_size samples take. Returns the exit status (1: a source whose audited samples all drop)."""
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    try:
        stream = ShardStream(data_dir, split=split, seed=seed, **stream_args)
    except (OSError, ValueError) as e:
        raise SystemExit(f"audit: {e}") from None
    mix, rows, status = stream.mixture, [], 0
    for i, source in enumerate(mix.sources):
        kept = mix.orders[i].kept
        audited = kept[:limit] if limit else kept
        sums = Counter()
        for n, local in enumerate(audited.tolist()):
            if progress and n and n % progress == 0:
                log(f"audit: {source.name}: {n} samples")
            e = stream.encode_or_drop(mix.bases[i] + local)
            if e is None:
                sums["dropped"] += 1
                continue
            images = (len(e[3]) if stream.max_tiles else 1) if e[2] is not None else 0
            sums.update(tokens=len(e[0]), supervised=sum(x != -100 for x in e[1][1:]), images=images,
                        tiles=len(e[2]) if stream.max_tiles and e[2] is not None else images)
        scale = len(kept) / max(1, len(audited))
        total = int(mix.ends[i] - mix.bases[i])
        rows.append((source, len(kept), total - len(kept), {k: v * scale for k, v in sums.items()}))
        status |= sums["dropped"] == len(audited)
    shares = mix.shares()
    token_weight = [share * row[3].get("tokens", 0) / max(1, row[1]) for share, row in zip(shares, rows)]
    rule = "weights" if mix.sources[0].weight is not None else "repeats" if split == "train" else f"{split} splits"
    p(f"audit: a mixture of {len(rows)} sources ({rule}), "
      f"{steps} steps x {batch_size} samples = {steps * batch_size:,} samples drawn"
      + (f"; each source's first {limit} kept samples audited, the figures scaled to all it keeps" if limit else ""))
    p("| source | rule | samples kept | left out by take | tokens | supervised | images | tiles | dropped | "
      "share of samples | share of tokens | epochs |")
    p("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (source, n_kept, left_out, s), share, tw in zip(rows, shares, token_weight):
        rule = f"weight {source.weight:g}" if source.weight is not None else f"repeat {source.repeat:g}" \
            if source.repeat is not None else "held out"
        rule += f", take {source.take}" if source.take != "all" else ""
        p(f"| {source.name} | {rule} | {n_kept:,} | {left_out:,} | {s.get('tokens', 0):,.0f} | "
          f"{s.get('supervised', 0):,.0f} | {s.get('images', 0):,.0f} | {s.get('tiles', 0):,.0f} | "
          f"{s.get('dropped', 0):,.0f} | {share:.1%} | {tw / max(sum(token_weight), 1e-12):.1%} | "
          f"{steps * batch_size * share / n_kept:.2f} |")
    left = sum(r[2] for r in rows)
    p(f"take rules leave out {left:,} of {sum(r[1] + r[2] for r in rows):,} samples")
    for source, _, _, s in rows:
        if s.get("dropped"):
            p(f"  {source.name}: {s['dropped']:,.0f} samples would drop (run `python data.py audit {source.path}` "
              f"for the reasons)")
    return status
