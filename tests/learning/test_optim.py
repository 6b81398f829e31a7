"""The optimizer of a node's local steps (learning/tasks/optim.py): its state kept across rounds, the schedules,
clipping, the built-in table against the real constructors, and settings that could change nothing refused."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from mosaicd.learning.tasks import build_task
from mosaicd.learning.tasks.optim import NodeOptimizers, Schedule, check_training, optimizer_class
from mosaicd.learning.tasks.torch_util import SGD, load_vector, to_vector, train_generator
from mosaicd.settings import OPTIMIZERS, Settings, SettingsError

DIGITS = {"task": "digits", "nodes": 4, "fanout": 1, "seed": 2, "lr": 0.05}


def _reference_sgd_kept(rounds: int, momentum: float, node: int = 1) -> np.ndarray:
    """Node `node`'s model after `rounds` rounds of one local step each, written with torch.optim.SGD made once and
    kept across rounds (the model's parameters are loaded in place each round, as the aggregate replaces them)."""
    task = build_task(Settings(**DIGITS))
    model = task.model  # this task never trains: its model is the reference's own
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    vector = task.initial(node)
    shard = task.shard(node)
    for t in range(rounds):
        load_vector(model, vector)
        order = torch.randperm(len(shard), generator=train_generator(2, node, t)).numpy()
        idx = shard[order[:32]]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(task.x(task.split.x_train[idx])),
                                          task.y(task.split.y_train[idx])).backward()
        opt.step()
        vector = to_vector(model)
    return vector


def test_momentum_at_one_local_step_changes_the_model_and_equals_torch_optim_sgd_kept_across_rounds() -> None:
    trained = {}
    for momentum in (0.0, 0.9):
        task = build_task(Settings(**DIGITS, momentum=momentum, local_steps=1))
        vector = task.initial(1)
        for t in range(4):
            vector, _ = task.train(1, t, vector)
        trained[momentum] = vector
        assert np.array_equal(vector, _reference_sgd_kept(4, momentum))
    assert not np.array_equal(trained[0.0], trained[0.9])


def test_reset_makes_a_fresh_optimizer_every_round() -> None:
    """--optimizer-state reset (decentralizepy's default): two steps a round, the buffer gone at each round."""
    kept = build_task(Settings(**DIGITS, momentum=0.9, local_steps=2))
    reset = build_task(Settings(**DIGITS, momentum=0.9, local_steps=2, optimizer_state="reset"))
    a = b = kept.initial(0)
    a, _ = kept.train(0, 0, a)
    b, _ = reset.train(0, 0, b)
    assert np.array_equal(a, b)  # round 0: both start empty
    a, _ = kept.train(0, 1, a)
    b, _ = reset.train(0, 1, b)
    assert not np.array_equal(a, b)
    assert reset.node_state(0) == {} and set(kept.node_state(0)) >= {"optimizer/0/momentum_buffer"}


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "rmsprop", "adagrad", "torch.optim:RAdam"])
def test_a_nodes_state_is_saved_and_restored_exactly(optimizer: str) -> None:
    """What a checkpoint holds (node_state) put into a fresh task gives the next round's model bit for bit."""
    settings = Settings(**{**DIGITS, "lr": 0.01}, optimizer=optimizer, local_steps=3, lr_schedule="cosine",
                        lr_warmup_steps=2, clip_grad_norm=1.0, rounds=6)
    task = build_task(settings)
    vector = task.initial(2)
    for t in range(3):
        vector, _ = task.train(2, t, vector)
    state = task.node_state(2)
    assert state and all(isinstance(v, np.ndarray) for v in state.values())
    expected, _ = task.train(2, 3, vector)
    fresh = build_task(settings)
    fresh.load_node_state(2, state)
    again, _ = fresh.train(2, 3, vector)
    assert np.array_equal(again, expected)
    unrestored, _ = build_task(settings).train(2, 3, vector)
    assert not np.array_equal(unrestored, expected)


def test_the_hand_written_sgd_matches_torch_optim_with_nesterov_and_dampening() -> None:
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    ref.load_state_dict(ours.state_dict())
    a = SGD(ours.parameters(), lr=0.1, momentum=0.8, dampening=0.1, weight_decay=1e-3)
    b = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.8, dampening=0.1, weight_decay=1e-3)
    c_model = torch.nn.Linear(5, 3)
    c_model.load_state_dict(ours.state_dict())
    d_model = torch.nn.Linear(5, 3)
    d_model.load_state_dict(ours.state_dict())
    c = SGD(c_model.parameters(), lr=0.1, momentum=0.8, nesterov=True)
    d = torch.optim.SGD(d_model.parameters(), lr=0.1, momentum=0.8, nesterov=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(7, 5, generator=g)
        for model, opt in ((ours, a), (ref, b), (c_model, c), (d_model, d)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert torch.equal(ours.weight, ref.weight) and torch.equal(c_model.weight, d_model.weight)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1, "amsgrad": True}, {"betas": (0.8, 0.95), "eps": 1e-3,
                                                                                   "maximize": True}])
