# The shapes demo (make demo): a 1.93M-parameter VLM trained from scratch on the CPU. Its settings are
# train.py's defaults, so `python train.py` trains the same thing; this file only names the run.
out_dir = "out/shapes"
