#!/usr/bin/env bash
# Environment for llavax training on a Cloud TPU VM: `source scripts/tpu_env.sh` before `python train.py`.
# usage: source scripts/tpu_env.sh   (sets PJRT_DEVICE and LIBTPU_INIT_ARGS; prints them with --print)
# The flags follow what MaxText and torchprime use for FSDP-style SPMD on v4/v5p/v6e; each says why.

libtpu_flags=(
  # run collectives asynchronously so they can overlap with compute instead of stalling it
  --xla_tpu_enable_async_collective_fusion=true
  # ... including the FSDP all-gathers of the next layer's weights (the bulk of our traffic)
  --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true
  # ... and let one async collective span several steps of the schedule, so it starts early enough
  --xla_tpu_enable_async_collective_fusion_multiple_steps=true
  # overlap collectives with compute on the TensorCore itself
  --xla_tpu_overlap_compute_collective_tc=true
  # start all-gathers asynchronously in the first place (the gradient reduce-scatters follow by default)
  --xla_enable_async_all_gather=true
  # dp across slices (dcn_mesh): merge the data-parallel all-reduces of many small tensors into fewer, larger ones
  --xla_tpu_enable_data_parallel_all_reduce_opt=true
  --xla_tpu_data_parallel_opt_different_sized_ops=true
)
export PJRT_DEVICE=TPU
export LIBTPU_INIT_ARGS="${libtpu_flags[*]}"
# Compiles are cached on local disk, so a restarted or resumed job skips recompiling the step.
export XLA_PERSISTENT_CACHE_PATH="${XLA_PERSISTENT_CACHE_PATH:-$HOME/.cache/llavax-xla}"
if [ "${1:-}" = "--print" ]; then
  printf 'PJRT_DEVICE=%s\nLIBTPU_INIT_ARGS=%s\n' "$PJRT_DEVICE" "$LIBTPU_INIT_ARGS"
fi