def test_the_hand_written_adam_matches_torch_optim_bit_for_bit_and_reads_its_state(name: str, options: dict) -> None:
    """torch_util.Adam / AdamW (no torch._dynamo) against torch.optim's on the CPU: the same parameters and state
    after steps with a changing lr (as a schedule sets it), and a state handed from one to the other goes on alike."""
    from mosaicd.learning.tasks import torch_util
    from mosaicd.learning.tasks.optim import load_state, set_lr, state_arrays

    g = torch.Generator().manual_seed(5)
    start = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    a = getattr(torch_util, name)(ours, lr=0.01, **options)
    b = getattr(torch.optim, name)(ref, lr=0.01, **options)
    for step in range(7):
        grads = [torch.randn(t.shape, generator=g) for t in start]
        for params, opt in ((ours, a), (ref, b)):
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.clone()
            set_lr(opt, 1.0 / (step + 1))
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, ref, strict=True)), step
        ours_state, ref_state = state_arrays(a), state_arrays(b)
        assert ours_state.keys() == ref_state.keys()
        assert all(np.array_equal(ours_state[k], ref_state[k]) and ours_state[k].dtype == ref_state[k].dtype
                   for k in ours_state)
    load_state(a, state_arrays(b))  # a checkpoint of torch.optim's read by ours and the other way round
    load_state(b, state_arrays(a))
    grads = [torch.randn(t.shape, generator=g) for t in start]
    for params, opt in ((ours, a), (ref, b)):
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, ref, strict=True))


def test_the_built_in_optimizers_arguments_are_their_constructors() -> None:
    """settings.OPTIMIZERS (checked without importing torch) against the classes the names stand for."""
    for name, keys in OPTIMIZERS.items():
        cls = optimizer_class(Settings(**DIGITS, optimizer=name))
        takes = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "lr"}
        assert set(keys) <= takes, (name, set(keys) - takes)


