"""The save: the ordered pipeline (``pipeline``, which states the save protocol) and its seam
to a tier (``route``: ``SaveRoute``), the tiers' routes (``durable``: the stager and DCP's
write; ``memory``: the copy into the node's memory and the replicas), the staging copy
(``stager``) and the key of DCP's plan cache (``plan_cache``), the background thread
(``background``), the foreground policy (``saver``), the coordinator, the handle, the value
checks of one rank (``value_checks``: replica digests, NaN/Inf) and rank 0's verdict on them
(``findings``), and what a save costs the training loop (``mode``, ``step_clock``).

Reaches down into ``train``, ``collective``, ``tiers``, ``root`` and ``storage``; nothing below
imports it.
"""
