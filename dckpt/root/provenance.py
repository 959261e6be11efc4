"""Whether a committed step is the job's own: its owner, and the job's key when it has one.

A digest proves that a step's bytes were not changed after its manifest sealed them; it does
not prove who sealed them. Another user who can put a directory into the root (a root she
made first, a group-writable project directory) can copy in a step of her own, re-sealed,
and every digest of it matches. So a resume claims a step only on one of two proofs:

- **The owner.** The step's directory, its manifest and every file a rank reads belong to
  the job's user (``os.geteuid()``): on a root proven private at the start
  (dckpt.owned.prove_root) nobody else can have put them there.
- **The key** (``CheckpointConfig.key_file``), opt-in: every manifest the job seals carries
  an HMAC-SHA256 under a key only the job's user can read, over the same canonical bytes the
  manifest's self-digest covers (every field, the file digests included). A keyed job claims
  only steps its key signs, whoever owns the files; an unsigned step, or one signed with
  another key, is foreign. The file digests must then be ``sha256``: a signature over xxh3
  digests could be met by bytes crafted to hash the same.

A step that fails is foreign (``ForeignStepError``): passed over and named in the report,
never quarantined, deleted or retained away, since it is not the job's to move. No torch, no
collective: a rank's verdict is made common by its caller (dckpt.load.checks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, ForeignStepError
from ..owned import NotOwnedError, check_ancestors, owner_name
from .manifest import Manifest, canonical

__all__ = ["ALGORITHM", "FileClaim", "ManifestKey", "Provenance", "foreign", "owner_problem"]

ALGORITHM = "hmac-sha256"
_DOMAIN = b"dckpt manifest signature v1\0"
"""Prefixed to what is signed, so a mac made for anything else never passes for a manifest's."""
_MIN_KEY_BYTES = 16
_MAX_KEY_BYTES = 4096


class ManifestKey:
    """The job's manifest key: ``load`` it from a file only the job's user can read."""

    def __init__(self, secret: bytes, source: str) -> None:
        if len(secret) < _MIN_KEY_BYTES:
            raise CheckpointError(
                f"key file {source}: a key of {len(secret)} bytes is too short; use at least "
                f"{_MIN_KEY_BYTES} random bytes (`openssl rand -hex 32 > {source}`)"
            )
        self._secret = secret
        self.source = source
        self.key_id = hashlib.sha256(b"dckpt key id\0" + secret).hexdigest()[:16]
        """Names the key in a manifest and in messages (a hash: the key stays secret)."""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ManifestKey:
        """The key in ``path``: a regular file (not a link) owned by the job's user, readable
        by nobody else, in a directory nobody else can change. NotOwnedError otherwise (a
        key another user could read or swap signs nothing for this job)."""
        path = Path(os.path.abspath(path))
        fix = f"`chown {owner_name(os.geteuid()).split(' ')[0]} {path}; chmod 600 {path}`"
        try:
            check_ancestors(path.parent)
        except NotOwnedError as exc:
            raise NotOwnedError(
                f"key file {path}: {exc}; keep the key in a directory of your own"
            ) from None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        except OSError as exc:
            raise NotOwnedError(
                f"key file {path} cannot be opened ({os.strerror(exc.errno or 0)}): give a "
                f"regular file, not a link (`openssl rand -hex 32 > {path}; chmod 600 {path}`)"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotOwnedError(f"key file {path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise NotOwnedError(
                    f"key file {path} belongs to {owner_name(st.st_uid)}, not to this job's "
                    f"user {owner_name(os.geteuid())}: its owner could sign steps as this job; "
                    f"make a key of your own"
                )
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise NotOwnedError(
                    f"key file {path} can be read by others (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}): whoever reads it can sign steps as "
                    f"this job; run {fix} (and make a new key if others may have read it)"
                )
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(_MAX_KEY_BYTES + 1)
        finally:
            os.close(fd)
        if len(raw) > _MAX_KEY_BYTES:
            raise CheckpointError(f"key file {path} is over {_MAX_KEY_BYTES} bytes: is it a key?")
        return cls(raw.strip(), str(path))

    def _mac(self, manifest: Manifest) -> str:
        body = dataclasses.replace(manifest, signature={}).to_json_obj()
        del body["self_digest"]  # a digest of the same fields: signed through them
        return hmac.new(self._secret, _DOMAIN + canonical(body), hashlib.sha256).hexdigest()

    def sign(self, manifest: Manifest) -> Manifest:
        """``manifest`` sealed, with its signature (what rank 0 writes at a commit)."""
        sealed = dataclasses.replace(manifest.sealed(), signature={})
        signature = {"algorithm": ALGORITHM, "key": self.key_id, "mac": self._mac(sealed)}
        return dataclasses.replace(sealed, signature=signature)

    def refusal(self, manifest: Manifest) -> str | None:
        """None when this key signs ``manifest``; else why not, in words."""
        sig = manifest.signature
        if not sig:
            return "its manifest is not signed, and this job takes only steps its key signs"
        if sig.get("algorithm") != ALGORITHM or sig.get("key") != self.key_id:
            return (
                f"its manifest is signed with another key ({sig.get('key')!r}, this job's is "
                f"{self.key_id!r})"
            )
        mac = sig.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(manifest)):
            return "its manifest's signature does not match its contents under this job's key"
        return None


