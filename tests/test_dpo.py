"""DPO against TRL 1.16's DPOTrainer: the same tiny random LLaVA, the same preference pairs with images, the same
reference model; our loss, metrics and gradients must equal TRL's compute_loss."""

import json
import math
import os

import pytest
import torch
from conftest import assert_same_logs, run_log, tiny_hf_llava, train_on_xla
from test_pack import tok  # noqa: F401  the byte-level tokenizer fixture

import chat
import config
import convert
import dpo
import hf_names
import images
import model_config
import model_files
import train
from model import build_model

os.environ["USE_TORCH_XLA"] = "0"  # TRL would otherwise import torch_xla and move to an XLA device

IMAGE, EOS, PAD = 511, 2, 0
N_IMAGE_TOKENS = 4  # 28 px, 14 px patches


def hf_llava(family, seed=0):
    """transformers' tiny random LLaVA at 28 px (4 image tokens): Llama and CLIP, or a family's decoder and SigLIP."""
    if family == "llama":
        return tiny_hf_llava(seed=seed)
    from test_families import tiny_llava

    return tiny_llava(family, image_size=28, seed=seed)


def our_model(hf, tmp_path, name):
    hf.save_pretrained(tmp_path / name)
    state, cfg = hf_names.llava_from_hf(tmp_path / name)
    model = build_model(cfg, init=False)
    model.load_state_dict(state, strict=not cfg.llm.tie_embeddings)  # tied: no output.weight of its own
    return model, cfg


def preference_pairs(n_pairs=3, seed=0):
    """Prompts (image placeholders inside), chosen and rejected completions ending in EOS: every length differs."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, IMAGE, (n,), generator=g)
    pairs = []
    for i in range(n_pairs):
        prompt = torch.cat([words(1 + i), torch.full((N_IMAGE_TOKENS,), IMAGE), words(3 + 2 * i)])
        chosen = torch.cat([words(2 + 3 * i), torch.tensor([EOS])])
        rejected = torch.cat([words(5 - i), torch.tensor([EOS])])
        pairs.append((prompt, chosen, rejected))
    return pairs, torch.randn(n_pairs, 3, 28, 28, generator=g)


def trl_batch(pairs, pixels):
    """DataCollatorForVisionPreference's layout: [chosen..., rejected...], prompts left-padded and completions
    right-padded, then flushed left; pixel_values repeated for the two halves."""
    from trl.trainer.utils import flush_left, pad

    prompts = [p for p, _, _ in pairs] * 2
    completions = [c for _, c, _ in pairs] + [r for _, _, r in pairs]
    prompt_ids = pad(prompts, PAD, "left")
    prompt_mask = pad([torch.ones_like(p) for p in prompts], 0, "left")
    completion_ids = pad(completions, PAD, "right")
    completion_mask = pad([torch.ones_like(c) for c in completions], 0, "right")
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    completion_mask = torch.cat([torch.zeros_like(prompt_mask), completion_mask], 1)
    attention_mask, input_ids, completion_mask = flush_left(attention_mask, input_ids, completion_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask,
            "pixel_values": pixels.repeat(2, 1, 1, 1)}


def our_batch(pairs, pixels, seq_len):
    """Ours: [chosen..., rejected...] rows right-padded to a fixed seq_len, completions labelled, one image a pair."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    ids = torch.full((len(rows), seq_len), PAD)
    labels = torch.full((len(rows), seq_len), -100)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.cat([prompt, completion])
        labels[i, len(prompt):n] = completion
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels}


def word_level_processor():
    """A LlavaProcessor for TRL's trainers: token ti is id i, <image> is IMAGE, 28 px images of 14 px patches."""
    from tokenizers import Tokenizer, models
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(IMAGE)} | {"<image>": IMAGE}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                     pad_token="t0", eos_token="t2", unk_token="t1")
    return LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                             crop_size={"height": 28, "width": 28}),
                          tokenizer=hf_tok, patch_size=14, vision_feature_select_strategy="default")


