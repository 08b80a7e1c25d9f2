"""`python data.py audit` on the shapes data and on a LLaVA JSON with mixed records, its chat template check
against transformers' apply_chat_template on published jinja templates, and its exit status."""

import base64
import io
import json
import os
import re

import numpy as np
import pytest
from conftest import ROOT
from PIL import Image

import chat
import config
import data
import loader
from shapes import make_shapes

# the non-tool part of Qwen2.5-Instruct's published template: its own default system prompt
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
    "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + "
    "message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen2-Instruct's published template: ChatML with "You are a helpful assistant."
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Meta-Llama-3-Instruct's published template: each message trimmed, the BOS first
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def run_audit(capsys, *args):
    """(exit status, stdout, stderr) of `data.py audit ARGS`, in this process."""
    with pytest.raises(SystemExit) as e:
        data.main(["audit", *map(str, args)])
    out, err = capsys.readouterr()
    code = e.value.code
    return (code if isinstance(code, int) else 1), out + (code if isinstance(code, str) else ""), err


@pytest.fixture(scope="module")
def shapes(shapes_data):
    return shapes_data(n=40, seed=3, val_fraction=0.25)


def webdataset_samples(shards):
    import webdataset as wds

    return list(wds.WebDataset(sorted(str(p) for p in shards.glob("shard-*.tar")), shardshuffle=False))


def test_shapes_counts_prompts_and_contact_sheet(shapes, capsys, tmp_path):
    sheet = tmp_path / "sheet.png"
    code, out, err = run_audit(capsys, shapes / "shards", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                               shapes / "tokenizer.model", "--show", 3, "--sheet", sheet, "--progress", 1e-6)
    assert code == 0, out
    samples = webdataset_samples(shapes / "shards")
    assert f"samples: {len(samples)}\n  kept: {len(samples)} " in out
    # progress goes to stderr: plain lines, not a terminal's redrawn bar, the last one at the end
    assert f"audit: {len(samples)}/{len(samples)} sample (100%)" in err and "done in" in err and "\r" not in err
    # each shown answer is marked as the supervised span, closed by Llama 3's end of turn; the image run is placed
    for s in samples[:3]:
        assert f"⟦{s['txt'].decode()}<|eot_id|>⟧" in out
    assert out.count("⟨<image> = tokens 4..12⟩") == 3  # 9 image tokens after the BOS and the user header
    # one tile per shown sample, each holding that sample's own image (the PNG it was drawn as)
    from audit import sheet_layout

    scale, tile_w, tile_h, margin = sheet_layout(48)
    img = np.asarray(Image.open(sheet).convert("RGB")).astype(int)
    assert img.shape == (3 * tile_h, tile_w, 3)
    for i, s in enumerate(samples[:3]):
        tile = img[i * tile_h + margin : i * tile_h + margin + 48 * scale : scale, margin : margin + 48 * scale : scale]
        source = np.asarray(Image.open(shapes / "images" / (json.loads(s["json"])["id"].split("-")[1] + ".png"))
                              .convert("RGB")).astype(int)
        others = [np.asarray(Image.open(io.BytesIO(t.get("jpg") or t["png"])).convert("RGB")).astype(int)
                  for t in samples[:3] if t is not s]
        assert np.abs(tile - source).mean() < 3
        assert all(np.abs(tile - o).mean() > 3 for o in others)


def test_too_short_seq_len_leaves_no_supervised_tokens_and_fails(shapes, capsys):
    # 14 tokens hold the BOS, the user header and the 9 image tokens, never the answer
    code, out, _ = run_audit(capsys, shapes / "shards", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                             shapes / "tokenizer.model", "--seq-len", 14, "--show", 1)
    n = len(webdataset_samples(shapes / "shards"))
    assert code == 1
    assert f"dropped, no_supervised_tokens: {n} " in out and "FAIL" in out
    assert "⟦" in out  # the dropped sample is still shown with its would-be supervised span


