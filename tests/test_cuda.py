"""On a CUDA GPU (skipped elsewhere): strict mode gives the same bits, fp32 and bf16, any loader.

Run with `make test-cuda` on a GPU machine; the drift demonstration (fast mode drifts on a
ResNet-18-size net, strict does not) is `scripts/drift_demo.py`, its output in benchmarks/.
"""

import pytest
import torch

from conftest import CONF_DIR, SHORT, cuda
from optional import require
from repro.defense.config import compose
from repro.engine.doctor import run_doctor
from repro.tools.compare import compare_dirs

pytestmark = [pytest.mark.cuda, cuda]


def test_strict_on_cuda_twice_and_with_workers_is_identical(train_run):
    a = train_run("a", *SHORT, "device=cuda")
    b = train_run("b", *SHORT, "device=cuda")
    multi = train_run("multi", *SHORT, "device=cuda", "loader=multi")
    on_device = train_run("on_device", *SHORT, "device=cuda", "loader=device")
    assert a.summary["device"].startswith("cuda")
    assert (
        a.summary["weights_sha256"]
        == b.summary["weights_sha256"]
        == multi.summary["weights_sha256"]
        == on_device.summary["weights_sha256"]
    )
    assert a.losses == b.losses == multi.losses == on_device.losses
    assert a.entry("CUBLAS_WORKSPACE_CONFIG")["verified"] is True
    for other in (b, multi, on_device):
        result = compare_dirs(a.dir, other.dir)
        print(result.text())
        assert result.identical and result.lines[0].startswith("identical: 40 steps")


def test_one_gpu_under_torchrun_gives_the_bits_of_the_run_without_it(train_run):
    """torchrun's agent on a GPU machine has started CUDA by the time it starts its ranks, so
    a rank forked from it could not (the tests' launcher then makes it a real interpreter):
    on the GPU, one rank under torchrun trains to the plain run's bits."""
    plain = train_run("plain", *SHORT, "device=cuda")
    under = train_run("torchrun", *SHORT, "device=cuda", nproc=1)
    assert under.summary["world_size"] == 1 and under.summary["device"].startswith("cuda")
    assert under.summary["weights_sha256"] == plain.summary["weights_sha256"]
    assert under.losses == plain.losses


def test_the_defaults_on_cuda_put_the_split_on_the_gpu_and_the_model_in_channels_last(train_run):
    """loader=auto and trainer.channels_last=auto (the defaults; train_run picks loader=single
    unless told) on CUDA: the split fits, so it is loader=device; the ConvNet has 2-D
    convolutions, so channels_last. The bits are those of loader=multi with channels_last
    set; the run records true, not auto; a contiguous run's checkpoint does not resume it."""
    auto = train_run("auto", *SHORT, "device=cuda", "loader=auto")
    multi = train_run("multi", *SHORT, "device=cuda", "loader=multi", "trainer.channels_last=true")
    assert (auto.summary["loader"], multi.summary["loader"]) == ("device", "multi")
    assert auto.summary["num_workers"] == 0 and multi.summary["num_workers"] == 2
    assert auto.entry("loader")["note"].startswith("auto: fits: the training split")
    assert auto.summary["weights_sha256"] == multi.summary["weights_sha256"]
    assert auto.losses == multi.losses
    assert auto.summary["channels_last"] is True
    assert auto.env["config"]["trainer"]["channels_last"] is True
    assert auto.entry("memory format")["value"] == "channels_last"
    assert auto.entry("memory format")["note"].startswith("auto: a CUDA run of a model with 2-D")
    contiguous = train_run("contiguous", *SHORT, "device=cuda", "trainer.channels_last=false")
    assert contiguous.entry("memory format")["value"] == "contiguous"
    refused = train_run(
        "resumed", *SHORT, "device=cuda", f"trainer.resume={contiguous.dir}", check=False
    )
    assert refused.proc.returncode != 0
    assert "trainer.channels_last: False (checkpoint) vs True (now)" in refused.output


NAN_FILL = "determinism.fill_uninitialized_memory=true"


def test_strict_bf16_on_cuda_twice_is_identical_with_or_without_the_nan_fill(train_run):
    """Strict leaves new tensors unfilled (fast); filling them with NaN, as warn mode does,
    must not change a bit: no op of the step reads memory it did not write."""
    a = train_run("a", *SHORT, "device=cuda", "amp=on")
    b = train_run("b", *SHORT, "device=cuda", "amp=on")
    filled = train_run("filled", *SHORT, "device=cuda", "amp=on", NAN_FILL)
    assert a.summary["weights_sha256"] == b.summary["weights_sha256"]
    assert a.summary["weights_sha256"] == filled.summary["weights_sha256"]
    assert a.losses == b.losses == filled.losses


