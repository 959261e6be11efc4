"""Process groups: dckpt's own collectives (``comm``), the save progress markers that name a
late rank (``progress``), forming the training world (``world``), and files moved between
ranks over dckpt's group, hashed as they arrive (``transfer``: the memory tier's replicas).

Never runs a collective on the training group except the resume's warmup all-reduce.
"""
