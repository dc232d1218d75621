"""Paged attention: the backends a model runner hands each layer, reading and writing the KV
block pool by slot (SDPA, flash-attn's paged kernel, the project's rows kernel) and the sliding
windows some families' layers attend through."""
