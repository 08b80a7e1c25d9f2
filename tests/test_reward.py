"""Reward models (objective='reward'): the VLM with a scalar head read at each row's last real token, trained with the
Bradley-Terry loss on the preference shards of DPO."""

import math

import pytest
import torch
from conftest import run_log, tiny_hf_llava
from test_dpo import IMAGE, N_IMAGE_TOKENS, PAD, debug_init, our_model

import model_files
import train
import weight_files
from losses import reward_loss
from model import build_model


def test_reward_loss_and_metrics_equal_an_independent_bradley_terry():
    chosen = [0.7, -1.2, 2.5, 0.3, 0.0]
    rejected = [0.1, 0.4, 2.5, -3.0, 9.0]
    n_tokens = torch.tensor([3, 5, 2, 4, 0] + [2, 2, 7, 1, 6])  # the last pair was dropped by the loader
    rewards = torch.tensor(chosen + rejected, requires_grad=True)
    for margin, center in ((0.0, 0.0), (0.5, 0.0), (0.0, 0.01), (0.25, 0.1)):
        loss, metrics = reward_loss(rewards, n_tokens, margin, center)
        kept = list(zip(chosen, rejected))[:4]
        # -log sigmoid(x) = log(1 + e^-x), with math's own functions
        want = sum(math.log1p(math.exp(-(c - r - margin))) + center * (c + r) ** 2 for c, r in kept) / 4
        assert abs(loss.item() - want) < 1e-6, (margin, center)
        assert metrics["reward/accuracy"].item() == sum(c > r for c, r in kept) / 4 == 0.5  # a tie is not right
        assert abs(metrics["reward/margin"].item() - sum(c - r for c, r in kept) / 4) < 1e-6
        assert abs(metrics["reward/chosen"].item() - sum(c for c, _ in kept) / 4) < 1e-6
    loss.backward()
    assert rewards.grad[4] == 0 and rewards.grad[9] == 0 and rewards.grad[0] < 0 < rewards.grad[5]


def rows(seed=0):
    """Three prompts with an image and answers of different lengths (token ids), and their pixels."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, IMAGE, (n,), generator=g).tolist()  # noqa: E731
    seqs = [words(1 + 2 * i) + [IMAGE] * N_IMAGE_TOKENS + words(9 - 3 * i) for i in range(3)]
    return seqs, torch.randn(3, 3, 28, 28, generator=g)


@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_head_reads_each_rows_last_real_token_as_transformers_does(tmp_path, side):
    """Against transformers' LLaVA: its final hidden state at the last non-pad token (the index its
    *ForSequenceClassification reads), positions counted from each row's first real token, through our head."""
    hf = tiny_hf_llava(seed=0)
    base, cfg = our_model(hf, tmp_path, "policy")
    model = build_model(cfg.with_overrides({"reward_head": True}), seed=3).eval()
    assert set(model.load_state_dict(base.state_dict(), strict=False).missing_keys) == {"reward_head.weight",
                                                                                     "reward_head.bias"}
    seqs, pixels = rows()
    T = max(map(len, seqs)) + 2
    ids = torch.full((3, T), PAD)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[i, span], mask[i, span] = torch.tensor(s), 1
    with torch.no_grad():
        _, rewards = model(ids, pixels, attention_mask=mask, reward=True)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, position_ids=positions,
                 output_hidden_states=True)
        last = (torch.arange(T) * mask).argmax(-1)  # transformers' LlamaForSequenceClassification index
        want = model.reward_head(out.hidden_states[-1][torch.arange(3), last]).squeeze(-1)
        alone = torch.stack([model(torch.tensor([s]), pixels[i : i + 1], reward=True)[1][0] for i, s in enumerate(seqs)])
    assert torch.allclose(rewards, want, atol=1e-5), (rewards, want)
    assert torch.allclose(rewards, alone, atol=1e-5)  # padding changes nothing
    assert rewards.std() > 1e-3  # the rows differ: a head reading the wrong token would not match


