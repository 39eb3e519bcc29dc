"""What a checkpoint captures besides tensors: training objects as trees, RNG streams, tokenizer and environment."""