def trl_trainer(policy, ref, loss_type, beta, tmp_path, loss_weights=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    processor = word_level_processor()
    args = DPOConfig(str(tmp_path / "trl"), beta=beta, loss_type=[loss_type] + (["sft"] if loss_weights else []),
                     loss_weights=loss_weights, report_to=[], use_cpu=True, bf16=False, max_length=None)
    data = Dataset.from_list([{"image": [[0]], "prompt": "x", "chosen": "y", "rejected": "z"}])
    return DPOTrainer(policy, ref_model=ref, args=args, train_dataset=data, processing_class=processor,
                      data_collator=lambda examples: examples)


@pytest.mark.parametrize("loss_type,sft_weight,family", [("sigmoid", 0.0, "llama"), ("hinge", 0.0, "llama"),
                                                         ("ipo", 0.0, "llama"), ("sigmoid", 0.5, "llama"),
                                                         ("sigmoid", 0.5, "qwen3"), ("ipo", 0.0, "gemma3")])
def test_dpo_loss_metrics_and_gradients_match_trl(tmp_path, loss_type, sft_weight, family):
    """Qwen3 and Gemma 3: tests/test_families.py's decoders (windows past 8 tokens, q/k norms, Gemma's norms)."""
    beta = 0.5 if loss_type == "ipo" else 0.1
    hf_policy, hf_ref = hf_llava(family, 0), hf_llava(family, 1)  # a reference unlike the policy: nonzero rewards
    policy, cfg = our_model(hf_policy, tmp_path, "policy")
    ref, _ = our_model(hf_ref, tmp_path, "ref")
    pairs, pixels = preference_pairs()

    trainer = trl_trainer(hf_policy.train(), hf_ref.eval(), loss_type, beta, tmp_path,
                          [1.0, sft_weight] if sft_weight else None)
    trl_loss = trainer.compute_loss(trainer.model, trl_batch(pairs, pixels))
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(("rewards/", "logps/"))}

    vit_images = []
    policy.vision.register_forward_hook(lambda module, args, out: vit_images.append(args[0].shape[0]))
    run = dict(config.DEFAULTS) | {"dpo_beta": beta, "dpo_loss": loss_type, "dpo_sft_weight": sft_weight}
    loss, metrics = dpo.preference_loss(policy.train(), ref.eval(), our_batch(pairs, pixels, seq_len=37), run)
    loss.backward()
    policy.loss_chunk = ref.loss_chunk = 24  # the chunked head, as loss_chunk > 0 trains: the same loss
    chunked, _ = dpo.preference_loss(policy, ref, our_batch(pairs, pixels, seq_len=37), run)
    assert abs(chunked.item() - loss.item()) <= 1e-6
    assert vit_images[0] == len(pairs)  # the ViT ran once a pair; TRL runs it on 2 x pairs images

    assert abs(loss.item() - trl_loss.item()) <= 1e-5, (loss.item(), trl_loss.item())
    assert set(metrics) == set(trl_metrics)
    for k, v in metrics.items():
        assert abs(v.item() - trl_metrics[k]) <= 1e-5 * max(1.0, abs(trl_metrics[k])), (k, v.item(), trl_metrics[k])
    assert abs(trl_metrics["rewards/chosen"]) > 1e-3 and abs(trl_metrics["rewards/rejected"]) > 1e-3  # not trivial

    hf_grads = {hf_names.hub_name(k): p.grad if p.grad is not None else torch.zeros_like(p)
                for k, p in hf_policy.named_parameters()}
    hf_grads = hf_names.remap(hf_grads, hf_names.llava_table(cfg), hf_names.expected_shapes(cfg), "TRL grads")
    compared = 0
    for name, p in policy.named_parameters():
        ours_grad = p.grad if p.grad is not None else torch.zeros_like(p)
        scale = hf_grads[name].abs().max().item()
        assert (ours_grad - hf_grads[name]).abs().max().item() <= 1e-4 * max(scale, 1e-3), name
        compared += scale > 0
    assert compared > 20  # the LLM, the projector and the ViT below the selected layer all got gradients


# -----------------------------------------------------------------------------
# preference records: packed once (both answers, one image), read as chosen and rejected rows


def preference(i, prompt, chosen, rejected, **kw):
    return {"id": f"pair{i}", "image": f"{i}.jpg", "conversations": prompt, "chosen": chosen, "rejected": rejected} | kw


