"""Mutation probes: one deliberate bug at a time in a copy of dckpt; the tests that guard it
must fail ("killed"). A mutant that survives is a check no test proves.

    .venv/bin/python tests/mutation_probe.py                 # every mutant, then a table
    .venv/bin/python tests/mutation_probe.py --only warmup   # the mutants whose name has it
    .venv/bin/python tests/mutation_probe.py --list

Not part of ``make test`` (it takes minutes). Each mutant names a file, an exact snippet that
must occur there once, its replacement, and the tests to run. The copy holds ``dckpt/``,
``tests/``, ``launch/``, ``bench/`` and ``pyproject.toml``; the tests run inside it with
``PYTHONPATH`` pointing at it, so they and every process they start import the mutant (checked
before each run). First the chosen tests run once unmutated: a mutant only counts as killed by
tests that pass without it. ``--json`` writes the table for the notes.

To add a probe, append a ``Mutant``; keep its tests few and fast (those that should catch it).
Equivalent mutants are left out: a report line's ``ok`` computed from a count that the code
has already enforced by raising cannot be caught, and says nothing about the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import mutant_draw

REPO = Path(__file__).resolve().parent.parent
VR = "tests/test_verified_resume.py"
AD = "tests/test_adoption.py"
S3 = "tests/test_s3.py"
MT = "tests/test_memory_tier.py"
ML = "tests/test_memory_ledger.py"
PC = "tests/test_plan_cache.py"
PR = "tests/test_preemption.py"
RS = "tests/test_resume_share.py"
IN = "tests/test_incremental.py"
OP = "tests/test_one_pass.py"
LP = "tests/test_loader_position.py"
PV = "tests/test_provenance.py"
WR = "tests/test_wait_replay_survivors.py"
MS = "tests/test_memory_survivors.py"
AG = "tests/test_adoption_guards.py"
CA = "tests/faults/test_capture.py"
LF = "tests/test_lock_fencing.py"
LV = "tests/faults/test_loss_verdict.py"
GU = "tests/faults/test_guards.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "tiers: torch's own optimizer step inside a save counts as a training step",
        "dckpt/manager.py",
        "        if self.state.in_torch_state_dict:",
        "        if False:",
        (f"{AG}::test_torchs_own_optimizer_step_inside_a_save_is_no_training_step",),
    ),
    Mutant(
        "tiers: an older dckpt's resume record keeps the report's words as its tier",
        "dckpt/root/resume_record.py",
        'tier=_OLD_TIER_NAMES[t] if (t := obj["tier"]) in _OLD_TIER_NAMES else t,',
        'tier=obj["tier"],',
        ("tests/test_restart_loop.py::test_the_rule_counts_starts_and_a_pass_breaks_the_row",),
    ),
    Mutant(
        "tiers: an s3:// quarantine does not confirm the damage in the bucket first",
        "dckpt/tiers/object_source.py",
        "        if damage is not None:\n            self.confirm_damage(step, damage)",
        "        if False:\n            self.confirm_damage(step, damage)",
        (f"{S3}::test_damage_found_only_in_the_mirror_is_not_blamed_on_the_bucket",),
    ),
    Mutant(
        "tiers: a memory save's commit moves the lineage's anchor",
        "dckpt/tiers/memory_commit.py",
        "        if anchor:\n            self.anchor = step",
        "        if True:\n            self.anchor = step",
        (f"{ML}::test_a_memory_save_below_the_newest_removes_the_branch_above_it",),
    ),
    Mutant(
        "resume: the cross-rank manifest agreement always passes",
        "dckpt/load/checks.py",
        "agree = comm.all_equal(digest)",
        "agree = True",
        (f"{VR}::test_ranks_that_read_different_roots_refuse_and_name_the_rank",),
    ),
    Mutant(
        "resume: ranks that disagree are quarantined and fallen back past",
        "dckpt/load/resumer.py",
        "if not fallback or divergent or isinstance(",
        "if not fallback or isinstance(",
        (f"{VR}::test_a_step_missing_from_one_ranks_root_is_refused_not_fallen_back_past",),
    ),
    Mutant(
        "resume: the warmup sum is never checked",
        "dckpt/collective/world.py",
        "        return self.value == self.expected",
        "        return True",
        (f"{VR}::test_a_warmup_that_sums_wrong_on_one_rank_is_refused_on_every_rank",),
    ),
    Mutant(
        "resume: the cross-rank digest check always passes",
        "dckpt/load/checks.py",
        "if record is None or digest != record.digest:",
        "if record is None:",
        (f"{VR}::test_a_rank_whose_digests_differ_is_named_by_every_rank",),
    ),
    Mutant(
        "resume: files no rank read are never hashed",
        "dckpt/load/checks.py",
        "    for owned in share:\n",
        "    for owned in share[:0]:\n",
        (f"{VR}::test_a_damaged_file_no_rank_reads_is_still_caught",),
    ),
    Mutant(
        "load: a file's digest is never compared with the manifest",
        "dckpt/storage/verified_files.py",
        "        if actual != record.digest:\n"
        "            raise IntegrityError(path, record.digest, actual)\n"
        "        f.digest",
        "        f.digest",
        (
            "tests/test_multiproc_roundtrip.py::test_flipped_byte_in_any_shard_fails_load_naming_the_file",
        ),
    ),
    Mutant(
        "load: the layout check (sizes before reading) is skipped",
        "dckpt/load/checks.py",
        "laid_out = check_layout(path, manifest, part=(comm.rank, comm.world_size), owned=owned)",
        "laid_out = len(share)",
        (f"{VR}::test_a_truncated_file_is_refused_before_any_tensor_is_filled",),
    ),
    Mutant(
        "resume: each rank stats rank 0's share of the layout (the rest is never checked)",
        "dckpt/load/checks.py",
        "part=(comm.rank, comm.world_size), owned=owned",
        "part=(0, comm.world_size), owned=owned",
        (f"{VR}::test_a_truncated_file_is_refused_before_any_tensor_is_filled",),
    ),
    Mutant(
        "resume: each rank hashes rank 0's share of the files nobody read",
        "dckpt/load/checks.py",
        "    share = manifest.share(comm.rank, comm.world_size)\n    failure",
        "    share = manifest.share(0, comm.world_size)\n    failure",
        (f"{RS}::test_a_flipped_bit_in_a_file_no_rank_reads_is_found_by_its_owner",),
    ),
    Mutant(
        "resume: damage seen by some ranks only is not called divergent",
        "dckpt/load/checks.py",
        "        and failed.count < comm.world_size\n",
        "        and False\n",
        (f"{VR}::test_a_step_missing_from_one_ranks_root_is_refused_not_fallen_back_past",),
    ),
    Mutant(
        "resume: a warmup that summed wrong on a rank passes (the agreement is skipped)",
        "dckpt/load/resumer.py",
        "if self._ctl.lowest(not mine.ok) is None:",
        "if True:",
        (f"{VR}::test_a_warmup_that_sums_wrong_on_one_rank_is_refused_on_every_rank",),
    ),
    Mutant(
        "load: overlapping chunks in DCP's metadata are let through",
        "dckpt/storage/verifying_reader.py",
        "            if pair is not None:\n",
        "            if False:\n",
        (
            "tests/test_storage.py::test_chunks_side_by_side_fit_and_overlapping_chunks_are_refused",
            f"{RS}::test_chunks_that_tile_a_tensor_fit_and_one_moved_into_a_neighbour_is_refused",
        ),
    ),
    Mutant(
        "load: the 2-D sweep compares a chunk with no open neighbour",
        "dckpt/storage/verifying_reader.py",
        "if before and meet(i, across[before - 1][2]):",
        "if False:",
        (f"{RS}::test_chunks_that_tile_a_tensor_fit_and_one_moved_into_a_neighbour_is_refused",),
    ),
    Mutant(
        "memory: a node that lacks a copy is not noticed (the exchange is skipped)",
        "dckpt/load/memory.py",
        "if not rounds and not shared and not self.ctl.any(bool(bad)):",
        "if not rounds and not shared:",
        (f"{RS}::test_a_damaged_memory_copy_no_node_can_replace_is_not_used",),
    ),
    Mutant(
        "memory: the files a node lacks are never sent (the exchange takes its shortcut)",
        "dckpt/load/memory.py",
        "        if not plan:  # the same on every rank",
        "        if True:  # the same on every rank",
        ("tests/test_memory_layouts.py::test_layouts_restore_exactly",),
    ),
    Mutant(
        "memory: steps a node holds without a record are never said (the agreement is skipped)",
        "dckpt/load/memory.py",
        "if not self.ctl.any(bool(notes)):",
        "if True:",
        (f"{MT}::test_no_listener_private_files_and_planted_steps",),
    ),
    Mutant(
        "resume: NumPy's RNG is not restored",
        "dckpt/train/rng.py",
        "    np.random.set_state(",
        "    (lambda _state: None)(",
        (f"{VR}::test_each_rank_gets_back_its_own_python_numpy_and_torch_rng",),
    ),
    Mutant(
        "resume: Python's RNG is not restored",
        "dckpt/train/rng.py",
        '    random.setstate((int(state["python_version"]), mt, gauss))',
        '    (int(state["python_version"]), mt, gauss)',
        (f"{VR}::test_each_rank_gets_back_its_own_python_numpy_and_torch_rng",),
    ),
    Mutant(
        "save: CPU tensors are not copied in save() (the live state is written)",
        "dckpt/save/stager.py",
        "                    digest = _copy_captured(buf, src, fqn, checks)",
        "                    digest, buf = host_digest(src), src",
        ("tests/test_snapshot.py::test_by_default_a_checkpoint_holds_the_state_of_save_time",),
    ),
    Mutant(
        "save: the overlap version guard compares nothing",
        "dckpt/save/stager.py",
        "if any(obj._version != version for obj, version in watched):",
        "if False:",
        (
            "tests/test_snapshot.py::test_with_overlap_a_checkpoint_is_the_save_time_state_or_the_save_fails",
        ),
    ),
    Mutant(
        "save: later saves copy what the previous plan gave another rank",
        "dckpt/save/stager.py",
        "elsewhere = mine is not None and fqn not in mine",
        "elsewhere = False",
        ("tests/test_snapshot.py::test_later_saves_copy_only_what_this_rank_writes",),
    ),
    Mutant(
        "commit: rank 0 commits although a rank reported a failure",
        "dckpt/save/coordinator.py",
        "        if failed or refused is not None:\n"
        "            shutil.rmtree(tmp, ignore_errors=True)\n",
        "        if False:\n            shutil.rmtree(tmp, ignore_errors=True)\n",
        ("tests/test_async.py::test_write_failing_on_one_rank_fails_the_save_everywhere",),
    ),
    Mutant(
        "commit: the root is not fsynced after the commit rename",
        "dckpt/root/commit.py",
        "            fault_point(Phase.FSYNC_PARENT, 0, step)\n            fsync_dir(base)",
        "            fault_point(Phase.FSYNC_PARENT, 0, step)",
        ("tests/faults/test_power_loss.py::test_every_durable_prefix_leaves_a_consistent_root",),
    ),
    Mutant(
        "config: a strict key passes like an operational one",
        "dckpt/load/config_check.py",
        'if self.strict != "all" and _matches(key, self.strict):',
        "if False:",
        (f"{AD}::test_a_refusal_shows_the_diff_and_both_ways_out",),
    ),
    Mutant(
        "loss watch: a loss above the expected band is never reported",
        "dckpt/load/loss_watch.py",
        "        if median > high:",
        "        if False:",
        (f"{AD}::test_the_loss_watch_passes_an_exact_resume_and_trips_a_broken_one",),
    ),
    Mutant(
        "per-rank: every rank saves its value under one shared key",
        "dckpt/train/per_rank.py",
        'return {f"rank_{_rank()}": buf.getvalue()}',
        'return {"rank_0": buf.getvalue()}',
        (f"{AD}::test_per_rank_values_come_back_to_their_rank_and_refuse_a_new_world",),
    ),
    Mutant(
        "retention: the newest checkpoint is not protected",
        "dckpt/root/retention.py",
        "newest = {c.step for c in ordered[-1:]}",
        "newest: set[int] = set()",
        ("tests/test_retention_lock.py::test_policy_keeps_newest_last_milestones_pins_and_best",),
    ),
    Mutant(
        "s3: a downloaded object is not compared with the writer's digest",
        "dckpt/tiers/s3_store.py",
        "            if got == want:",
        "            if True:",
        (f"{S3}::test_a_damaged_object_is_named_and_resume_falls_back_to_the_previous_step",),
    ),
    Mutant(
        "s3: the manifest is PUT without checking that every object is there",
        "dckpt/tiers/object_commit.py",
        "self._check_objects(step, parse_manifest(raw, str(tmp / MANIFEST_FILE)))",
        "pass",
        (f"{S3}::test_the_commit_refuses_when_an_uploaded_object_is_gone",),
    ),
    Mutant(
        "s3: damage found only in the mirror quarantines the bucket's intact copy",
        "dckpt/tiers/object_source.py",
        "        if problems:\n            return\n        shutil.rmtree",
        "        if problems or True:\n            return\n        shutil.rmtree",
        (f"{S3}::test_damage_found_only_in_the_mirror_is_not_blamed_on_the_bucket",),
    ),
    Mutant(
        "s3: the run lock's acquire is not conditional",
        "dckpt/tiers/object_lock.py",
        "try:\n            etag = self.store.put_small(self.key, self._record(), if_absent=True)",
        "try:\n            etag = self.store.put_small(self.key, self._record())",
        (f"{S3}::test_the_lock_is_a_conditional_put_and_a_second_job_is_refused",),
    ),
    Mutant(
        "memory: a copy in a node's memory is used without comparing its digest",
        "dckpt/load/memory.py",
        "    if actual != record.digest:\n        mm.close()",
        "    if False:\n        mm.close()",
        (
            f"{MT}::test_flipped_bit_in_replica_falls_back_to_durable",
            f"{MT}::test_flipped_bit_in_own_copy_uses_replica",
        ),
    ),
    Mutant(
        "memory: a received file is renamed in without comparing its digest",
        "dckpt/collective/transfer.py",
        "if actual != item.digest:",
        "if False:",
        ("tests/test_transfer.py::test_bytes_that_do_not_hash_right_are_never_named",),
    ),
    Mutant(
        "memory: a memory step of a branch the run left (its durable anchor moved) is resumed",
        "dckpt/load/memory.py",
        "if after != before:",
        "if False:",
        (f"{ML}::test_a_memory_step_of_a_branch_the_run_left_is_not_resumed",),
    ),
    Mutant(
        "memory: a save of a step saved before retires the committed copy before it commits",
        "dckpt/save/memory.py",
        "self.slots.rename(staged.final, _aside(staged))",
        'self.slots.retire(staged.final, "replaced")',
        (f"{ML}::test_a_failed_save_of_a_step_saved_before_keeps_its_committed_copy",),
    ),
    Mutant(
        "memory: a memory save below the newest leaves the records of the branch above it",
        "dckpt/tiers/memory_commit.py",
        "dropped = self.ledger.drop_above(step)",
        "dropped: list[int] = []",
        (f"{ML}::test_a_memory_save_below_the_newest_removes_the_branch_above_it",),
    ),
    Mutant(
        "save: the plan cache's fingerprint ignores a DTensor's dtype (DCP's own comparison)",
        "dckpt/save/plan_cache.py",
        '            "dtensor",\n            tuple(value.shape),\n            str(value.dtype),\n',
        '            "dtensor",\n            tuple(value.shape),\n',
        (f"{PC}::test_the_plan_is_reused_only_while_no_rank_changed_its_layout",),
    ),
    Mutant(
        "save: ranks that save different steps are not refused",
        "dckpt/save/coordinator.py",
        "        if self.comm.all_equal(repr(step)):\n            return",
        "        if True:\n            return",
        ("tests/test_multiproc_roundtrip.py",),
    ),
    Mutant(
        "preemption: a check ignores the agreed flag",
        "dckpt/preemption.py",
        "stop, interval = bool(box[0].item()), max(1, int(box[1].item()))",
        "stop, interval = False, max(1, int(box[1].item()))",
        (f"{PR}::test_the_ranks_agree_on_the_step_and_a_missed_deadline_raises",),
    ),
    Mutant(
        "preemption: a rank other than 0 checks at every step, not at the agreed interval",
        "dckpt/preemption.py",
        "schedule.next_check = schedule.calls + interval",
        "schedule.next_check = schedule.calls + (interval if self.rank == 0 else 1)",
        (f"{PR}::test_checks_come_about_check_every_s_apart_and_still_agree_on_one_step",),
    ),
    Mutant(
        "comm: the tree reduction skips a child",
        "dckpt/collective/comm.py",
        "            if rank + mask < n:",
        "            if rank + mask < n - 1:",
        ("tests/test_comm.py",),
    ),
    Mutant(
        "comm: a meeting the first to arrive gave up on is not marked abandoned",
        "dckpt/collective/comm.py",
        "                got = sealed.claim(store, second, _GONE)",
        "                got = theirs",
        (
            "tests/test_comm.py::test_ranks_meet_through_the_store_and_a_late_peer_is_named_on_both_ends",
        ),
    ),
    Mutant(
        "resume: an item read from another rank's file is used without its digest matching",
        "dckpt/storage/verified_files.py",
        "        if actual != expected:",
        "        if False:",
        ("tests/test_item_digests.py",),
    ),
    Mutant(
        "resume: one rank's layout failure is damage without a witness",
        "dckpt/load/checks.py",
        "        if comm.broadcast(seen, src=witness) is not None:",
        "        if comm.broadcast(seen, src=witness) is None:",
        (f"{RS}::test_a_file_one_rank_alone_sees_damaged_is_divergence_not_damage",),
    ),
    Mutant(
        "preemption: the final save's deadline counts from the agreement, not the signal",
        "dckpt/preemption.py",
        "self._first_signal = earliest / 1000 if earliest < _NO_SIGNAL_MS else None",
        "self._first_signal = None",
        (f"{PR}::test_checks_come_about_check_every_s_apart_and_still_agree_on_one_step",),
    ),
    Mutant(
        "preemption: a rank decides from its own view whether the older save still runs",
        "dckpt/preemption.py",
        "if self._ctl.any(self._saver.current is not None):",
        "if self._saver.current is not None:",
        (f"{PR}::test_ranks_that_see_the_save_in_flight_differently_take_the_same_branches",),
    ),
    Mutant(
        "saver: a rank whose save thread has ended raises its failure before the broadcast",
        "dckpt/save/saver.py",
        "        t0 = time.perf_counter()\n        mine = None",
        "        t0 = time.perf_counter()\n"
        "        self._thread.raise_if_failed()\n        mine = None",
        (
            "tests/test_async.py::test_a_failure_seen_at_different_times_is_raised_by_the_next_save_on_every_rank",
        ),
    ),
    Mutant(
        "saver: wait() re-raises a memory save's failure where that save was still running",
        "dckpt/save/saver.py",
        "            return SaveHandle(ticket).result()\n        except SaveError:",
        "            return SaveHandle(ticket).result()\n        except KeyError:",
        ("tests/test_async.py::test_wait_after_a_failed_memory_save_does_the_same_on_every_rank",),
    ),
    Mutant(
        "comm: ranks that reached different agreements are not told",
        "dckpt/collective/comm.py",
        "        if highest != lowest:",
        "        if False:",
        (
            "tests/test_comm.py::test_ranks_that_reach_different_agreements_all_raise_instead_of_aborting",
        ),
    ),
    Mutant(
        "incremental: the pre-hash hashes the tensor as given, not as the writer writes it",
        "dckpt/storage/stable_file.py",
        "torch.save(as_written(tensor), sink)",
        "torch.save(tensor, sink)",
        (f"{IN}::test_the_writer_links_an_unchanged_stable_file_and_writes_a_changed_one",),
    ),
    Mutant(
        "incremental: a stable file is linked whatever its items hash to",
        "dckpt/storage/hashing_writer.py",
        "and base.file.items == items",
        "and len(base.file.items) == len(items)",
        (f"{IN}::test_the_writer_links_an_unchanged_stable_file_and_writes_a_changed_one",),
    ),
    Mutant(
        "incremental: a link to a name that now holds another file is kept",
        "dckpt/storage/stable_file.py",
        "        if (\n            (st.st_dev, st.st_ino) != base.inode",
        "        if False and (\n            (st.st_dev, st.st_ino) != base.inode",
        (f"{IN}::test_a_base_that_is_gone_or_replaced_is_written_afresh_leaving_no_link",),
    ),
    Mutant(
        "incremental: consecutive steps share one copy by default",
        "dckpt/save/durable.py",
        "        return self._bases[0]",
        "        return self._bases[-1]",
        (f"{IN}::test_by_default_two_copies_alternate_and_a_bad_one_leaves_the_step_before",),
    ),
    Mutant(
        "incremental: a rollback links a file of the dropped branch",
        "dckpt/save/durable.py",
        "while self._bases and self._bases[-1].step >= step:",
        "while False and self._bases:",
        (f"{IN}::test_by_default_two_copies_alternate_and_a_bad_one_leaves_the_step_before",),
    ),
    Mutant(
        "incremental: the writer truncates a name that is there (a link to a committed file)",
        "dckpt/storage/direct_file.py",
        'return os.fdopen(create_new(path), "wb", buffering=1 << 20)',
        'return open(path, "wb", buffering=1 << 20)',
        (f"{IN}::test_the_writer_never_opens_an_existing_name",),
    ),
    Mutant(
        "incremental: a file made before O_DIRECT was refused stays in the fallback's way",
        "dckpt/storage/direct_file.py",
        "            with contextlib.suppress(FileNotFoundError):\n                os.unlink(path)",
        "            pass",
        (f"{IN}::test_a_file_system_that_refuses_o_direct_after_creating_the_file_still_gets_it",),
    ),
    # Issue 45: eight bugs a blind reviewer wrote that no test caught, each the other variant
    # of a rule that was tested one way only (and one bug the sweep over dtypes found).
    Mutant(
        "replay: the newest committed step's journal is pruned while a save is in flight",
        "dckpt/load/replay.py",
        "self._writer.prune(committed)",
        "self._writer.prune(step)",
        (
            "tests/test_replay.py::test_the_newest_committed_step_s_journal_outlives_the_save_in_flight",
        ),
    ),
    Mutant(
        "memory: a memory step resumed from becomes the durable anchor of later memory saves",
        "dckpt/tiers/memory_commit.py",
        '        if manifest.mesh.get("tier") == "memory":\n'
        '            after = manifest.mesh.get("after")\n'
        "            self.anchor = after if isinstance(after, int) else None\n"
        "        else:\n"
        "            self.anchor = manifest.step",
        "        self.anchor = manifest.step",
        (f"{ML}::test_a_memory_save_below_the_newest_removes_the_branch_above_it",),
    ),
    Mutant(
        "plan cache: a plain tensor cast to another dtype keeps the cached plan",
        "dckpt/save/plan_cache.py",
        '            "tensor",\n            tuple(value.shape),\n            str(value.dtype),',
        '            "tensor",\n            tuple(value.shape),',
        (f"{PC}::test_the_plan_is_reused_only_while_no_rank_changed_its_layout",),
    ),
    Mutant(
        "value checks: NaN and Inf in bf16 and fp16 are not looked for",
        "dckpt/save/value_checks.py",
        "_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)",
        "_FLOATS = (torch.float32, torch.float64)",
        (
            "tests/test_value_checks.py::test_a_nan_weight_fails_its_save_and_latest_keeps_the_finite_step",
        ),
    ),
    Mutant(
        "value checks: a float8 NaN is counted on the float8 tensor (torch cannot: unchecked)",
        "dckpt/save/value_checks.py",
        "counted = floats if t.dtype in _FLOAT8 else t",
        "counted = t",
        (
            "tests/test_value_checks.py::test_every_floating_dtype_has_its_nan_and_inf_found_and_a_finite_tensor_passes",
        ),
    ),
    Mutant(
        "preemption: the final save's deadline leaves out the time since the first signal",
        "dckpt/preemption.py",
        "since = max(0.0, time.time() - self._first_signal) if self._first_signal else 0.0",
        "since = 0.0",
        (f"{PR}::test_the_ranks_agree_on_the_step_and_a_missed_deadline_raises",),
    ),
    Mutant(
        "s3: a check that only hashes takes one flipped read as the object's digest",
        "dckpt/tiers/s3_store.py",
        "return got if got == want else self.digest(key, size, algorithm, progress)",
        "return got",
        (
            "tests/test_s3_wire.py::test_a_flipped_read_is_read_again_and_only_a_flip_on_every_read_is_damage",
        ),
    ),
    Mutant(
        "s3: the commit checks that each object exists, not its size",
        "dckpt/tiers/object_commit.py",
        "            if size != record.bytes:\n                raise IntegrityError(",
        "            if size is None:\n                raise IntegrityError(",
        (f"{S3}::test_the_commit_refuses_when_an_uploaded_object_is_gone_or_cut_short",),
    ),
    Mutant(
        "data: the sampler's epoch is not restored",
        "dckpt/train/data.py",
        'self.set_position(int(state["epoch"]), int(state["batches_done"]))',
        'self.set_position(0, int(state["batches_done"]))',
        (
            "tests/test_resume_api.py::test_a_restored_sampler_goes_on_with_the_epoch_and_the_batch_it_stopped_at",
        ),
    ),
    # Issue 43: a verified file read once, its tensors filled before the digest is known.
    Mutant(
        "one pass: a value is applied before its file is proven",
        "dckpt/storage/one_pass.py",
        "            return lambda: planner.load_bytes(item, io.BytesIO(data))",
        "            planner.load_bytes(item, io.BytesIO(data))\n            return lambda: None",
        (f"{OP}::test_a_flipped_bit_anywhere_fails_the_load_and_commits_no_value",),
    ),
    Mutant(
        "one pass: the file's digest is not compared",
        "dckpt/storage/one_pass.py",
        "        if actual != self.record.digest:\n            raise self._mismatch(",
        "        if False:\n            raise self._mismatch(",
        (f"{OP}::test_a_flipped_bit_anywhere_fails_the_load_and_commits_no_value",),
    ),
    Mutant(
        "one pass: bytes read straight into a tensor are not hashed",
        "dckpt/storage/one_pass.py",
        "                self.hasher.update(view)",
        "                if into is None:\n                    self.hasher.update(view)",
        (f"{OP}::test_each_dtype_is_read_once_into_its_tensor_bit_for_bit",),
    ),
    Mutant(
        "one pass: small tensors are filled before their file is proven",
        "dckpt/storage/one_pass.py",
        "            if self._held_bytes + length <= HELD_BUDGET:  # deserialized once proven",
        "            if False:",
        (f"{OP}::test_a_flipped_bit_anywhere_fails_the_load_and_commits_no_value",),
    ),
    Mutant(
        "one pass: an error after a tensor was filled does not say the state holds its bytes",
        "dckpt/storage/one_pass.py",
        '        note = PARTLY_FILLED if self.filled else ""',
        '        note = ""',
        (f"{OP}::test_a_flipped_bit_anywhere_fails_the_load_and_commits_no_value",),
    ),
    Mutant(
        "one pass: an item that failed to deserialize is reported before the digest's verdict",
        "dckpt/storage/one_pass.py",
        "                except Exception as exc:  # judged once the digest is known\n"
        "                    broken = exc",
        "                except Exception as exc:  # judged once the digest is known\n"
        "                    raise",
        (f"{OP}::test_a_flipped_bit_anywhere_fails_the_load_and_commits_no_value",),
    ),
    Mutant(
        "loader: the order is not taken again when an iteration ends or is left",
        "dckpt/train/loader.py",
        "            self.batches = 0\n            self._at_begin = self._states()\n",
        "            self.batches = 0\n",
        (
            f"{LP}::test_a_loop_left_early_then_saved_resumes_with_the_next_order",
            f"{LP}::test_a_rebuilt_loader_continues_with_the_next_batch",
        ),
    ),
    Mutant(
        "loader: a loader with a subset of the saved generators passes",
        "dckpt/train/loader.py",
        'if sorted(state["names"]) != sorted(gens):',
        'if not set(gens) <= set(state["names"]):',
        (f"{LP}::test_a_loader_built_differently_is_refused_in_words",),
    ),
    Mutant(
        "loader: a loader without a generator keeps drawing from the global RNG",
        "dckpt/train/loader.py",
        "            if owner.generator is None:  # see the module docstring",
        "            if False:",
        (f"{LP}::test_the_iterator_draws_nothing_from_the_global_rng",),
    ),
    Mutant(
        "accelerate: the AcceleratedOptimizer is not unwrapped",
        "dckpt/train/state.py",
        "        self.optimizer = _unwrap_optimizer(optimizer)",
        "        self.optimizer = optimizer",
        (
            "tests/test_integration_accelerate.py::test_prepared_objects_resume_exact_in_every_epoch",
        ),
    ),
    Mutant(
        "stream: a file that arrived into the state is not judged by its digest",
        "dckpt/collective/transfer.py",
        "if error is None and (actual := format_digest(algorithm, hasher)) != item.digest:",
        "if False and (actual := format_digest(algorithm, hasher)) != item.digest:",
        (
            "tests/test_memory_stream.py::test_a_flipped_byte_on_the_way_leaves_nothing_of_that"
            "_step_in_the_state",
        ),
    ),
    Mutant(
        "stream: the copy put back behind the resume is named without its digest",
        "dckpt/load/memory_refill.py",
        "    if format_digest(algorithm, hasher) != record.digest:\n        source.slots.drop",
        "    if False:\n        source.slots.drop",
        (
            "tests/test_memory_stream.py::test_a_state_changed_before_the_copy_behind_the_resume"
            "_is_not_kept",
        ),
    ),
    Mutant(
        "stream: an arriving header of other shapes still routes its bytes into the state",
        "dckpt/storage/memory_file.py",
        "            if live.dtype != dtype or list(live.shape) != shape:",
        "            if False:",
        ("tests/test_memory_stream.py::test_a_header_that_does_not_fit_the_state_writes_nothing",),
    ),
    Mutant(
        "capture: a capture that differs from the bytes written is let through",
        "dckpt/save/value_checks.py",
        "                elif wrote != captured[name]:",
        "                elif False:",
        (f"{CA}::test_a_stale_torn_or_cut_staging_copy_never_commits_and_names_the_tensor",),
    ),
    Mutant(
        "capture: a host tensor's capture digest is taken of its staging buffer, not its source",
        "dckpt/save/stager.py",
        "        return copy_hashed(buf, src)  # the source's digest",
        "        return (buf.copy_(src), host_digest(buf))[1]  # the source's digest",
        (f"{CA}::test_a_stale_torn_or_cut_staging_copy_never_commits_and_names_the_tensor",),
    ),
    Mutant(
        "capture: the writer never finds a tensor's bytes in its stream (nothing compared)",
        "dckpt/storage/item_writes.py",
        "            waiting = self._waiting.get((address, len(view)))",
        "            waiting = None",
        (f"{CA}::test_a_stale_torn_or_cut_staging_copy_never_commits_and_names_the_tensor",),
    ),
    Mutant(
        "capture: a deferred copy (overlap_staging) is never captured at save()",
        "dckpt/save/stager.py",
        "                if checks is not None and not src.is_cuda:  # its state now, copied later",
        "                if False:  # its state now, copied later",
        (f"{CA}::test_a_stale_torn_or_cut_staging_copy_never_commits_and_names_the_tensor",),
    ),
    Mutant(
        "capture: the memory route compares nothing it wrote",
        "dckpt/save/memory.py",
        '            names, writes if checks.capture else None, dict.fromkeys(names, "mapped")',
        '            names, None, dict.fromkeys(names, "mapped")',
        (f"{CA}::test_a_stale_torn_or_cut_staging_copy_never_commits_and_names_the_tensor",),
    ),
    Mutant(
        "capture: the progress note fires when trainable tensors did change",
        "dckpt/save/findings.py",
        "    if stepped and moved and sum(n for n, _ in moved) and not sum(c for _, c in moved):",
        "    if stepped and moved and sum(n for n, _ in moved):",
        (f"{CA}::test_lr_zero_saves_say_no_trainable_tensor_changed",),
    ),
    Mutant(
        "lock: a renewal that cannot read the lock file counts the lock as lost",
        "dckpt/root/lock.py",
        '                log.warning("dckpt: could not renew the run lock (will retry): %s",'
        " exc)\n                continue",
        "                self._lose()\n                return",
        (f"{LF}::test_an_unreadable_lock_is_a_storage_error_never_a_lost_lock",),
    ),
    Mutant(
        "lock: a failed read of the lock file at a commit is read once, not again",
        "dckpt/root/lock.py",
        "        for pause in (*READ_BACKOFF_S, None):",
        "        for pause in (None,):",
        (f"{LF}::test_an_unreadable_lock_is_a_storage_error_never_a_lost_lock",),
    ),
    Mutant(
        "lock: the other ranks do not wait as long as rank 0 watches another host's lock",
        "dckpt/collective/gate.py",
        '            deadline = max(deadline, time.monotonic() + told["s"] + self.timeout_s)',
        "            deadline = deadline",
        (
            "tests/faults/test_start_faults.py::test_a_relaunch_from_another_host_waits_one_lease"
            "_on_every_rank_and_trains",
        ),
    ),
    Mutant(
        "loss verdict: with raise, each rank raises its own verdict (no agreement)",
        "dckpt/load/watch.py",
        '        if self._config.loss_watch == "raise":\n'
        "            self._agreement = _Agreement(ctl, self._config.loss_watch_steps)",
        '        if self._config.loss_watch == "raise" and False:\n'
        "            self._agreement = _Agreement(ctl, self._config.loss_watch_steps)",
        (f"{LV}::test_the_ranks_raise_together_or_not_at_all",),
    ),
    Mutant(
        "loss verdict: rank 0's replay proof does not outrank another rank's loss watch",
        "dckpt/load/watch.py",
        "                vouched = ctl.broadcast(self.replay.vouched() if self.rank == 0"
        " else None)",
        "                vouched = ctl.broadcast(None)",
        (f"{LV}::test_the_ranks_raise_together_or_not_at_all",),
    ),
    Mutant(
        "read error: a media error is not read again (one EIO refuses the start)",
        "dckpt/load/resumer.py",
        "            if not exc.media or not exc.path:\n                raise\n"
        "            first = exc",
        "            raise",
        (f"{GU}::test_a_transient_eio_at_each_resume_read_is_read_again_and_resumes",),
    ),
    Mutant(
        "read error: a second unreadable step does not stop the start (the storage is failing)",
        "dckpt/load/resumer.py",
        "                if not fallback or unreadable is not None:",
        "                if not fallback:",
        (f"{GU}::test_a_read_error_on_every_step_sets_nothing_aside_and_stops",),
    ),
    Mutant(
        "read error: a step is set aside at its second failed read, before an older one loads",
        "dckpt/load/resumer.py",
        "                unreadable = (tier, step, exc)"
        "  # set aside (and reported) once one loads\n",
        "                self._quarantine(tier, step, self._unreadable_reason(exc, step), exc)\n"
        "                unreadable = None\n",
        (f"{GU}::test_a_read_error_on_every_step_sets_nothing_aside_and_stops",),
    ),
    Mutant(
        "read error: an s3:// mirror's unreadable file sets the bucket's step aside",
        "dckpt/tiers/object_source.py",
        "            self._confirm_unreadable(step, exc)\n            return",
        "            return",
        (
            "tests/test_s3_gaps.py::test_a_mirror_file_the_local_disk_cannot_read_sets_nothing_aside"
            "_in_the_bucket",
        ),
    ),
    Mutant(
        "load: an item of another rank's file is used before its segment digest is checked",
        "dckpt/storage/verifying_reader.py",
        "                            self.hashed_bytes += verify_span("
        "f, where, digests, offset, length)\n"
        "                            self.items_checked += 1\n"
        "                            self._load_item(f, item, planner)\n",
        "                            self._load_item(f, item, planner)\n"
        "                            self.hashed_bytes += verify_span("
        "f, where, digests, offset, length)\n"
        "                            self.items_checked += 1\n",
        (
            "tests/faults/test_unloadable_items.py::"
            "test_an_item_of_another_ranks_file_reaches_the_state_only_once_its_segment_matched",
        ),
    ),
    Mutant(
        "provenance: a file another user owns is taken as the job's",
        "dckpt/root/provenance.py",
        "    if st.st_uid != uid:",
        "    if False:",
        (f"{PV}::test_a_step_another_user_owns_is_passed_over_named_and_never_moved",),
    ),
    Mutant(
        "provenance: a keyed run takes a step its key does not sign",
        "dckpt/root/provenance.py",
        "            why = self.key.refusal(manifest)\n            if why is not None:",
        "            why = self.key.refusal(manifest)\n            if False:",
        (f"{PV}::test_a_keyed_run_resumes_only_the_steps_its_key_signs",),
    ),
    Mutant(
        "provenance: retention deletes a step another user owns",
        "dckpt/root/upkeep.py",
        "                theirs.append(step)\n                continue",
        "                pass",
        (f"{PV}::test_a_step_another_user_owns_is_passed_over_named_and_never_moved",),
    ),
    Mutant(
        "owned: a root others may write is taken (prove_root)",
        "dckpt/owned.py",
        "        if _shared(st) and not sticky_parent and not teams:",
        "        if False:",
        (
            "tests/test_owned.py::test_a_root_others_may_write_is_refused_unless_the_group_is_trusted",
            f"{PV}::test_a_group_writable_root_starts_only_with_the_group_switch",
        ),
    ),
    Mutant(
        "owned: an existing directory is chmod-ed (a /dev/shm given as memory_dir)",
        "dckpt/owned.py",
        "            if made:  # ours",
        "            if True:  # ours",
        (
            "tests/test_owned.py::"
            "test_an_existing_directory_is_never_chmod_ed_and_refused_if_others_may_write_it",
            "tests/test_owned.py::test_a_shared_sticky_directory_is_refused_as_the_memory_directory_itself",
        ),
    ),
    Mutant(
        "store: the exit probe does not look afresh (a stall, then an exit within QUIET_S, ends "
        "the agent)",
        "dckpt/collective/store.py",
        '    _quiet["until"] = 0.0  # a fresh look\n',
        "",
        (f"{WR}::test_a_store_that_answers_again_after_one_stall_leaves_the_agent_alone",),
    ),
    Mutant(
        "watch: horizon keys count as neutral (a changed max_steps is replayed and strikes)",
        "dckpt/load/watch.py",
        "neutral = OPERATIONAL_KEYS - HORIZON_KEYS",
        "neutral = OPERATIONAL_KEYS",
        (f"{WR}::test_a_changed_training_length_is_not_replayed_and_records_no_strike",),
    ),
    Mutant(
        "resumer: the restart-loop verdict reads every save of the step",
        "dckpt/load/resumer.py",
        "                reason = restart_loop(same)\n",
        "                reason = restart_loop(mine)\n",
        (f"{WR}::test_a_step_re_saved_after_a_restart_loop_is_not_quarantined_for_the_old_save",),
    ),
    Mutant(
        "resumer: the restart-loop rule filters no save id",
        "dckpt/load/resumer.py",
        "                same = [r for r in mine if r.save_id == save_id]\n",
        "                same = mine\n",
        (f"{WR}::test_a_step_re_saved_after_a_restart_loop_is_not_quarantined_for_the_old_save",),
    ),
    Mutant(
        "loader: the restored epoch is not handed to the loader's set_epoch",
        "dckpt/train/loader.py",
        "            set_epoch(self.epoch)\n",
        "            pass\n",
        (f"{WR}::test_an_accelerate_loader_resumed_in_a_later_epoch_draws_that_epoch_s_order",),
    ),
    Mutant(
        "hf_trainer: the restored LR is not put back into the optimizer groups",
        "dckpt/integrations/hf_trainer.py",
        "                group.update(saved)\n",
        "                pass\n",
        (f"{WR}::test_a_trainer_resumed_after_warmup_trains_on_at_the_restored_lr",),
    ),
    Mutant(
        "lightning: last*.ckpt links to the step, not the root",
        "dckpt/integrations/lightning.py",
        "            target = self.root if name.startswith(_LAST)"
        " else self.root / step_dir_name(step)\n",
        "            target = self.root / step_dir_name(step)\n",
        (
            "tests/test_lightning_paths.py::"
            "test_a_planted_last_ckpt_is_refused_before_lightning_loads_it",
        ),
    ),
    Mutant(
        "memory ledger: the run lock is checked after the rename (a fenced job writes a record)",
        "dckpt/root/memory_ledger.py",
        "        if self.held is not None:  # a job that lost its lock must not write in"
        "to the root\n"
        "            self.held()\n"
        "        os.replace(manifest, final)  # the commit point (a re-save replaces the record)\n",
        "        os.replace(manifest, final)  # the commit point (a re-save replaces the record)\n"
        "        if self.held is not None:  # a job that lost its lock must not write in"
        "to the root\n"
        "            self.held()\n",
        (f"{MS}::test_a_job_fenced_before_the_memory_commit_writes_no_record",),
    ),
    Mutant(
        "memory reader: tensors copied before the ranks agree (one rank refuses, all overwritten)",
        "dckpt/load/memory_reader.py",
        "            raise_first(self.ctl, failure)  # every rank matched every tensor, "
        "or none copies\n"
        "            assert fill is not None\n"
        "            filled = fill.apply()  # from here on the live state changes\n",
        "            filled = fill.apply() if fill is not None else {}  # copied before "
        "the ranks agree\n"
        "            raise_first(self.ctl, failure)\n",
        (f"{MS}::test_when_one_rank_alone_refuses_a_memory_resume_no_rank_is_overwritten",),
    ),
    Mutant(
        "memory refill: the first step does not wait for the copy back into memory",
        "dckpt/load/memory_refill.py",
        "        if not done.wait(timeout_s):\n"
        "            cancel.set()  # it stops between two pieces, and drops its part file\n"
        "            done.wait(timeout_s)\n",
        "        if not done.is_set():\n"
        "            pass  # the state goes on before the copy back is done\n",
        (f"{MS}::test_the_first_step_after_a_partner_restore_waits_for_the_copy_back_into_memory",),
    ),
    Mutant(
        "memory refill: the first step waits for the copy back no time at all",
        "dckpt/load/memory_refill.py",
        "        if not done.wait(timeout_s):\n",
        "        if not done.wait(0):\n",
        (f"{MS}::test_the_first_step_after_a_partner_restore_waits_for_the_copy_back_into_memory",),
    ),
    Mutant(
        "memory tier: only rank 0 proves its node's directory at a start",
        "dckpt/memory_tier.py",
        "        if topology.ranks_of(node)[0] == rank:\n",
        "        if rank == 0:\n",
        (f"{MS}::test_each_nodes_first_rank_proves_its_nodes_directory",),
    ),
    Mutant(
        "memory tier: each node's first rank cleans node 0's directory, not its own",
        "dckpt/memory_tier.py",
        "            memory_layout.clean_abandoned(node_dir)\n",
        "            memory_layout.clean_abandoned(memory_layout.node_dir(memory_dir, 0))\n",
        (f"{MS}::test_each_nodes_first_rank_cleans_its_nodes_abandoned_files",),
    ),
    Mutant(
        "resumer: an optimizer step does not settle what the load left running",
        "dckpt/load/resumer.py",
        '        optimizer, an ``observe()``: the loaded state is changing."""\n'
        "        self.settle()\n"
        "        self._untouched = None\n",
        '        optimizer, an ``observe()``: the loaded state is changing."""\n'
        "        self._untouched = None\n",
        (f"{MS}::test_the_first_step_after_a_partner_restore_waits_for_the_copy_back_into_memory",),
    ),
    Mutant(
        "blind 54: owned: _prove_way stops at the root itself when it is fine (its parents "
        "never walked: a squatted parent accepted)",
        "dckpt/owned.py",
        "        if d != real and st.st_uid in (0, me) and not _shared(st):",
        "        if st.st_uid in (0, me) and not _shared(st):",
        (
            "tests/test_owned.py::"
            "test_an_existing_root_is_refused_under_a_parent_another_user_controls",
        ),
    ),
    Mutant(
        "blind 54: provenance: refusal never compares the mac (a signature with the right key "
        "id but any mac passes)",
        "dckpt/root/provenance.py",
        "        if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(manifest)):",
        "        if not isinstance(mac, str):",
        ("tests/test_provenance.py::test_a_keyed_run_resumes_only_the_steps_its_key_signs",),
    ),
    Mutant(
        "blind 54: provenance: the mac covers only the files digest (other fields, e.g. "
        "config/step, changed and re-sealed still pass)",
        "dckpt/root/provenance.py",
        "        body = dataclasses.replace(manifest, signature={}).to_json_obj()\n"
        '        del body["self_digest"]  # a digest of the same fields: signed through them',
        '        body = {"files_digest": manifest.files_digest}',
        ("tests/test_provenance.py::test_a_keyed_run_resumes_only_the_steps_its_key_signs",),
    ),
    Mutant(
        "blind 54: provenance: a group-readable key file accepted (only other-read refused)",
        "dckpt/root/provenance.py",
        "            if stat.S_IMODE(st.st_mode) & 0o077:",
        "            if stat.S_IMODE(st.st_mode) & 0o007:",
        (
            "tests/test_provenance.py::"
            "test_a_key_file_others_could_read_or_swap_is_refused_in_words",
        ),
    ),
    Mutant(
        "blind 54: sealed: the seal does not cover the key (a genuine value copied under "
        "another key passes)",
        "dckpt/collective/sealed.py",
        '        raw = key.encode() + b"\\0" + payload.encode()',
        "        raw = payload.encode()",
        ("tests/test_sealed.py::test_a_sealed_value_reads_back_only_under_its_own_key",),
    ),
    Mutant(
        "blind 54: sealed: the seal's secret is the public key name (any client that lists "
        "the keys can seal)",
        "dckpt/collective/sealed.py",
        '        _seals[name] = Seal(_derive(token, b"seal"))',
        "        _seals[name] = Seal(name.encode())",
        ("tests/test_sealed.py::test_nothing_public_seals_a_value",),
    ),
    Mutant(
        "blind 54: lightning: a later hop's directory not proven (only the first link's "
        "directory is)",
        "dckpt/integrations/lightning.py",
        "            where = _prove_links_dir(parent, make=False)",
        "            where = _prove_links_dir(parent, make=False) if "
        "cur == given else Path(parent)",
        (
            "tests/test_lightning_paths.py::"
            "test_each_hop_of_a_link_chain_is_in_a_directory_of_the_jobs_own",
        ),
    ),
    Mutant(
        "blind 54: manifest: check_layout claims a file only after its type and size checks "
        "(another user's symlink or wrong-size file is quarantined as damage, not passed "
        "over)",
        "dckpt/root/manifest.py",
        "        if owned is not None:  # another user's file is fore"
        "ign, whatever it holds: not damage\n"
        "            owned(path, st)\n"
        "        if not stat.S_ISREG(st.st_mode):\n"
        '            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"\n'
        '            raise IntegrityError(str(path), "a regular file", kind, "wrong file type")\n'
        "        if st.st_size != rec.bytes:\n"
        "            raise IntegrityError(\n"
        '                str(path), f"{rec.bytes} bytes", f"{st.st_si'
        'ze} bytes", "size mismatch"\n'
        "            )\n",
        "        if not stat.S_ISREG(st.st_mode):\n"
        '            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"\n'
        '            raise IntegrityError(str(path), "a regular file", kind, "wrong file type")\n'
        "        if st.st_size != rec.bytes:\n"
        "            raise IntegrityError(\n"
        '                str(path), f"{rec.bytes} bytes", f"{st.st_si'
        'ze} bytes", "size mismatch"\n'
        "            )\n"
        "        if owned is not None:  # another user's file is fore"
        "ign, whatever it holds: not damage\n"
        "            owned(path, st)\n",
        (
            "tests/test_provenance.py::"
            "test_another_users_file_of_the_wrong_size_is_foreign_not_damage",
        ),
    ),
    Mutant(
        "fence: the directory commit's lock check comes before its last fault point",
        "dckpt/root/commit.py",
        "        fault_point(Phase.RENAME, 0, step)\n"
        "        if cancelled is not None and cancelled.is_set():\n"
        '            raise RuntimeError(f"the save of step {step} was'
        ' cancelled before its commit")\n'
        "        self.fence.check()  # a job whose run lock was taken commits nothing more\n",
        "        self.fence.check()  # a job whose run lock was taken commits nothing more\n"
        "        fault_point(Phase.RENAME, 0, step)\n"
        "        if cancelled is not None and cancelled.is_set():\n"
        '            raise RuntimeError(f"the save of step {step} was'
        ' cancelled before its commit")\n',
        (
            "tests/test_fenced_commits.py::"
            "test_a_directory_job_fenced_right_before_the_rename_commits_nothing",
        ),
    ),
    Mutant(
        "fence: the directory commit does not check the lock before the rename",
        "dckpt/root/commit.py",
        "        self.fence.check()  # a job whose run lock was taken commits nothing more\n"
        "        replaced: Path | None = None",
        "        replaced: Path | None = None",
        (
            "tests/test_fenced_commits.py::"
            "test_a_directory_job_fenced_right_before_the_rename_commits_nothing",
        ),
    ),
    Mutant(
        "fence: the s3 commit's lock check comes before its last fault point",
        "dckpt/tiers/object_commit.py",
        "        fault_point(Phase.RENAME, 0, step)\n"
        "        if cancelled is not None and cancelled.is_set():\n"
        '            raise RuntimeError(f"the save of step {step} was'
        ' cancelled before its commit")\n'
        "        self._check_objects(step, parse_manifest(raw, str(tmp / MANIFEST_FILE)))\n"
        "        self.fence.check()  # a job that lost its lock may have lost its objects too\n",
        "        self.fence.check()  # a job that lost its lock may have lost its objects too\n"
        "        fault_point(Phase.RENAME, 0, step)\n"
        "        if cancelled is not None and cancelled.is_set():\n"
        '            raise RuntimeError(f"the save of step {step} was'
        ' cancelled before its commit")\n'
        "        self._check_objects(step, parse_manifest(raw, str(tmp / MANIFEST_FILE)))\n",
        (
            "tests/test_fenced_commits.py::"
            "test_an_s3_job_fenced_right_before_its_manifest_put_or_a_delete_changes_nothing",
        ),
    ),
    Mutant(
        "fence: a fenced s3 re-save uncommits the committed step",
        "dckpt/tiers/object_commit.py",
        "        self.fence.check()  # a delete: a job that lost its "
        "lock must not uncommit a step\n",
        "",
        (
            "tests/test_fenced_commits.py::"
            "test_an_s3_job_fenced_right_before_its_manifest_put_or_a_delete_changes_nothing",
        ),
    ),
    Mutant(
        "fence: retention deletes after the lock was taken",
        "dckpt/root/fence.py",
        "        if any(not d.keep for d in decisions):\n            self.check()\n",
        "",
        (
            "tests/test_fenced_commits.py::"
            "test_a_directory_job_fenced_right_before_its_retention_deletes_nothing",
        ),
    ),
    Mutant(
        "fence: the memory ledger prunes after the lock was taken",
        "dckpt/root/memory_ledger.py",
        "        if steps and self.held is not None:\n            self.held()\n",
        "",
        (
            "tests/test_fenced_commits.py::"
            "test_a_directory_job_fenced_right_before_its_retention_deletes_nothing",
        ),
    ),
    Mutant(
        "memory commit: the lineage anchor is the memory step, not its durable anchor",
        "dckpt/tiers/memory_commit.py",
        "            self.anchor = after if isinstance(after, int) else None",
        "            self.anchor = manifest.step",
        (
            "tests/test_step_after_resume.py::"
            "test_a_step_after_each_resume_is_saved_and_resumed_again_exactly",
        ),
    ),
    Mutant(
        "state: a resume writes the model back but not the optimizer",
        "dckpt/train/state.py",
        "                set_state_dict(\n"
        "                    self.model,\n"
        "                    self.optimizer,\n"
        '                    model_state_dict=state_dict["model"],\n'
        '                    optim_state_dict=state_dict["optimizer"],\n'
        "                    options=self._options,\n"
        "                )",
        "                set_model_state_dict(self.model, state_dict["
        '"model"], options=self._options)',
        (
            "tests/test_step_after_resume.py::"
            "test_a_step_after_each_resume_is_saved_and_resumed_again_exactly",
        ),
    ),
    Mutant(
        "agreement: a config refused on one rank is raised on that rank alone",
        "dckpt/load/checks.py",
        "            raise_first(self.comm, refused)\n"
        "        # A state built differently on one rank",
        "            if refused is not None:\n"
        "                raise refused\n"
        "        # A state built differently on one rank",
        (
            "tests/test_one_rank_alone.py::"
            "test_a_config_changed_on_one_rank_alone_is_refused_on_every_rank",
        ),
    ),
    Mutant(
        "agreement: a precision refused on one rank is raised on that rank alone (memory tier)",
        "dckpt/load/checks.py",
        "            raise_first(self.comm, refused)\n"
        "        # A state built differently on one rank",
        "            if refused is not None:\n"
        "                raise refused\n"
        "        # A state built differently on one rank",
        (
            "tests/test_one_rank_alone.py::"
            "test_a_precision_changed_on_one_rank_alone_is_refused_on_every_rank",
        ),
    ),
    Mutant(
        "agreement: a PerRank refusing the new world on one rank is raised on that rank alone",
        "dckpt/load/durable.py",
        "        refused: CheckpointError | None = None\n"
        "        try:\n"
        "            if manifest.world_size != self.world_size:  # a "
        "PerRank may refuse on one rank\n",
        "        if manifest.world_size != self.world_size:\n"
        "            checks.resolve_per_rank(state, state_dict, manif"
        "est.world_size, name, report)\n"
        "        refused: CheckpointError | None = None\n"
        "        try:\n"
        "            if False:\n",
        (
            "tests/test_one_rank_alone.py::"
            "test_a_per_rank_value_refused_on_one_rank_alone_is_refused_on_every_rank",
        ),
    ),
    Mutant(
        "agreement: DCP's load does not gather every rank's read result (one rank's damage)",
        "dckpt/load/durable.py",
        "                no_dist=not self.ctl.distributed,\n",
        "                no_dist=True,\n",
        (
            "tests/test_one_rank_alone.py::"
            "test_a_file_only_one_rank_reads_damaged_sets_the_step_aside_on_every_rank",
        ),
    ),
    Mutant(
        "store: after one call timed out, every call fails at once for QUIET_S though the "
        "store answers again",
        "dckpt/collective/store.py",
        '    if time.monotonic() < _quiet["until"] and _still_stuck():\n',
        '    if time.monotonic() < _quiet["until"]:\n',
        (
            "tests/test_store_comes_back.py::"
            "test_marks_flags_and_heartbeats_read_right_once_the_store_answers_again",
        ),
    ),
    Mutant(
        "gate: a waiter gives up at the first store call that timed out",
        "dckpt/collective/gate.py",
        "            except StoreUnreachableError as exc:  # a stall,"
        " or gone: the deadline tells\n"
        "                lost = exc\n",
        "            except StoreUnreachableError as exc:  # a stall,"
        " or gone: the deadline tells\n"
        "                lost = exc\n"
        "                deadline = time.monotonic()\n",
        ("tests/test_store_comes_back.py::test_the_gate_opens_through_a_stall",),
    ),
    Mutant(
        "comm: a meeting's claim gives up at the first store call that timed out",
        "dckpt/collective/comm.py",
        "            held = _until(end, sealed.claim, store, key, mine)\n",
        "            held = sealed.claim(store, key, mine)\n",
        ("tests/test_store_comes_back.py::test_ranks_meet_through_a_stall",),
    ),
    Mutant(
        "comm: the second's claim of its mark gives up at the first store call that timed out",
        "dckpt/collective/comm.py",
        '_until(end, sealed.claim, store, f"{key}/second", mine)',
        'sealed.claim(store, f"{key}/second", mine)',
        ("tests/test_store_comes_back.py::test_a_meeting_met_through_a_stall_at_the_second_mark",),
    ),
    Mutant(
        "sealed: a wait whose read of the value did not answer gives up at once",
        "dckpt/collective/sealed.py",
        "        except StoreUnreachableError as exc:  # the key is t"
        "here; its read did not answer\n"
        "            lost = exc\n",
        "        except StoreUnreachableError as exc:  # the key is t"
        "here; its read did not answer\n"
        "            lost = exc\n"
        "            end = time.monotonic()\n",
        ("tests/test_store_comes_back.py::test_a_meeting_met_through_a_stall_at_the_second_mark",),
    ),
    Mutant(
        "sealed: a wait whose store wait failed gives up at once",
        "dckpt/collective/sealed.py",
        "        except StoreUnreachableError as exc:\n            lost = exc\n",
        "        except StoreUnreachableError as exc:\n"
        "            lost = exc\n"
        "            end = time.monotonic()\n",
        (
            "tests/test_store_comes_back.py::"
            "test_marks_flags_and_heartbeats_read_right_once_the_store_answers_again",
        ),
    ),
)


