"""Mutants drawn by a script, not by hand: every comparison, boolean guard, ``and``/``or`` and
``range`` bound in the modules a verified save and resume rest on.

``tests/mutation_probe.py --drawn`` runs them (``make mutants``); this module only draws. A
mutant is one edit of one file's text at the exact place the AST names, so it is the bug a
real change makes there:

- a comparison's operator negated (``<`` to ``>=``, ``==`` to ``!=``, ``in`` to ``not in``,
  ``is`` to ``is not``) or moved by one (``<`` to ``<=``, ``>`` to ``>=``, both ways);
- a guard inverted: the test of an ``if``, ``while``, conditional expression or comprehension
  filter becomes ``not (...)`` (a test that is one comparison is negated above instead, and an
  ``assert`` only narrows types here);
- ``and`` to ``or`` and back;
- a ``range`` bound off by one: the stop less one, a start more one.

Nothing inside an f-string, a ``TYPE_CHECKING`` block or a ``__main__`` guard is drawn: text
and typing cannot change behaviour a test should see. Each mutant has a key that survives
edits elsewhere in the file (path, enclosing function, the stripped source line, the kind and
its index on that line), so ``tests/mutants_equivalent.txt`` can name the ones that cannot
change behaviour. The order is a hash of the key: a time budget runs the same mutants each
time, and a file's new code joins at a stable place.

Invariant: every drawn text compiles, and differs from the original at exactly one place.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The modules a verified save and resume rest on (issue 28), each with the tests that cover
# it: a map kept by hand because coverage cannot see into the ranks these tests spawn.
# Fastest files first: the run stops at the first failure.
MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "dckpt/load/replay.py": ("tests/test_replay.py", "tests/faults/test_loss_verdict.py"),
    "dckpt/load/watch.py": (
        "tests/test_replay.py",
        "tests/test_restart_loop.py",
        "tests/faults/test_loss_verdict.py",
    ),
    "dckpt/root/replay_journal.py": ("tests/test_replay.py",),
    "dckpt/load/overrides.py": ("tests/test_replay.py",),
    "dckpt/save/coordinator.py": (
        "tests/test_async.py",
        "tests/test_save_root_gaps.py",
        "tests/test_value_checks.py",
        "tests/faults/test_rank_errors.py",
    ),
    "dckpt/save/stager.py": ("tests/test_snapshot.py", "tests/test_async.py"),
    "dckpt/root/commit.py": ("tests/test_commit.py", "tests/faults/test_power_loss.py"),
    "dckpt/root/manifest.py": (
        "tests/test_manifest.py",
        "tests/test_commit.py",
        "tests/faults/test_hostile.py",
        "tests/test_provenance.py",
    ),
    "dckpt/load/resumer.py": (
        "tests/test_provenance.py",
        "tests/test_resume_gaps.py",
        "tests/test_restart_loop.py",
    ),
    "dckpt/root/layout.py": (
        "tests/test_commit.py",
        "tests/test_retention_lock.py",
        "tests/test_cli.py",
        "tests/test_provenance.py",
    ),
    "dckpt/root/retention.py": (
        "tests/test_retention_lock.py",
        "tests/test_save_root_gaps.py",
        "tests/test_value_checks.py",
    ),
    "dckpt/root/upkeep.py": (
        "tests/test_commit.py",
        "tests/test_retention_lock.py",
        "tests/test_provenance.py",
    ),
    "dckpt/root/lock.py": (
        "tests/test_retention_lock.py",
        "tests/test_lock_refusals.py",
        "tests/test_lock_fencing.py",
        "tests/test_save_root_gaps.py",
    ),
    "dckpt/root/verify.py": (
        "tests/test_cli.py",
        "tests/test_save_root_gaps.py",
        "tests/test_cross_version.py",
    ),
    "dckpt/load/checks.py": (
        "tests/test_verified_resume.py",
        "tests/test_resume_gaps.py",
        "tests/test_precision.py",
        "tests/faults/test_corruption.py",
        "tests/test_provenance.py",
    ),
    "dckpt/storage/digest.py": ("tests/test_digest.py", "tests/test_storage.py"),
    "dckpt/storage/direct_file.py": ("tests/test_storage.py",),
    "dckpt/storage/hashing_writer.py": ("tests/test_storage.py", "tests/test_digest.py"),
    "dckpt/storage/records.py": ("tests/test_storage.py", "tests/test_manifest.py"),
    "dckpt/storage/safe_unpickle.py": ("tests/test_storage.py", "tests/test_cross_version.py"),
    "dckpt/storage/sink.py": ("tests/test_storage.py", "tests/test_multiproc_roundtrip.py"),
    "dckpt/storage/verified_files.py": (
        "tests/test_storage.py",
        "tests/test_multiproc_roundtrip.py",
    ),
    "dckpt/storage/verifying_reader.py": (
        "tests/test_storage.py",
        "tests/test_multiproc_roundtrip.py",
        "tests/test_verified_resume.py",
        "tests/faults/test_unloadable_items.py",
    ),
    "dckpt/root/provenance.py": ("tests/test_provenance.py",),
    "dckpt/train/rng.py": ("tests/test_resume_gaps.py", "tests/test_verified_resume.py"),
    "dckpt/train/data.py": ("tests/test_resume_api.py",),
    "dckpt/tiers/object_commit.py": ("tests/test_s3.py", "tests/test_s3_gaps.py"),
    "dckpt/tiers/object_ledger.py": ("tests/test_s3.py", "tests/test_s3_gaps.py"),
    "dckpt/tiers/object_lock.py": (
        "tests/test_s3_gaps.py",
        "tests/test_s3.py",
        "tests/test_lock_refusals.py",
    ),
    "dckpt/tiers/object_root.py": (
        "tests/tiers/test_root_contract.py",
        "tests/test_s3.py",
        "tests/test_s3_gaps.py",
    ),
    "dckpt/root/directory.py": ("tests/tiers/test_root_contract.py", "tests/test_cli.py"),
    "dckpt/tiers/object_source.py": ("tests/test_s3.py", "tests/test_s3_gaps.py"),
    "dckpt/tiers/s3_store.py": (
        "tests/test_s3_wire.py",
        "tests/test_s3.py",
        "tests/test_s3_gaps.py",
    ),
    "dckpt/owned.py": (
        "tests/test_owned.py",
        "tests/test_provenance.py",
        "tests/faults/test_shared_host.py",
    ),
    "dckpt/collective/sealed.py": (
        "tests/test_sealed.py",
        "tests/test_store_outsider.py",
        "tests/test_comm.py",
    ),
    "dckpt/integrations/lightning.py": ("tests/test_lightning_paths.py",),
}

_NEGATE = {
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Lt: ">=",
    ast.GtE: "<",
    ast.Gt: "<=",
    ast.LtE: ">",
    ast.In: "not in",
    ast.NotIn: "in",
    ast.Is: "is not",
    ast.IsNot: "is",
}
_BOUNDARY = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
# How each operator is spelled between its operands; `<` must not match the `<` of `<=`.
_SPELLED = {
    ast.Eq: r"==",
    ast.NotEq: r"!=",
    ast.Lt: r"<(?!=)",
    ast.LtE: r"<=",
    ast.Gt: r">(?!=)",
    ast.GtE: r">=",
    ast.In: r"(?<!not )\bin\b",
    ast.NotIn: r"\bnot\s+in\b",
    ast.Is: r"\bis\b(?!\s+not\b)",
    ast.IsNot: r"\bis\s+not\b",
}


@dataclass(frozen=True)
class Drawn:
    """One drawn mutant: the file's whole mutated text, and how to name it."""

    path: str
    key: str  # stable: path::function | line | kind #k
    line: int
    what: str  # e.g. "`a < b` -> `a <= b`"
    text: str
    order: str  # hash of the key: the order a budget runs them in

    @property
    def module(self) -> str:
        return self.path