def test_padding_share_is_what_the_loader_hands_out(shapes, capsys):
    code, out, _ = run_audit(capsys, shapes / "shards", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                             shapes / "tokenizer.model", "--rows", 5, "--show", 0)
    share = float(re.search(r"padding: ([\d.]+)% ", out).group(1)) / 100
    T = config.DEFAULTS["seq_len"]  # configs/shapes.py's
    stream = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=5, seq_len=T, image_size=48,
                              image_token_id=512, n_image_tokens=9, template="llama_3")
    assert len(stream) == 30  # 6 batches of 5 rows are one epoch
    batches = [stream.batch(k)["input_ids"] for k in range(6)]
    real = sum(int((b != stream.tok.pad_id).sum()) for b in batches)
    assert code == 0 and abs(share - (1 - real / (6 * 5 * T))) < 0.0006
    # packing 2 samples a row: no two fit (each is 30+ tokens), so half find no room, as in the loader
    code, out, _ = run_audit(capsys, shapes / "shards", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                             shapes / "tokenizer.model", "--rows", 5, "--pack", 2, "--show", 0)
    packed = loader.ShardStream(shapes / "shards", shapes / "tokenizer.model", batch_size=5, seq_len=T, image_size=48,
                              image_token_id=512, n_image_tokens=9, template="llama_3", pack=2)
    for k in range(3):
        packed.batch(k)
    assert packed.skips.counts["no_room_in_pack"] == 15 and "; 15 samples find no room" in out


