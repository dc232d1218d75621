"""Block diffusion decoding: ``decoder`` (the canvas loop for LLaDA, Dream and twins),
``policies`` (unmasking policy and schedule), ``cache`` (KV cache strategy), and ``gemma``
(DiffusionGemma's canvas loop)."""
