"""Speculative decoding: ``decoder`` (draft from sources, verify in one target forward, accept),
``source`` (the ``DraftSource`` contract), ``drafters`` (the EAGLE head and DFlash drafter as
sources), ``suffix`` (suffix lookup as a source), ``tree`` (the draft tree, merging sources, the
acceptance rules) and ``budget`` (how much each source drafts each step, from measured cost and
acceptance)."""
