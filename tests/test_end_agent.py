"""A worker cut off from the job's store ends torchrun's agent at its exit
(dckpt/collective/store.py): SIGTERM, and SIGKILL from a watcher when the agent has not gone
``AGENT_GRACE_S`` later (an agent blocked in a rendezvous call on a dead link handles SIGTERM
only when that call gives up). A stand-in agent (its command line names torch.distributed.run)
starts a worker whose store never answers."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    """
    import time
    import dckpt.collective.store as store
    store.AGENT_GRACE_S = 2.0
    class Dead:  # a store on a link that went down: a call never returns
        def check(self, keys):
            time.sleep(3600)
    store._STORE.append(Dead())
    store._end_agent_if_cut_off()
    """
)


def _agent(ignores_sigterm: bool) -> subprocess.Popen[bytes]:
    code = textwrap.dedent(
        f"""
        import signal, subprocess, sys, time
        if {ignores_sigterm}:  # blocked in a call: the handler would run only much later
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", {WORKER!r}]).wait()
        time.sleep(3600)  # the rendezvous keep-alive that never ends on a dead link
        """
    )
    return subprocess.Popen([sys.executable, "-c", code, "torch.distributed.run"])


@pytest.mark.parametrize("ignores_sigterm", [False, True], ids=["stops", "stuck"])
def test_an_agent_on_a_dead_link_is_ended(ignores_sigterm: bool) -> None:
    agent = _agent(ignores_sigterm)
    try:
        code = agent.wait(timeout=120)  # 5 s probe + 2 s grace; the rest only ends a hang
    finally:
        if agent.poll() is None:
            agent.kill()
    assert code == (-signal.SIGKILL if ignores_sigterm else -signal.SIGTERM), code
