"""World-size invariance: `torchrun` with 1, 2 or 4 processes gives the same bits (gloo on
the CPU), and a checkpoint written by one world size resumes in another with the same bits.

Each multi-process run is a real `torchrun --standalone` launch of train.py, strict,
`loader=multi`, the ConvNet with dropout on; the one-process reference trains in this
process (conftest.train_here)."""

import csv
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import launch
from conftest import Run, run_train, train_cmd, train_here, user_env, with_tests_on_path
from repro.base.errors import ConfigError, ReproError
from repro.base.files import LOCK_FILE
from repro.base.world import World, launched_world
from repro.defense.config import compose
from repro.engine.reduction import (
    add_partials,
    canonical_nodes,
    check_split,
    finish_tree,
    is_subtree,
    share,
    tree_reduce,
)
from repro.engine.running_stats import RunningStats
from repro.tools.compare import compare_dirs

# 4 micro-batches of 16 a step: 4, 2 or 1 of them on each rank
SMALL = [
    "trainer.batch_size=64",
    "trainer.micro_batch_size=16",
    "data.train_size=512",  # 8 steps an epoch: the run crosses an epoch boundary
    "data.val_size=128",
    "trainer.max_steps=12",
    "trainer.eval_every=6",
    "trainer.trace_every=3",
    "trainer.checkpoint_every=5",  # step 5: mid-epoch, and not a multiple of anything else
    "loader=multi",
    "logger=[csv,tensorboard]",  # rank 0's alone (test_only_rank_0_writes_into_one_run_directory)
]


def metrics(run: Run) -> str:
    return (run.dir / "metrics.csv").read_text()


def assert_same_bits(run: Run, reference: Run) -> None:
    assert run.summary["weights_sha256"] == reference.summary["weights_sha256"]
    assert metrics(run) == metrics(reference)  # every step's loss and grad norm, exactly
    result = compare_dirs(reference.dir, run.dir)
    assert result.identical, result.text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (plain python), and torchrun with 2 and 4 processes."""
    base = tmp_path_factory.mktemp("world")
    cache: dict[int, Run] = {}

    def get(world_size: int) -> Run:
        if world_size not in cache:
            run_dir = base / f"w{world_size}"
            one = world_size == 1
            cache[world_size] = (
                train_here(run_dir, *SMALL) if one else run_train(run_dir, *SMALL, nproc=world_size)
            )
        return cache[world_size]

    return get


@pytest.mark.e2e
@pytest.mark.parametrize("world_size", [2, 4])
def test_world_size_does_not_change_the_bits(runs, world_size):
    one, many = runs(1), runs(world_size)
    assert many.summary["world_size"] == world_size and one.summary["world_size"] == 1
    assert_same_bits(many, one)
    env = compare_dirs(one.dir, many.dir).text()
    assert f"environment.world_size: 1 vs {world_size}" in env


@pytest.mark.e2e
def test_torchrun_restarts_a_group_whose_rank_was_killed_and_it_resumes_by_itself(runs, tmp_path):
    """``torchrun --max-restarts=1``, rank 1 SIGKILLed after step 7 (the checkpoint is step
    5's), no hydra.run.dir and no trainer.resume given: the restarted group finds the first
    start's run directory, resumes there from step 5 and ends on the one-process bits."""
    outputs = tmp_path / "outputs"
    cmd = [*train_cmd(*SMALL, f"paths.output_dir={outputs}", nproc=2)]
    cmd.insert(cmd.index("--standalone"), "--max-restarts=1")
    env = user_env(REPRO_FAULT_KILL_AFTER_STEP="7", REPRO_FAULT_KILL_RANK="1")
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        proc = launch.popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=out)
    try:
        proc.wait(timeout=300)
    finally:
        stop_torchrun(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
    (run_dir,) = [p.parent for p in outputs.glob("*/*/summary.json")]  # one directory
    restarted = Run(run_dir, json.loads((run_dir / "summary.json").read_text()), log.read_text())
    assert [r["step"] for r in restarted.summary["resumes"]] == [5]
    assert_same_bits(restarted, runs(1))
    (record,) = (outputs / ".torchelastic").iterdir()  # where the restart found it
    assert json.loads(record.read_text())["run_dir"] == str(run_dir)


def workers_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(w) for w in out.split()]


