#!/usr/bin/env python
"""Does the test suite catch the bugs it exists to catch? Apply each mutation listed in
tests/README.md to a copy of the source, run the tests that must catch it, and say CAUGHT
(every one of them fails) or MISSED.

    python scripts/mutations.py            # all mutations (about a minute on 2 cores)
    python scripts/mutations.py --list     # the mutations and their tests
    python scripts/mutations.py sampler    # one, by name

The copy lives in a temporary directory; the checkout is never modified. Exit status 0 when
every mutation is caught, 1 when one is missed, 2 when a mutation no longer applies (the code
it patches has changed: update MUTATIONS).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    what: str
    file: str  # relative to the project root
    old: str  # replaced once; it must occur exactly once
    new: str
    tests: list[str]  # each must fail with the mutation (and pass without it)


MUTATIONS = [
    Mutation(
        "sampler",
        "the sampler's start_step forced to 0 (a resumed run replays the first steps' data)",
        "src/repro/components/data/loading.py",
        "self.seed, self.start_step = seed, start_step",
        "self.seed, self.start_step = seed, 0",
        [
            "tests/test_data.py::test_sampler_is_a_pure_function_of_the_step",
            "tests/test_resume.py::test_a_storm_of_kills_ends_on_the_uninterrupted_bits",
        ],
    ),
    Mutation(
        "flip",
        "an un-keyed random flip (drawn from the process's global generator)",
        "src/repro/components/data/augment.py",
        "draws[:, 2] & 1], 1",
        "torch.randint(0, 2, index.shape, device=index.device)], 1",
        [
            "tests/test_data.py::test_loader_output_does_not_depend_on_worker_count[2-workers]",
            "tests/test_train.py::test_loader_workers_do_not_change_the_bits",
        ],
    ),
    Mutation(
        "sequential-sum",
        "the tree reduction replaced by a sequential sum",
        "src/repro/engine/reduction.py",
        "    if hi - lo == 1:\n        return leaf(lo)\n",
        "    total = leaf(lo)\n    for k in range(lo + 1, hi):\n        total = add(total, leaf(k))\n"
        "    return total\n",
        [
            "tests/test_loop.py::test_tree_shape_is_fixed_and_halves_at_the_midpoint",
            "tests/test_dist.py::test_world_size_does_not_change_the_bits[2]",
        ],
    ),
    Mutation(
        "rng-restore",
        "the global RNG states not restored on resume",
        "src/repro/records/checkpoint.py",
        '        set_global_rng_states(state["rng"])\n',
        "",
        [
            "tests/test_resume_checkpoints.py::"
            "test_third_party_randomness_resumes_exactly_because_the_rng_states_are_restored",
        ],
    ),
    Mutation(
        "mask-stays",
        "a segmentation mask not cropped and flipped with its image",
        "src/repro/components/data/augment.py",
        "            targets = crop_flip_batch(targets[:, None], params, self.pad, fill=IGNORE)[:, 0]\n",
        "            pass\n",
        ["tests/test_segmentation.py::test_masks_get_their_images_crop_and_flip"],
    ),
    Mutation(
        "adjoint-edge",
        "upsample2x's backward without the edge correction (edge weight 0.75, not 1)",
        "src/repro/components/ops.py",
        "    pairs = _pad_one(grad, dim).unflatten(dim, (n + 1, 2))",
        "    pairs = torch.nn.functional.pad(grad, (1, 1) if dim == -1 else (0, 0, 1, 1))"
        ".unflatten(dim, (n + 1, 2))",
        [
            "tests/test_ops.py::test_upsample2x_is_pytorchs_bilinear_upsampling_and_its_transpose"
            "[shape0]",
            "tests/test_ops.py::"
            "test_upsample2x_float32_is_within_rounding_of_pytorchs_and_repeats_bit_exactly",
        ],
    ),
    Mutation(
        "scatter-order",
        "the reduce-scatter finishing each shard by a left fold over the ranks' partial sums",
        "src/repro/engine/reduction.py",
        "            mine = finish_tree(ex.k, known, lambda a, b: a.add_(b))",
        "            mine = list(known.values())[0]\n"
        "            for v in list(known.values())[1:]:\n"
        "                mine = mine.add_(v)",
        [
            "tests/test_dist.py::test_both_ordered_reductions_over_three_processes_are_the_tree_of_one",
        ],
    ),
    Mutation(
        "overlap-order",
        "the overlapped exchange adding the last micro-batch's gradients to its left "
        "siblings top first (the tree adds the deepest first)",
        "src/repro/engine/reduction.py",
        "            for left in reversed(ex.lefts):  # the additions tree_reduce makes",
        "            for left in ex.lefts:  # the additions tree_reduce makes",
        [
            "tests/test_dist.py::test_both_ordered_reductions_over_three_processes_are_the_tree_of_one",
        ],
    ),
    Mutation(
        "unkeyed-numpy",
        "a user's augmentation drawing from NumPy's global state as the worker left it (the "
        "state not set from the sample's key)",
        "src/repro/components/data/augment.py",
        "    np.random.seed([value & 0xFFFFFFFF, value >> 32])\n",
        "",
        [
            "tests/test_augment.py::test_any_pipeline_gives_the_same_bits_repeated_with_any_"
            "workers_resumed_and_on_two_processes[user]",
        ],
    ),
    Mutation(
        "private-rng-unseen",
        "the check before step 1 comparing nothing across builds, orders and clock times (a "
        "private generator behind a keyed coin, a call counter, the clock go unseen)",
        "src/repro/components/data/pipeline_check.py",
        "    if any(not _same(ref[k], other[k]) for k in ref):\n        raise ConfigError(_why(",
        "    if False:\n        raise ConfigError(_why(",
        [
            "tests/test_pipeline_check.py::test_a_private_generator_behind_a_keyed_coin_is_"
            "refused_under_every_seed[1]",
            "tests/test_pipeline_check.py::test_a_transform_reading_the_clock_is_refused",
        ],
    ),
    Mutation(
        "pipeline-writes-stored-image",
        "a user's pipeline given the stored image itself, not a copy (a Cutout in place "
        "changes an in-memory split)",
        "src/repro/components/data/augment.py",
        "                image, target = image.clone(), _copy(target)\n",
        "",
        [
            "tests/test_pipeline_check.py::test_a_write_into_the_input_cannot_change_the_"
            "stored_images",
        ],
    ),
    Mutation(
        "digest-unchecked",
        "a checkpoint without its sidecar loaded without checking its own digest",
        "src/repro/records/checkpoint.py",
        "        if held is not None and content_sha256(state) != held:",
        "        if False:",
        [
            "tests/test_resume_checkpoints.py::test_a_damaged_checkpoint_is_detected_and_resume_falls_back"
            "[damaged_without_checksum-its content does not match its own digest (corrupted)]",
        ],
    ),
    Mutation(
        "no-kernel-lock",
        "the run directory's lock file opened but not locked",
        "src/repro/records/rundir.py",
        "                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "                pass\n",
        [
            "tests/test_rundir.py::test_eight_processes_taking_over_a_dead_runs_lock_at_once_"
            "exactly_one_holds_it",
            "tests/test_rundir.py::test_a_run_directory_in_use_is_refused_naming_its_holder",
        ],
    ),
    Mutation(
        "untracked-clean",
        "untracked files under src/ and conf/ not counted as dirty (a fork's uncommitted model)",
        "src/repro/records/fingerprint.py",
        '"dirty": bool(diff or untracked),',
        '"dirty": bool(diff),',
        [
            "tests/test_compare.py::test_untracked_code_and_config_make_the_checkout_dirty_and_"
            "compare_names_them",
        ],
    ),
    Mutation(
        "unpaired-comparison",
        "groups compared unpaired (Welch) although their seeds match",
        "src/repro/tools/comparisons.py",
        "if len(common) >= 2:",
        "if len(common) >= 2 and False:",
        ["tests/test_sweep.py::test_two_groups_of_a_sweep_are_compared_seed_by_seed"],
    ),
    Mutation(
        "pairs-misaligned",
        "a group's values paired with another seed's of the baseline",
        "src/repro/tools/comparisons.py",
        "stats.paired([a[s] for s in common], [b[s] for s in common])",
        "stats.paired([a[s] for s in common], [b[s] for s in reversed(common)])",
        ["tests/test_sweep.py::test_two_groups_of_a_sweep_are_compared_seed_by_seed"],
    ),
    Mutation(
        "channels-last-unrecorded",
        "trainer.channels_last=auto recorded as auto, not as the format the model was built in",
        "src/repro/engine/loop.py",
        "cfg = record_channels_last(self.cfg, channels_last)",
        "cfg = self.cfg",
        [
            "tests/test_compile.py::test_channels_last_auto_is_recorded_as_the_format_it_chose",
            "tests/test_compile.py::test_channels_last_repeats_with_any_loader_and_is_recorded",
        ],
    ),
    Mutation(
        "mask-top-left",
        "a mask resized by top-left nearest, floor(i·n/size): half an output pixel off its image",
        "src/repro/components/data/augment.py",
        "    centre = (2 * i + 1) * n\n",
        "    centre = 2 * i * n\n",
        [
            "tests/test_geometry.py::test_resize_puts_the_mask_on_its_images_grid[size0]",
            "tests/test_geometry.py::test_a_mask_taken_to_training_size_and_back_keeps_more_of_itself",
        ],
    ),
    Mutation(
        "split-by-position",
        "a file's split keyed by its position in the sorted folder, not by its name",
        "src/repro/components/data/splitting.py",
        'u = {k: keyed_unit(seed, purpose + "/split", k) for k in units}',
        'u = {k: keyed_unit(seed, purpose + "/split", str(i)) for i, k in enumerate(units)}',
        ["tests/test_splits.py::test_adding_a_file_moves_no_other_file"],
    ),
    Mutation(
        "dice-pooled-headline",
        "the headline val_dice pooled over the split's pixels, not the mean over images",
        "src/repro/components/tasks.py",
        'out["val_dice"] = _mean([per_image[n][0] for n in self.names[first:]])',
        'out["val_dice"] = _mean(dice[first:])',
        [
            "tests/test_segmentation.py::test_the_headline_is_the_per_image_mean_and_the_pooled_value_is_kept"
        ],
    ),
    Mutation(
        "scored-at-training-size",
        "a squashed model scored against its resized masks, not each native mask",
        "src/repro/engine/evaluation.py",
        "if back and _masks_off_size(targets, pipeline.size):",
        "if False:",
        ["tests/test_native.py::test_a_squashed_model_is_scored_against_each_native_mask"],
    ),
    Mutation(
        "threads-unpinned",
        "per-sample work left on the main process's threads (the one-thread rule a no-op)",
        "src/repro/components/data/sample_settings.py",
        "        if torch.get_num_threads() != SAMPLE_THREADS:\n",
        "        if False:\n",
        [
            "tests/test_threads.py::test_a_users_reduction_gives_a_workers_bits_in_the_main_process",
            "tests/test_threads.py::test_what_a_transform_reads_of_its_process_is_the_same_in_every_loader",
        ],
    ),
    Mutation(
        "mean-threaded",
        "the augmentations' mean taken by torch (split across the intra-op threads)",
        "src/repro/components/data/augment.py",
        "return float(np.mean(x.numpy(force=True), dtype=np.float64))",
        "return float(x.mean())",
        [
            "tests/test_threads.py::test_each_shipped_transform_gives_one_result_under_one_and_two_threads[SegmentationAugment]",
            "tests/test_threads.py::test_each_shipped_transform_gives_one_result_under_one_and_two_threads[RandomPatch]",
        ],
    ),
    Mutation(
        "check-one-process",
        "the check's second pass run in this process's identity (pid, worker info, addresses)",
        "src/repro/components/data/pipeline_check.py",
        "ELSEWHERE = (True, True)",
        "ELSEWHERE = (True, False)",
        [
            "tests/test_pipeline_check.py::test_what_differs_between_processes_is_refused[ReadsTheProcessId]",
            "tests/test_pipeline_check.py::test_what_differs_between_processes_is_refused[ReadsTheWorkerId]",
        ],
    ),
]


def copy_project(dest: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".venv", ".git", "outputs", "multirun", "benchmarks", "__pycache__", "*.egg-info"
    )
    shutil.copytree(ROOT, dest, ignore=ignore)


def run_tests(project: Path, tests: list[str]) -> dict[str, bool]:
    """{test: passed} for the given node ids, run in ``project`` with its src/ first."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(project / "src"), str(project / "tests")]),
    }
    report = project / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         *tests],
        cwd=project,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    import xml.etree.ElementTree as ET

    results: dict[str, bool] = {}
    if not report.is_file():  # pytest did not get as far as running tests
        return results
    for case in ET.parse(report).iter("testcase"):
        failed = any(child.tag in ("failure", "error") for child in case)
        skipped = any(child.tag == "skipped" for child in case)
        node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        results[node] = not failed and not skipped
    report.unlink()
    return results