def test_strict_resnet18_fp32_twice_is_identical_with_or_without_the_nan_fill(train_run):
    args = [
        "device=cuda",
        "model=resnet18",
        "trainer.max_steps=20",
        "trainer.eval_every=20",
        "trainer.batch_size=256",
        "trainer.micro_batch_size=128",
    ]
    a, b = train_run("a", *args), train_run("b", *args, NAN_FILL)  # BatchNorm: both ways
    assert a.summary["weights_sha256"] == b.summary["weights_sha256"]
    assert a.losses == b.losses


def test_background_digests_hash_the_state_as_submitted_on_cuda():
    from test_compare import check_background_digests

    check_background_digests("cuda")  # the pinned, asynchronous copy


def test_deterministic_mode_makes_index_add_repeatable():
    """index_add_ on CUDA: atomics in its default kernel; a deterministic kernel under
    use_deterministic_algorithms(True). 5 repeats in deterministic mode give one result."""
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(1 << 20, device="cuda", generator=g)
    index = torch.randint(0, 64, (1 << 20,), device="cuda", generator=g)

    def distinct(deterministic: bool) -> int:
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            outs = {
                torch.zeros(64, device="cuda").index_add_(0, index, src).cpu().numpy().tobytes()
                for _ in range(5)
            }
        finally:
            torch.use_deterministic_algorithms(before)
        return len(outs)

    fast = distinct(False)
    print(f"index_add_ distinct results in 5 repeats: fast {fast}, deterministic 1 expected")
    assert distinct(True) == 1


def _doctor(*overrides):
    cfg = compose(["device=cuda", "data.train_size=256", "data.val_size=64", *overrides], CONF_DIR)
    report = run_doctor(cfg, repeats=4, log=lambda m: None)
    print(report.format())
    return report


def test_doctor_names_index_add_in_fast_mode_and_strict_mode_fixes_it():
    report = _doctor("model._target_=nondeterministic_models.IndexAddNet")
    assert [(f.module, f.where) for f in report.fast] == [("suspect", "forward")]
    assert report.strict_ops == [] and report.strict == []  # a deterministic kernel in strict
    assert report.clean


def test_doctor_finds_the_default_model_clean_in_strict_mode_on_cuda():
    report = _doctor()
    assert report.strict_ops == [] and report.strict == []
    assert report.clean


