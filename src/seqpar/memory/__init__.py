"""Long-context memory features: exact per-rank memory meter, activation checkpointing (+ host offload),
fused chunked lm_head + loss, tiled MLP, FSDP2 sharding over all ranks (sharding.py). Each module has one
job; the trainers switch them on from `TrainConfig.memory` (seqpar.train.config.MemorySpec)."""
