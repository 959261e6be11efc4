"""CheckpointConfig: how dckpt saves and loads, validated once at construction.

Frozen and keyword-only: a config is a value that can be logged, compared and stored. Every bad
value is rejected in ``__post_init__`` with the reason, never later in the middle of a save.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import xxhash

from .owned import Access
from .root.retention import BestMode, RetentionPolicy
from .storage.digest import ALGORITHMS
from .tiers.url import ObjectURL, default_mirror, parse_root, parse_url

__all__ = ["CheckpointConfig", "IfBusy", "LossWatchAction", "ReplayCheckMode", "ReplicaCheck"]

IfBusy = Literal["wait", "skip"]
"""What ``save()`` does while the previous save is still writing."""
LossWatchAction = Literal["warn", "raise", "off"]
"""What a loss above the bound does after a resume."""
ReplayCheckMode = Literal["auto", "exact", "close", "off"]
"""How a resume compares the steps it replays with the run that stopped."""
RootAccess = Access
"""Who else may write the root's directories: nobody, or the directory's group too."""
ReplicaCheck = Literal["error", "warn", "off"]
"""What a save does when the ranks' copies of a replicated value differ."""


def _lock_from_env() -> bool:
    """``lock``'s default: ``$DCKPT_LOCK``, so any launcher can turn the run lock off (a store
    without conditional writes) without a code change; unset or empty means on."""
    raw = os.environ.get("DCKPT_LOCK", "")
    value = raw.strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"DCKPT_LOCK={raw!r}: use 0 (no run lock) or 1 (the default)")


def _root_access_from_env() -> RootAccess:
    """``root_access``'s default: ``$DCKPT_ROOT_ACCESS`` (``private`` or ``group``)."""
    raw = os.environ.get("DCKPT_ROOT_ACCESS", "").strip().lower()
    if raw in ("", "private"):
        return "private"
    if raw == "group":
        return "group"
    raise ValueError(
        f"DCKPT_ROOT_ACCESS={raw!r}: use private (the default) or group (a directory the "
        "team's group may write on purpose)"
    )