def test_preference_records_pack_audit_and_load_as_pair_rows(tmp_path, tok, capsys):  # noqa: F811
    from test_pack import images_dir, open_stream

    import pack

    imgs = images_dir(tmp_path)
    ask = lambda q: [{"from": "human", "value": "<image>\n" + q}]  # noqa: E731
    multi_turn = ask("What is it?") + [{"from": "gpt", "value": "A dog."}, {"from": "human", "value": "Its colour?"}]
    good = [preference(0, ask("What is in the image?"), "A dog on a beach.", "A cat on a sofa, sleeping."),
            preference(1, multi_turn, "Brown.", "It is a blue dog with wings.", image=["1.jpg"])]
    bad = [preference(2, ask("Q?"), "Yes.", None), preference(3, ask("Q?"), "Same.", " Same. "),
           {k: v for k, v in preference(4, ask("Q?"), "Yes.", "No.").items() if k != "image"},
           preference(5, ask("Q?") + [{"from": "gpt", "value": "A."}], "Yes.", "No."),
           {k: v for k, v in preference(6, ask("Q?"), "Yes.", "No.").items() if k != "chosen"}]
    (tmp_path / "d.json").write_text(json.dumps(good + bad))
    skips = pack.pack(tmp_path / "d.json", imgs, tmp_path / "out")
    assert dict(skips.counts) == {"preference_missing_side": 2, "preference_identical_sides": 1,
                                  "preference_without_image": 1, "preference_prompt_not_ending_in_question": 1}

    stream = open_stream(tmp_path / "out", tok, preference=True, seq_len=200)
    b = stream.batch(0)
    B = 2
    assert b["input_ids"].shape == b["labels"].shape == (2 * B, 200) and b["pixel_values"].shape == (B, 3, 28, 28)
    assert b["has_image"].all() and not b["dropped"].any()
    by_id = {json.loads(stream.read(s)[1]["json"])["id"]: i for i, s in enumerate(b["sample_id"].tolist())}
    supervised = lambda row: tok.decode([t for t in b["labels"][row].tolist() if t != -100]).strip()  # noqa: E731
    for rec in good:
        i = by_id[rec["id"]]
        assert supervised(i) == rec["chosen"] + "</s>" and supervised(B + i) == rec["rejected"] + "</s>"
        start = int((b["labels"][i] != -100).nonzero()[0])  # the shared prompt, earlier answers unsupervised
        assert torch.equal(b["input_ids"][i, :start], b["input_ids"][B + i, :start])
        assert (b["input_ids"][i, :start] == 999).sum() == 4

    # an SFT stream over the same shards trains on the chosen answer
    sft = open_stream(tmp_path / "out", tok).batch(0)
    assert tok.decode([t for t in sft["labels"][by_id["pair0"]].tolist() if t != -100]).strip() == "A dog on a beach.</s>"

    # a pair whose prompt fills seq_len is dropped with a reason, and its rows stay without labels
    short = open_stream(tmp_path / "out", tok, preference=True, seq_len=140)
    b = short.batch(0)
    assert short.skips.counts["answer_beyond_seq_len"] == 1
    assert b["dropped"].tolist() == [by_id["pair1"] == i for i in (0, 1)]
    assert short.skips.counts["truncated_not_dropped"] == 1  # pair0: its prompt fits, its answers are cut
    assert (b["labels"][b["dropped"].repeat(2)] == -100).all()

    from audit import audit
    assert audit(tmp_path / "out", tok, "vicuna_v1", 200, 28, 4, 999, show=2) == 0
    out = capsys.readouterr().out
    assert "rejected: 'A cat on a sofa, sleeping.'" in out and "preference pairs (chosen and rejected" in out
    with pytest.raises(ValueError, match="pack must be 0"):
        open_stream(tmp_path / "out", tok, preference=True, pack=2)


# -----------------------------------------------------------------------------
# train.py objective='dpo': the one loop, a frozen reference, the metrics logged


@pytest.fixture(scope="module")
def shapes_pairs(shapes_data):
    return shapes_data(n=240, seed=0, val_fraction=0.1, preference=True)


def dpo_args(shapes, out, *extra):
    from conftest import ROOT

    return [str(ROOT / "configs/debug.py"), f"--data_dir={shapes / 'preference'}",
            f"--tokenizer={shapes / 'tokenizer.model'}", f"--out_dir={out}", "--objective=dpo", "--log_interval=1",
            "--lr_decay_iters=20", *extra]


