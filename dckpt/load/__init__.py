"""The load and resume: the ordered resume (``resumer``, which states the resume protocol), its
checks, its report, the config check, the loss watch, and offline reading for the CLI.

Reaches down into ``train``, ``dist``, ``root`` and ``storage``; never into ``save``.
"""
