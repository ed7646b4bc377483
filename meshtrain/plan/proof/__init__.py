"""The plan-time proof: the abstract run of one rank of a plan on fake tensors (``run``), what it
tracks (``effects``, ``sizes``, ``shard_dims``, ``experts``), what it checks at each boundary
(``boundaries``, ``prover``) and how it refuses (``refusals``); its inputs (``probe``) — pure.
"""
