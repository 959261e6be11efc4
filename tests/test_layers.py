"""The floor plan as a test: every dckpt module imports only from the layers below it, and the
root layer and the CLI never import torch.

The layers and who may import whom are the table in docs/ARCHITECTURE.md ("Layers"). Imports
are read from the source (``ast``), relative ones resolved, including imports inside functions
and under ``TYPE_CHECKING``: a name used only for types still couples two layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dckpt"

BASE = {
    "dckpt.errors",
    "dckpt.units",
    "dckpt.phases",
    "dckpt.faults",
    "dckpt.robust",
    "dckpt.owned",
    "dckpt.version",
}


def layer_of(module: str, *, importer: bool = False) -> str:
    if module == "dckpt":  # the public names, imported lazily: the top, for every importer
        return "top"
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in (
        "storage",
        "root",
        "tiers",
        "collective",
        "train",
        "save",
        "load",
        "cli",
    ):
        return parts[1]
    if module == "dckpt.config":
        return "config"
    if module in (
        "dckpt.manager",
        "dckpt.preemption",
        "dckpt.resume",
        "dckpt.tier",
        "dckpt.memory_tier",
    ):
        return "top"
    if len(parts) >= 2 and parts[1] == "integrations":
        return "integrations"
    raise AssertionError(f"{module} belongs to no layer: add it to docs/ARCHITECTURE.md and here")


# What each layer may import, besides itself. Single modules are named where a layer may use
# only part of another (config needs the retention policy and the digest names, nothing else).
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "storage": {"base"},
    # verifying_reader (torch) only inside `dckpt verify --deep`, imported when asked: the
    # no-torch test below proves nothing imports it when the root layer is loaded.
    "root": {
        "base",
        "dckpt.storage.digest",
        "dckpt.storage.records",
        "dckpt.storage.sink",
        "dckpt.storage.verified_files",
        "dckpt.storage.verifying_reader",
    },
    # object stores: keys and manifests, no torch (boto3 only when an s3:// root is used)
    "tiers": {
        "base",
        "root",
        "dckpt.storage.digest",
        "dckpt.storage.records",
        "dckpt.storage.sink",
        "dckpt.storage.verified_files",
    },
    "config": {"base", "dckpt.root.retention", "dckpt.storage.digest", "dckpt.tiers.url"},
    # collective moves bytes between ranks and hashes them as they arrive (transfer.py)
    "collective": {"base", "dckpt.storage.digest"},
    "train": {"base"},
    "save": {"base", "storage", "root", "tiers", "config", "collective", "train"},
    "load": {"base", "storage", "root", "tiers", "config", "collective", "train"},
    "top": {"base", "storage", "root", "tiers", "config", "collective", "train", "save", "load"},
    # one module per framework, above the manager: the public API, the train layer, and the
    # step directories' names (Lightning's links point at them)
    "integrations": {"base", "config", "train", "top", "dckpt.root.layout"},
    "cli": {"base", "storage", "root", "tiers", "config", "load", "dckpt.save.step_clock"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def dckpt_imports(path: Path) -> set[str]:
    """Every dckpt module ``path`` imports, by absolute name."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "dckpt")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "dckpt":
                continue
            for alias in node.names:  # `from . import rng` imports the module dckpt.rng
                candidate = f"{target}.{alias.name}"
                sub = PACKAGE.parent / Path(*candidate.split("."))
                is_module = sub.with_suffix(".py").exists() or (sub / "__init__.py").exists()
                found.add(candidate if is_module else target)
    return found


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def allowed(importer: str, imported: str) -> bool:
    mine, theirs = layer_of(importer, importer=True), layer_of(imported)
    if mine == theirs:
        return True
    rules = ALLOWED[mine]
    return theirs in rules or imported in rules


def test_every_module_imports_only_from_the_layers_below_it() -> None:
    breaks = [
        f"{module_name(path)} ({layer_of(module_name(path), importer=True)}) imports {imported} "
        f"({layer_of(imported)})"
        for path in modules()
        for imported in sorted(dckpt_imports(path))
        if not allowed(module_name(path), imported)
    ]
    assert not breaks, "layer rule broken:\n" + "\n".join(breaks)