def test_schedules_over_the_runs_local_steps() -> None:
    run = Settings(**{**DIGITS, "lr": 0.1}, rounds=10, local_steps=4, lr_schedule="cosine", lr_warmup_steps=4)
    s = Schedule(run)
    assert [s.factor(g) for g in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.factor(4) == 1.0 and s.factor(39) < 0.01 and math.isclose(s.factor(4 + 18), 0.5)
    step = Schedule(Settings(**DIGITS, rounds=10, lr_schedule="step", lr_schedule_options={"step_size": 3,
                                                                                              "gamma": 0.5}))
    assert [step.factor(g) for g in (0, 2, 3, 6, 9)] == [1, 1, 0.5, 0.25, 0.125]
    linear = Schedule(Settings(**DIGITS, rounds=4, local_steps=1, lr_schedule="linear"))
    assert [linear.factor(g) for g in range(4)] == [1.0, 0.75, 0.5, 0.25]
    torch_step = Schedule(Settings(**DIGITS, rounds=10, lr_schedule="torch.optim.lr_scheduler:StepLR",
                                   lr_schedule_options={"step_size": 3, "gamma": 0.5}))
    assert [torch_step.factor(g) for g in (0, 2, 3, 6, 9)] == [1, 1, 0.5, 0.25, 0.125]


def test_clipping_bounds_each_steps_gradient() -> None:
    free = build_task(Settings(**{**DIGITS, "lr": 1.0}))
    clipped = build_task(Settings(**{**DIGITS, "lr": 1.0}, clip_grad_norm=0.01))
    x0 = free.initial(0)
    moved_free = np.linalg.norm(free.train(0, 0, x0)[0] - x0)
    moved = np.linalg.norm(clipped.train(0, 0, x0)[0] - x0)
    assert moved <= 0.01 + 1e-6 < moved_free


VOID = [
    ({"momentum": 0.9, "optimizer_state": "reset"}, "--momentum needs --optimizer-state keep or --local-steps 2"),
    ({"optimizer": "adam", "momentum": 0.9}, "--momentum needs an --optimizer that takes momentum"),
    ({"optimizer": "adam", "optimizer_options": {"nesterov": True}}, "--optimizer-option nesterov"),
    ({"optimizer": "adam", "local_steps": 0}, "--optimizer needs --local-steps 1 or more"),
    ({"lr_schedule": "constant", "lr_schedule_options": {"gamma": 0.5}}, "--lr-schedule-option gamma"),
    ({"lr_schedule": "step"}, "--lr-schedule step needs --lr-schedule-option step_size"),
    ({"lr_warmup_steps": 99, "rounds": 3}, "--lr-warmup-steps 99"),
    ({"task": "quadratic", "clip_grad_norm": 1.0}, "--clip-grad-norm needs a --task other than quadratic"),
    ({"optimizer_options": {"lr": 0.1}}, "--optimizer-option lr: give it as --lr"),
]


@pytest.mark.parametrize("given,says", VOID)
def test_a_setting_that_changes_nothing_is_refused_naming_its_flag(given: dict, says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        Settings.load(**{**DIGITS, **given})
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_an_imported_optimizers_arguments_are_checked_before_the_run() -> None:
    check_training(Settings(**DIGITS, optimizer="torch.optim:RAdam", optimizer_options={"decoupled_weight_decay":
                                                                                        True}))
    with pytest.raises(SettingsError, match="--optimizer-option betaz: --optimizer torch.optim:RAdam takes no"):
        check_training(Settings(**DIGITS, optimizer="torch.optim:RAdam", optimizer_options={"betaz": 1}))
    with pytest.raises(SettingsError, match="--optimizer torch.optim:Nope: torch.optim has no 'Nope'"):
        check_training(Settings(**DIGITS, optimizer="torch.optim:Nope"))
    with pytest.raises(SettingsError, match="--lr-schedule torch.optim.lr_scheduler:StepLR: TypeError"):
        check_training(Settings(**DIGITS, lr_schedule="torch.optim.lr_scheduler:StepLR"))


SIGN_SGD = """
import torch


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.01, scale=1.0):
        if scale <= 0:
            raise ValueError(f"Invalid scale: {scale}")
        super().__init__(params, {"lr": lr, "scale": scale})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"] * group["scale"])
"""


@pytest.mark.parametrize("options,says", [
    ({"betas": 0.9}, "--optimizer-option betas=0.9: TypeError: 'float' object is not subscriptable (Adam's default: "
                     "betas=(0.9, 0.999))"),
    ({"eps": -1}, "--optimizer-option eps=-1: Invalid epsilon value: -1"),
    ({"amsgrad": True, "betas": [0.9, 1.5]}, "--optimizer-option betas=[0.9,1.5]: Invalid beta parameter at index 1"),
])
def test_an_optimizers_values_are_refused_by_building_it_naming_the_flag(options: dict, says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        check_training(Settings(**DIGITS, optimizer="adam", optimizer_options=options))
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    check_training(Settings(**DIGITS, optimizer="adam", optimizer_options={"betas": [0.9, 0.99], "eps": 1e-6}))


def test_an_optimizer_by_file_is_found_as_a_task_is_and_its_values_checked(tmp_path, monkeypatch) -> None:
    (tmp_path / "signsgd.py").write_text(SIGN_SGD)
    monkeypatch.chdir(tmp_path)
    run = Settings(**DIGITS, optimizer="signsgd.py:SignSGD")
    assert run.optimizer == f"{tmp_path / 'signsgd.py'}:SignSGD"  # made absolute: a node started elsewhere finds it
    check_training(run)
    params = [torch.nn.Parameter(torch.tensor([1.0, -2.0]))]
    opt = NodeOptimizers.of(run).of_node(0, params)
    params[0].grad = torch.tensor([3.0, -0.5])
    opt.step()
    assert params[0].tolist() == torch.tensor([1.0 - 0.05, -2.0 + 0.05]).tolist()  # the sign of each gradient
    with pytest.raises(SettingsError, match=r"^--optimizer-option scale=0: Invalid scale: 0$"):
        check_training(Settings(**DIGITS, optimizer="signsgd.py:SignSGD", optimizer_options={"scale": 0}))
    with pytest.raises(SettingsError, match=r"signsgd.py:Nope: \S*signsgd.py has no 'Nope'$"):
        check_training(Settings(**DIGITS, optimizer="signsgd.py:Nope"))
    with pytest.raises(SettingsError, match=r"nofile.py:SignSGD: no such file: "):
        check_training(Settings(**DIGITS, optimizer="nofile.py:SignSGD"))


def test_a_nodes_optimizers_restore_before_and_after_they_exist() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    opts = NodeOptimizers(lambda p: SGD(p, lr=0.1, momentum=0.5), keep=True)
    opts.restore(4, {"optimizer/0/momentum_buffer": np.full(3, 2.0, np.float32)})
    assert np.array_equal(opts.state(4)["optimizer/0/momentum_buffer"], np.full(3, 2.0, np.float32))
    opt = opts.of_node(4, params)
    params[0].grad = torch.zeros(3)
    opt.step()
    assert np.allclose(params[0].detach().numpy(), 1 - 0.1 * 0.5 * 2.0)
