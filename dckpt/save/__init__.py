"""The save: the staging copy, the background thread, the ordered pipeline (``pipeline``, which
states the save protocol), the coordinator, and what a save costs the training loop.

Reaches down into ``train``, ``dist``, ``root`` and ``storage``; nothing below imports it.
"""
