"""Process groups: dckpt's own collectives (``comm``), the save progress markers that name a
late rank (``progress``), and forming the training world (``world``).

Never runs a collective on the training group except the resume's warmup all-reduce.
"""
