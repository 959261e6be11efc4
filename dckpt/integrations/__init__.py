"""dckpt inside the frameworks people train with: one module per framework.

- ``dckpt.integrations.accelerate``: Hugging Face Accelerate (the objects ``prepare`` returns,
  a prepared DataLoader's position and order);
- ``dckpt.integrations.hf_trainer``: the Hugging Face ``Trainer`` (a callback);
- ``dckpt.integrations.lightning``: Lightning (a strategy).

Invariants: ``import dckpt`` imports none of these, and each imports its framework only when
it is imported itself (a missing framework is an ImportError naming the extra to install:
``pip install dckpt[accelerate]``). These modules sit above the manager: they compose the
public API (``TrainState``, ``CheckpointManager``) and nothing below imports them.
"""
