# The shapes demo as a mixture: the one-image questions and the two-image "Which image has more circles?" in one run,
# drawn 3:1, each source's samples, tokens, held-out loss and accuracy logged apart (docs/data.md "Mixtures").
# The two-image data is drawn with the one-image data's tokenizer, so one tokenizer reads both (in a folder of its
# own: configs/shapes_multi.py's data/shapes2 has a tokenizer of its own):
#   python train.py configs/shapes_mixture.py
#   python data.py audit --config configs/shapes_mixture.py                   # the mixture, by source
prepare = [
    "python data.py shapes --out data/shapes",  # make demo draws this one
    "python data.py shapes --out data/shapes2-mixture --images 2 --tokenizer data/shapes/tokenizer.model",
]
out_dir = "out/shapes_mixture"
data_dir = [{"path": "data/shapes/shards", "weight": 3, "name": "one_image"},
            {"path": "data/shapes2-mixture/shards", "weight": 1, "name": "two_images"}]
max_tiles = 2  # two tile slots a row: a one-image sample uses one
seq_len = 56  # the two-image samples are about 51 tokens in the llama_3 template