def check(m: Mutation, base: Path) -> bool | None:
    """True: caught by every listed test; False: missed; None: does not apply."""
    project = base / m.name
    copy_project(project)
    path = project / m.file
    text = path.read_text()
    if text.count(m.old) != 1:
        return None
    path.write_text(text.replace(m.old, m.new))
    results = run_tests(project, m.tests)
    caught = [t for t in m.tests if results.get(t) is False]
    for t in m.tests:
        print(f"    {'fails (caught)' if t in caught else 'PASSES (missed)':<16} {t}")
    return len(caught) == len(m.tests)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("names", nargs="*", help="mutations to check (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n  " + "\n  ".join(m.tests))
        return 0
    status = 0
    with tempfile.TemporaryDirectory(prefix="repro-mutations-") as tmp:
        print("without mutations (the tests must pass):")
        copy_project(Path(tmp) / "clean")
        wanted = sorted({t for m in chosen for t in m.tests})
        clean = run_tests(Path(tmp) / "clean", wanted)
        failing = [t for t in wanted if not clean.get(t)]
        if failing:  # failed, skipped, or not found (renamed?): the check would mean nothing
            print("  not passing (or not found): " + ", ".join(failing))
            return 2
        print(f"  {len(clean)} tests pass")
        for m in chosen:
            print(f"{m.name}: {m.what}")
            verdict = check(m, Path(tmp))
            if verdict is None:
                print(f"  DOES NOT APPLY: {m.file} no longer holds the code it patches")
                status = 2
            else:
                print(f"  {'CAUGHT' if verdict else 'MISSED'}")
                status = status or (0 if verdict else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