def debug_init(path):
    from model_config import vlm_preset

    cfg = vlm_preset("debug")
    cfg.vision.image_size, cfg.vision.patch_size, cfg.llm.vocab_size, cfg.image_token_id = 28, 14, 576, 512
    model_files.save_model(build_model(cfg, seed=0), path)
    return path


def test_dpo_training_starts_at_log2_with_zero_rewards_and_separates_the_pairs(shapes_pairs, tmp_path):
    from safetensors.torch import load_file

    init = debug_init(tmp_path / "init")
    before = load_file(init / "model.safetensors")
    train.main(dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--max_iters=8", "--eval_interval=8",
                        "--eval_iters=2", "--lr=2e-3"))
    events = run_log(tmp_path / "out")
    steps = [e for e in events if "rewards/accuracies" in e]
    assert [e["step"] for e in steps] == list(range(1, 9))
    # step 1's forward ran before any update: the policy is the reference, so every log ratio is 0
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-6 and steps[0]["rewards/margins"] == 0.0
    assert steps[0]["rewards/accuracies"] == 0.0  # strict >: ties are not right
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < math.log(2)
    assert steps[-1]["logps/chosen"] > steps[-1]["logps/rejected"]
    val = next(e for e in events if "val_loss" in e)
    assert {"val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen"} <= set(val)
    assert all(torch.equal(v, load_file(init / "model.safetensors")[k]) for k, v in before.items())  # untouched


