"""The step: a fixed reduction tree over micro-batches, keyed dropout, the schedule."""

import pytest
import torch
from omegaconf import OmegaConf

from repro.base.errors import CheckpointError
from repro.components.data import synthetic
from repro.components.models import ConvNet
from repro.components.schedules import warmup_cosine
from repro.components.tasks import Classification
from repro.engine.build import Precision, Training, build_model
from repro.engine.ema import WeightAverage
from repro.engine.reduction import tree_reduce
from repro.engine.running_stats import RunningStats
from repro.engine.step import train_step


def shape(k: int) -> str:
    order = []

    def leaf(i):
        order.append(i)
        return str(i)

    out = tree_reduce(0, k, leaf, lambda a, b: f"({a}+{b})")
    assert order == list(range(k))  # leaves in arrival order
    return out


def test_tree_shape_is_fixed_and_halves_at_the_midpoint():
    assert shape(1) == "0"
    assert shape(2) == "(0+1)"
    assert shape(4) == "((0+1)+(2+3))"
    assert shape(6) == "((0+(1+2))+(3+(4+5)))"
    # a contiguous half (or quarter) is a whole subtree: what world-size invariance needs
    assert shape(8) == "(((0+1)+(2+3))+((4+5)+(6+7)))"


def _step(model, k, step=0, seed=0, same_inputs=False, clip=None):
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    if same_inputs:
        x = x[:1].expand(8, -1, -1, -1).contiguous()
    y = torch.arange(8) % 10
    mb = [(x[i : i + 8 // k], y[i : i + 8 // k]) for i in range(0, 8, 8 // k)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp = OmegaConf.create({"enabled": False, "dtype": "bfloat16"})
    training = Training(
        model=model,
        task=Classification(),
        optimizer=opt,
        schedule=warmup_cosine(opt, max_steps=10),
        precision=Precision(amp, torch.device("cpu")),
        running_stats=RunningStats(model),
        seed=seed,
        batch_size=8,
        clip_grad_norm=clip,
    )
    seen = {}

    def grab(*_):
        seen.update({n: p.grad.clone() for n, p in model.named_parameters()})

    opt.register_step_pre_hook(grab)
    loss, norm = train_step(training, mb, step)
    return loss, norm, seen


def test_micro_batch_gradients_sum_to_the_full_batch_gradient():
    model = ConvNet(10, width=8, dropout=0.0)
    l1, n1, g1 = _step(model, 1)
    l4, n4, g4 = _step(model, 4)
    # Same mathematics (K only regroups the sum); the bits may differ, so allclose here.
    assert torch.allclose(l1, l4, atol=1e-6)
    assert torch.allclose(n1, n4, rtol=1e-5)
    assert all(torch.allclose(g1[k], g4[k], atol=1e-6) for k in g1)


def test_clipping_is_torchs_clip_grad_norm_on_the_summed_gradients():
    """optim.clip_grad_norm scales the step's summed gradients exactly as
    torch.nn.utils.clip_grad_norm_ would (the global norm over all of them, foreach); the
    norm the step returns is the one before clipping, as clip_grad_norm_'s is."""
    torch.manual_seed(0)
    model = ConvNet(10, width=8, dropout=0.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, norm, unclipped = _step(model, 2)
    limit = float(norm) / 3  # clipping is active
    model.load_state_dict(state)
    _, clipped_norm, clipped = _step(model, 2, clip=limit)
    assert torch.equal(clipped_norm, norm)
    for name, p in model.named_parameters():
        p.grad = unclipped[name].clone()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), limit, foreach=True)
    for name, p in model.named_parameters():
        assert torch.equal(clipped[name], p.grad), name
    assert not torch.equal(clipped["head.weight"], unclipped["head.weight"])


def test_dropout_masks_are_keyed_by_step_and_micro_batch_not_the_global_rng():
    model = ConvNet(10, width=8, dropout=0.5)
    torch.manual_seed(1)
    a = _step(model, 2, step=3)
    torch.manual_seed(2)  # the global RNG's state must not matter
    b = _step(model, 2, step=3)
    c = _step(model, 2, step=4)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    assert not torch.equal(a[0], c[0])


def test_each_micro_batch_draws_its_own_dropout_masks():
    """Identical inputs in micro-batches 0 and 1: equal losses would mean equal masks."""
    model = ConvNet(10, width=8, dropout=0.5)
    seen = []
    model.head.register_forward_hook(lambda m, i, out: seen.append(out.detach().clone()))
    _step(model, 2, same_inputs=True)
    assert len(seen) == 2 and not torch.equal(seen[0], seen[1])


def test_model_init_is_keyed_by_seed_and_ignores_the_global_rng():
    data = synthetic(train_size=64, val_size=8)
    cfg = OmegaConf.create({"seed": 0, "model": {"_target_": "repro.models.ConvNet", "width": 8}})
    torch.manual_seed(1)
    a = build_model(cfg, data, torch.device("cpu")).state_dict()
    torch.manual_seed(2)
    b = build_model(cfg, data, torch.device("cpu")).state_dict()
    cfg.seed = 1
    c = build_model(cfg, data, torch.device("cpu")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_cosine_schedule_with_warmup():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_cosine(opt, max_steps=6, warmup_steps=2)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[3] < 1.0 and lrs == sorted(lrs[:2]) + sorted(lrs[2:], reverse=True)


def test_the_weight_average_is_the_formula_and_leaves_the_weights_alone():
    """trainer.ema: a copy up to ``start``, then decay * average + (1 - decay) * weights,
    per element as written; inside applied() the model holds the averages, afterwards its
    own weights bit for bit; a checkpoint's averages load only into the same model."""
    torch.manual_seed(0)
    model = ConvNet(10, width=8, dropout=0.0)
    ema = WeightAverage(model, decay=0.75, start=1)
    expected = [p.detach().clone() for p in model.parameters()]
    for done in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(done)
        for i, p in enumerate(model.parameters()):
            expected[i] = p.detach().clone() if done <= 1 else expected[i] * 0.75 + p * 0.25
    assert all(torch.equal(a, e) for a, e in zip(ema.average, expected, strict=True))
    own = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied():
        assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected, strict=True))
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    again = WeightAverage(model, decay=0.75, start=1)
    again.load_state_dict(ema.state_dict(), "ckpt.pt")
    assert again.digest() == ema.digest() != WeightAverage(model, 0.75).digest()
    other = WeightAverage(ConvNet(10, width=4), 0.75)
    with pytest.raises(CheckpointError, match="ckpt.pt: its weight average of .* does not fit"):
        other.load_state_dict(ema.state_dict(), "ckpt.pt")
    with pytest.raises(CheckpointError, match="ckpt.pt: its weight average .* is missing"):
        other.load_state_dict(None, "ckpt.pt")
