"""The losses module: every loss against a direct, loop-by-loop reference formula, with temperature and masks."""

from __future__ import annotations

import math

import pytest
import torch

from drafttrain.drafts import losses

B, T, V = 2, 5, 7


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(B, T, V, generator=g) * 2
    teacher = torch.randn(B, T, V, generator=g) * 2
    weight = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
    return student, teacher, weight


def softmax(row, temperature):
    exps = [math.exp(x / temperature) for x in row]
    return [e / sum(exps) for e in exps]


def reference(per_position, student, teacher, weight, temperature):
    """Σ_t w_t · f(p_t, q_t) / Σ_t w_t, written out position by position."""
    total, norm = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            p = softmax(teacher[b, t].tolist(), temperature)
            q = softmax(student[b, t].tolist(), temperature)
            total += float(weight[b, t]) * per_position(p, q)
            norm += float(weight[b, t])
    return total / norm


def kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


FORMULAS = {
    "soft_ce": lambda p, q: -sum(x * math.log(y) for x, y in zip(p, q)),
    "fkl": lambda p, q: kl(p, q),
    "rkl": lambda p, q: kl(q, p),
    "tvd": lambda p, q: 0.5 * sum(abs(x - y) for x, y in zip(p, q)),
}


@pytest.mark.parametrize("name", sorted(FORMULAS))
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_divergences_equal_their_formulas(case, name, temperature):
    student, teacher, weight = case
    got = losses.DIVERGENCES[name](student, teacher, weight, temperature=temperature)
    assert float(got) == pytest.approx(reference(FORMULAS[name], student, teacher, weight, temperature), rel=1e-5)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_equals_its_formula(case, beta):
    student, teacher, weight = case

    def jsd(p, q):
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        return beta * kl(p, m) + (1 - beta) * kl(q, m)

    got = losses.jsd(student, teacher, weight, temperature=1.5, beta=beta)
    assert float(got) == pytest.approx(reference(jsd, student, teacher, weight, 1.5), rel=1e-5)
    with pytest.raises(ValueError, match="beta"):
        losses.jsd(student, teacher, weight, beta=1.0)


@pytest.mark.parametrize("name", ["fkl", "rkl", "jsd", "tvd"])
def test_divergences_are_zero_when_the_distributions_agree(case, name):
    student, _, weight = case
    assert float(losses.DIVERGENCES[name](student, student.clone(), weight)) == pytest.approx(0.0, abs=1e-6)


def test_cross_entropy_and_masks(case):
    student, teacher, weight = case
    labels = teacher.argmax(-1)
    total, norm = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            q = softmax(student[b, t].tolist(), 1.0)
            total += float(weight[b, t]) * -math.log(q[int(labels[b, t])])
            norm += float(weight[b, t])
    assert float(losses.cross_entropy(student, labels, weight)) == pytest.approx(total / norm, rel=1e-5)
    # masked positions do not count, and an all-zero mask gives 0 (not NaN)
    changed = student.clone()
    changed[0, 2] += 100
    assert torch.equal(losses.cross_entropy(changed, labels, weight), losses.cross_entropy(student, labels, weight))
    assert float(losses.cross_entropy(student, labels, torch.zeros_like(weight))) == 0.0


def test_smooth_l1_is_the_masked_mean_of_huber_per_feature(case):
    student, teacher, weight = case

    def huber(x):
        return 0.5 * x * x if abs(x) < 1 else abs(x) - 0.5

    total, norm = 0.0, 0.0
    for b in range(B):
        for t in range(T):
            diffs = (student[b, t] - teacher[b, t]).tolist()
            total += float(weight[b, t]) * sum(huber(d) for d in diffs) / V
            norm += float(weight[b, t])
    assert float(losses.smooth_l1(student, teacher, weight)) == pytest.approx(total / norm, rel=1e-5)