def _from_file(path: Path) -> tuple[Mutant, ...]:
    """Mutants someone wrote into a JSON list of {name, path, old, new}; each runs against
    its module's tests from the drawn mutants' map (``mutant_draw.MODULE_TESTS``)."""
    rows = json.loads(path.read_text())
    return tuple(
        Mutant(r["name"], r["path"], r["old"], r["new"], mutant_draw.MODULE_TESTS[r["path"]])
        for r in rows
    )


def _stamp() -> dict[str, str]:
    """Which code a score is of (the commit, ``+`` when the checkout had changes) and when it
    was made: the test run's summary shows the newest score beside the fault table."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return {
        "commit": (head or "unknown") + ("+" if dirty else ""),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _copy_repo(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in ("dckpt", "tests", "launch", "bench"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")


def _env(copy: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(copy), "DCKPT_ALLOW_SKIPS": "1"}
    which = subprocess.run(
        [sys.executable, "-c", "import dckpt; print(dckpt.__file__)"],
        capture_output=True, text=True, env=env, cwd=copy, check=True,
    )  # fmt: skip
    if not which.stdout.strip().startswith(str(copy)):
        raise SystemExit(f"the copy is not what gets imported: {which.stdout.strip()}")
    return env


def _run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    """pytest -x on the copy; rc -1 when it ran past ``timeout`` (its whole process group,
    spawned ranks included, is killed: a hung mutant must not hold the next one's ports)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(copy),
        cwd=copy, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return -1, time.perf_counter() - t0, "timed out"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    return proc.returncode, time.perf_counter() - t0, lines[-1] if lines else err[-200:]


def _drawn_queue(
    drawn: dict[str, list[mutant_draw.Drawn]], equivalent: dict[str, str]
) -> list[mutant_draw.Drawn]:
    """Round robin over the modules, each in its own hashed order: a budget that runs out
    leaves every module with a share, not the first modules with all of it."""
    lists = [[d for d in ds if d.key not in equivalent] for ds in drawn.values()]
    queue: list[mutant_draw.Drawn] = []
    for i in range(max((len(ds) for ds in lists), default=0)):
        queue.extend(ds[i] for ds in lists if i < len(ds))
    return queue


def run_drawn(args: argparse.Namespace) -> int:
    """Mutants drawn by ``tests/mutant_draw.py``, each against its module's tests, until the
    budget is spent; a score per module and every survivor, printed and written."""
    modules = [
        m for m in mutant_draw.MODULE_TESTS if not args.only or any(o in m for o in args.only)
    ]
    drawn = {m: mutant_draw.draw(REPO, m) for m in modules}
    equivalent = mutant_draw.equivalent_keys(REPO)
    queue = _drawn_queue(drawn, equivalent)
    if args.survivors_of:  # the survivors of an earlier run, against today's tests
        earlier = json.loads(Path(args.survivors_of).read_text())["rows"]
        again = {r["key"] for r in earlier if r["verdict"] == "SURVIVED"}
        queue = [d for d in queue if d.key in again]
    if args.per_module:
        taken: dict[str, int] = {}
        kept = []
        for d in queue:
            taken[d.path] = taken.get(d.path, 0) + 1
            if taken[d.path] <= args.per_module:
                kept.append(d)
        queue = kept
    print(f"{sum(map(len, drawn.values()))} mutants drawn in {len(modules)} modules; "
          f"{len(queue)} queued; budget {args.budget_min:.0f} min", flush=True)  # fmt: skip
    if args.list:
        for d in queue:
            print(f"{d.key}\n    {d.what}")
        return 0
    deadline = time.monotonic() + args.budget_min * 60
    work = Path(tempfile.mkdtemp(prefix="dckpt-drawn-"))
    base: dict[str, tuple[bool, float]] = {}  # test file -> (passes unmutated, seconds)
    rows: list[dict[str, object]] = []
    try:
        copy = work / "copy"
        _copy_repo(copy)
        for d in queue:
            if time.monotonic() > deadline:
                break
            files = mutant_draw.MODULE_TESTS[d.path]
            for f in files:
                if f not in base:
                    rc, secs, last = _run_tests(copy, (f,), args.timeout)
                    base[f] = (rc == 0, secs)
                    print(f"unmutated {f}: {'pass' if rc == 0 else 'FAIL'} in {secs:.0f} s "
                          f"({last})", flush=True)  # fmt: skip
            tests = tuple(f for f in files if base[f][0])
            if not tests:
                rows.append({"module": d.path, "key": d.key, "what": d.what, "line": d.line,
                             "verdict": "no passing tests"})  # fmt: skip
                continue
            target = copy / d.path
            original = target.read_text()
            target.write_text(d.text)
            try:
                limit = min(args.timeout, 60.0 + 3 * sum(base[f][1] for f in tests))
                rc, secs, last = _run_tests(copy, tests, limit)
            finally:
                target.write_text(original)
            verdict = "killed" if rc != 0 else "SURVIVED"
            if rc == -1:
                verdict = "killed"
                last = f"timed out after {limit:.0f} s"
            row = {"module": d.path, "key": d.key, "what": d.what, "line": d.line}
            rows.append({**row, "verdict": verdict, "seconds": round(secs, 1), "last_line": last})
            print(f"{verdict:<8} {secs:5.0f} s  {d.path}:{d.line}  {d.what}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _score(modules, drawn, equivalent, rows, args)


def _score(
    modules: list[str],
    drawn: dict[str, list[mutant_draw.Drawn]],
    equivalent: dict[str, str],
    rows: list[dict[str, object]],
    args: argparse.Namespace,
) -> int:
    table = ["| module | drawn | equivalent | run | killed | survived | score |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    killed_all = run_all = 0
    per_module = []
    for m in modules:
        mine = [r for r in rows if r["module"] == m]
        run = [r for r in mine if r["verdict"] in ("killed", "SURVIVED")]
        killed = sum(r["verdict"] == "killed" for r in run)
        eq = sum(d.key in equivalent for d in drawn[m])
        killed_all += killed
        run_all += len(run)
        score = f"{killed / len(run):.0%}" if run else "-"
        table.append(f"| {m} | {len(drawn[m])} | {eq} | {len(run)} | {killed} | "
                     f"{len(run) - killed} | {score} |")  # fmt: skip
        per_module.append({"module": m, "drawn": len(drawn[m]), "equivalent": eq,
                           "run": len(run), "killed": killed})  # fmt: skip
    total = f"{killed_all / run_all:.0%}" if run_all else "-"
    table.append(f"| **all** | {sum(map(len, drawn.values()))} | {len(equivalent)} | "
                 f"{run_all} | {killed_all} | {run_all - killed_all} | **{total}** |")  # fmt: skip
    survivors = [r for r in rows if r["verdict"] == "SURVIVED"]
    lines = ["", *table, "", f"{len(survivors)} survivors (not equivalent, no test failed):"]
    lines += [f"- {r['key']}\n    {r['what']}" for r in survivors]
    print("\n".join(lines))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {"kind": "drawn", **_stamp(), "modules": per_module, "rows": rows}
        out.write_text(json.dumps(report, indent=1) + "\n")
        out.with_suffix(".md").write_text("\n".join(lines).lstrip() + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", nargs="*", default=[], help="mutants whose name contains one of these")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    p.add_argument("--json", default=None, help="also write the table here")
    p.add_argument("--drawn", action="store_true", help="mutants drawn by tests/mutant_draw.py")
    p.add_argument("--budget-min", type=float, default=40.0, help="--drawn: minutes to spend")
    p.add_argument("--per-module", type=int, default=0, help="--drawn: at most this many each")
    p.add_argument(
        "--no-base", action="store_true", help="skip the unmutated run (right after make test)"
    )
    p.add_argument("--mutants-file", default=None, help="hand-written mutants (JSON) to run")
    p.add_argument("--survivors-of", default=None, help="--drawn: rerun this JSON's survivors")
    args = p.parse_args(argv)
    if args.drawn:
        return run_drawn(args)
    pool = _from_file(Path(args.mutants_file)) if args.mutants_file else MUTANTS
    chosen = [m for m in pool if not args.only or any(o in m.name for o in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.path}; tests: {' '.join(m.tests)}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="dckpt-mutants-"))
    rows: list[dict[str, object]] = []
    try:
        base = work / "base"
        _copy_repo(base)
        every = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, secs, last = (
            (0, 0.0, "skipped") if args.no_base else _run_tests(base, every, args.timeout)
        )
        print(f"unmutated: {'pass' if rc == 0 else 'FAIL'} in {secs:.0f} s ({last})", flush=True)
        if rc != 0:
            print("the chosen tests fail without any mutant: fix that first", file=sys.stderr)
            return 2
        for i, m in enumerate(chosen):
            copy = work / f"m{i}"
            _copy_repo(copy)
            target = copy / m.path
            text = target.read_text()
            if text.count(m.old) != 1:
                rows.append({"mutant": m.name, "verdict": "STALE (snippet not found once)"})
                print(f"STALE    {m.name}", flush=True)
                continue
            target.write_text(text.replace(m.old, m.new))
            rc, secs, last = _run_tests(copy, m.tests, args.timeout)
            verdict = "killed" if rc != 0 else "SURVIVED"
            rows.append({"mutant": m.name, "verdict": verdict, "seconds": round(secs, 1),
                         "tests": list(m.tests), "last_line": last})  # fmt: skip
            print(f"{verdict:<8} {secs:5.0f} s  {m.name}  ({last})", flush=True)
            shutil.rmtree(copy, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    killed = sum(r["verdict"] == "killed" for r in rows)
    print("\n| mutant | verdict |\n|---|---|")
    for r in rows:
        print(f"| {r['mutant']} | {r['verdict']} |")
    print(f"\n{killed} of {len(rows)} mutants killed")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        report = {"kind": "probes", **_stamp(), "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
