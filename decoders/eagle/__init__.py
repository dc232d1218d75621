"""EAGLE speculative decoding: ``decoder`` (draft with the head, verify in one target forward,
accept) and ``tree`` (the draft tree, its attention mask and the acceptance rules)."""