def stop_torchrun(proc) -> None:
    """A torchrun still running after a test (it failed): kill its ranks, which run in a
    session of their own and would outlive it, then torchrun."""
    if proc.poll() is None:
        for worker in workers_of(proc.pid):
            os.kill(worker, signal.SIGKILL)
        proc.kill()


def not_rank_0(proc, run_dir: Path) -> list[int]:
    """The pids of torchrun's ranks other than rank 0, which holds the run directory's lock
    (its pid written there; a forked rank's /proc/PID/environ is its parent's)."""
    holder = json.loads((run_dir / LOCK_FILE).read_text())["pid"]
    return [w for w in workers_of(proc.pid) if w != holder]


@pytest.mark.e2e
def test_a_rank_that_hangs_stops_the_group_after_the_timeout_with_one_line_naming_it(tmp_path):
    """Rank 1 of 2 SIGSTOPped mid-run: rank 0's next collective waits dist.timeout_s (5 s),
    then the group stops with one line naming rank 1 (its heartbeat stopped), not after
    the default half hour, and never waiting forever."""
    log = tmp_path / "torchrun.log"
    cmd = train_cmd(f"hydra.run.dir={tmp_path / 'run'}", *SMALL, "trainer.max_steps=400",
                    "dist.timeout_s=5", nproc=2)  # fmt: skip
    with open(log, "w") as out:
        proc = launch.popen(cmd, cwd=tmp_path, env=user_env(), stdout=out, stderr=out)
    metrics_file, stopped, start = tmp_path / "run" / "metrics.csv", None, time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - start < 120:
            started = metrics_file.is_file() and metrics_file.read_text().count("\n") > 3
            if stopped is None and started:
                (stopped,) = not_rank_0(proc, tmp_path / "run")  # rank 1 of 2
                os.kill(stopped, signal.SIGSTOP)
                stopped_at = time.monotonic()
            if stopped and "stopped answering" in log.read_text():
                os.kill(stopped, signal.SIGKILL)  # what torchrun does after its grace period
                break
            time.sleep(0.2)
        proc.wait(timeout=60)
    finally:
        stop_torchrun(proc)
    errors = [line for line in log.read_text().splitlines() if line.startswith("error: [rank 0/2]")]
    assert proc.returncode != 0 and len(errors) == 1, log.read_text()[-3000:]
    assert "dist.timeout_s=5 s: rank 1 of 2 stopped answering" in errors[0]
    assert time.monotonic() - stopped_at < 60


def test_a_collective_timeout_is_explained_and_other_timeouts_are_not(monkeypatch):
    """gloo's two ways of saying it (both met in the hang test) become the one-line verdict
    (here without a store to read: it says so); a download's timeout and a lost peer do not."""
    from repro.engine.dist import explain_timeout

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    world = World(0, 2)
    for text in (
        "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv",
        "[/x/gloo/transport/tcp/pair.cc:589] Application timeout caused pair closure",
    ):
        verdict = str(explain_timeout(RuntimeError(text), world, 5))
        assert verdict.startswith("a collective waited dist.timeout_s=5 s: a rank stopped")
        assert text in verdict  # the error's own line kept
    assert explain_timeout(TimeoutError("The read operation timed out"), world, 5) is None
    assert explain_timeout(RuntimeError("[gloo] Connection reset by peer"), world, 5) is None
    assert explain_timeout(RuntimeError("gloo: timed out"), World(0, 1), 5) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(run_dir: Path, rendezvous: str, *overrides: str) -> Run:
    """Two "nodes" on this machine: two torchrun invocations, node ranks 0 and 1, one
    process each, meeting on 127.0.0.1 through ``static`` (--master_addr/--master_port, as
    a SLURM script gives them) or ``c10d`` (--rdzv-endpoint) rendezvous. Node 1 starts in
    a folder of its own and is given a run directory of its own: it must use node 0's and
    write nothing."""
    port = free_port()
    meet = (
        ["--master_addr=127.0.0.1", f"--master_port={port}"]
        if rendezvous == "static"
        else ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two"]
    )
    node1 = run_dir.parent / "node1"
    node1.mkdir()
    procs, logs = [], [run_dir.parent / "node0.log", node1 / "node1.log"]
    try:
        for node, (where, own) in enumerate([(run_dir.parent, run_dir), (node1, node1 / "run")]):
            cmd = train_cmd(f"hydra.run.dir={own}", *SMALL, *overrides)
            launcher = ["-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}"]
            cmd[1:1] = [*launcher, "--nproc_per_node=1", *meet]
            with open(logs[node], "w") as out:
                procs.append(launch.popen(cmd, cwd=where, env=user_env(), stdout=out, stderr=out))
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            stop_torchrun(p)
    output = logs[0].read_text() + logs[1].read_text()
    assert [p.returncode for p in procs] == [0, 0], output[-6000:]
    assert sorted(p.name for p in node1.iterdir()) == ["node1.log"]  # node 1 wrote nothing
    return Run(run_dir, json.loads((run_dir / "summary.json").read_text()), output)


