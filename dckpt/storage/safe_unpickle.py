"""Load DCP's ``.metadata`` pickle with an allow-list, so a hostile file cannot run code.

DCP stores its metadata as a plain pickle and reads it with an unrestricted unpickler: anyone
who can write a checkpoint directory could otherwise execute code in every rank that loads it.
This unpickler resolves only the classes DCP's metadata is made of; anything else raises
``ManifestError`` before it is constructed.

Across torch versions: DCP's metadata pickle is read by the classes of the torch that reads
it, and a newer torch may pickle them differently (torch 2.15 adds a sixth field, ``strides``,
to ``TensorProperties``, whose ``__setstate__`` in 2.13 unpacks five). Given the versions the
manifest records (``writer``), a failure to read or use the metadata of a checkpoint that
another torch release wrote is ``IncompatibleCheckpointError`` (``incompatible_torch``):
not damage, so never quarantined, and it names both versions and the way out.

``refusal_words`` says in one line why an item's ``torch.load(weights_only=True)`` failed,
without torch's advice to load with ``weights_only=False`` (which would run the pickle).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

import torch

from ..errors import IncompatibleCheckpointError, ManifestError

__all__ = [
    "incompatible_torch",
    "load_dcp_metadata",
    "public_version",
    "refusal_words",
    "step_words",
    "torch_release",
]

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Exact names only: pickle protocol 4 resolves dotted names ("os.system") through a
        # module's own imports, so a prefix or pattern match would let any callable through.
        if name in _ALLOWED.get(module, frozenset()):
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            if name == "Size":
                return torch.Size
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_VALUE_TYPES):
                return value
        raise ManifestError(
            f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never "
            "holds; the file may be hostile. It was not loaded."
        )


def load_dcp_metadata(data: bytes, source: str, writer: Mapping[str, object] | None = None) -> Any:
    """Unpickle DCP metadata bytes with the allow-list; ``source`` names the file in errors.

    ``writer``: the manifest's ``versions``; when they name another torch release than this
    one, a failure is ``IncompatibleCheckpointError`` (see the module docstring)."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except ManifestError as exc:
        failure = ManifestError(f"{source}: {exc}")
        cause: BaseException = exc
    except Exception as exc:  # ValueError, TypeError, AttributeError ... from a __setstate__
        failure = ManifestError(f"cannot parse DCP metadata {source}: {exc}")
        cause = exc
    raise incompatible_torch(writer, source, cause) or failure from cause


_RELEASE = re.compile(r"(\d+)\.(\d+)(?!\d)")


def torch_release(version: object) -> tuple[int, int] | None:
    """(major, minor) of a torch version ("2.15.0", "2.13.0+cpu", "2.16.0.dev20260301",
    "2.15.0a0+git1234"); None when it is not one."""
    match = _RELEASE.match(version) if isinstance(version, str) else None
    return (int(match[1]), int(match[2])) if match else None


_FORMAT_ERRORS = (
    TypeError,
    AttributeError,
    ValueError,
    KeyError,
    IndexError,
    EOFError,
    ImportError,
    pickle.UnpicklingError,
    ManifestError,
)
"""What a reader of another torch's metadata raises when that torch wrote it differently
(a ``__setstate__`` that unpacks other fields, a class or attribute that moved); an out of
memory, a timeout or a state that does not fit is a RuntimeError or a dckpt error, and
stays what it is."""


def public_version(version: object) -> str | None:
    """A torch version without its local build tag ("2.13.0+cpu" → "2.13.0")."""
    return version.split("+", 1)[0] if isinstance(version, str) and version else None


def _format_like(failure: BaseException) -> bool:
    inner = getattr(failure, "failures", None)  # DCP's CheckpointException: rank → (exc, tb)
    if isinstance(inner, dict) and inner:
        return all(isinstance(f[0], _FORMAT_ERRORS) for f in inner.values())
    return isinstance(failure, _FORMAT_ERRORS)


def incompatible_torch(
    writer: Mapping[str, object] | None,
    source: str,
    failure: BaseException,
    *,
    format_errors_only: bool = False,
) -> IncompatibleCheckpointError | None:
    """The refusal to raise for ``failure`` (reading or using the DCP metadata ``source``),
    when the manifest's ``writer`` versions name another torch (its public version: a
    nightly of another date, a patch release; not a ``+cpu``/``+cu130`` build tag) than the
    one running; None when they name this one, or none at all (then ``failure`` stands: with
    the same torch, metadata that fails is crafted or broken, not incompatible).
    ``format_errors_only``: only a failure of the kinds another format raises counts (DCP's
    planning and load, where an out of memory or a timeout is no format's fault)."""
    if not writer or (format_errors_only and not _format_like(failure)):
        return None
    theirs, ours = writer.get("torch"), str(torch.__version__)
    if public_version(theirs) is None or public_version(theirs) == public_version(ours):
        return None
    wrote, runs = torch_release(theirs), torch_release(ours)
    if wrote is None or runs is None:
        return None
    detail = f"{type(failure).__name__}: {failure}"
    dckpt = writer.get("dckpt")
    by = f"torch {theirs}" + (f" (dckpt {dckpt})" if isinstance(dckpt, str) else "")
    step = step_words(PurePath(source).parent, "it")
    if wrote > runs:
        way_out = (
            "A newer torch's DCP metadata is not always readable by an older one. Install "
            f"torch {wrote[0]}.{wrote[1]} or newer to resume from {step}, or load an older "
            "step this torch wrote, explicitly (manager.load(step=N); `dckpt inspect ROOT "
            "--step N` shows the versions that wrote a step)"
        )
    elif wrote == runs:  # two builds of one release (nightlies, a source build)
        way_out = (
            f"Load {step} with torch {theirs}, the build that wrote it, or load another step "
            "explicitly (manager.load(step=N))"
        )
    else:
        way_out = (
            f"This torch cannot read what the older torch {theirs} wrote (a break in DCP's "
            f"format, worth reporting to PyTorch). Load {step} with torch "
            f"{wrote[0]}.{wrote[1]}, or load another step explicitly (manager.load(step=N))"
        )
    return IncompatibleCheckpointError(
        f"{source} was written by {by}; this torch, {ours}, cannot read it ({detail}). "
        f"{way_out}. This is not damage (the file's bytes are the ones committed): nothing "
        "was loaded from it and nothing was quarantined."
    )


def step_words(step_dir: str | PurePath, otherwise: str) -> str:
    """ "step N" for a step directory (``step-0000000N``); ``otherwise`` for any other."""
    named = re.fullmatch(r"step-0*(\d+)", PurePath(step_dir).name)
    return f"step {named[1]}" if named else otherwise


def refusal_words(exc: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line: a refusal names what it
    refused, without torch's advice to load with ``weights_only=False`` (which would run the
    pickle: never, for a checkpoint); any other failure is its kind and first line."""
    text = str(exc).strip()
    if isinstance(exc, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        lines = [line.strip() for line in text.splitlines()]
        said = [line for line in lines if line.startswith("WeightsUnpickler error:")]
        said += [line for line in lines if "GLOBAL" in line]
        what = said[0].removeprefix("WeightsUnpickler error:").strip() if said else ""
        what = what.split(" Please use ", 1)[0].rstrip(". ")
        return "torch.load(weights_only=True) refused it" + (f" ({what})" if what else "")
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__