def hf_tokenizer_dir(path, chat_template, family="qwen2"):
    """A transformers tokenizer folder (tokenizer.json + tokenizer_config.json with a chat template), trained here
    with Qwen2's special tokens (no BOS) or Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials, named = {"qwen2": (["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                                 {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
                       "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                   "<|eot_id|>"], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})}[family]
    tok.train_from_iterator(["What is in the image? A red bus on a street. Describe it. user assistant system"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, **named).save_pretrained(path)
    for stale in path.glob("chat_template.*"):
        stale.unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": chat_template}))
    return path


def jpeg(w, h, seed):
    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def mixed_json(tmp_path_factory):
    """Records as llava_v1_5_mix665k has them, and the broken kinds found in the wild."""
    d = tmp_path_factory.mktemp("mixed")
    (d / "images/coco").mkdir(parents=True)
    (d / "images/coco/a.jpg").write_bytes(jpeg(640, 480, 0))
    (d / "images/coco/b.jpg").write_bytes(jpeg(333, 500, 1))
    h, g = "human", "gpt"
    records = [
        {"id": "good", "image": "coco/a.jpg", "conversations": [{"from": h, "value": "<image>\nWhat is in the image?"},
                                                                 {"from": g, "value": "A red bus on a street."}]},
        {"id": "tag_last", "image": "coco/b.jpg", "conversations": [{"from": h, "value": "Describe it.\n<image>"},
                                                                     {"from": g, "value": "A street."}]},
        {"id": "text_only", "conversations": [{"from": h, "value": "What is a bus?"}, {"from": g, "value": "A vehicle."}]},
        {"id": "multi_turn", "image": "coco/a.jpg", "conversations": [
            {"from": h, "value": "<image>\nWhat is it?"}, {"from": g, "value": "A bus."},
            {"from": h, "value": " What colour? \n"}, {"from": g, "value": "Red."}]},
        {"id": "bad_role", "image": "coco/a.jpg", "conversations": [{"from": "Human", "value": "<image>\nWhat?"},
                                                                     {"from": "chatgpt", "value": "A bus."}]},
        {"id": "missing", "image": "coco/nope.jpg", "conversations": [{"from": h, "value": "<image>\nWhat?"},
                                                                       {"from": g, "value": "Nothing."}]},
    ]
    (d / "mixed.json").write_text(json.dumps(records, indent=1))
    return d, records


def audit_json(capsys, d, tok_dir, template, *extra):
    return run_audit(capsys, d / "mixed.json", "--images", d / "images", "--tokenizer", tok_dir, "--template",
                     template, "--seq-len", 128, "--image-size", 28, "--n-image-tokens", 4, "--image-token-id", 400,
                     "--show", 10, *extra)


@pytest.mark.parametrize("template, jinja, family", [("chatml", QWEN2_TEMPLATE, "qwen2"),
                                                      ("llama_3", LLAMA3_TEMPLATE, "llama3")])
def test_mixed_llava_json_every_record_accounted_for(mixed_json, capsys, tmp_path, template, jinja, family):
    d, records = mixed_json
    tok_dir = hf_tokenizer_dir(tmp_path / "tok", jinja, family)
    code, out, _ = audit_json(capsys, d, tok_dir, template, "--hf-tokenizer", tok_dir, "--sheet", tmp_path / "s.html")
    assert code == 0, out
    assert f"samples: {len(records)}\n  kept: 4 " in out
    assert "dropped, missing_image: 1 (first: missing)" in out
    assert "(first: bad_role)" in out  # an unknown role is a counted drop, never a crash
    end = {"chatml": "<|im_end|>", "llama_3": "<|eot_id|>"}[template]
    assert f"⟦A vehicle.{end}⟧" in out  # the text-only record trains on its answer
    assert f"⟦A bus.{end}⟧" in out and f"⟦Red.{end}⟧" in out  # both turns of the multi-turn record
    assert "chat template: 4 of 4 samples render as" in out  # no difference from the published template
    html = (tmp_path / "s.html").read_text()
    assert html.startswith('<img src="data:image/png;base64,')
    from audit import sheet_layout

    embedded = Image.open(io.BytesIO(base64.b64decode(html.split(",", 1)[1].split('"')[0])))
    assert embedded.size[1] == len(records) * sheet_layout(28)[2]  # one tile per shown record, dropped ones too


def test_template_that_disagrees_with_the_chat_template_fails_and_shows_where(mixed_json, capsys, tmp_path):
    from transformers import AutoTokenizer

    d, records = mixed_json
    tok_dir = hf_tokenizer_dir(tmp_path / "tok", QWEN25_TEMPLATE)
    code, out, _ = audit_json(capsys, d, tok_dir, "chatml", "--hf-tokenizer", tok_dir)
    assert code == 1 and "FAIL: template chatml disagrees" in out
    assert "chat template: 0 of 4 samples" in out
    # the first difference is reported where transformers' rendering and ours part, with both texts
    messages = [{"role": "user", "content": "<image>\nWhat is in the image?"},
                {"role": "assistant", "content": "A red bus on a street."}]
    expected = AutoTokenizer.from_pretrained(tok_dir).apply_chat_template(messages, tokenize=False)
    got = "".join(t for t, _ in chat.TEMPLATES["chatml"]([{"from": "human", "value": messages[0]["content"]},
                                                           {"from": "gpt", "value": messages[1]["content"]}]))
    first = len(os.path.commonprefix([expected, got]))
    assert first > 0 and f"\n    {first}: " in out and "Qwen" in out


@pytest.mark.parametrize("change, message", [
    (lambda a: a.__setitem__(0, "no/such/folder"), "no/such/folder: no such shard folder"),
    (lambda a: a.__setitem__(a.index("--template") + 1, "vicuna"), "unknown template 'vicuna'"),
    (lambda a: a.__setitem__(a.index("--tokenizer") + 1, "/"), "--tokenizer /"),
    (lambda a: a.extend(["--hf-tokenizer", "/"]), "--hf-tokenizer /: no tokenizer_config.json"),
    (lambda a: a.extend(["--config", "configs/nope.py"]), "--config configs/nope.py: no such file"),
])
def test_bad_inputs_get_one_clear_message(shapes, capsys, change, message):
    args = [str(shapes / "shards"), "--tokenizer", str(shapes / "tokenizer.model"), "--template", "llama_3"]
    change(args)
    code, out, err = run_audit(capsys, *args)
    assert code != 0 and message in out and "Traceback" not in out + err


def test_an_unfinished_shard_folder_is_refused_as_the_loader_refuses_it(shapes, capsys, tmp_path):
    import shutil

    shutil.copy(shapes / "shards/shard-000000.tar", tmp_path)  # what a killed pack leaves: tars, no .nv-meta
    code, out, err = run_audit(capsys, tmp_path, "--tokenizer", shapes / "tokenizer.model")
    assert code != 0 and "not a finished dataset" in out and "Traceback" not in out + err


def test_image_settings_come_from_the_checkpoint_a_config_starts_from(shapes, capsys, tmp_path):
    from model_config import vlm_preset

    cfg = vlm_preset("debug").to_dict()
    cfg["vision"] |= {"image_size": 28, "patch_size": 14}
    cfg["image_token_id"] = 600
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt/config.json").write_text(json.dumps(cfg))  # as convert.py's save_checkpoint writes it
    (tmp_path / "run.py").write_text(f"init_from = {str(tmp_path / 'ckpt')!r}\nseq_len = 64\n")
    code, out, _ = run_audit(capsys, shapes / "shards", "--config", tmp_path / "run.py", "--tokenizer",
                             shapes / "tokenizer.model", "--show", 1)
    assert code == 0, out
    assert "images 28 px pad, 4 image tokens (id 600)" in out and "⟨<image> = tokens 4..7⟩" in out


def test_a_foreign_webdataset_shard_drops_what_the_loader_drops(shapes, capsys, tmp_path):
    import webdataset as wds

    h, g = "human", "gpt"
    ok = [{"from": h, "value": "<image>\nWhat is it?"}, {"from": g, "value": "red"}]
    samples = [{"jpg": jpeg(64, 40, 0), "json": {"conversations": ok}},
               {"jpg": jpeg(40, 64, 1), "json": {"conversations": [{"from": "Human", "value": "<image>\nWhat?"},
                                                                   {"from": "chatgpt", "value": "red"}]}},
               {"jpg": jpeg(64, 64, 2)[:200], "json": {"conversations": ok}},  # a truncated JPEG
               {"jpg": jpeg(50, 50, 3), "json": {"caption": "a red square"}},  # caption only in KEY.json
               {"json": {"conversations": [{"from": h, "value": "Hi?"}, {"from": g, "value": None}]}}]
    with wds.TarWriter(str(tmp_path / "foreign.tar")) as w:
        for i, s in enumerate(samples):
            w.write({"__key__": f"s{i}", **{k: json.dumps(v).encode() if k == "json" else v for k, v in s.items()}})
    code, out, _ = run_audit(capsys, tmp_path / "foreign.tar", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                             shapes / "tokenizer.model", "--show", 0)
    stream = loader.ShardStream(tmp_path / "foreign.tar", shapes / "tokenizer.model", batch_size=5, seq_len=40,
                              image_size=48, image_token_id=512, n_image_tokens=9, template="llama_3")
    dropped = stream.batch(0)["dropped"]
    counts = {k: n for k, n in stream.skips.counts.items() if k != "truncated_not_dropped"}
    assert code == 0 and f"samples: 5\n  kept: {int((~dropped).sum())} " in out
    assert sorted(re.findall(r"dropped, (\w+): (\d+)", out)) == sorted((k, str(n)) for k, n in counts.items())
    assert len(counts) == 3  # a role, a corrupt image, a null value: each counted by its reason


def test_the_demo_seq_len_keeps_every_question_of_a_demo_draw(tmp_path, capsys):
    # a draw like make demo's (seed 0; 2000 samples hold every question form and answer), audited at configs/shapes.py's
    # seq_len: every sample is kept whole, so the demo's short rows (no padding past its longest sample) cost nothing
    make_shapes(tmp_path, n=2000, seed=0, val_fraction=0.1)
    code, out, _ = run_audit(capsys, tmp_path / "shards", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                             tmp_path / "tokenizer.model", "--show", 0)
    n = len(webdataset_samples(tmp_path / "shards"))
    assert code == 0 and n == 1800, out
    assert f"samples: {n}\n  kept: {n} (truncated to seq_len: 0)" in out  # at 33 tokens: 1 in 13 lose their end


def test_an_audit_of_packed_shards_counts_what_pack_refused(shapes, capsys, tmp_path):
    """The records pack skipped are in no shard; the audit of the shards reports them from .nv-meta/llavax.json,
    by reason with their first ids, and counts them among the samples."""
    records = json.loads((shapes / "shapes.json").read_text())[:6]
    records += [{"id": "gone", "image": "nowhere.png", "conversations": records[0]["conversations"]},
                {"id": "mute", "image": records[1]["image"], "conversations": [records[1]["conversations"][0]]}]
    (tmp_path / "d.json").write_text(json.dumps(records))
    from pack import pack

    skips = pack(tmp_path / "d.json", shapes / "images", tmp_path / "s")
    assert dict(skips.counts) == {"missing_image": 1, "no_gpt_turn": 1}
    code, out, _ = run_audit(capsys, tmp_path / "s", "--config", ROOT / "configs/shapes.py", "--tokenizer",
                             shapes / "tokenizer.model", "--show", 0)
    assert code == 0 and "samples: 8\n  kept: 6 " in out, out
    assert "dropped at pack time, missing_image: 1 (first: gone)" in out
    assert "dropped at pack time, no_gpt_turn: 1 (first: mute)" in out


# -----------------------------------------------------------------------------
# every source pack reads, and an exit status a script can trust


def test_a_parquet_source_is_audited_as_pack_reads_it(mixed_json, capsys, tmp_path):
    """LLaVA-OneVision-Data's rows (id, image {bytes, path}, conversations): the audit reads them as pack does, every
    drop by pack's reason, and keeps what pack keeps (before: "is a LLaVA JSON: --images must name its image folder",
    then "NUL bytes: UTF-16/32 text")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import pack
    import sources

    d, records = mixed_json
    rows = [{"id": r["id"], "conversations": r["conversations"],
             "image": {"bytes": (d / "images" / r["image"]).read_bytes(), "path": r["image"]}
             if "image" in r and (d / "images" / r["image"]).exists() else None} for r in records]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train-00000-of-00001.parquet", row_group_size=4)
    skips = pack.pack_source(sources.ParquetRows(tmp_path), tmp_path / "packed")
    tok_dir = hf_tokenizer_dir(tmp_path / "tok", QWEN2_TEMPLATE)
    common = ["--tokenizer", tok_dir, "--template", "chatml", "--seq-len", 128, "--image-size", 28,
              "--n-image-tokens", 4, "--image-token-id", 400, "--show", 0]
    for source in (tmp_path / "train-00000-of-00001.parquet", tmp_path, tmp_path / "*.parquet"):
        code, out, err = run_audit(capsys, source, *common)
        assert code == 0 and f"samples: {len(rows)}\n  kept: {len(rows) - sum(skips.counts.values())} " in out, out + err
        for reason, n in skips.counts.items():
            assert f"dropped, {reason}: {n} " in out, out
    code, out, _ = run_audit(capsys, tmp_path / "packed", *common)
    assert f"kept: {len(rows) - sum(skips.counts.values())} " in out
    code, out, _ = run_audit(capsys, tmp_path / "nothing-*.parquet", *common)
    assert code == 1 and out.strip().splitlines()[-1] == f"audit: {tmp_path / 'nothing-*.parquet'}: no .parquet or " \
        ".arrow file there", out


