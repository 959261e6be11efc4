"""`make demo`: train on 2 ranks, crash on purpose, resume verified, and prove nothing was lost.

1. an uninterrupted 2-rank run of launch/train.py to step 12 (the reference);
2. the same run, saving every 4 steps, killed with SIGKILL right after step 10;
3. `dckpt ls` shows what survived: steps 4 and 8, committed;
4. the run is started again: it resumes from the newest committed checkpoint after checking its
   manifest, config and every file's digest, restoring RNG and data position, and a warmup
   all-reduce; the report is printed;
5. `dckpt verify` re-hashes every committed checkpoint;
6. the losses of steps 9-12 of the resumed run are compared with the reference, bit for bit;
7. one bit of a copy of the newest checkpoint is flipped, and `dckpt verify` names the file;
8. a job started on that copy quarantines the damaged checkpoint and resumes from the one before;
9. preemption: a long run gets SIGTERM on rank 1 only; the ranks agree on a step, save it and
   exit 0;
10. the memory tier: saves to host memory every 2 steps (to the root every 6), SIGKILL after
    step 11; the restart resumes from memory, every byte hashed against the manifest the root
    recorded, loss for loss; the run ends with its last step in the root, which frees the
    memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "demo"
STEPS, SAVE_EVERY, CRASH_AT = 12, 4, 10


def say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def torchrun(ckpt: Path, log: Path, *extra: str, save_every: int = SAVE_EVERY) -> int:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "launch" / "train.py"), "--ckpt-dir", str(ckpt), "--steps", str(STEPS),
        "--save-every", str(save_every), "--loss-log", str(log), *extra,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    for line in proc.stdout.splitlines():
        shown = ("dckpt", "train:", "  [", "  rng", "  replay", "  world", "  timings", "  skip")
        if line.startswith(shown):
            print("  " + line)
    return proc.returncode


def preempt_rank1(ckpt: Path, log: Path) -> int:
    """Start a run that would take hours, SIGTERM rank 1 once it trains; torchrun's exit code."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "launch" / "train.py"), "--ckpt-dir", str(ckpt), "--steps", "1000000",
        "--save-every", "1000", "--loss-log", str(log),
    ]  # fmt: skip
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while agent.poll() is None and not (log.exists() and len(log.read_text().splitlines()) > 3):
        time.sleep(0.05)
    for child in psutil.Process(agent.pid).children(recursive=True):
        if child.environ().get("RANK") == "1":
            print(f"  SIGTERM to rank 1 (pid {child.pid}) only")
            os.kill(child.pid, signal.SIGTERM)
    out, _ = agent.communicate(timeout=300)
    for line in out.splitlines():
        if line.startswith(("dckpt: saved", "dckpt: preempted", "train: preempted")):
            print("  " + line)
    return agent.returncode


def dckpt(*args: str) -> int:
    cmd = [sys.executable, "-m", "dckpt.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print("\n".join("  " + line for line in (proc.stdout + proc.stderr).splitlines()))
    return proc.returncode


def losses(log: Path) -> dict[int, float]:
    """Step → loss, the last line of each step winning (a resumed run logs the steps again)."""
    out: dict[int, float] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def main() -> int:
    shutil.rmtree(RUNS, ignore_errors=True)
    RUNS.mkdir(parents=True)
    ref_dir, ref_log = RUNS / "reference", RUNS / "reference.jsonl"
    run_dir, run_log = RUNS / "ckpt", RUNS / "loss.jsonl"

    say(f"1. reference: 2 ranks (gloo, CPU), uninterrupted, {STEPS} steps")
    if torchrun(ref_dir, ref_log) != 0:
        print("reference run failed")
        return 1

    say(f"2. the same run, saving every {SAVE_EVERY} steps, killed (SIGKILL) after step {CRASH_AT}")
    code = torchrun(run_dir, run_log, "--crash-at-step", str(CRASH_AT))
    print(f"  torchrun exited with {code}: the job died, as planned")

    say("3. what survived: dckpt ls")
    dckpt("ls", str(run_dir))
    listing = subprocess.run(
        [sys.executable, "-m", "dckpt.cli", "ls", str(run_dir), "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    committed = [r["step"] for r in json.loads(listing.stdout) if r["status"] == "committed"]
    resume_from = max(committed)
    print(
        f"  newest committed: step {resume_from}. Saves are asynchronous, so a save still "
        "writing when the job died is left as an incomplete tmp dir, never as a checkpoint."
    )

    say("4. start the job again: a verified resume, with its report")
    if torchrun(run_dir, run_log) != 0:
        print("resumed run failed")
        return 1

    say("5. dckpt verify: re-hash every file of every committed checkpoint")
    if dckpt("verify", str(run_dir)) != 0:
        return 1

    say(f"6. resumed run vs reference, steps {resume_from + 1}-{STEPS}")
    ref, got = losses(ref_log), losses(run_log)
    resumed = range(resume_from + 1, STEPS + 1)
    same = all(ref[s] == got[s] for s in resumed)
    for s in resumed:
        mark = "identical" if ref[s] == got[s] else "DIFFERENT"
        print(f"  step {s:3d}: reference {ref[s]:.10f}  resumed {got[s]:.10f}  {mark}")
    if not same:
        print("  the resumed run diverged from the reference")
        return 1

    say("7. bit rot: flip one bit in a copy of the newest checkpoint, then verify it")
    bad = RUNS / "bitrot"
    shutil.copytree(run_dir, bad)
    shard = sorted((bad / f"step-{STEPS:08d}").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code = dckpt("verify", str(bad), "--step", str(STEPS))
    print(f"  dckpt verify exited with {code} (3 = integrity failure) and named the file")

    say("8. start a job on the damaged copy: it quarantines the bad step and falls back")
    if torchrun(bad, RUNS / "bitrot.jsonl") != 0:
        print("the job on the damaged copy failed")
        return 1
    dckpt("ls", str(bad))

    say("9. preemption: SIGTERM to one rank of a long run")
    code_pre = preempt_rank1(RUNS / "preempted", RUNS / "preempted.jsonl")
    print(f"  torchrun exited with {code_pre}: the agreed step is committed; a requeue resumes it")
    dckpt("ls", str(RUNS / "preempted"))

    say("10. the memory tier: to memory every 2 steps, to the root every 6, SIGKILL after step 11")
    mem_dir, mem_log, memory = RUNS / "memory-ckpt", RUNS / "memory.jsonl", RUNS / "memory"
    tier = ("--memory-every", "2", "--memory-dir", str(memory))
    torchrun(mem_dir, mem_log, *tier, "--crash-at-step", "11", save_every=6)
    dckpt("ls", str(mem_dir), "--memory-dir", str(memory))
    print("  the restart: the memory tier holds a newer step than the root; each file is hashed")
    if torchrun(mem_dir, mem_log, *tier, save_every=6) != 0:
        print("the restart from memory failed")
        return 1
    got = losses(mem_log)
    same_memory = all(ref[s] == got[s] for s in range(1, STEPS + 1))
    print(
        f"  losses of steps 1-{STEPS} against the reference: "
        + ("identical" if same_memory else "DIFFERENT")
    )
    left = list(memory.rglob("rank-*.mem*")) if memory.exists() else []
    print(f"  the run ended with its last step in the root: {len(left)} memory files left")

    say("done: crashed, resumed from a verified checkpoint, continued loss for loss")
    print(f"  checkpoints: {run_dir}\n  loss logs: {ref_log}, {run_log}")
    return 0 if code == 3 and code_pre == 0 and same_memory and not left else 1


if __name__ == "__main__":
    sys.exit(main())
