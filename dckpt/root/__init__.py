"""A checkpoint root on disk, and the shape every root has: the ``Root`` protocol
(``protocol``) and the directory's implementation (``directory``: each member one of the
functions here); names and discovery (``layout``), the manifest, the commit strategy
(``commit``), fsync and ``latest`` (``durable``), upkeep (recovery, quarantine, deletes, pins,
retention carried out) and the pure retention decision, the run lock, offline verification
(``verify``), where a load finds its candidates (``source``), the memory tier's ledger
(``memory_ledger``), the records of resumes (``resume_record``) and the replay journal
(``replay_journal``), and ``peek`` (a checkpoint's config before the model exists).

Knows files and directories, never tensors: nothing here imports torch (a test enforces it),
so the CLI reads a root in a fraction of a second.
"""
