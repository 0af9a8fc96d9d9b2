"""Per-sequence state (KV cache, recurrent state, checkpoints) and the prefix cache across sequences."""