@pytest.mark.e2e
def test_two_nodes_with_static_rendezvous_give_the_one_process_bits(runs, tmp_path):
    two = two_nodes(tmp_path / "nodes", "static")
    assert two.summary["world_size"] == 2
    assert_same_bits(two, runs(1))


@pytest.mark.e2e
def test_two_nodes_with_c10d_rendezvous_resume_a_one_process_checkpoint_to_its_bits(runs, tmp_path):
    one = runs(1)
    step10 = one.dir / "checkpoints" / "step-00000010.pt"  # the periodic ones kept: 10, 12
    two = two_nodes(tmp_path / "nodes", "c10d", f"trainer.resume={step10}")
    assert two.summary["world_size"] == 2
    assert [r["step"] for r in two.summary["resumes"]] == [10]
    assert_same_bits(two, one)


@pytest.mark.e2e
def test_three_processes_give_the_one_process_bits(tmp_path):
    """W = 3 does not cut K = 6 into power-of-two subtrees: ranks 0 and 1 each sum two
    canonical nodes of the tree ([0,1) [1,2); [2,3) [3,4)), rank 2 one ([4,6)), and the
    reduce-scatter finishes the tree over them."""
    six = [*SMALL, "trainer.batch_size=96", "data.train_size=768", "loader=single"]  # 6 x 16
    one = train_here(tmp_path / "w1", *six)
    three = run_train(tmp_path / "w3", *six, nproc=3)
    assert three.summary["world_size"] == 3
    assert_same_bits(three, one)


@pytest.mark.e2e
def test_only_rank_0_writes_into_one_run_directory(runs, tmp_path):
    run = runs(2)
    assert sorted(p.name for p in (run.dir / ".hydra").iterdir()) == [
        "config.yaml",
        "hydra.yaml",
        "overrides.yaml",
    ]
    log = (run.dir / "train.log").read_text()
    assert log.count("determinism report") == 1 and "[rank 1]" not in log
    assert "4 x 16 (2 on each of 2 processes)" in log
    # one run directory: no rank made its own (e.g. outputs/<date>/ in the working directory)
    assert sorted(p.name for p in run.dir.parent.iterdir()) == sorted(
        p.name for p in run.dir.parent.iterdir() if p.name.startswith("w")
    )
    assert not list(run.dir.rglob("*rank*"))
    assert len(list((run.dir / "tensorboard").glob("events.out.tfevents.*"))) == 1


@pytest.mark.e2e
def test_a_two_process_checkpoint_resumes_in_another_world_size(runs, tmp_path):
    """Resumed in one process. Every world size gives the one-process bits (above), so a
    resume into 4 processes is the same claim at several times the CI time."""
    # written by the 2-process run at step 10 (mid-epoch: 8 steps an epoch)
    checkpoint = runs(2).dir / "checkpoints" / "step-00000010.pt"
    assert checkpoint.exists()
    resumed = train_here(tmp_path / "resumed", *SMALL, f"trainer.resume={checkpoint}")
    assert resumed.summary["resumes"][-1]["step"] == 10
    assert resumed.summary["resumes"][-1]["world_size"] == 1
    assert_same_bits(resumed, runs(1))


