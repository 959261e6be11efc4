"""What a checkpoint holds of the training: the state (model, optimizer, schedulers, scaler,
data position, counters), RNG streams, the global batch sampler, mixed precision.

Imports torch; imports nothing of dckpt above ``errors``.
"""