def test_the_rules_are_not_vacuous() -> None:
    """The reader finds what is there: the manager imports the pipeline, the pipeline the
    commit strategy, and a made-up upward import would be refused."""
    found = dckpt_imports(PACKAGE / "manager.py")
    assert {"dckpt.save.pipeline", "dckpt.load.resumer", "dckpt.tiers.roots"} <= found
    assert "dckpt.root.commit" in dckpt_imports(PACKAGE / "save" / "coordinator.py")
    assert "dckpt.train.rng" in dckpt_imports(PACKAGE / "save" / "pipeline.py")
    assert not allowed("dckpt.root.commit", "dckpt.save.pipeline")
    assert not allowed("dckpt.storage.hashing_writer", "dckpt.collective.progress")
    assert not allowed("dckpt.load.resumer", "dckpt.save.handle")
    assert allowed("dckpt.save.pipeline", "dckpt.root.commit")


# What only the root kinds and ``open_root`` may name: a module outside them that imports one
# of these, or tests a root with isinstance, is branching on which kind of root it holds.
KIND_MODULES = {
    "dckpt.root.directory",
    "dckpt.root.commit",
    "dckpt.root.upkeep",
    "dckpt.root.lock",
    "dckpt.root.layout",
    "dckpt.tiers.object_root",
    "dckpt.tiers.object_commit",
    "dckpt.tiers.object_lock",
    "dckpt.tiers.object_ledger",
    "dckpt.tiers.object_source",
    "dckpt.tiers.s3_store",
    "dckpt.tiers.url",
}
KIND_NAMES = {"DirectoryRoot", "ObjectRoot", "ObjectCommit", "ObjectLock", "RenameCommit",
              "RunLock", "LocalSource", "ObjectSource", "DirectoryLedger", "ObjectLedger",
              "is_url", "parse_url", "parse_root", "S3Store"}  # fmt: skip
# The CLI may still use the directory layout's names and small readers for what it shows.
CLI_MAY = {"dckpt.root.layout"}


def kind_branches(path: Path, may: set[str]) -> list[str]:
    """Where ``path`` imports a root kind's own module or names a kind (see KIND_MODULES)."""
    found = [f"imports {m}" for m in sorted(dckpt_imports(path) & (KIND_MODULES - may))]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in KIND_NAMES:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in ("remote", "_objects"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_manager_and_the_cli_never_ask_which_kind_of_root_they_hold() -> None:
    """One shape for every root: manager.py, the CLI and peek open a root with ``open_root``
    and talk to the ``Root`` protocol; no kind's module, class or URL test appears in them."""
    checked = [PACKAGE / "manager.py", PACKAGE / "tiers" / "peek.py"]
    checked += sorted((PACKAGE / "cli").glob("*.py"))
    branches = {
        module_name(p): b
        for p in checked
        if (b := kind_branches(p, CLI_MAY if p.parent.name == "cli" else set()))
    }
    assert not branches, f"a branch on the root's kind: {branches}"
    # and the check can fail: what the old manager held is caught
    planted = PACKAGE.parent / "build" / "planted_manager.py"
    planted.parent.mkdir(exist_ok=True)
    planted.write_text(
        "from dckpt.tiers.object_root import ObjectRoot\nisinstance(x, ObjectRoot)\n"
    )
    assert len(kind_branches(planted, set())) == 2


# The tiers' own modules: each is one tier's implementation of the seams, and names its tier.
TIER_MODULES = {
    "dckpt.save.durable", "dckpt.save.memory", "dckpt.load.durable", "dckpt.load.memory",
    "dckpt.load.memory_reader", "dckpt.load.memory_refill",
}  # fmt: skip
TIER_NAMES = {"durable", "memory", "memory tier", "root"}
# save/ and load/ talk to the protocols in these (the commit strategy's, the layout's names).
PROTOCOL_MAY = {"dckpt.root.layout", "dckpt.root.commit"}


def _annotations(tree: ast.AST) -> set[int]:
    """The ids of every node inside an annotation or a docstring (a ``Literal`` of the
    public signature, a tier named in words), which name tiers without branching on one."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        parts: list[ast.AST | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            every += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            parts = [a.annotation for a in every] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            parts = [node.annotation]
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            parts.append(body[0])  # a docstring (or a bare expression: no branch either)
        for part in parts:
            if part is not None:
                skipped.update(id(n) for n in ast.walk(part))
    return skipped


def tier_branches(path: Path) -> list[str]:
    """Where ``path`` branches on a tier: a tier's name as a value (``tier == "memory"``),
    an ``s3://`` test, or the config's ``remote`` (see ``kind_branches``)."""
    found = kind_branches(path, PROTOCOL_MAY)
    tree = ast.parse(path.read_text(), str(path))
    skipped = _annotations(tree)
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.Constant):
            continue
        # a URL's scheme as a value (words that mention s3:// roots are not a test of one)
        if node.value in TIER_NAMES or (isinstance(node.value, str) and node.value == "s3://"):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_save_load_and_the_manager_never_ask_which_tier_they_run() -> None:
    """The save protocol, the resume protocol and the manager hold tiers as values
    (dckpt.tier): no tier's name compared, no root kind, no s3:// or ``remote`` test. Only a
    tier's own modules name it, and the manager's public ``save(tier=...)`` signature."""
    checked = [PACKAGE / "manager.py"]
    for folder in ("save", "load"):
        checked += [
            p for p in sorted((PACKAGE / folder).glob("*.py"))
            if module_name(p) not in TIER_MODULES
        ]  # fmt: skip
    branches = {module_name(p): b for p in checked if (b := tier_branches(p))}
    assert not branches, f"a branch on the tier: {branches}"
    # and the check can fail: what the resumer held before tiers were values is caught
    planted = PACKAGE.parent / "build" / "planted_resumer.py"
    planted.parent.mkdir(exist_ok=True)
    planted.write_text(
        '"""A docstring may say memory."""\n'
        'tier = "durable" if x is y else "memory"\n'
        'if where.startswith("s3://"):\n    pass\n'
        "if config.remote is None:\n    pass\n"
    )
    assert len(tier_branches(planted)) == 4, tier_branches(planted)