@pytest.mark.e2e
def test_preempted_two_process_run_resumes_in_one_process_with_the_same_bits(runs, tmp_path):
    """SIGTERM to torchrun: every rank stops after the same step, rank 0 checkpoints, and
    the run resumes with one process to the uninterrupted run's bits."""
    run_dir = tmp_path / "preempted"
    steps = [*SMALL, "trainer.max_steps=30", "trainer.checkpoint_every=1000"]
    steps += ["trainer.log_every=1", "trainer.eval_every=15", "trainer.trace_every=10"]
    straight = train_here(tmp_path / "straight", *steps)
    proc = launch.popen(
        train_cmd(f"hydra.run.dir={run_dir}", *steps, nproc=2),
        cwd=tmp_path,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    metrics_csv = run_dir / "metrics.csv"
    while not metrics_csv.exists() or len(metrics_csv.read_text().splitlines()) < 6:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out  # torchrun reports the stop as a failure
    saved = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    assert len(saved) == 1, out
    stopped_at = int(saved[0].stem.split("-")[1])
    assert 5 <= stopped_at < 30
    assert out.count(f"stopped after step {stopped_at}/30") == 1, out  # rank 0 says it once
    resumed = train_here(run_dir, *steps, "trainer.resume=auto")
    assert resumed.summary["resumes"][-1]["step"] == stopped_at
    assert resumed.summary["weights_sha256"] == straight.summary["weights_sha256"]
    assert metrics(resumed) == metrics(straight)


@pytest.mark.e2e
def test_batchnorm_running_statistics_do_not_depend_on_the_world_size(tmp_path):
    """ResNet-18 (BatchNorm) at width 8: the running buffers are folded in micro-batch order
    on every rank, so they too are the same bits. With gradient clipping on (the global norm
    is that of the reduced gradients, the same on every rank) and a weight average."""
    small_resnet = [*SMALL, "model=resnet18", "model.width=8", "trainer.max_steps=4"]
    small_resnet += ["optim.clip_grad_norm=0.5", "trainer.ema.decay=0.5"]
    one = train_here(tmp_path / "one", *small_resnet)
    two = run_train(tmp_path / "two", *small_resnet, nproc=2)
    assert_same_bits(two, one)
    norms = [float(row["grad_norm"]) for row in csv.DictReader(metrics(one).splitlines())]
    assert max(norms) > 0.5  # clipping was active
    assert two.summary["ema"] == one.summary["ema"] is not None  # and the weight average
    state = torch.load(two.dir / "checkpoint.pt", weights_only=True)["model"]
    assert int(state["stem.1.num_batches_tracked"]) == 4 * 4  # 4 steps x 4 micro-batches


@pytest.mark.e2e
def test_a_world_size_that_cannot_split_the_step_is_one_line(tmp_path):
    run = run_train(
        tmp_path / "three",
        *SMALL,
        "trainer.batch_size=48",  # K = 3 micro-batches
        check=False,
        nproc=2,
    )
    assert run.proc.returncode != 0
    # every rank meets it at once; torchrun may stop one before it prints: either line
    assert re.search(
        r"error: \[rank [01]/2\] config error: trainer.batch_size / trainer.micro_batch_size",
        run.proc.stderr,
    )
    assert "Traceback" not in run.proc.stderr.split("error: [rank")[0]
    assert not (tmp_path / "three" / "checkpoints").exists()


@pytest.mark.e2e
def test_an_error_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    run_dir = tmp_path / "fails"
    proc = launch.run(
        train_cmd(
            f"hydra.run.dir={run_dir}",
            *SMALL,
            "model._target_=sweep_models.FailsOnRank",
            "+model.fail_rank=1",
            nproc=2,
        ),
        cwd=tmp_path,
        env=with_tests_on_path(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "error: [rank 1/2] RuntimeError: this rank's forward fails" in out
    # torchrun's summary names the failing rank and shows the message (our error file)
    assert "this rank's forward fails" in out.split("Root Cause")[-1]
    assert not (run_dir / "summary.json").exists()


@pytest.mark.e2e
def test_a_sweep_under_torchrun_is_refused(tmp_path):
    proc = launch.run(
        train_cmd("-m", "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}", nproc=2),
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "a sweep (-m) cannot run under torchrun" in proc.stderr
    assert not (tmp_path / "sweep").exists()


# ------------------------------------------------------------------ in-process units


def test_a_k_that_the_processes_cannot_split_names_the_micro_batch_size_that_would():
    with pytest.raises(ConfigError, match=r"set trainer.micro_batch_size=128 \(2 micro-batches"):
        check_split(1, World(0, 2), batch_size=256)  # the ResNet-18 preset on 2 GPUs


def test_a_share_is_covered_by_its_canonical_nodes_which_are_tree_nodes():
    for k in range(1, 49):
        for w in range(1, k + 1):
            if k % w:
                with pytest.raises(ConfigError, match=f"cannot be split among {w} processes"):
                    check_split(k, World(0, w))
                continue
            check_split(k, World(0, w))
            s = k // w
            for r in range(w):
                nodes = canonical_nodes(r * s, (r + 1) * s, k)
                assert [i for a, b in nodes for i in range(a, b)] == list(range(r * s, (r + 1) * s))
                assert all(is_subtree(a, b, k) for a, b in nodes)
                if w & (w - 1) == 0:  # a power of two: the share is one node
                    assert nodes == [(r * s, (r + 1) * s)]
    assert canonical_nodes(0, 2, 6) == [(0, 1), (1, 2)]  # 3 ranks: [0, 3) splits 1 + 2
    assert share(8, World(3, 4)) == (6, 2)


def decades(k: int, n: int = 1000) -> list[torch.Tensor]:
    """``k`` vectors whose entries span 16 decades: the order of float additions shows."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(n, generator=g) * 10.0 ** torch.randint(-8, 8, (n,), generator=g)
        for _ in range(k)
    ]


def test_canonical_node_sums_then_the_rest_of_the_tree_is_the_tree_over_k():
    """The reduction's claim, for any W that divides K, on values where the order of float
    additions shows."""

    def add(a, b):
        return a + b

    for k in (6, 12, 16):
        leaves = decades(k)
        one = tree_reduce(0, k, leaves.__getitem__, add)
        for w in [w for w in range(2, k + 1) if k % w == 0]:
            s = k // w
            known = {
                (a, b): tree_reduce(a, b, leaves.__getitem__, add)
                for r in range(w)
                for a, b in canonical_nodes(r * s, (r + 1) * s, k)
            }
            assert torch.equal(finish_tree(k, known, add), one), (k, w)
    # the test can tell orders apart: the ranks' shares summed left to right differ
    leaves = decades(6)
    shares = [tree_reduce(2 * r, 2 * r + 2, leaves.__getitem__, add) for r in range(3)]
    assert not torch.equal(
        shares[0] + shares[1] + shares[2], tree_reduce(0, 6, leaves.__getitem__, add)
    )


SHAPES = [(7, 71), (5,), (501,)]  # 998 gradient values; the (5,) parameter goes unused


def toy_step(k: int):
    """``(params, forward, backward)`` of a step of ``k`` micro-batches whose gradients are
    decades-spanning vectors (micro-batch i's are exactly ``decades(k)[i]``: d/dp of
    ``sum(p * c)`` at ``p = 1``), one parameter unused (its gradient: zeros, and no hook)."""
    values = decades(k, 497 + 501)
    params = [torch.ones(shape, requires_grad=True) for shape in SHAPES]

    def forward(i):
        c = values[i]
        loss = (params[0] * c[:497].view(7, 71)).sum() + (params[2] * c[497:]).sum()
        return loss.detach(), loss, [torch.tensor([float(i)])]  # the extras: i itself

    def backward(scaled, wrt=None):
        return list(torch.autograd.grad(scaled, wrt or params, materialize_grads=True))

    return params, forward, backward


def toy_tree(k: int, wrt=None):
    """The single-process tree over :func:`toy_step`'s micro-batches (the gradients of the
    parameters at indices ``wrt``, or all)."""
    params, forward, backward = toy_step(k)
    chosen = [params[i] for i in wrt] if wrt else None

    def leaf(i):
        loss, scaled, _ = forward(i)
        return loss, backward(scaled, chosen)

    return tree_reduce(0, k, leaf, add_partials)


REDUCTIONS = [  # (dist.reduction, overlap, bucket_mb)
    ("ordered", True, 25.0),  # one bucket (the loss and 998 values)
    ("ordered", True, 0.001),  # 1 KiB buckets: the loss; (501,); the unused (5,); (7, 71)
    ("ordered", False, 0.001),
    ("ordered_allgather", True, 25.0),
]


def _reduce_in_three_processes(rank: int, path: str, results: str) -> None:
    """One of 3 gloo processes: its share of a toy step of K = 6 and K = 12 decades-spanning
    micro-batches, summed and reduced by each ordered path (twice: the buffers are kept);
    rank 0 saves the results, with which buckets were launched during the backward pass."""
    import torch.distributed as tdist

    from repro.engine.reduction import Reducer

    tdist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=3)
    out = {}
    # K = 12: rank 2 holds [8, 9) and [9, 12), 2 left siblings on the way to leaf 11; K = 24:
    # [16, 18) and [18, 24), 3 left siblings ([18, 21), [21, 22), [22, 23)) up to leaf 23
    for k in (6, 12, 24):
        for how, overlap, bucket_mb in REDUCTIONS:
            params, forward, backward = toy_step(k)
            reducer = Reducer(World(rank, 3), how, overlap=overlap, bucket_mb=bucket_mb)
            during_backward = []
            launch = reducer._launch

            def recording(ex, bucket, launch=launch, seen=during_backward, reducer=reducer):
                seen.append((bucket.indices, reducer._exchange is not None))
                launch(ex, bucket)

            reducer._launch = recording
            count = k // 3
            for _ in range(2):
                loss, grads, regrouped = reducer.reduce_share(
                    rank * count, count, forward, backward, params
                )
            extras = [float(t) for mb in regrouped for t in mb]
            out[(k, how, overlap, bucket_mb)] = (loss, grads, extras, during_backward)
    # the same reducer once the trained parameters change (the unused one frozen): its
    # hooks follow the new list; then a hook registered after its own that replaces a
    # gradient is refused, where W = 1 would sum the replacement
    params, forward, backward = toy_step(12)
    reducer = Reducer(World(rank, 3), "ordered", bucket_mb=0.001)
    reducer.reduce_share(rank * 4, 4, forward, backward, params)
    kept = [params[0], params[2]]
    loss, grads, _ = reducer.reduce_share(
        rank * 4, 4, forward, lambda scaled: backward(scaled, kept), kept
    )
    out["frozen"] = (loss, grads)
    params[2].register_hook(lambda g: g * 2)
    try:
        reducer.reduce_share(rank * 4, 4, forward, lambda scaled: backward(scaled, kept), kept)
        out["replaced"] = "not refused"
    except ReproError as err:
        out["replaced"] = str(err)
    # dist.reduction=all_reduce (NCCL's or gloo's order: not the tree's bits), for the record
    params, forward, backward = toy_step(6)
    loss, grads, regrouped = Reducer(World(rank, 3), "all_reduce").reduce_share(
        rank * 2, 2, forward, backward, params
    )
    out["all_reduce"] = (loss, grads, [float(t) for mb in regrouped for t in mb])
    if rank == 0:
        torch.save(out, results)
    tdist.destroy_process_group()


@pytest.mark.e2e
def test_both_ordered_reductions_over_three_processes_are_the_tree_of_one(tmp_path):
    """gloo, 3 processes, K = 6 (shares [0, 2), [2, 4), [4, 6): ranks 0 and 1 hold two
    canonical nodes, rank 2 one), 12 and 24: the reduce-scatter -- overlapped with the
    backward pass or after it, in one bucket or several -- and the all-gather give the
    single-process tree's loss and gradients, bit for bit, on decades-spanning values."""
    import torch.multiprocessing as mp

    results = tmp_path / "results.pt"
    mp.start_processes(_reduce_in_three_processes, args=(str(tmp_path / "rdv"), str(results)),
                       nprocs=3, start_method=launch.start_method())  # fmt: skip
    out = torch.load(results)
    assert "gradient of parameter 1 was replaced" in out.pop("replaced")
    loss, grads, extras = out.pop("all_reduce")  # a sum, in another order: close, not equal
    exact = torch.stack(decades(6, 998)).double().sum(0)
    assert torch.allclose(torch.cat([grads[0].flatten(), grads[2]]).double(), exact, rtol=1e-5)
    assert not grads[1].any() and extras == [float(i) for i in range(6)]
    loss, grads = out.pop("frozen")
    one_loss, one_grads = toy_tree(12, wrt=[0, 2])
    assert torch.equal(loss, one_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, one_grads, strict=True))
    for (k, how, overlap, bucket_mb), (loss, grads, extras, launches) in out.items():
        case = (k, how, overlap, bucket_mb)
        one_loss, one_grads = toy_tree(k)
        assert torch.equal(loss, one_loss), case
        assert all(torch.equal(a, b) for a, b in zip(grads, one_grads, strict=True)), case
        assert not grads[1].any()  # the unused parameter's gradient: zeros
        assert extras == [float(i) for i in range(k)], case  # micro-batch order
        if how == "ordered" and bucket_mb < 1:
            # in order: the loss alone at once, (501,) when its hook fires, then the unused
            # (5,) and (7, 71) after the backward pass (an unused parameter holds the rest)
            indices = [b for b, _ in launches[:4]]
            assert indices == [[0], [3], [2], [1]], case
            armed = [a for _, a in launches[:4]]
            assert armed == ([True, True, False, False] if overlap else [False] * 4), case


def test_running_stats_follow_pytorchs_formula():
    """Deferred updates give what BatchNorm itself would have stored (momentum, the
    cumulative average, and layers with different momenta in one model), to float
    rounding; and the forward is unchanged."""
    torch.manual_seed(0)
    for momenta in ((0.1,), (None,), (0.1, None, 0.01)):

        def net(momenta: tuple[float | None, ...] = momenta) -> nn.Sequential:
            layers: list[nn.Module] = [nn.Conv2d(3, 4, 3)]
            layers += [nn.BatchNorm2d(4, momentum=m) for m in momenta]
            return nn.Sequential(*layers)

        ours, theirs = net(), net()
        theirs.load_state_dict(ours.state_dict())
        stats = RunningStats(ours)
        batches = [torch.randn(8, 3, 6, 6) for _ in range(3)]
        recorded = []
        for x in batches:
            with stats.capture() as r:
                y = ours(x)
            recorded.append(r)
            assert torch.equal(y, theirs(x))
        stats.update(recorded)
        for key, value in theirs.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)
        assert all(int(m.num_batches_tracked) == 3 for m in ours[1:])


def test_without_torchrun_this_is_rank_0_of_1(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launched_world() == World(0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        launched_world()


def test_dist_keys_are_in_the_schema():
    cfg = compose(
        ["dist.reduction=all_reduce", "dist.backend=gloo"], Path(__file__).parents[1] / "conf"
    )
    assert str(cfg.dist.reduction) == "all_reduce" and str(cfg.dist.backend) == "gloo"
    with pytest.raises(ConfigError, match="dist.reduction"):
        compose(["dist.reduction=mean"], Path(__file__).parents[1] / "conf")


def test_running_stats_go_to_the_layer_that_computed_them():
    """Layers registered a, b but called b, a: each gets its own statistics (as PyTorch's
    own update would), not the other's by position."""

    class Swapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

        def forward(self, x):
            return self.a(self.b(x) * 0 + 5.0) + x  # b sees x, a sees constant 5

    torch.manual_seed(0)
    ours, theirs = Swapped(), Swapped()
    stats = RunningStats(ours)
    x = torch.randn(16, 3)
    with stats.capture() as recorded:
        ours(x)
    stats.update([recorded])
    theirs(x)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_running_stats_refuse_what_they_cannot_reconcile():
    with pytest.raises(ConfigError, match="InstanceNorm2d"):
        RunningStats(nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True)))

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

        def forward(self, x, use_b=False):
            return self.b(x) if use_b else self.a(x)

    model = Skips()
    kept_a, kept_b = (
        {k: getattr(m, k) for k in ("running_mean", "running_var", "num_batches_tracked")}
        for m in (model.a, model.b)
    )
    stats = RunningStats(model)
    with stats.capture() as recorded:  # b never ran: left out, named
        model(torch.randn(4, 3))
    assert stats.idle == ["b"] and [name for name, _ in stats.layers] == ["a"]
    assert [t.numel() for t in recorded] == [6]  # a's mean and variance only
    stats.update([recorded])
    assert int(model.a.num_batches_tracked) == 1 and int(model.b.num_batches_tracked) == 0
    kept_a = {k: getattr(model.a, k) for k in kept_a}
    with pytest.raises(RuntimeError, match="layer b did not run in the first training forward"):
        with stats.capture():
            model(torch.randn(4, 3), use_b=True)
    # the layers got their own buffers and momentum back, even from a forward that failed
    for layer, buffers in ((model.a, kept_a), (model.b, kept_b)):
        assert all(getattr(layer, k) is v for k, v in buffers.items())
        assert layer.momentum == 0.1

    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.BatchNorm1d(3), nn.BatchNorm1d(3)

        def forward(self, x, skip_b=False):
            x = self.a(x)
            return x if skip_b else self.b(x)

    sometimes = Sometimes()
    stats = RunningStats(sometimes)
    with stats.capture():
        sometimes(torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="b ran in the first training forward but not"):
        with stats.capture():
            sometimes(torch.randn(4, 3), skip_b=True)
    with pytest.raises(ValueError):
        with stats.capture():
            raise ValueError("the forward failed")
    assert all(getattr(model.a, k) is v for k, v in kept_a.items())


def test_running_stats_leave_the_buffers_alone_during_the_forward():
    """Inside capture() the layers' real buffers are not written (the kernel writes its
    batch statistics to scratch buffers); update() then folds them in."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = RunningStats(model)
    with stats.capture() as recorded:
        model(torch.randn(8, 3, 6, 6))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    (flat,) = recorded  # one flat tensor per dtype: the layers' means, then their variances
    mean, var = flat.split(4)
    assert mean.abs().sum() > 0 and var.abs().sum() > 0  # the batch's, not the zeros
    stats.update([recorded])
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])


def test_resume_compares_the_reduction_and_accepts_checkpoints_from_before_it():
    from repro.records.checkpoint import mismatches

    before = {"config": {"seed": 0, "determinism": {"mode": "strict"}}, "device": "cpu"}
    now = {
        "seed": 0,
        "determinism": {"mode": "strict", "nccl_env": {"NCCL_ALGO": "Ring"}},
        "dist": {"reduction": "ordered"},
    }
    assert mismatches(before, now, {}, "cpu") == []  # written before dist.* existed
    now["dist"]["reduction"] = "ordered_allgather"  # the same tree, other collectives
    assert mismatches(before, now, {}, "cpu") == []
    now["dist"]["reduction"] = "all_reduce"
    assert mismatches(before, now, {}, "cpu") == [
        "dist.reduction: ordered (checkpoint) vs all_reduce (now)"
    ]


def test_resume_ignores_the_nan_fill_but_not_the_rest_of_determinism():
    """Checkpoints from before strict turned the NaN fill off still resume without a flag."""
    from repro.records.checkpoint import mismatches

    def config(fill: bool, deterministic: bool = True) -> dict:
        return {
            "determinism": {
                "fill_uninitialized_memory": fill,
                "deterministic_algorithms": deterministic,
            }
        }

    before = {"config": config(True), "device": "cpu"}
    assert mismatches(before, config(False), {}, "cpu") == []
    assert mismatches(before, config(False, deterministic=False), {}, "cpu") == [
        "determinism.deterministic_algorithms: True (checkpoint) vs False (now)"
    ]


def test_the_ranks_compare_each_digest_at_the_next_digest_step_or_checkpoint(monkeypatch):
    """Under torchrun the weights are hashed in the background, and the ranks compare a
    digest step's digest at the next digest step, or before the next checkpoint; a digest
    step that is a checkpoint step, and the last step, are compared at once. Each
    comparison names the step whose weights it hashed, and hashes those weights."""
    import repro.records.trace

    compared: list[tuple[str, int]] = []
    monkeypatch.setattr(
        repro.records.trace,
        "check_same",
        lambda digest, world, what, step: compared.append((digest, step)),
    )

    def run(checkpoint_every: int) -> tuple[dict[int, list[int]], dict[int, str], dict]:
        compared.clear()
        model = nn.Linear(3, 2)
        tracer = repro.records.trace.StepTracer(True, 2, 7, World(0, 2), checkpoint_every)
        seen, expected = {}, {}
        try:
            for done in range(1, 8):
                with torch.no_grad():
                    model.weight.add_(1.0)  # the step's update
                expected[done] = repro.records.trace.state_dict_sha256(model.state_dict())
                record = tracer.state(done, model)
                seen[done] = [s for _, s in compared]
        finally:
            tracer.close()
        assert compared == [(expected[s], s) for s in seen[7]]
        assert record["weights_sha256"] == expected[7] and record["final"]
        return seen

    seen = run(checkpoint_every=0)  # digest steps 2, 4, 6 and the last, 7
    assert seen == {1: [], 2: [], 3: [], 4: [2], 5: [2], 6: [2, 4], 7: [2, 4, 6, 7]}
    seen = run(checkpoint_every=3)  # checkpoints after 3 and 6: 6 is also a digest step
    assert seen == {1: [], 2: [], 3: [2], 4: [2], 5: [2], 6: [2, 4, 6], 7: [2, 4, 6, 7]}


def test_a_peer_lost_while_a_collective_is_in_flight_is_told_apart():
    """A rank whose collective fails because a peer died records its error later, so that
    torchrun names the peer's error as the root cause: a failure in a torch.distributed
    call, or in repro.base.world.wait (an asynchronous collective's end), counts; others not."""
    from repro.base.errors import inside_a_collective
    from repro.base.world import wait

    class LostPeer:
        def wait(self):
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(RuntimeError) as lost:
        wait(LostPeer())
    assert inside_a_collective(lost.value)
    with pytest.raises(RuntimeError) as own:
        LostPeer().wait()
    assert not inside_a_collective(own.value)