@pytest.mark.parametrize("extra,message", [
    (["--init_from=scratch"], "objective='dpo' needs a reference checkpoint"),
    (["--dpo_loss=kto"], "dpo_loss must be one of"),
    (["--objective=rloo"], "objective must be one of"),
    (["--pack=2", "--init_from=x"], "pack must be 0"),
    (["--dpo_beta=0"], "dpo_beta must be > 0"),
])
def test_dpo_config_errors_are_one_sentence(tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        train.main(dpo_args(tmp_path, tmp_path / "out", "--init_from=ckpt", *extra))


@pytest.mark.slow
@pytest.mark.full
def test_dpo_under_torchrun_ddp_and_fsdp_matches_one_process(shapes_pairs, tmp_path):
    from test_train import run

    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", "--max_iters=4", "--eval_interval=0", "--ckpt_interval=0", "--lr=2e-3"]
    run(dpo_args(shapes_pairs, tmp_path / "single", *common))
    for parallel in ("ddp", "fsdp"):  # 2 ranks x 4 pairs = the single run's 8
        run(dpo_args(shapes_pairs, tmp_path / parallel, *common, f"--parallel={parallel}", "--micro_batch_size=4"),
            nproc=2)
    logged = {name: run_log(tmp_path / name) for name in ("single", "ddp", "fsdp")}
    keys = ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected")
    for name in ("ddp", "fsdp"):
        for want, got in zip(logged["single"], logged[name], strict=True):
            for k in keys:
                assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (name, want["step"], k, got[k], want[k])
    assert logged["single"][-1]["rewards/margins"] > 0


def tiled_pairs(out, questions):
    """Preference shards in out/shards for the tile path: 6 scenes resized to the odd sizes of test_xla.SIZES (tiled
    grids of several shapes), question i % len(questions) of each, the right count chosen, a wrong one rejected."""
    import numpy as np
    from test_xla import SIZES

    import pack
    from shapes import NUMBERS, draw_scene, wrong_answer

    rng, records = np.random.default_rng(0), []
    (out / "images").mkdir()
    for i in range(6):
        img, objects = draw_scene(rng, 48)
        img.resize(SIZES[i]).save(out / "images" / f"{i}.png")
        right = NUMBERS[sum(s == "circle" for s, *_ in objects)]
        records.append({"id": f"p{i}", "image": f"{i}.png", "chosen": right, "rejected": wrong_answer(right, rng),
                        "conversations": [{"from": "human", "value": f"<image>\n{questions[i % len(questions)]}"}]})
    (out / "pairs.json").write_text(json.dumps(records))
    pack.pack(out / "pairs.json", out / "images", out / "shards")


def test_tiled_pairs_share_their_tiles_and_match_rows_run_apart(shapes_pairs, tmp_path):
    """The tile path (anyres_max, max_tiles): a pair's tiles are read once and placed in both its rows; the log-probs
    equal those of the rows run with their own copy of the tiles (TRL's layout), and the chosen row is the SFT row."""
    from xla_runs import TILED_MODEL

    import loader
    from model_config import vlm_preset

    tiled_pairs(tmp_path, ["How many circles are there?"])
    cfg = vlm_preset("debug").with_overrides(TILED_MODEL)
    stream_args = {"batch_size": 3, "seq_len": 160, "image_size": 28, "image_token_id": 512, "n_image_tokens": 4,
                   "template": "llama_3", "vlm": cfg, "max_tiles": 5, "shuffle_block": 1}
    pairs = loader.ShardStream(tmp_path / "shards", shapes_pairs / "tokenizer.model", preference=True, **stream_args)
    sft = loader.ShardStream(tmp_path / "shards", shapes_pairs / "tokenizer.model", **stream_args)
    model = build_model(cfg, seed=0).eval()
    for k in range(2):
        b, s = pairs.batch(k), sft.batch(k)
        assert not b["dropped"].any() and b["pixel_values"].shape == (3, 5, 3, 28, 28)
        assert torch.equal(b["input_ids"][:3], s["input_ids"]) and torch.equal(b["labels"][:3], s["labels"])
        assert torch.equal(b["image_index"][:3], s["image_index"]) and torch.equal(b["pixel_values"], s["pixel_values"])
        pixels = images.normalize_images(b["pixel_values"], *cfg.vision.image_stats)
        with torch.no_grad():
            logps, n = dpo.sequence_logps(model, b | {"pixel_values": pixels})
            apart, _ = dpo.sequence_logps(model, b | {"pixel_values": pixels.repeat(2, 1, 1, 1, 1)})
        assert (n > 0).all() and torch.allclose(logps, apart, rtol=1e-6, atol=1e-5)


def test_dpo_configs_parse_and_onevision_is_the_recipe():
    from conftest import ROOT

    cfg = config.load_config([str(ROOT / "configs/dpo_onevision.py")])
    assert (cfg["objective"], cfg["dpo_beta"], cfg["lr"], cfg["dpo_sft_weight"]) == ("dpo", 0.1, 5e-7, 0.0)
    assert cfg["warmup_iters"] == round(0.1 * cfg["max_iters"]) and cfg["min_lr"] == 0.0
    assert config.load_config([str(ROOT / "configs/dpo_shapes.py")])["objective"] == "dpo"


def test_shapes_pairs_reject_a_wrong_answer_of_the_same_kind(shapes_pairs):
    from shapes import ANSWER_SETS

    pairs = json.loads((shapes_pairs / "preference.json").read_text())
    sft = {r["id"]: r for r in json.loads((shapes_pairs / "shapes.json").read_text())}
    assert len(pairs) == len(sft) == 240
    for p in pairs:
        assert p["chosen"] == sft[p["id"]]["conversations"][-1]["value"] != p["rejected"]
        assert any(p["chosen"] in kind and p["rejected"] in kind for kind in ANSWER_SETS)
    assert len({p["rejected"] for p in pairs}) > 10  # colours, numbers, shapes, yes/no, nothing


@pytest.mark.slow
@pytest.mark.full
def test_dpo_on_xla_spmd_compiles_once_and_matches_cpu_eager(shapes_pairs, tmp_path):
    """torch_xla SPMD on 4 CPU devices (fsdp 4): the pair rows and the reference shard like any batch and model;
    after the first two steps (the second sees AdamW's step count) every step reuses the compiled graphs."""

    from test_train import run

    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", "--max_iters=6", "--eval_interval=0", "--ckpt_interval=0", "--lr=2e-3",
              "--seq_len=40"]  # a few pairs drop (answer_beyond_seq_len): still one graph
    run(dpo_args(shapes_pairs, tmp_path / "cpu", *common))
    train_on_xla(dpo_args(shapes_pairs, tmp_path / "xla", *common))
    cpu, xla = run_log(tmp_path / "cpu"), run_log(tmp_path / "xla")
    assert len(cpu) == len(xla) == 6
    assert_same_logs(cpu, xla, ("loss", "rewards/margins", "logps/chosen"))


