"""A counting shim for ``torch.distributed``, loaded by Python at start-up (``sitecustomize``).

Role: ``bench/scale.py`` and ``tests/test_scale.py`` count what dckpt sends between ranks
without dckpt knowing: put this directory first on ``PYTHONPATH`` and set
``DCKPT_SCALE_COUNT=<directory>``. Nothing happens without that variable (the import costs
nothing then). With it, once ``torch.distributed`` is imported:

- every collective and point-to-point function of ``torch.distributed`` (``all_reduce``,
  ``broadcast``, ``all_gather``, ``gather``, ``scatter``, ``reduce``, ``barrier``, ``send``,
  ``recv``, ``all_to_all``, the ``*_object`` calls, ``new_group``, ...) is wrapped, in the
  package and in ``distributed_c10d``. The outermost call on a thread is one *call*, named by
  its function and its *site*: the first frame outside torch, this file and dckpt's
  ``Comm`` wrappers (``dckpt/collective/comm.py``), i.e. the dckpt ``file:line`` that asked,
  after the DCP functions it went through, if any. Calls made inside it (the tensor
  collectives an ``*_object`` call runs on the pickled bytes) are its *primitives*: each
  one's kind, the group's size and the bytes one rank contributes, from which the bytes it
  sends and receives are counted (the pickled, padded sizes for object calls). Bytes are what
  a call delivers (an all-reduce's result, a broadcast's payload to each other rank, an
  all-gather's N-1 other contributions, a gather's N-1 to its root), not gloo's wire
  pattern, which the model in ``bench/scale.py`` applies. ``async_op`` calls are marked.
- ``init_process_group`` without a ``store`` gets the store its ``init_method`` names
  (``env://``, ``tcp://``, ``file://``), wrapped in ``CountingStore``, a Python
  ``dist.Store`` that forwards to it; the C++ side (gloo's connections, every group's
  store traffic) calls it through torch's Python-store trampoline, so each get, set, wait,
  add, check and compare_set of this rank is counted with its key and value bytes. The
  default group's ``default_pg/`` prefix is kept, so the keys are those of a plain run. (The
  trampoline offers no ``multi_get``; gloo then fetches keys one by one, which is what the
  counts show.)
- ``dckpt.manager.CheckpointManager``'s methods and ``dckpt.save.handle.SaveHandle.result``
  are wrapped after their import, to label each call and each store access with the
  *operation* dckpt was in: ``start`` (``__init__``, ``watch_preemption``), ``step``
  (``preempted``, ``observe``), ``save`` (``save``, ``wait``, ``SaveHandle.result``),
  ``resume`` (``resume``, ``load``), ``close``. The label is process-wide (the save thread's
  collectives happen while the caller waits in ``result``); outside any operation it is
  ``outside`` on the main thread (training: DDP, FSDP2) and ``background`` on others. Each
  call and store access also records which entry into its operation it came in (``occ``:
  1 for the first outermost ``save`` or ``SaveHandle.result`` of the process, 2 for the
  next...), so a first save can be told from a later one.

Invariants: the wrapped functions return what the originals return and raise what they
raise; counting never raises into the caller; the counters are per process (reset in a
forked child) and written as JSON to ``$DCKPT_SCALE_COUNT/rank<R>-<pid>.json`` when the
default group is destroyed, and again at exit. ``DCKPT_SCALE_LABEL`` is copied into the file.
This file hides any other ``sitecustomize`` on the path while it is first there (the
interpreter imports only one); dckpt's venv has none.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

_ENV = "DCKPT_SCALE_COUNT"
_MARK = "_dckpt_scale_wrapped"
_EVENT_CAP = 20000

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "new_group",
)
"""What is wrapped (those this torch has)."""

OPERATIONS: dict[str, str] = {
    "__init__": "start",
    "watch_preemption": "start",
    "preempted": "step",
    "observe": "step",
    "save": "save",
    "wait": "save",
    "resume": "resume",
    "load": "resume",
    "close": "close",
}
"""CheckpointManager method -> the operation its calls are counted under."""


class _State:
    """This process's counters (one lock: the save thread and gloo's threads count too)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.dropped = 0
        self.totals: dict[str, dict[str, int]] = {}
        self.store: dict[str, dict[str, int]] = {}
        self.entries: dict[str, int] = {}
        self.op: str | None = None
        self.occurrence = 0
        self.local = threading.local()


_state = _State()


def _reset_after_fork() -> None:
    global _state  # noqa: PLW0603 (a forked child starts with no counts)
    _state = _State()


def _occurrence() -> int:
    """Which entry into the current operation this is (1, 2, ...; 0 outside any)."""
    return _state.occurrence if _state.op is not None else 0


def _current_op() -> str:
    op = _state.op
    if op is not None:
        return op
    return "outside" if threading.current_thread() is threading.main_thread() else "background"