class _Offsets:
    """(line, col) of the AST to offsets into the text; columns are UTF-8 byte offsets."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for ln in self.lines:
            self.starts.append(self.starts[-1] + len(ln))

    def at(self, line: int, col: int) -> int:
        raw = self.lines[line - 1].encode()[:col]
        return self.starts[line - 1] + len(raw.decode())


def _skipped_spans(tree: ast.AST) -> list[tuple[int, int]]:
    """Line spans nothing is drawn in: f-strings, TYPE_CHECKING blocks, __main__ guards."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            spans.append((node.lineno, node.end_lineno or node.lineno))
        if isinstance(node, ast.If):
            src = ast.unparse(node.test)
            if "TYPE_CHECKING" in src or "__main__" in src:
                spans.append((node.lineno, node.end_lineno or node.lineno))
    return spans


def _functions(tree: ast.AST) -> list[tuple[int, int, str]]:
    found: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                found.append((child.lineno, child.end_lineno or child.lineno, name))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _is_guard(test: ast.expr) -> bool:
    """A test worth inverting: one comparison's inversion is already drawn as its negation."""
    return not (isinstance(test, ast.Compare) and len(test.ops) == 1)


def _edits(tree: ast.AST, text: str, off: _Offsets) -> Iterator[tuple[ast.AST, str, int, int, str]]:
    """(node, kind, start, end, replacement) for every mutation site, in text order."""

    def span(node: ast.AST) -> tuple[int, int]:
        start = off.at(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = off.at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def operator_between(left: ast.AST, right: ast.AST, pattern: str) -> tuple[int, int] | None:
        _, a = span(left)
        b, _ = span(right)
        m = re.search(pattern, text[a:b])
        return (a + m.start(), a + m.end()) if m else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            op = type(node.ops[0])
            where = operator_between(node.left, node.comparators[0], _SPELLED[op])
            if where is None:
                continue
            yield node, "negate", where[0], where[1], _NEGATE[op]
            if op in _BOUNDARY:
                yield node, "boundary", where[0], where[1], _BOUNDARY[op]
        elif isinstance(node, ast.BoolOp) and len(node.values) >= 2:
            word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            where = operator_between(node.values[0], node.values[1], rf"\b{word}\b")
            if where is not None:
                yield node, f"{word}->{other}", where[0], where[1], other
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)) and _is_guard(node.test):
            a, b = span(node.test)
            yield node.test, "guard", a, b, f"not ({text[a:b]})"
        elif isinstance(node, ast.comprehension):
            for cond in filter(_is_guard, node.ifs):
                a, b = span(cond)
                yield cond, "guard", a, b, f"not ({text[a:b]})"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "range"
            and 1 <= len(node.args) <= 3
            and not node.keywords
        ):
            stop = node.args[0] if len(node.args) == 1 else node.args[1]
            a, b = span(stop)
            yield stop, "range stop-1", a, b, f"({text[a:b]}) - 1"
            if len(node.args) >= 2:
                a, b = span(node.args[0])
                yield node.args[0], "range start+1", a, b, f"({text[a:b]}) + 1"