@pytest.mark.parametrize("template", ["llama_3", "chatml"])
def test_pair_rows_are_trl_vision_collator_rows(tmp_path, template):
    """TRL's DataCollatorForVisionPreference on our exported processor (its chat template, image expansion):
    the same token rows and the same supervised positions as our loader, up to padding. ChatML differs in one
    token: TRL's completion is the rest of the rendered text, so it also supervises the "\\n" after <|im_end|>,
    which our template (and our SFT) leaves unsupervised: the model stops at <|im_end|>."""
    from PIL import Image
    from test_data import bpe_tokenizer
    from transformers import AutoProcessor
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    import loader
    import pack
    from model_config import vlm_preset

    bpe_tokenizer(tmp_path)
    bos = {"llama_3": "<|begin_of_text|>", "chatml": None}[template]  # Llama-3's and Qwen2's tokenizer_config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": None}))
    tok = chat.Tokenizer(tmp_path / "tokenizer.json")  # noqa: F811  not the byte-level fixture
    cfg = vlm_preset("debug").to_dict()
    cfg["vision"]["image_size"], cfg["vision"]["patch_size"], cfg["image_token_id"] = 28, 14, tok.vocab_size
    cfg["llm"]["vocab_size"] = -(-(tok.vocab_size + 1) // 64) * 64
    cfg = model_config.VLMConfig.from_dict(cfg)
    model_files.save_model(build_model(cfg, seed=0), tmp_path / "ckpt", tokenizer_dir=tmp_path)
    convert.llava_to_hf(tmp_path / "ckpt", tmp_path / "hf", template=template, image_mode="pad")
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    processor.tokenizer.pad_token = "<|endoftext|>"  # DPOTrainer needs one (its pad_token or eos; this has neither)

    (tmp_path / "images").mkdir()
    pairs = [("What is it?", "A cat.", "Black."), ("Color? What is it?", "Black cat.", "A."),
             ("What?", "It is a cat. A black cat.", "What is it? A cat?")]
    records = []
    for i, (question, chosen, rejected) in enumerate(pairs):
        Image.new("RGB", (28 + 9 * i, 28), (40 * i, 90, 200)).save(tmp_path / "images" / f"{i}.png")
        records.append({"id": f"p{i}", "image": f"{i}.png", "chosen": chosen, "rejected": rejected,
                        "conversations": [{"from": "human", "value": "<image>\n" + question}]})
    (tmp_path / "pairs.json").write_text(json.dumps(records))
    pack.pack(tmp_path / "pairs.json", tmp_path / "images", tmp_path / "shards")
    stream = loader.ShardStream(tmp_path / "shards", tok, batch_size=3, seq_len=96, image_size=28,
                              image_token_id=cfg.image_token_id, n_image_tokens=cfg.n_image_tokens, template=template,
                              shuffle_block=1, preference=True)
    ours = stream.batch(0)
    order = [json.loads(stream.read(s)[1]["json"])["id"] for s in ours["sample_id"].tolist()]

    theirs = DataCollatorForVisionPreference(processor)([
        {"images": [Image.open(tmp_path / "images" / f"{rec['id'][1:]}.png")],
         "prompt": [{"role": "user", "content": rec["conversations"][0]["value"].removeprefix("<image>\n")}],
         "chosen": [{"role": "assistant", "content": rec["chosen"]}],
         "rejected": [{"role": "assistant", "content": rec["rejected"]}]} for rec in map(dict(zip(
             [r["id"] for r in records], records)).get, order)])
    newline = tok.encode("\n", False)
    for row in range(6):
        n = int(theirs["attention_mask"][row].sum())
        assert theirs["input_ids"][row, :n].tolist() == ours["input_ids"][row, :n].tolist()
        mask = theirs["completion_mask"][row, :n].bool()
        supervised = ours["labels"][row, :n] != -100
        if template == "chatml":  # the one difference: TRL's trailing "\n", never ours
            assert theirs["input_ids"][row, n - len(newline):n].tolist() == newline and mask[-1]
            mask[n - len(newline):] = False
        assert torch.equal(mask, supervised), (row, mask.int().tolist(), supervised.int().tolist())
        assert (ours["labels"][row, n:] == -100).all()


# -----------------------------------------------------------------------------
# LoRA: the reference is the policy with its adapters off (and the projector it trains in full at its start values)

LORA_DPO = ["--stage=2", "--lora={'r': 4, 'alpha': 8, 'dropout': 0.1, 'targets': ['llm']}", "--lr=3e-3",
            "--warmup_iters=1", "--max_iters=5", "--eval_interval=5", "--eval_iters=2", "--final_accuracy_samples=0"]
LOGGED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
          "logps/rejected", "val_loss", "val_rewards/margins", "val_logps/rejected")