# --- call sites ----------------------------------------------------------------------------


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


_SKIP: tuple[str, ...] = ()
_DCP = os.sep + os.path.join("distributed", "checkpoint") + os.sep
_WRAPPERS = (os.sep + os.path.join("dckpt", "collective", "comm.py"),)


def _short(filename: str) -> str:
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("dckpt", "bench", "tests", "launch"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1 :])
    return parts[-1]


def _site() -> str:
    """The first frame outside torch, this shim and dckpt's ``Comm`` wrappers (``dckpt/
    collective/comm.py``), after the DCP functions the call went through, if any."""
    frame: types.FrameType | None = sys._getframe(2)
    dcp: list[str] = []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_SKIP) or name.endswith(_WRAPPERS):
            if _DCP in name and not name.endswith("logger.py"):
                step = f"{os.path.basename(name)[:-3]}.{frame.f_code.co_name}"
                if step not in dcp and not frame.f_code.co_name.startswith("<"):
                    dcp.append(step)
            frame = frame.f_back
            continue
        here = f"{_short(name)}:{frame.f_lineno}"
        return f"DCP {' < '.join(dcp[:3])} <- {here}" if dcp else here
    return f"DCP {' < '.join(dcp[:3])}" if dcp else "?"


# --- bytes of one primitive ----------------------------------------------------------------