def draw(repo: Path, path: str) -> list[Drawn]:
    """Every mutant of one module, in the order a budget runs them."""
    text = (repo / path).read_text()
    tree = ast.parse(text)
    off = _Offsets(text)
    skipped = _skipped_spans(tree)
    functions = _functions(tree)
    out: list[Drawn] = []
    seen: dict[str, int] = {}
    for node, kind, a, b, new in _edits(tree, text, off):
        line = node.lineno  # type: ignore[attr-defined]
        if any(lo <= line <= hi for lo, hi in skipped):
            continue
        mutated = text[:a] + new + text[b:]
        try:
            compile(mutated, path, "exec")
        except SyntaxError:
            continue
        inner = [f for f in functions if f[0] <= line <= f[1]]
        where = inner[-1][2] if inner else "<module>"
        src_line = off.lines[line - 1].strip()
        base = f"{path}::{where} | {src_line} | {kind}"
        k = seen.get(base, 0)
        seen[base] = k + 1
        key = f"{base} #{k}"
        old = text[a:b]
        what = f"`{old}` -> `{new}`" if len(old) + len(new) < 120 else f"{kind} at line {line}"
        order = hashlib.sha1(key.encode()).hexdigest()
        out.append(Drawn(path, key, line, what, mutated, order))
    return sorted(out, key=lambda d: d.order)


def equivalent_keys(repo: Path) -> dict[str, str]:
    """The kept list of mutants that cannot change behaviour: key -> why."""
    listed: dict[str, str] = {}
    kept = repo / "tests" / "mutants_equivalent.txt"
    if not kept.exists():
        return listed
    for raw in kept.read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        key, _, why = raw.partition("  ## ")
        listed[key.strip()] = why.strip()
    return listed
