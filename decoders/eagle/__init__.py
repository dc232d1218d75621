"""Speculative decoding: ``decoder`` (draft, verify in one target forward, accept), ``tree`` (the
draft tree, merging sources, the acceptance rules), ``suffix`` (suffix lookup drafts) and
``budget`` (how much to draft each step, from measured cost and acceptance)."""
