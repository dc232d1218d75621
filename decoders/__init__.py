"""dualserve.decoders: the engine core and the decoding algorithms that run on it.

- ``engine/``: the engine loop, scheduler, block pool, requests, model runner, paged attention,
  sampling, grammar and detokenization, shared by every decoder;
- ``ar``, ``eagle/``, ``diffusion/``: one room per decoding algorithm;
- ``deployment``: builds one engine with its runners and decoders from a start-up spec;
- ``training/``: offline tools that make EAGLE draft heads and diffusion twins.
"""
