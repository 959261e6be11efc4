"""The ``dckpt`` command: look at, check, inspect and manage checkpoints without Python.

Commands: ``ls``, ``verify``, ``inspect`` (reading.py); ``gc``, ``pin``, ``unpin``,
``set-aside``, ``restore`` (manage.py); ``diff``, ``export`` (tensors.py); ``plan``
(planning.py, with plan_model.py); ``memory clear`` (memory_tier.py). Every command takes a
directory or an s3:// root and reads it through the ``Root`` protocol (``common.cli_root``):
none asks which kind it has; ``diff`` and ``export`` read tensors from local step directories
(``common.step_dirs``: an object store's steps fetched, verified, into a temporary
directory). Exit codes: 0 ok; 2 bad usage, or a root/step that does not exist or is not
dckpt's; 3 an integrity failure; 4 a checkpoint this torch cannot read; 5 the storage did not
serve a file (nothing known about its bytes). Importing this package does not import torch.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from ..errors import CheckpointError, IntegrityError, ManifestError, StorageError
from ..version import __version__
from .common import EXIT_INTEGRITY, EXIT_STORAGE, EXIT_USAGE, CliError, err, fail

__all__ = ["main"]


_KEY_HELP = (
    "the run's key file (CheckpointConfig.key_file): say which steps it signs (a keyed run "
    "resumes only those)"
)


def _parser() -> argparse.ArgumentParser:
    from .manage import cmd_gc, cmd_pin, cmd_restore, cmd_set_aside, cmd_unpin
    from .memory_tier import cmd_memory_clear
    from .planning import cmd_plan
    from .reading import cmd_inspect, cmd_ls, cmd_verify
    from .tensors import cmd_diff, cmd_export

    parser = argparse.ArgumentParser(
        prog="dckpt", description="Inspect, verify and manage dckpt checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"dckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", help="list the checkpoints under a root, and its memory tier")
    p.add_argument("root")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--memory-dir", default=None, help="the memory tier's directory (default: the job's)"
    )
    p.add_argument("--key-file", default=None, help=_KEY_HELP)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "verify",
        help="re-hash every file against its manifest; default: every committed step",
        # Written by hand (argparse puts ROOT last): a new option must be added here too.
        usage="dckpt verify ROOT [--step N | --all] [--deep] [--key-file F] [--threads N] [--json]",
        description="Re-hash every file of committed checkpoints against their manifests.\n"
        "ROOT [--step N | --all]; default: every committed step under ROOT.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, metavar="N", help="only step N")
    which.add_argument("--all", action="store_true", help="every committed step (the default)")
    p.add_argument("--threads", type=int, default=4, metavar="N", help="files hashed in parallel")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also read DCP's metadata as a load would (allow-listed unpickling, every "
        "tensor's spans inside the listed files): catches a checkpoint rewritten and "
        "re-sealed on purpose, which hashes right",
    )
    p.add_argument(
        "--key-file",
        default=None,
        help=_KEY_HELP + "; a step it does not sign fails verify (exit 6)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="show a checkpoint's manifest")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="this step (default: the newest committed)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("gc", help="apply the retention policy by hand")
    p.add_argument("root")
    p.add_argument("--keep-last", type=int, required=True, help="keep the N newest (>= 2)")
    p.add_argument("--best-k", type=int, default=0, help="also keep the k best by metric")
    p.add_argument("--mode", choices=["min", "max"], default="min", help="what 'best' means")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.add_argument("--force", action="store_true", help="even while a job holds the lock")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("diff", help="config and per-tensor differences of two steps")
    p.add_argument("root")
    p.add_argument("a", type=int, help="step A")
    p.add_argument("b", type=int, help="step B")
    p.add_argument(
        "--top",
        type=int,
        default=20,
        metavar="N",
        help="rows to show: model weights, then optimizer state, then counters and scalars, "
        "largest differences first in each",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output (all rows)")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("plan", help="save interval, loss per failure, RTO, storage, memory")
    p.add_argument("root", nargs="?", help="take size and timings from this root's manifest")
    p.add_argument(
        "--memory-dir", default=None, help="the memory tier's directory (default: the job's)"
    )
    p.add_argument("--step", type=int, help="that step (default: the newest)")
    p.add_argument("--bytes", type=int, help="checkpoint size in bytes")
    p.add_argument("--write-gbps", type=float, help="write bandwidth, GB/s")
    p.add_argument("--read-gbps", type=float, help="read bandwidth, GB/s (default: write)")
    p.add_argument("--stall-s", type=float, help="what one save costs the training loop")
    p.add_argument("--restart-s", type=float, default=60.0, help="scheduler + startup time")
    p.add_argument("--mtbf-hours", type=float, default=5000.0, help="MTBF of one node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--milestones", type=int, default=0, help="milestones kept forever")
    p.add_argument("--host-mem-gb", type=float, help="host memory per node (default: this one)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("export", help="the model alone, in one safetensors or torch file")
    p.add_argument("root")
    p.add_argument("--step", type=int, help="this step (default: the newest committed)")
    p.add_argument("--out", required=True, help="FILE.safetensors, or any other name for torch")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--trainable",
        action="store_true",
        help="only the parameters that required grad when the step was saved (an adapter, "
        "a fine-tuned head), by name; needs a step saved with incremental on (the default)",
    )
    p.add_argument(
        "--with-config",
        action="store_true",
        help="also store the run config and the step, to build the model from: in a "
        ".safetensors file as metadata (dckpt_config: the config as JSON, dckpt_step); a "
        'torch file then holds {"model": {name: tensor}, "config": dict, "step": int} '
        "instead of the bare {name: tensor} dict",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("memory", help="the memory tier of a root on this host")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    v = verbs.add_parser(
        "clear",
        help="free this host's memory tier of a root (the job ends well: freed by itself)",
    )
    v.add_argument("root")
    v.add_argument("--memory-dir", default=None, help="the memory tier's directory")
    v.add_argument(
        "--records",
        action="store_true",
        help="also remove the root's records of memory steps (ROOT/memory/), so no resume "
        "looks for them again",
    )
    v.add_argument("--force", action="store_true", help="even while a job holds the lock")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=cmd_memory_clear)

    p = sub.add_parser(
        "set-aside",
        help="move a committed step to quarantine/ by hand: no resume picks it",
    )
    p.add_argument("root")
    p.add_argument("step", type=int)
    p.add_argument("--reason", default="", metavar="TEXT", help="why, kept in its reason file")
    p.add_argument("--force", action="store_true", help="even while a job holds the lock")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_set_aside)

    p = sub.add_parser("restore", help="put a quarantined step back as committed, once it verifies")
    p.add_argument("root")
    p.add_argument("step", type=int)
    p.add_argument(
        "--name",
        metavar="quarantine/step-N-HEX",
        help="which quarantined copy (dckpt ls lists them), when the step is there twice",
    )
    p.add_argument("--force", action="store_true", help="even while a job holds the lock")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_restore)

    for name, func, what in (
        ("pin", cmd_pin, "keep a step through retention"),
        ("unpin", cmd_unpin, "let retention judge a step again"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("root")
        p.add_argument("step", type=int)
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)  # exits 2 on bad usage
    if argv is None:  # the dckpt command's own process, not a library call: its filters
        # DCP warns at every single-process load that it assumes one process: it does here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    try:
        try:
            code: int = args.func(args)
        except (IntegrityError, ManifestError) as exc:  # a damaged or hostile manifest
            fail(EXIT_INTEGRITY, str(exc))
        except StorageError as exc:  # the storage failed to serve a file: no word on bytes
            fail(EXIT_STORAGE, str(exc))
        except CheckpointError as exc:  # a missing bucket, refused credentials, no network
            fail(EXIT_USAGE, str(exc))
    except CliError as exc:
        err.print(f"dckpt {args.command}: {exc}")
        return exc.code
    except BrokenPipeError:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