def test_sigkill_and_resume_on_cuda_gives_the_uninterrupted_bits(tmp_path):
    from test_resume import SCENARIOS, assert_same_as, interrupt, resume

    from conftest import run_train

    overrides = [*SCENARIOS["mid-epoch"], "device=cuda"]
    straight = run_train(tmp_path / "straight", *overrides)
    status, at, _ = interrupt(tmp_path / "killed", overrides, after=25)
    assert status == -9 and at % 10 != 0
    resumed = resume(tmp_path / "killed", overrides)
    assert resumed.summary["device"].startswith("cuda")
    assert resumed.summary["resumes"][0]["step"] == (at // 10) * 10
    assert_same_as(resumed, straight)
    print(
        f"killed after step {at}, resumed from step {(at // 10) * 10}: "
        f"weights {resumed.summary['weights_sha256']} == {straight.summary['weights_sha256']}"
    )


def _overlapped_on_one_gpu(rank: int, path: str, results: str) -> None:
    """In its own process: NCCL with one rank, the ResNet-18 preset (BatchNorm), bf16,
    strict, 4 micro-batches a step; 3 steps through the overlapped reduce-scatter (1 MiB
    buckets: its side stream adds the last micro-batch's gradients to the left siblings'
    sums while the backward pass goes on) and 3 through the plain tree."""
    import torch.distributed as tdist

    from repro.base.world import World
    from repro.defense.determinism import apply_determinism
    from repro.engine.build import build_data, build_training
    from repro.engine.reduction import Reducer
    from repro.engine.step import train_step

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    tdist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    overrides = ["device=cuda", "experiment=resnet18", "trainer.micro_batch_size=64"]
    cfg = compose([*overrides, "data.train_size=256", "data.val_size=64"], CONF_DIR)
    apply_determinism(cfg, device)
    data = build_data(cfg)
    weights, losses = {}, {}
    reducers = {"tree": None, "overlapped": Reducer(World(0, 1, 0, "nccl"), "ordered", bucket_mb=1)}
    for name, reducer in reducers.items():
        training = build_training(cfg, data, device)
        # the classifier's backward queued behind 50 ms of sleep: its gradients are still to
        # come when their hooks hand them over, so a side stream that did not wait for the
        # compute stream would read them unwritten
        head = [m for m in training.model.modules() if isinstance(m, torch.nn.Linear)][-1]
        head.register_full_backward_pre_hook(lambda *_: torch.cuda._sleep(100_000_000))
        g = torch.Generator().manual_seed(0)
        losses[name] = []
        for step in range(3):
            micro = [
                (
                    torch.randn(64, 3, 32, 32, generator=g).to(device),
                    torch.randint(0, 10, (64,), generator=g).to(device),
                )
                for _ in range(4)
            ]
            loss, grad_norm = train_step(training, micro, step, reducer=reducer)
            losses[name].append((float(loss), float(grad_norm)))
        weights[name] = {k: v.cpu() for k, v in training.model.state_dict().items()}
    torch.save((weights, losses), results)
    tdist.destroy_process_group()


def test_the_overlapped_reduce_scatter_is_the_tree_on_cuda(tmp_path):
    """The side stream and the hooks under NCCL on one GPU (one rank: the all-to-all and the
    all-gather are copies): the same weights, BatchNorm buffers, losses and gradient norms
    as the tree of one process."""
    import torch.multiprocessing as mp

    results = tmp_path / "results.pt"
    mp.spawn(_overlapped_on_one_gpu, args=(str(tmp_path / "rdv"), str(results)), nprocs=1)
    weights, losses = torch.load(results)
    assert losses["overlapped"] == losses["tree"]
    tree, overlapped = weights["tree"], weights["overlapped"]
    assert tree.keys() == overlapped.keys()
    assert all(torch.equal(tree[k], overlapped[k]) for k in tree), [
        k for k in tree if not torch.equal(tree[k], overlapped[k])
    ]


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@two_gpus
@pytest.mark.parametrize("model", [[], ["model=resnet18"]], ids=["convnet", "resnet18"])
def test_two_gpus_under_nccl_give_the_one_gpu_bits(tmp_path, model):
    """torchrun on 2 GPUs (NCCL) and one process on 1 GPU: same weights, same per-step
    losses, bf16, strict, loader workers; BatchNorm buffers included (ResNet-18)."""
    import json

    from conftest import run_train

    args = [*SHORT, "device=cuda", "amp=on", "loader=multi", "trainer.trace_every=10"]
    args += ["trainer.batch_size=128", "trainer.micro_batch_size=32", *model]
    one = run_train(tmp_path / "one", *args)
    two = run_train(tmp_path / "two", *args, nproc=2)
    assert two.summary["world_size"] == 2
    assert "nccl" in two.summary["environment"]["dist_backend"]
    assert two.summary["weights_sha256"] == one.summary["weights_sha256"]
    assert two.losses == one.losses
    result = compare_dirs(one.dir, two.dir)
    print(result.text())
    assert result.identical
    report = json.loads((two.dir / "determinism.json").read_text())
    pinned = {e["name"]: e["value"] for e in report["entries"]}
    assert pinned["NCCL_NVLS_ENABLE"] == "0" and pinned["NCCL_ALGO"] == "Ring"


def test_compiled_strict_on_cuda_repeats_with_any_loader(train_run):
    """trainer.compile=default with channels_last, bf16: one digest over repeats and loaders,
    Inductor's deterministic mode recorded (and read back into env.json)."""
    args = [*SHORT, "device=cuda", "amp=on", "trainer.compile=default"]
    args.append("trainer.channels_last=true")
    a = train_run("a", *args)
    b = train_run("b", *args)
    multi = train_run("multi", *args, "loader=multi")
    on_device = train_run("on_device", *args, "loader=device")
    runs = (a, b, multi, on_device)
    assert len({r.summary["weights_sha256"] for r in runs}) == 1
    assert a.losses == b.losses == multi.losses == on_device.losses
    assert a.entry("inductor deterministic")["value"] is True
    assert a.env["flags"]["inductor_deterministic"] is True
    eager = train_run("eager", *SHORT, "device=cuda", "amp=on", "trainer.channels_last=true")
    assert eager.summary["weights_sha256"] != a.summary["weights_sha256"]  # other kernels


@pytest.mark.parametrize("augment", ["crop_flip", "imagenet", "torchvision"])
def test_folder_images_of_their_own_sizes_augmented_on_cuda_give_one_digest(
    augment, tmp_path, train_run
):
    """An image folder of mixed sizes, each augmentation preset: 2 loader workers vs the
    main process (and for crop_flip the device loader too) give one digest on the GPU."""
    from conftest import mixed_image_folder

    if augment == "torchvision":
        require("torchvision", "make add PKG=torchvision")
    folder = mixed_image_folder(tmp_path / "images")
    args = [
        "device=cuda",
        "data=image_folder",
        f"data.path={folder}",
        "data.image_size=16",
        f"augment={augment}",
        "trainer.batch_size=16",
        "trainer.micro_batch_size=8",
        "trainer.max_steps=12",
        "trainer.eval_every=6",
        "model.width=8",
    ]
    single = train_run("single", *args, "loader=single")
    multi = train_run("multi", *args, "loader=multi", "loader.num_workers=2")
    runs = [multi]
    if augment == "crop_flip":
        runs.append(train_run("device", *args, "loader=device"))
    for run in runs:
        assert run.summary["weights_sha256"] == single.summary["weights_sha256"], run.dir.name
        assert run.losses == single.losses
