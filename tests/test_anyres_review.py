"""Inputs a reviewer tried on the tiled (LLaVA-NeXT / OneVision) path that the other tests did not: each a
clear promise (a one-line error naming the input, never a traceback) or a reference."""

import pytest
import torch
from test_multi_image_data import chat_tokenizer, tiny_onevision_config

import convert
import sample
from model import VLM


@pytest.fixture(scope="module")
def onevision_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ov")
    tok = chat_tokenizer(d / "tok")
    with torch.device("meta"):
        model = VLM(tiny_onevision_config(tok))
    model.to_empty(device="cpu").init_weights(seed=0)
    convert.save_model(model, d / "ckpt", d / "tok")
    return d / "ckpt"


def test_sample_video_without_frames_is_a_one_line_error(onevision_ckpt):
    """`sample.py --video` with no --image: a video of zero frames (was an IndexError traceback)."""
    with pytest.raises(SystemExit, match="frame"):
        sample.main(["--ckpt", str(onevision_ckpt), "--video", "--prompt", "What happens?", "--template", "chatml",
                     "--max-new-tokens", "1", "--device", "cpu"])