def _key_file_from_env() -> Path | None:
    """``key_file``'s default: ``$DCKPT_KEY_FILE``, unset or empty meaning no key."""
    raw = os.environ.get("DCKPT_KEY_FILE", "").strip()
    return Path(raw) if raw else None


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Settings of a CheckpointManager: ``CheckpointConfig(root="runs/exp1", keep_last=3)``.

    Only ``root`` is required. Each setting is documented right under its declaration below,
    grouped by theme (where the checkpoints go, integrity, the waits, saving, resuming and its
    guards, retention, the run lock, the memory tier, the value checks), and each theme's
    ``_check_*`` method, right after its fields, refuses a bad value at construction with the
    reason. ``remote``, ``value_checks`` and ``capture_check`` are read by dckpt, never set:
    the first is filled in for an ``s3://`` root, the others are benchmarks' switches
    (``_value_checks``, ``_capture_check``).
    """

    # -- Where the checkpoints go ---------------------------------------------------------------

    root: Path | str
    """The directory that holds the checkpoints of one run (created if missing), or an object
    store URL, ``s3://bucket/prefix`` (``pip install dckpt[s3]``; the endpoint and credentials
    come from the AWS variables, ``AWS_ENDPOINT_URL`` for MinIO or Ceph). Always a ``Path``
    after construction: for a URL, the local mirror (``mirror``), and ``remote`` holds the
    URL."""
    mirror: Path | None = None
    """For an ``s3://`` root, the local directory a save is written into before its upload and
    a resume downloads into (each file verified): it holds the newest step and the save in
    flight. None: ``$DCKPT_CACHE_DIR`` or ``~/.cache/dckpt``, under ``s3/<bucket>/``. Refused
    with a directory root (which is its own copy)."""
    _remote: str | None = None
    """Not a setting: the ``s3://`` URL of a URL root, filled in at construction (read it as
    ``remote``). An init field only so that a copy (``dataclasses.replace``), which passes
    the mirror as ``root``, keeps the URL."""

    def _check_where(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ValueError(f"root must be a directory path or an s3:// URL, got {self.root!r}")
        where = parse_root(self.root)
        if isinstance(where, ObjectURL):
            object.__setattr__(self, "_remote", str(where))
            object.__setattr__(self, "root", Path(self.mirror or default_mirror(where)))
        elif self._remote is not None:  # a copy of a config that was given a URL
            object.__setattr__(self, "_remote", str(parse_url(self._remote)))
        elif self.mirror is not None:
            raise ValueError("mirror is for s3:// roots; a directory root is its own copy")
        object.__setattr__(self, "root", Path(self.root))

    @property
    def remote(self) -> str | None:
        """The ``s3://`` URL of a URL root (whose ``root`` is its local mirror); None for a
        directory root."""
        return self._remote

    @property
    def directory(self) -> Path:
        """The local directory: the root itself, or an s3:// root's mirror."""
        return Path(self.root)

    @property
    def where(self) -> str | Path:
        """The root as a user names it: the directory, or the s3:// URL."""
        return self._remote or Path(self.root)

    # -- Integrity ------------------------------------------------------------------------------

    digest: str = "xxh3_128"
    """The digest of every file: ``xxh3_128`` (fast, the default) or ``sha256``
    (cryptographic)."""

    def _check_integrity(self) -> None:
        if self.digest not in ALGORITHMS:
            raise ValueError(f"digest must be one of {sorted(ALGORITHMS)}, got {self.digest!r}")

    # -- How long a rank waits for the others -------------------------------------------------

    timeout_s: float = 600.0
    """The longest any rank waits for the others in a save or load collective (> 0).

    A wait that fails names the late rank, about two heartbeats (1 s up to 1000 ranks, at
    most 10 s) after ``timeout_s``: *silent* (frozen or gone: its heartbeat stood still) or
    *slow* (alive, its heartbeat moves, but it is not yet where the others wait), with its
    host, what it was doing and for how long.

    A background save that lost a rank this way raises that verdict in the training thread
    at the next ``observe()``, ``save()`` or ``wait()``. A loop stuck first in a collective
    of its own (DDP's all-reduce waiting for the frozen rank) learns it when that collective
    fails: the manager's ``with`` block (or ``close()``) then raises dckpt's verdict, gloo's
    error as its cause. The rule: keep the training group's own timeout
    (``init_process_group(timeout=...)``) above ``timeout_s`` + 10 s, so dckpt's verdict is
    in before the loop's collective gives up; with a shorter one, the exit waits for the
    verdict (within ``timeout_s`` and the heartbeat watch) before raising it."""
    save_timeout_s: float | None = None
    """The longest one save may take from ``save()`` to its commit before the watchdog
    declares it stuck (a hung write, a dead rank): it logs which rank and phase, and the next
    ``save()`` raises. At least ``timeout_s``. None: ``4 * timeout_s + 30``."""

    def _check_waits(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(
                f"timeout_s must be > 0, got {self.timeout_s}: a wait without a bound turns a "
                "dead rank into a hang"
            )
        if self.save_timeout_s is not None and not self.save_timeout_s >= self.timeout_s:
            raise ValueError(
                f"save_timeout_s ({self.save_timeout_s}) must be >= timeout_s ({self.timeout_s})"
                ": a save waits for the others at least once"
            )

    @property
    def watchdog_s(self) -> float:
        """Seconds after which a save in flight counts as stuck."""
        return self.save_timeout_s or 4 * self.timeout_s + 30

    # -- Saving ---------------------------------------------------------------------------------

    io_threads: int = 1
    """Writer threads per rank (DCP's ``thread_count``), 1 to 64; one file per thread."""
    direct_io: bool = True
    """Write shard files with ``O_DIRECT`` where the file system allows it (buffered where it
    refuses it): no page-cache copy, a fraction of the CPU a buffered write takes from the
    training steps. The price: a load right after a save on the same node reads from the
    disk, not from the page cache."""
    incremental: bool = True
    """Write the model parameters that do not require grad (a frozen backbone) to a file of
    their own per rank, and let a save whose frozen items all hash the same as an earlier
    save's (``incremental_copies``) link that file instead of writing it again (a hard link:
    every step stays a complete directory, retention and ``gc`` work as before, and every
    byte is still verified; on an s3:// root, a copy inside the bucket, from rank 0's node:
    other nodes upload theirs). A model with no frozen parameter writes the same files as
    without it (its manifest lists the trainable names). See docs/ARCHITECTURE.md,
    "Incremental saves"."""
    incremental_copies: int = 2
    """With ``incremental``, how many copies of the frozen file the newest steps hold (>= 1):
    a save links the file of the save ``incremental_copies`` saves before it, never a newer
    one. 2 (the default): two consecutive steps never share a copy, so one bad sector in it
    fails every other step and the resume falls back to the step before, as without
    incremental saves (the second save writes the file again; the third on link). 1: every
    save links the last one's (the least bytes; one bad sector fails every step since the copy
    was written). A save only links a file whose step is still kept: with ``keep_last`` below
    this, none is. On an s3:// root a reused file is copied in the bucket, an object of its
    own, so every save reuses the last one's whatever this says."""
    full_every: int = 0
    """With ``incremental``, write the frozen file afresh once a written copy serves this many
    steps (>= 0; 0: only when it changes; 1: never reuse): bounds how many steps one bad
    sector in a copy can fail."""
    async_save: bool | Literal["auto"] = "auto"
    """``True``: write in the background; ``save()`` returns once the state is staged.
    ``False``: ``save()`` returns once the checkpoint is committed. ``"auto"`` (the default):
    whichever costs the training loop less, measured: the first saves run in the background
    (their cost read from step times, dckpt.save.step_clock), one save is made synchronously
    (its stall), the cheaper way is kept, and the comparison runs again when the kept way's
    cost drifts by more than 1.5x (dckpt.save.mode); each decision is logged on rank 0 with
    both figures."""
    overlap_staging: bool = False
    """Let ``save()`` return before the parameters and optimizer state that go to host memory
    are copied; the copy completes before the next ``optimizer.step()`` (a step pre-hook waits
    for it). Needs a background save (``async_save`` True or ``"auto"``). Off by default: it
    rests on a promise that those tensors change only inside ``optimizer.step()`` until then
    (version counters catch in-place changes through the tensors, not through ``.data``).
    Off, every copy is taken (CPU) or queued on the training stream (CUDA) inside ``save()``:
    a consistent snapshot by construction."""
    device_staging_bytes: int | None = None
    """GPU memory for staging buffers: CUDA tensors are copied into them device-to-device
    inside ``save()`` and drained to pinned host memory in the background; what does not fit
    is copied device-to-host on the training stream. None (the default): 1/8 of the GPU's
    memory. 0: off."""
    if_busy: IfBusy = "wait"
    """What ``save()`` does while the previous save is still writing: ``wait`` for it, or
    ``skip`` this one (all ranks decide together; logged either way)."""

    def _check_saving(self) -> None:
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in [1, 64], got {self.io_threads}")
        if self.incremental_copies < 1:
            raise ValueError(f"incremental_copies must be >= 1, got {self.incremental_copies}")
        if self.full_every < 0:
            raise ValueError(
                f"full_every must be >= 0 (0: a frozen file is written again only when it "
                f"changes), got {self.full_every}"
            )
        if self.async_save not in (True, False, "auto"):
            raise ValueError(f"async_save must be True, False or 'auto', got {self.async_save!r}")
        if self.overlap_staging and self.async_save is False:
            raise ValueError(
                "overlap_staging=True needs a background save (async_save True or 'auto'): a "
                "synchronous save has nothing to overlap the copy with"
            )
        if self.device_staging_bytes is not None and self.device_staging_bytes < 0:
            raise ValueError(
                f"device_staging_bytes must be >= 0 (0 turns device staging off), got "
                f"{self.device_staging_bytes}"
            )
        if self.if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', got {self.if_busy!r}")

    # -- Resuming and its guards ----------------------------------------------------------------

    read_threads: int = 4
    """Reads in flight per file at a load (8 MiB each), 1 to 64: a disk's bandwidth needs a
    deep queue. A load's memory beyond the state it fills is these buffers, 64 MiB of small
    items held until their file is proven, and a large item that cannot be read straight into
    its tensor (a resharded load, a GPU tensor)."""
    fallback: bool = True
    """On resume, quarantine a checkpoint that fails verification and try the next older one
    (``False``: raise instead)."""
    warmup: bool = True
    """Run the warmup all-reduce on the training group at the end of a resume."""
    loss_watch: LossWatchAction = "warn"
    """After a resume, compare the first ``loss_watch_steps`` losses given to ``observe()``
    with the loss recorded at save time; a loss above the bound is ``warn``-ed about,
    ``raise``-s ``LossDeviationError``, or is not looked at (``off``). With ``raise`` the
    ranks agree on the verdict (every rank raises, or none: dckpt.load.watch), so
    ``observe()`` is a collective at the 1st, 2nd, 4th ... call after a resume: call it on
    every rank at every step (``warn`` never waits for another rank)."""
    loss_watch_steps: int = 5
    """How many losses after a resume ``loss_watch`` compares (>= 1)."""
    replay_check: ReplayCheckMode = "auto"
    """After a resume from step N, compare the losses of the steps the resumed run replays
    (N+1, ... as far as the run that stopped got) with that run's, kept by rank 0 in
    ``ROOT/.dckpt-replay/`` (dckpt.load.replay): ``exact`` (bits), ``close`` (relative
    ``replay_rtol``: GPU kernels that are not deterministic), ``auto`` (the default: exact
    when every parameter is on the CPU or ``torch.use_deterministic_algorithms`` is on, else
    close) or ``off`` (no journal). A difference is logged, naming the step; with
    ``loss_watch="raise"`` it raises ``LossDeviationError``."""
    replay_rtol: float = 1e-3
    """The relative difference ``replay_check="close"`` passes, in [0, 1)."""

    def _check_resuming(self) -> None:
        if not 1 <= self.read_threads <= 64:
            raise ValueError(f"read_threads must be in [1, 64], got {self.read_threads}")
        if self.loss_watch not in ("warn", "raise", "off"):
            raise ValueError(f"loss_watch must be warn, raise or off, got {self.loss_watch!r}")
        if self.loss_watch_steps < 1:
            raise ValueError(f"loss_watch_steps must be >= 1, got {self.loss_watch_steps}")
        if self.replay_check not in ("auto", "exact", "close", "off"):
            raise ValueError(
                f"replay_check must be auto, exact, close or off, got {self.replay_check!r}"
            )
        if not 0 <= self.replay_rtol < 1:
            raise ValueError(f"replay_rtol must be in [0, 1), got {self.replay_rtol}")

    # -- Retention ------------------------------------------------------------------------------

    keep_last: int | None = None
    """Keep the N newest committed checkpoints (at least 2: the newest may turn out damaged,
    and the one before it is what a resume falls back to); None keeps all."""
    milestone_every: int | None = None
    """Every checkpoint whose step is a multiple of this (>= 1) is a milestone, kept forever
    (as is any ``save(..., milestone=True)``)."""
    best_k: int = 0
    """Also keep the k best checkpoints (>= 0) by the metric given to ``save(metric=...)``;
    needs ``keep_last`` (without it everything is kept)."""
    best_mode: BestMode = "min"
    """Which metric is best for ``best_k``: the lowest (``min``) or the highest (``max``)."""

    def _check_retention(self) -> None:
        self.retention  # noqa: B018 - builds the policy, which checks keep_last, best_k, best_mode
        if self.milestone_every is not None and self.milestone_every < 1:
            raise ValueError(f"milestone_every must be >= 1, got {self.milestone_every}")
        if self.best_k and self.keep_last is None:
            raise ValueError("best_k needs keep_last: with keep_last=None everything is kept")

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(
            keep_last=self.keep_last, best_k=self.best_k, best_mode=self.best_mode
        )

    # -- Who may have written it ----------------------------------------------------------------

    root_access: RootAccess = field(default_factory=_root_access_from_env)
    """Who else may write the root. ``private`` (the default): at every start the root and
    its parents up to one the job's user owns (or a root-owned one nobody else can write) are
    proven the job's: owned by its user or root, writable by nobody else (a root-owned sticky
    directory such as ``/tmp`` only as a parent), no link; a start refuses otherwise
    (dckpt.owned.prove_root). ``group``: a directory a team shares on purpose may also be
    writable by its group (never by others); said once in the resume's report. Either way a
    step whose directory or files another user owns is never resumed unless the job's key
    signs it (``key_file``). Default: ``$DCKPT_ROOT_ACCESS`` or ``private``."""
    key_file: Path | None = field(default_factory=_key_file_from_env)
    """A file only the job's user can read (owned by it, mode 0600 or 0400, not a link)
    holding the key of this run's manifests: each save seals its manifest with an HMAC-SHA256
    of the manifest's digest under it, and a resume takes only steps it signs (a step
    unsigned or signed with another key is foreign: named, never quarantined or deleted).
    Needs ``digest="sha256"`` (a signed xxh3 digest could be matched by crafted bytes).
    Default: ``$DCKPT_KEY_FILE`` or None (no key)."""

    def _check_access(self) -> None:
        if self.root_access not in ("private", "group"):
            raise ValueError(f"root_access must be 'private' or 'group', got {self.root_access!r}")
        if self.key_file is not None:
            object.__setattr__(self, "key_file", Path(self.key_file))
            if self.digest != "sha256":
                raise ValueError(
                    "key_file signs each manifest's file digests, which are only as strong as "
                    f"the digest: {self.digest!r} can be matched by crafted bytes; pass "
                    "digest='sha256' with a key"
                )

    # -- The run lock ---------------------------------------------------------------------------

    lock: bool = field(default_factory=_lock_from_env)
    """Hold ``ROOT/.dckpt-lock`` so a second job on the same root fails fast. Default: on,
    unless ``$DCKPT_LOCK`` is ``0``, ``false`` or ``no`` (for a store that ignores
    conditional writes, where the lock is refused; then make sure only one job writes the
    root)."""
    lock_lease_s: float = 300.0
    """The run lock's lease, at least 10 s: its owner renews it every ``lock_lease_s / 3``,
    and a job on another host takes the lock over only once the owner has not renewed it for
    a whole lease, timed on the taker's own clock."""

    def _check_lock(self) -> None:
        if self.lock_lease_s < 10:
            raise ValueError(f"lock_lease_s must be >= 10 s, got {self.lock_lease_s}")

    # -- The memory tier ------------------------------------------------------------------------

    memory: bool = False
    """Turn on the memory tier: ``save(step, tier="memory")`` keeps the checkpoint in host
    memory (``memory_dir``) and, sent over dckpt's own process group, on a partner node; its
    manifest goes into the root (``ROOT/memory/``), the record a resume trusts; ``resume()``
    takes the newest step of either tier (see dckpt.save.memory and dckpt.load.memory)."""
    memory_dir: Path | None = None
    """A directory on a memory file system that holds ``node-<n>/`` for each node (made 0700,
    its files 0600). None: ``$DCKPT_MEMORY_DIR`` or ``/dev/shm/dckpt-<uid>``, under a name
    derived from the root, so two runs never share it."""
    memory_keep: int = 1
    """Memory checkpoints each node keeps of its own ranks and of its partner's (>= 1; the
    footprint is ``memory_keep + 1`` copies of each, reserved by the first memory save)."""

    def _check_memory(self) -> None:
        if self.memory_keep < 1:
            raise ValueError(f"memory_keep must be >= 1, got {self.memory_keep}")
        if self.memory_dir is not None:
            object.__setattr__(self, "memory_dir", Path(self.memory_dir))

    @property
    def memory_base(self) -> Path:
        """The directory from which every directory of the memory tier is the job's own
        (made 0700, or proven owned by its user: dckpt.owned.private_tree): ``memory_dir``
        when given, else ``$DCKPT_MEMORY_DIR`` or ``/dev/shm/dckpt-<uid>``."""
        if self.memory_dir is not None:
            return Path(self.memory_dir)
        return Path(os.environ.get("DCKPT_MEMORY_DIR") or f"/dev/shm/dckpt-{os.geteuid()}")

    @property
    def memory_root(self) -> Path:
        """Where this run's memory tier lives (``node-<n>/`` under it, one per node)."""
        if self.memory_dir is not None:
            return Path(self.memory_dir)
        key = xxhash.xxh64_hexdigest((self._remote or str(Path(self.root).resolve())).encode())
        return self.memory_base / f"{Path(self._remote or self.root).name or 'root'}-{key[:12]}"

    # -- The value checks of every save ---------------------------------------------------------

    replica_check: ReplicaCheck = "error"
    """DCP keeps one copy of a value that several ranks hold under one name (a plain tensor
    under DDP, a non-tensor value); every holder hashes its own copy and rank 0 compares the
    digests before it commits. ``error`` (the default): copies that differ fail the save on
    every rank, naming the value and which ranks hold which digest; ``warn``: commit, log it
    loudly and mark the step; ``off``: no digests."""
    allow_nonfinite: bool = False
    """Every floating-point tensor written is checked for NaN and Inf (on its GPU where it
    lives there). False (the default): such a save fails, naming the tensors, so a diverged
    step never becomes the newest; True: it is saved, marked, and retention keeps the newest
    finite step beside it."""
    replica_sample: float = 1.0
    """The share of replicated tensors compared per save, in (0, 1] (1.0: all). Below 1, each
    tensor is compared in one save of every ``round(1 / replica_sample)``, the same save on
    every rank, so all are compared over that many saves; it cuts the hashing a save adds
    (every holder hashes its copy) by that factor."""
    _value_checks: bool = field(default=True, repr=False)
    """Not a setting: the switch that measures what the two checks above cost. False turns
    both off (no replica digests, no NaN scan), so a run saves whatever its values are;
    ``bench/true_cost.py`` runs the trainer so (``launch/train.py --no-value-checks``) and
    compares, as ``bench/memory.py --no-value-checks`` does. Read it as ``value_checks``."""
    _capture_check: bool = field(default=True, repr=False)
    """Not a setting: the switch that measures what the capture check costs (every tensor
    written is digested at ``save()`` and compared with the bytes written for it; a mismatch
    fails the save, dckpt.save.capture). False turns it off; ``bench/true_cost.py`` runs the
    trainer so (``launch/train.py --no-capture-check``). Read it as ``capture_check``."""

    def _check_values(self) -> None:
        if self.replica_check not in ("error", "warn", "off"):
            raise ValueError(
                f"replica_check must be 'error', 'warn' or 'off', got {self.replica_check!r}"
            )
        if not 0 < self.replica_sample <= 1:
            raise ValueError(f"replica_sample must be in (0, 1], got {self.replica_sample}")

    @property
    def value_checks(self) -> bool:
        """Whether saves run the value checks at all (``_value_checks``: True but in the
        benchmarks that measure their cost)."""
        return self._value_checks

    @property
    def capture_check(self) -> bool:
        """Whether saves compare what they captured with what they wrote (``_capture_check``:
        True but in the benchmark that measures its cost)."""
        return self._capture_check

    @property
    def replica_every(self) -> int:
        """Saves over which every replicated tensor is compared once (``replica_sample``)."""
        return max(1, round(1 / self.replica_sample))

    def __post_init__(self) -> None:
        self._check_where()  # first: it makes root a Path
        self._check_integrity()
        self._check_waits()
        self._check_saving()
        self._check_resuming()
        self._check_retention()
        self._check_lock()
        self._check_access()
        self._check_memory()
        self._check_values()