def logged(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if "loss" in line]


# bfloat16: autocast's cache
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=[pytest.mark.slow, pytest.mark.full])])
def test_lora_dpo_with_adapters_off_equals_the_frozen_copy_reference(shapes_pairs, tmp_path, capsys, dtype, s3_bucket):
    """The frozen copy is read from a bucket (moto's S3 server): dpo_reference loads as init_from does."""
    from conftest import checkpoint_tensors
    from safetensors.torch import load_file

    import storage

    init = debug_init(tmp_path / "init")
    for f in init.iterdir():
        storage.upload(f, f"{s3_bucket}/init/{f.name}")
    lora_dpo = [*LORA_DPO, f"--dtype={dtype}"]
    train.main(dpo_args(shapes_pairs, tmp_path / "off", f"--init_from={init}", *lora_dpo))
    assert "dpo: reference model = the policy with its LoRA adapters off and its 4 tensors trained in full" in \
        capsys.readouterr().out  # the projector's two weights and biases (LLaVA's recipe trains it in full)
    train.main(dpo_args(shapes_pairs, tmp_path / "copy", f"--init_from={init}", f"--dpo_reference={s3_bucket}/init",
                        *lora_dpo))
    assert f"dpo: reference model {s3_bucket}/init (frozen)" in capsys.readouterr().out
    off, copy = logged(tmp_path / "off"), logged(tmp_path / "copy")
    assert [e["step"] for e in off] == [1, 2, 3, 4, 5, 5] and len(off) == len(copy)
    for want, got in zip(copy, off, strict=True):
        for k in set(LOGGED) & set(want):
            assert abs(got[k] - want[k]) <= 1e-6 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])
    assert off[4]["rewards/margins"] > 0 and off[4]["loss"] < math.log(2)
    # the projector moved: a reference that ran it at its trained values (adapters off alone) would differ
    before, after = load_file(init / "model.safetensors"), checkpoint_tensors(tmp_path / "off/step-000005", "model.")
    assert (after["model.projector.fc.0.weight"] - before["projector.fc.0.weight"]).abs().max() > 1e-3


def test_adapter_free_reference_restores_the_policy_after_an_exception(shapes_pairs, tmp_path):
    from dpo import AdapterFreeReference
    from lora import LoRAConfig, LoRALinear, apply_lora

    model = model_files.load_model(debug_init(tmp_path / "init"))
    apply_lora(model, LoRAConfig(r=2, targets=["llm.attention.wq"]), seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith("projector."))
    ref = AdapterFreeReference(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # one "step": the adapters' B and the projector leave their start values
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError):
        ref("not ids", None)
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert all(m.adapter_on for m in model.modules() if isinstance(m, LoRALinear))


@pytest.mark.parametrize("policy_first", [False, True])  # dpo runs the reference first, grpo after generating
def test_adapter_free_reference_under_bf16_autocast_is_the_frozen_copy(tmp_path, policy_first):
    """autocast caches its bf16 cast of a trained (requires_grad) weight for the rest of the region, keyed by the
    tensor, blind to the in-place swap: the policy ran on the reference's projector, or the reference on the
    policy's."""
    from dpo import AdapterFreeReference
    from lora import LoRAConfig, apply_lora

    init = debug_init(tmp_path / "init")
    model, frozen = model_files.load_model(init), model_files.load_model(init).eval()
    apply_lora(model, LoRAConfig(r=2, targets=["llm"]), seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith("projector."))
    ref = AdapterFreeReference(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05 if p.requires_grad else 0)  # a step: B and the projector move
    ids = torch.randint(0, 500, (2, 10))
    ids[:, 1:5] = 512  # the image's 4 tokens
    pixels = torch.randn(2, 3, 28, 28)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        policy_alone = model(ids, pixels)[0]
        frozen_logits = frozen(ids, pixels)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if policy_first:
            model(ids, pixels)
        ref_logits = ref(ids, pixels)[0]
        policy_logits = model(ids, pixels)[0]
    assert torch.equal(ref_logits, frozen_logits)
    assert torch.equal(policy_logits, policy_alone)