def test_audit_fails_when_nothing_or_too_little_would_train(mixed_json, capsys, tmp_path):
    """`audit && train` must not pass on data that trains nothing: kept 0 exits 1 (before: 0), and --min-kept F
    fails under that share of the samples."""
    d, records = mixed_json
    tok_dir = hf_tokenizer_dir(tmp_path / "tok", QWEN2_TEMPLATE)
    gone = [r | {"image": "coco/nope.jpg"} for r in records if "image" in r]
    (d / "gone.json").write_text(json.dumps(gone))
    args = ["--images", d / "images", "--tokenizer", tok_dir, "--template", "chatml", "--seq-len", 128,
            "--image-size", 28, "--n-image-tokens", 4, "--image-token-id", 400, "--show", 0]
    code, out, _ = run_audit(capsys, d / "gone.json", *args)
    assert code == 1 and "kept: 0 " in out and f"FAIL: 0 of {len(gone)} samples would train" in out, out
    code, out, _ = run_audit(capsys, d / "mixed.json", *args, "--min-kept", 0.9)
    assert code == 1 and f"FAIL: 4 of {len(records)} samples would train, under --min-kept 0.9" in out, out
    code, out, _ = run_audit(capsys, d / "mixed.json", *args, "--min-kept", 0.6)
    assert code == 0 and "FAIL" not in out, out
