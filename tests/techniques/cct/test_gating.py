import pytest
import torch
from torch import nn

from dynaseq.techniques.cct.gating import ALL_GATES_ON, BudgetControl
from dynaseq.techniques.cct.layers import (
    ControlNet,
    Gate,
    NoiseSchedule,
    force_gates,
    set_gate_step,
)


def test_noise_schedule_rises_linearly_then_holds():
    s = NoiseSchedule(alpha_max=5.0, ramp_steps=1000)
    assert [float(s.alpha(k)) for k in (0, 250, 500, 1000, 5000)] == [0.0, 1.25, 2.5, 5.0, 5.0]
    assert float(NoiseSchedule(alpha_max=2.0, ramp_steps=0).alpha(0)) == 2.0
    assert NoiseSchedule().alpha_max == 5.0


def test_noise_schedule_starts_its_ramp_at_start():
    s = NoiseSchedule(alpha_max=5.0, ramp_steps=100, start=50)
    assert [float(s.alpha(k)) for k in (0, 49, 50, 100, 150, 900)] == [0, 0, 0, 2.5, 5, 5]
    jump = NoiseSchedule(alpha_max=2.0, ramp_steps=0, start=10)
    assert [float(jump.alpha(k)) for k in (0, 9, 10, 11)] == [0.0, 0.0, 2.0, 2.0]


def test_gate_step_is_a_buffer_set_by_the_training_loop():
    model = nn.ModuleList([Gate(NoiseSchedule(4.0, 100)), Gate(NoiseSchedule(4.0, 100))])
    set_gate_step(model, 50)
    assert [float(g.alpha()) for g in model] == [2.0, 2.0]
    assert model[0].step.item() == 50 and "0.step" not in model.state_dict()  # loop owns it


def test_training_gates_are_noisy_sigmoids_with_scale_alpha():
    torch.manual_seed(0)
    gate = Gate(NoiseSchedule(5.0, 100)).train()
    logits = torch.zeros(200_000)
    assert torch.equal(gate(logits), torch.full_like(logits, 0.5))  # step 0: α = 0, no noise
    set_gate_step(gate, 50)  # α = 2.5
    g = gate(logits).double()
    noise = torch.log(g / (1 - g))
    assert noise.mean().item() == pytest.approx(0.0, abs=0.02)
    assert noise.std().item() == pytest.approx(2.5, rel=0.01)


def test_inference_gates_are_hard_at_sigmoid_one_half():
    gate = Gate(NoiseSchedule(5.0, 0)).eval()  # full noise scale, but no noise at inference
    logits = torch.tensor([-3.0, -1e-6, 0.0, 1e-6, 4.0])
    assert gate(logits).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_override_and_force_gates_restore():
    gates = nn.ModuleList([Gate(), Gate()])
    gates[1].gate_override = 0.0
    logits = torch.randn(7)
    with force_gates(gates, 1.0):
        gates.train()
        assert all(torch.equal(g(logits), torch.ones(7)) for g in gates)
        gates.eval()
        assert all(torch.equal(g(logits), torch.ones(7)) for g in gates)
    assert [g.gate_override for g in gates] == [None, 0.0]
    gates[0].gate_override = 0.7
    gates.train()
    assert torch.equal(gates[0](logits), torch.full((7,), 0.7))
    gates.eval()
    assert torch.equal(gates[0](logits), torch.ones(7))


def test_control_net_shapes_and_macs():
    net = ControlNet(32, n_gates=4, hidden=16)
    assert net(torch.randn(2, 5, 32)).shape == (2, 5, 4)
    assert net.macs(10) == 10 * (32 * 16 + 16 * 4)
    assert ControlNet(8).w1.out_features == 128


@pytest.mark.parametrize("kwargs, match", [
    ({"hidden": 0}, "hidden"), ({"n_gates": 0}, "n_gates"),
])
def test_control_net_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControlNet(8, **kwargs)


@pytest.mark.parametrize("kwargs", [{"alpha_max": -1.0}, {"ramp_steps": -5},
                                    {"start": -1}])
def test_schedule_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        NoiseSchedule(**kwargs)


def test_hard_budget_counts_the_inference_decision_with_the_sigmoid_gradient():
    logits = torch.tensor([-2.0, -0.1, 0.0, 3.0], requires_grad=True)
    gate = Gate(NoiseSchedule(5.0, 0), hard_budget=True).train()
    g = gate(logits)
    counted = gate.for_budget(logits, g)
    assert counted.tolist() == [0.0, 0.0, 1.0, 1.0]  # what inference will run
    counted.sum().backward()
    s = torch.sigmoid(logits.detach())
    torch.testing.assert_close(logits.grad, s * (1 - s))  # straight-through σ'
    soft = Gate(NoiseSchedule(5.0, 0)).train()
    assert soft.for_budget(logits, g) is g  # the paper: the noisy training gates
    assert gate.eval().for_budget(logits, g) is g


def test_all_open_is_every_sub_network_at_plus_infinity_per_row():
    inf = ALL_GATES_ON
    c = BudgetControl(torch.tensor([0, 1, 2]), {"encoder": torch.tensor([inf, inf, 0.5]),
                                                "decoder": torch.tensor([inf, -1.0, inf])})
    assert c.all_open(3) == [True, False, False]
    assert BudgetControl(0, {"encoder": inf, "decoder": inf}).all_open(2) == [True, True]
    assert BudgetControl(0, {"decoder": inf}).all_open(2) == [False, False]  # encoder: 0
    assert BudgetControl(0, {"encoder": inf}).all_open(2, ("encoder",)) == [True, True]