def _nbytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return int(obj.numel() * obj.element_size())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _group_size_and_rank(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return dist.get_world_size(), dist.get_rank()
    return dist.get_world_size(group), dist.get_rank(group)


def _root(bound: dict[str, Any], key: str, group: Any) -> int:
    """The group rank of ``src``/``dst`` (given as a global rank, or as ``group_src``...)."""
    import torch.distributed as dist

    local = bound.get(f"group_{key}")
    if local is not None:
        return int(local)
    glob = bound.get(key)
    glob = 0 if glob is None else int(glob)
    if group is None or group is dist.GroupMember.WORLD:
        return glob
    return int(dist.get_group_rank(group, glob))


def _traffic(kind: str, bound: dict[str, Any]) -> tuple[int, int, int, int]:
    """(group size, bytes one rank contributes, bytes this rank sends, receives) of a
    tensor-level call, by what the call delivers (not gloo's wire pattern: the model in
    bench/scale.py applies that)."""
    group = bound.get("group")
    n, me = _group_size_and_rank(group)
    if kind in ("all_reduce", "reduce"):
        nb = _nbytes(bound.get("tensor"))
        is_dst = kind == "all_reduce" or me == _root(bound, "dst", group)
        return n, nb, nb, nb if is_dst else 0
    if kind == "broadcast":
        nb = _nbytes(bound.get("tensor"))
        src = me == _root(bound, "src", group)
        return n, nb, nb if src else 0, 0 if src else nb
    if kind == "all_gather":
        nb = _nbytes(bound.get("tensor"))
        return n, nb, nb, max(0, _nbytes(bound.get("tensor_list")) - nb)
    if kind == "all_gather_into_tensor":
        nb = _nbytes(bound.get("input_tensor"))
        return n, nb, nb, max(0, _nbytes(bound.get("output_tensor")) - nb)
    if kind == "gather":
        nb = _nbytes(bound.get("tensor"))
        dst = me == _root(bound, "dst", group)
        return n, nb, 0 if dst else nb, max(0, _nbytes(bound.get("gather_list")) - nb) if dst else 0
    if kind == "scatter":
        nb = _nbytes(bound.get("tensor"))
        src = me == _root(bound, "src", group)
        return (
            n,
            nb,
            max(0, _nbytes(bound.get("scatter_list")) - nb) if src else 0,
            0 if src else nb,
        )
    if kind in ("reduce_scatter", "reduce_scatter_tensor"):
        nb = _nbytes(bound.get("output"))
        return n, nb, _nbytes(bound.get("input_list", bound.get("input"))), nb
    if kind in ("all_to_all", "all_to_all_single"):
        sent = _nbytes(bound.get("input_tensor_list", bound.get("input")))
        got = _nbytes(bound.get("output_tensor_list", bound.get("output")))
        return n, sent // max(n, 1), sent - sent // max(n, 1), got - got // max(n, 1)
    if kind in ("send", "isend"):
        nb = _nbytes(bound.get("tensor"))
        return n, nb, nb, 0
    if kind in ("recv", "irecv"):
        nb = _nbytes(bound.get("tensor"))
        return n, nb, 0, nb
    if kind == "batch_isend_irecv":
        sent = got = 0
        for p2p in bound.get("p2p_op_list") or ():
            nb = _nbytes(getattr(p2p, "tensor", None))
            if "send" in getattr(getattr(p2p, "op", None), "__name__", ""):
                sent += nb
            else:
                got += nb
        return n, sent, sent, got
    return n, 0, 0, 0  # barrier, new_group, object calls (their primitives carry the bytes)


# --- the wrappers --------------------------------------------------------------------------


def _wrap_collective(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    try:
        signature: inspect.Signature | None = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        local = _state.local
        outer: dict[str, Any] | None = getattr(local, "event", None)
        try:
            bound = dict(signature.bind_partial(*args, **kwargs).arguments) if signature else kwargs
            n, contrib, sent, got = _traffic(kind, bound)
        except Exception:  # counting never breaks the call
            bound, n, contrib, sent, got = {}, 0, 0, 0, 0
        if outer is not None:  # inside an object call: one of its primitives
            outer["prims"].append([kind, n, contrib])
            outer["sent"] += sent
            outer["recv"] += got
            return original(*args, **kwargs)
        event: dict[str, Any] = {
            "op": _current_op(),
            "occ": _occurrence(),
            "kind": kind,
            "site": _site(),
            "n": n,
            "sent": sent,
            "recv": got,
            "prims": [] if kind.endswith(("_object", "_object_list")) else [[kind, n, contrib]],
            "async": bool(bound.get("async_op")) or kind in ("isend", "irecv", "batch_isend_irecv"),
        }
        if kind == "new_group":
            ranks = bound.get("ranks")
            event["n"] = len(ranks) if ranks else n
            event["prims"] = [["new_group", event["n"], 0]]
        local.event = event
        try:
            return original(*args, **kwargs)
        finally:
            local.event = None
            _record(event)

    setattr(wrapper, _MARK, True)
    return wrapper


def _record(event: dict[str, Any]) -> None:
    with _state.lock:
        key = f"{event['op']}|{event['kind']}|{event['site']}"
        t = _state.totals.setdefault(key, {"calls": 0, "sent": 0, "recv": 0})
        t["calls"] += 1
        t["sent"] += event["sent"]
        t["recv"] += event["recv"]
        if event["op"] in ("outside", "background"):
            return  # training's own collectives: totals only
        if len(_state.events) < _EVENT_CAP:
            _state.events.append(event)
        else:
            _state.dropped += 1


def _wrap_operation(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _state.lock:
            mine = _state.op is None
            if mine:
                _state.op = op
                _state.entries[op] = _state.entries.get(op, 0) + 1
                _state.occurrence = _state.entries[op]
        try:
            return original(*args, **kwargs)
        finally:
            if mine:
                with _state.lock:
                    _state.op = None

    setattr(wrapper, _MARK, True)
    return wrapper


# --- the store -----------------------------------------------------------------------------


def _store_class() -> type:
    from torch._C._distributed_c10d import Store

    def _b(value: Any) -> int:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return len(value)
        return len(str(value).encode())

    class CountingStore(Store):
        """Forwards every call to ``real`` and counts it under the current operation."""

        def __init__(self, real: Store) -> None:
            super().__init__()
            self.real = real

        def _count(self, method: str, sent: int, got: int) -> None:
            with _state.lock:
                key = f"{_current_op()}|{method}|{_occurrence()}"
                c = _state.store.setdefault(key, {"calls": 0, "sent": 0, "recv": 0})
                c["calls"] += 1
                c["sent"] += sent
                c["recv"] += got

        def set(self, key: str, value: Any) -> None:
            self._count("set", _b(key) + _b(value), 0)
            self.real.set(key, value)

        def get(self, key: str) -> bytes:
            value = self.real.get(key)
            self._count("get", _b(key), _b(value))
            return value

        def add(self, key: str, value: int) -> int:
            self._count("add", _b(key) + 8, 8)
            return self.real.add(key, value)

        def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
            got = self.real.compare_set(key, expected_value, desired_value)
            self._count("compare_set", _b(key) + _b(expected_value) + _b(desired_value), _b(got))
            return got

        def delete_key(self, key: str) -> bool:
            self._count("delete_key", _b(key), 1)
            return self.real.delete_key(key)

        def num_keys(self) -> int:
            self._count("num_keys", 0, 8)
            return self.real.num_keys()

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self.real.set_timeout(timeout)

        def check(self, keys: list[str]) -> bool:
            self._count("check", sum(_b(k) for k in keys), 1)
            return self.real.check(keys)

        def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
            self._count("wait", sum(_b(k) for k in keys), 0)
            if timeout is None:
                self.real.wait(keys)
            else:
                self.real.wait(keys, timeout)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            values = self.real.multi_get(keys)
            self._count("multi_get", sum(_b(k) for k in keys), sum(_b(v) for v in values))
            return values

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            self._count(
                "multi_set", sum(_b(k) + _b(v) for k, v in zip(keys, values, strict=True)), 0
            )
            cast(Any, self.real).multi_set(keys, values)

        def append(self, key: str, value: Any) -> None:
            self._count("append", _b(key) + _b(value), 0)
            cast(Any, self.real).append(key, value)

    return CountingStore


_KEEP: list[Any] = []


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from torch._C._distributed_c10d import PrefixStore
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.rendezvous import rendezvous

        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
        backend = str(bound.get("backend") or "")
        if bound.get("store") is not None or "fake" in backend or "mpi" in backend:
            return original(*args, **kwargs)
        timeout = bound.get("timeout")
        if timeout is None:
            default = getattr(c10d, "_get_default_timeout", None)
            timeout = default(backend) if default else datetime.timedelta(minutes=30)
        init_method = bound.pop("init_method", None) or "env://"
        rank, world = int(bound.pop("rank", -1)), int(bound.pop("world_size", -1))
        real, rank, world = next(rendezvous(init_method, rank, world, timeout=timeout))
        real.set_timeout(timeout)
        counting = _store_class()(real)
        _KEEP.append(counting)  # the C++ side holds it, but its Python half must stay alive
        store = PrefixStore("default_pg", counting)
        bound.update(store=store, rank=rank, world_size=world, timeout=timeout)
        return original(**bound)

    setattr(wrapper, _MARK, True)
    return wrapper


def _wrap_destroy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not args and kwargs.get("group") is None:
            dump()
        return original(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


# --- output --------------------------------------------------------------------------------


def snapshot() -> dict[str, Any]:
    """This process's counters as one JSON-able object."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    with _state.lock:
        return {
            "rank": dist.get_rank() if initialized else int(os.environ.get("RANK", "-1")),
            "world_size": (
                dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "-1"))
            ),
            "pid": os.getpid(),
            "label": os.environ.get("DCKPT_SCALE_LABEL", ""),
            "entries": dict(_state.entries),
            "events": list(_state.events),
            "events_dropped": _state.dropped,
            "totals": {k: dict(v) for k, v in _state.totals.items()},
            "store": {k: dict(v) for k, v in _state.store.items()},
        }


def dump() -> None:
    """Write the counters to ``$DCKPT_SCALE_COUNT/rank<R>-<pid>.json`` (replacing them)."""
    out = os.environ.get(_ENV)
    if not out or "torch.distributed" not in sys.modules:
        return  # a helper process (resource tracker, fork server) that never used torch
    with _state.lock:
        if not (_state.events or _state.store or _state.totals):
            return
    try:
        data = snapshot()
        if data["rank"] < 0:
            return
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"rank{data['rank']}-{data['pid']}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except Exception as exc:  # never break the job's exit
        print(f"dckpt scale shim: could not write counts: {exc!r}", file=sys.stderr)


# --- installation --------------------------------------------------------------------------


def _patch_torch() -> None:
    global _SKIP  # noqa: PLW0603 (set once torch's location is known)
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    _SKIP = (_torch_dir(), os.path.abspath(__file__))
    for name in COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapped = _wrap_collective(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
    for name, wrap in (
        ("init_process_group", _wrap_init),
        ("destroy_process_group", _wrap_destroy),
    ):
        original = getattr(c10d, name)
        if not getattr(original, _MARK, False):
            setattr(c10d, name, wrap(original))
            if getattr(dist, name, None) is original:
                setattr(dist, name, getattr(c10d, name))


def _patch_manager(module: types.ModuleType) -> None:
    cls = getattr(module, "CheckpointManager", None)
    if cls is None:
        return
    for method, op in OPERATIONS.items():
        original = cls.__dict__.get(method)
        if callable(original) and not getattr(original, _MARK, False):
            setattr(cls, method, _wrap_operation(op, original))


def _patch_handle(module: types.ModuleType) -> None:
    cls = getattr(module, "SaveHandle", None)
    original = cls.__dict__.get("result") if cls is not None else None
    if cls is not None and callable(original) and not getattr(original, _MARK, False):
        cls.result = _wrap_operation("save", original)


_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "torch.distributed": lambda _m: _patch_torch(),
    "dckpt.manager": _patch_manager,
    "dckpt.save.handle": _patch_handle,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after one of ``_PATCHES``'s modules has been executed."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None:
            return None
        loader: Any = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def run(module: types.ModuleType) -> None:
            exec_module(module)
            try:
                patch(module)
            except Exception as exc:
                print(f"dckpt scale shim: cannot patch {fullname}: {exc!r}", file=sys.stderr)

        loader.exec_module = run
        return spec


def _install() -> None:
    sys.meta_path.insert(0, _AfterImport())
    for name, patch in _PATCHES.items():  # already imported (a preloaded fork server)
        if name in sys.modules:
            patch(sys.modules[name])
    os.register_at_fork(after_in_child=_reset_after_fork)
    atexit.register(dump)


if os.environ.get(_ENV):
    _install()
