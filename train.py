"""Train: `python train.py [group=option ...] [key=value ...]` (see README.md).

The package (and torch) is imported inside ``main``: a bad command line is reported, and
strict mode's re-execution happens (``repro.defense.process_env``), before torch is loaded."""

import json
import logging
import os
import shlex
import signal
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from repro.base.errors import (
    INTERRUPTED_EXIT_CODE,
    JobFailed,
    Preempted,
    ReproError,
    exit_with,
    report_error,
)
from repro.base.files import ERROR_FILE, LAUNCH_DIR, LOG_FILE, open_run_file, resume_command
from repro.base.signals import arm as arm_preemption
from repro.defense.config import check_overrides
from repro.defense.process_env import under_torchrun

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    from repro.base.files import write_file
    from repro.engine.dist import explain_timeout, launched_world, record_elastic_run, shutdown
    from repro.engine.loop import train

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)

    taken = False  # is the run directory this launch's? (a refused one changes no byte)

    def accepted(run_dir: Path) -> None:
        """The run directory is this run's: record the launch, as Hydra would have."""
        nonlocal taken
        taken = True
        record_elastic_run(cfg, run_dir)  # where a restart of this group resumes (torchrun)
        (run_dir / ERROR_FILE).unlink(missing_ok=True)  # from an earlier attempt of this job
        launch = run_dir / LAUNCH_DIR
        launch.mkdir(exist_ok=True)
        for name, node in (
            ("config.yaml", cfg),
            ("hydra.yaml", OmegaConf.create({"hydra": hydra_cfg})),
            ("overrides.yaml", hydra_cfg.overrides.task),
        ):
            text = OmegaConf.to_yaml(node)
            write_file(launch / name, text)

    try:
        summary = train(cfg, run_dir, accepted=accepted, after_step=_fault_kill())
    except Preempted:
        shutdown()  # every rank stopped after the same step, past a barrier
        raise
    except KeyboardInterrupt:  # a second Ctrl-C (or one before training started): at once
        print(
            "interrupted: stopped at once. To continue from the last checkpoint (if one was "
            f"written): the same command plus {resume_command(run_dir)}",
            file=sys.stderr,
        )
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    except Exception as err:
        if launched_world().distributed:
            # Stop this rank now: waiting in NCCL's teardown for ranks that are gone can hang.
            # torchrun then stops the others and shows this rank's error in its summary.
            timed_out = explain_timeout(err, launched_world(), int(cfg.dist.timeout_s))
            if not isinstance(err, ReproError) and timed_out is None:
                traceback.print_exc()
            if not taken:  # this rank's folders for the run go again, if left empty
                from repro.engine.callbacks import remove_unused_output_dir

                remove_unused_output_dir()
            report_error(timed_out or err)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        # an error before the directory was taken (a refusal, a config that cannot build)
        # writes nothing there, except a sweep job's record into a directory Hydra has just
        # created (a relaunch into either can still take it)
        new = run_dir.is_dir() and not any(run_dir.iterdir())
        if hydra_cfg.mode != RunMode.MULTIRUN:
            if not taken:  # the folders this launch made for its run go again, if empty
                from repro.engine.callbacks import remove_unused_output_dir

                remove_unused_output_dir()
            if isinstance(err, ReproError):
                exit_with(err)
            if not taken:
                traceback.print_exc()
                raise SystemExit(1) from None
            log_file = run_dir / LOG_FILE
            with open_run_file(log_file, "a") as f:  # never through a link
                f.write(traceback.format_exc())
            first = (str(err).strip().splitlines() or [""])[0]
            print(
                f"error: {type(err).__name__}: {first} (traceback in {log_file})",
                file=sys.stderr,
            )
            raise SystemExit(1) from None
        if new:  # a sweep's job: record the launch, so that its report lists the failure
            accepted(run_dir)
        if taken:
            record = {
                "type": type(err).__name__,
                "message": str(err),
                "traceback": traceback.format_exc(),
            }
            text = json.dumps(record, indent=2) + "\n"
            write_file(run_dir / ERROR_FILE, text)
        print(f"error: job {hydra_cfg.job.num} ({run_dir.name}): {err}", file=sys.stderr)
        # the sweep goes on; it ends with this line, not a second copy of the error (its
        # traceback is in the job's error.json)
        raise JobFailed(
            f"a job of the sweep failed ({run_dir.name}: above); its other jobs ran: "
            f"repro report {shlex.quote(str(run_dir.parent))} lists them all"
        ) from None
    shutdown()  # leave the process group (torchrun)
    # what a sweeper (Optuna, Ax) optimises; a run finished before summaries named it: accuracy
    return summary.get(summary.get("headline", "val_accuracy"), float("nan"))


def _fault_kill():
    """``REPRO_FAULT_KILL_AFTER_STEP=N``: this process SIGKILLs itself right after optimizer
    step N, before that step is recorded -- a kill at a known point, for the tests of a
    fork's experiment (``repro.tools.testing.train_killed``). Under torchrun, with
    ``REPRO_FAULT_KILL_RANK=R`` only rank R, and only before torchrun restarts the group.
    ``REPRO_FAULT_SIGNAL=SIGUSR2`` sends that signal instead (a pre-emption notice: the run
    checkpoints after step N and stops, and a resumed run never sees step N again).
    Unset: no hook."""
    at = os.environ.get("REPRO_FAULT_KILL_AFTER_STEP")
    rank = os.environ.get("REPRO_FAULT_KILL_RANK")
    if not at or (rank is not None and rank != os.environ.get("RANK", "0")):
        return None
    if rank is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) > 0:
        return None

    how = signal.Signals[os.environ.get("REPRO_FAULT_SIGNAL") or "SIGKILL"]

    def kill(step: int, model) -> None:
        if step == int(at):
            os.kill(os.getpid(), how)

    return kill


if __name__ == "__main__":
    arm_preemption()  # from here on a cluster's SIGTERM stops the run cleanly, exit status 75
    try:
        multirun = any(a in ("-m", "--multirun") or a == "hydra.mode=MULTIRUN" for a in sys.argv)
        check_overrides(sys.argv[1:], CONF_DIR, multirun)  # one line for a bad value, first
    except ReproError as err:
        exit_with(err)
    if not under_torchrun():
        main()
    else:
        # Under torchrun, end the process as soon as the run's Python work is done: the C++
        # teardown of the process group's threads at interpreter exit intermittently aborts
        # a rank ("terminate called without an active exception", about 1 launch in 10 with
        # gloo on torch 2.13), and torchrun would report a finished run as failed.
        try:
            main()
            status = 0
        except SystemExit as stop:  # Preempted (75, 130), exit_with (1)
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