@pytest.mark.slow
@pytest.mark.full
def test_lora_dpo_adapters_off_under_torchrun_fsdp_matches_one_process(shapes_pairs, tmp_path):
    """FSDP2 keeps the root's gathered weights (the projector's among them) after a forward: the reference's swap must
    reach them, and the policy's next forward must see its trained values again. The evaluation just before the last
    checkpoint also covers checkpoint.train_state after a forward without backward (it failed with KeyError: 0)."""
    from test_train import run

    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", *LORA_DPO, "--ckpt_interval=0",  # no dropout: each rank draws its own masks
              "--lora={'r': 4, 'alpha': 8, 'dropout': 0.0, 'targets': ['llm']}"]
    run(dpo_args(shapes_pairs, tmp_path / "single", *common))
    r = run(dpo_args(shapes_pairs, tmp_path / "fsdp", *common, "--parallel=fsdp", "--micro_batch_size=4"), nproc=2)
    assert "reference model = the policy with its LoRA adapters off" in r.stdout
    for want, got in zip(logged(tmp_path / "single"), logged(tmp_path / "fsdp"), strict=True):
        for k in set(LOGGED) & set(want):
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (want["step"], k, got[k], want[k])


@pytest.mark.parametrize("template", ["llama_3", "chatml", "vicuna_v1"])
def test_dpo_end_of_turn_off_leaves_exactly_the_answer_tokens(tmp_path, template):
    """dpo_end_of_turn=False: of each pair row's supervised tokens, the one left out is the template's end of turn
    (chat.stop_token_id: <|eot_id|>, <|im_end|>, </s>) and what stays decodes to the answer's own text."""
    from PIL import Image
    from test_data import bpe_tokenizer

    import dpo
    import loader
    import pack

    bpe_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|endoftext|>"}))
    tok = chat.Tokenizer(tmp_path / "tokenizer.json")  # noqa: F811  not the byte-level fixture
    (tmp_path / "images").mkdir()
    pairs = [("What is it?", "A cat.", "Black."), ("Color?", "black", "It is a cat. A black cat.")]
    records = []
    for i, (question, chosen, rejected) in enumerate(pairs):
        Image.new("RGB", (28, 28 + 5 * i), (40 * i, 90, 200)).save(tmp_path / "images" / f"{i}.png")
        records.append({"id": f"p{i}", "image": f"{i}.png", "chosen": chosen, "rejected": rejected,
                        "conversations": [{"from": "human", "value": "<image>\n" + question}]})
    (tmp_path / "pairs.json").write_text(json.dumps(records))
    pack.pack(tmp_path / "pairs.json", tmp_path / "images", tmp_path / "shards")
    stream = loader.ShardStream(tmp_path / "shards", tok, batch_size=2, seq_len=256, image_size=28, image_token_id=
                              tok.vocab_size, n_image_tokens=4, template=template, shuffle_block=1, preference=True)
    b = stream.batch(0)
    order = [json.loads(stream.read(s)[1]["json"])["id"] for s in b["sample_id"].tolist()]
    answers = [dict(zip([r["id"] for r in records], records))[i][side] for side in ("chosen", "rejected") for i in order]
    labels = dpo.without_last_label(b["labels"])
    stop = chat.stop_token_id(template, tok)
    for row, answer in enumerate(answers):
        before, after = b["labels"][row] != -100, labels[row] != -100
        gone = (before & ~after).nonzero().flatten().tolist()
        assert len(gone) == 1 and b["input_ids"][row, gone[0]] == stop and gone[0] == before.nonzero().max()
        assert tok.decode(b["input_ids"][row][after].tolist()).strip() == answer
    assert torch.equal(dpo.without_last_label(torch.full((2, 5), -100)), torch.full((2, 5), -100))