@pytest.mark.slow
@pytest.mark.full
def test_reward_model_ranks_right_above_wrong_on_held_out_shapes_pairs(tmp_path):
    """A short run from a random init on the shapes pairs: accuracy above chance on 120 held-out pairs; the
    checkpoint reloads with its head (convert.load_model)."""
    from test_dpo import dpo_args

    import convert
    from shapes import make_shapes

    shapes_pairs = tmp_path / "shapes"
    make_shapes(shapes_pairs, n=480, seed=1, val_fraction=0.25, preference=True)

    init = debug_init(tmp_path / "init")
    train.main(dpo_args(shapes_pairs, tmp_path / "out", f"--init_from={init}", "--objective=reward", "--max_iters=40",
                        "--lr_decay_iters=40", "--eval_interval=40", "--eval_iters=8", "--lr=2e-3", "--warmup_iters=3",
                        "--log_interval=10", "--batch_size=16", "--micro_batch_size=16"))
    events = run_log(tmp_path / "out")
    logged = [e for e in events if "reward/accuracy" in e]
    assert [e["step"] for e in logged] == [10, 20, 30, 40]
    val = next(e for e in events if "val_loss" in e)
    assert val["val_reward/accuracy"] > 0.6 and val["val_reward/margin"] > 0 and val["val_loss"] < math.log(2), val
    reloaded = model_files.load_model(tmp_path / "out/step-000040")
    assert reloaded.reward_head is not None and reloaded.cfg.reward_head
    with pytest.raises(weight_files.ConversionError, match="no Hugging Face LLaVA class holds its scalar head"):
        convert.llava_to_hf(tmp_path / "out/step-000040", tmp_path / "hf")


@pytest.mark.parametrize("extra,message", [(["--pack=2"], "pack must be 0"),
                                           (["--reward_center_weight=-1"], "reward_center_weight must be >= 0")])
def test_reward_config_errors_are_one_sentence(tmp_path, extra, message):
    from test_dpo import dpo_args

    with pytest.raises(SystemExit, match=message):
        train.main(dpo_args(tmp_path, tmp_path / "out", "--init_from=ckpt", "--objective=reward", *extra))


@pytest.mark.slow
@pytest.mark.full
def test_reward_model_under_torchrun_ddp_and_fsdp_matches_one_process(tmp_path):
    from test_dpo import dpo_args
    from test_train import run

    from shapes import make_shapes

    make_shapes(tmp_path / "shapes", n=120, seed=2, val_fraction=0.1, preference=True)
    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", "--objective=reward", "--max_iters=3", "--eval_interval=0", "--ckpt_interval=0",
              "--lr=2e-3", "--reward_center_weight=0.01"]
    run(dpo_args(tmp_path / "shapes", tmp_path / "single", *common))
    for parallel in ("ddp", "fsdp"):  # 2 ranks x 4 pairs = the single run's 8
        run(dpo_args(tmp_path / "shapes", tmp_path / parallel, *common, f"--parallel={parallel}",
                     "--micro_batch_size=4"), nproc=2)
    logged = {name: run_log(tmp_path / name) for name in ("single", "ddp", "fsdp")}
    for name in ("ddp", "fsdp"):
        for want, got in zip(logged["single"], logged[name], strict=True):
            for k in ("loss", "reward/accuracy", "reward/margin", "reward/chosen"):
                assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (name, want["step"], k, got[k], want[k])


@pytest.mark.slow
@pytest.mark.full
def test_reward_model_on_xla_spmd_compiles_once_and_matches_cpu_eager(tmp_path):
    """torch_xla SPMD on 4 CPU devices (fsdp 4): the reward head's gather at each row's last real token and the
    Bradley-Terry loss shard like any batch and model; losses and accuracy equal CPU eager's, and after the second step
    (AdamW's step count) every step reuses the compiled graphs."""

    from conftest import assert_same_logs, run_log, train_on_xla
    from test_dpo import dpo_args
    from test_train import run

    from shapes import make_shapes

    make_shapes(tmp_path / "shapes", n=120, seed=3, val_fraction=0.1, preference=True)
    init = debug_init(tmp_path / "init")
    common = [f"--init_from={init}", "--objective=reward", "--max_iters=5", "--eval_interval=0", "--ckpt_interval=0",
              "--lr=2e-3", "--reward_center_weight=0.01", "--seq_len=40"]  # some pairs drop: still one graph
    run(dpo_args(tmp_path / "shapes", tmp_path / "cpu", *common))
    train_on_xla(dpo_args(tmp_path / "shapes", tmp_path / "xla", *common))
    cpu, xla = run_log(tmp_path / "cpu"), run_log(tmp_path / "xla")
    assert len(cpu) == len(xla) == 5
    assert_same_logs(cpu, xla, ("loss", "reward/accuracy", "reward/margin", "reward/chosen"))
    assert len({e["loss"] for e in cpu}) > 1  # the head trained
