"""The load and resume: the ordered resume over every tier's candidates (``resumer``, which
states the resume protocol), the tiers' readers (``durable``: fetch, prove, DCP load;
``memory``: the memory tier's source and reader), the checks, the report, the config check,
the loss watch, the replay check against the stopped run's journal (``replay``), the config
changes the restored state overrides (``overrides``), and offline reading for the CLI.

Reaches down into ``train``, ``collective``, ``tiers``, ``root`` and ``storage``; never into
``save``.
"""
