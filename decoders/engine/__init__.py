"""The engine core: one engine thread, its scheduler and block pool, the model runners that own the
KV tensors and attention backends, and the per-token rules (sampling, grammar, detokenization)
shared by every decoder. Nothing here imports a decoding algorithm."""
