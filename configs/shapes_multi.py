# The two-image shapes demo: "Which image has more circles?" about two images a sample (answers "the first",
# "the second", "neither", equally often), so the multi-image path trains end to end on a CPU: static tile slots,
# each image's features placed by image_index/image_weight. Its data, then the run:
#   python train.py configs/shapes_multi.py
# The model is the shapes demo's (train.py's defaults): 48 px images, 9 tokens each.
prepare = [
    "python data.py shapes --out data/shapes2 --images 2",
]
out_dir = "out/shapes_multi"
data_dir = "data/shapes2/shards"
tokenizer = "data/shapes2/tokenizer.model"
max_tiles = 2  # two images a row, one view each (anyres="")
seq_len = 56  # about 51 tokens: 2 x 9 image tokens, the question and the answer in the llama_3 template
max_iters = 600  # held-out loss is ~0.002 by step 500