def test_the_folders_are_the_layers_in_the_architecture_doc() -> None:
    doc = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == [
        "cli", "collective", "integrations", "load", "root", "save", "storage", "tiers", "train",
    ]  # fmt: skip
    for folder in folders:
        assert f"{folder}/" in doc, f"docs/ARCHITECTURE.md does not show {folder}/"
    for path in modules():
        if path.name not in ("__init__.py", "resume.py") and path.parent.name != "cli":
            assert path.name in doc, f"docs/ARCHITECTURE.md does not name {path.name}"


@pytest.mark.parametrize("what", ["root", "tiers", "cli"])
def test_root_and_cli_import_no_torch(what: str) -> None:
    names = [
        module_name(p)
        for p in modules()
        if module_name(p).startswith(f"dckpt.{what}") and p.name != "__main__.py"  # runs main
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert proc.stdout.strip() == "[]", f"importing dckpt.{what} pulled in {proc.stdout[:300]}"
    assert len(names) > 3


EMPTY_BODIES = {"pass", "...", "return None", "return {}", "return []", "return ()"}


def empty_bodies(path: Path) -> list[str]:
    """The methods of ``path``'s concrete classes that do nothing (a body, past its
    docstring, of ``pass``, ``...``, an empty value, or ``raise NotImplementedError``): a
    seam member a tier implements only because another tier needs it."""
    found: list[str] = []
    for cls in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(cls, ast.ClassDef):
            continue
        bases = {getattr(b, "id", getattr(b, "attr", "")) for b in cls.bases}
        if bases & {"Protocol", "ABC"}:
            continue  # a declaration, not an implementation
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("__"):
                continue
            body = fn.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            text = [ast.unparse(b) for b in body]
            if (
                not text
                or (len(text) == 1 and text[0] in EMPTY_BODIES)
                or (len(text) == 1 and "NotImplementedError" in text[0])
            ):
                found.append(f"{cls.name}.{fn.name} (line {fn.lineno})")
    return found


def test_the_tiers_implement_the_seams_without_empty_bodies() -> None:
    """Each root kind and tier implements what it uses: the seams (dckpt.root.protocol,
    .commit, .source; dckpt.save.route; dckpt.load.resumer) are split so that no
    implementation carries a member only another needs; an optional part is a value
    (``uploads``, ``fetcher``, ``survey``: None), never a method that does nothing."""
    checked = [p for folder in ("root", "tiers", "save", "load") for p in modules()
               if p.parent.name == folder]  # fmt: skip
    empty = {module_name(p): e for p in checked if (e := empty_bodies(p))}
    assert not empty, f"empty bodies in tier implementations: {empty}"
    planted = PACKAGE.parent / "build" / "planted_source.py"
    planted.parent.mkdir(exist_ok=True)
    planted.write_text(
        "class LocalSource:\n"
        "    def fetch(self, step):\n        return None\n"
        "    def digest_remote(self, step, name):\n"
        "        '''read in place'''\n        raise NotImplementedError('in place')\n"
        "    def steps(self):\n        return [1]\n"
    )
    assert len(empty_bodies(planted)) == 2, empty_bodies(planted)