def owner_problem(path: Path, st: os.stat_result, uid: int) -> str | None:
    """Why ``path`` (its ``lstat``) is not the job's own, or None."""
    if st.st_uid != uid:
        return (
            f"{path} belongs to {owner_name(st.st_uid)}, not to this job's user {owner_name(uid)}"
        )
    return None


@dataclass(frozen=True)
class Provenance:
    """What a job takes as its own: files of its user, or, with a key, what the key signs."""

    uid: int = dataclasses.field(default_factory=os.geteuid)
    key: ManifestKey | None = None

    def signed(self, manifest: Manifest, where: str) -> None:
        """With a key: ForeignStepError unless it signs ``manifest`` (read from ``where``)."""
        if self.key is not None and (why := self.key.refusal(manifest)) is not None:
            raise ForeignStepError(
                f"step {manifest.step} at {where} is not this job's: {why}; it is left where it is"
            )

    def claim(self, directory: Path, manifest: Manifest) -> int | None:
        """Claim step ``directory`` (its manifest read): the uid its files must have (the
        job's), or None when the key signs it and owners do not matter. ForeignStepError
        when the step is not the job's."""
        step = manifest.step
        if self.key is not None:
            why = self.key.refusal(manifest)
            if why is not None:
                raise ForeignStepError(
                    f"step {step} at {directory} is not this job's: {why}; it is left where "
                    f"it is (`dckpt verify {directory.parent} --key-file {self.key.source}` "
                    "lists the steps the key signs)"
                )
            return None
        for path in (directory, directory / "manifest.json"):
            try:
                st = os.lstat(path)
            except OSError:
                continue  # gone or unreadable: the manifest read already said so
            problem = owner_problem(path, st, self.uid)
            if problem is not None:
                raise foreign(step, problem, directory)
        return self.uid

    def files(self, step: int, directory: Path, uid: int | None) -> FileClaim | None:
        """What ``check_layout`` calls on each file of a step claimed with ``uid`` (None:
        the key signs it, nothing to check)."""
        if uid is None:
            return None

        def owned(path: Path, st: os.stat_result) -> None:
            problem = owner_problem(path, st, uid)
            if problem is not None:
                raise foreign(step, problem, directory)

        return owned


FileClaim = Callable[[Path, os.stat_result], None]


def foreign(step: int, problem: str, directory: Path) -> ForeignStepError:
    """The words for a step with a file another user owns."""
    user = owner_name(os.geteuid()).split(" ")[0]
    return ForeignStepError(
        f"step {step} is not this job's: {problem}; another user may have put it there, so it "
        f"is never resumed (left where it is; if it is yours, `chown -R {user} {directory}`)"
    )
