"""The hand-picked mutation probes stay aimed at the code (tests/mutation_probe.py): each
names an exact snippet that must occur once in its file. A refactor that moves the code under
a probe left four of them pointing at nothing, found only when ``make probes`` ran; this test
finds it at ``make test``, without running a probe."""

from __future__ import annotations

import mutation_probe


def test_every_probe_snippet_occurs_once_in_its_file() -> None:
    stale = [
        f"{m.name} ({m.path}: found {count} times)"
        for m in mutation_probe.MUTANTS
        if (count := (mutation_probe.REPO / m.path).read_text().count(m.old)) != 1
    ]
    assert not stale, "probes whose snippet is not in their file once:\n" + "\n".join(stale)
    assert len(mutation_probe.MUTANTS) > 50  # the list was read
