"""Every layer's rows in one call: ``jacap_attn.types.fold_plans`` and Jacap's ``across_layers`` over
folded plans (the same scores as plan by plan, fewer calls)."""

from __future__ import annotations

import pytest
import torch

from jacap_attn import methods
from jacap_attn.math import lookup
from jacap_attn.methods import jacap as jacap_module
from jacap_attn.types import LayerPlan, fold_plans, repeat_rows, unfold_scores


def _plans(count=4, b=2, h=3, n=40, *, seed=0, last=True, room=False):
    gen = torch.Generator().manual_seed(seed)
    key_valid = torch.ones(b, n, dtype=torch.bool)
    key_valid[1, :5] = False  # a left-padded row
    plans = []
    for i in range(count):
        parts = {"leverage": torch.rand(b, h, n, generator=gen)}
        if last:
            parts[jacap_module.LAST] = torch.rand(b, h, n, generator=gen) / 4
        if room:
            parts[lookup.ROOM] = torch.randint(0, 3, (b, h), generator=gen)
        scores = torch.rand(b, h, n, generator=gen).masked_fill(~key_valid[:, None], float("-inf"))
        plans.append(LayerPlan(i, None, scores, key_valid.clone(), 4, parts,
                               head_budgets=torch.randint(6, 20, (b, h), generator=gen)))
    return plans, key_valid


def test_fold_plans_concatenates_rows_plan_major_and_unfolds_back():
    plans, _ = _plans(3)
    groups, count = fold_plans(plans, ("leverage", jacap_module.LAST, lookup.ROOM))
    assert count == 3 and len(groups) == 1
    folded = groups[0]
    assert folded.scores.shape == (6, 3, 40) and folded.key_valid.shape == (6, 40) and folded.head_budgets.shape == (6, 3)
    assert torch.equal(folded.scores[2:4], plans[1].scores)  # row i b + r is row r of plan i
    assert torch.equal(folded.parts["leverage"][4:], plans[2].parts["leverage"])
    assert lookup.ROOM not in folded.parts  # no plan holds it
    folded.scores = folded.scores + 1.0
    unfold_scores(groups, plans, count)
    assert all(torch.equal(p.scores, folded.scores[2 * i:2 * i + 2]) for i, p in enumerate(plans))
    assert torch.equal(repeat_rows(torch.arange(4).view(2, 2), 3)[4:], torch.arange(4).view(2, 2))
    assert repeat_rows(None, 3) is None


@pytest.mark.parametrize("change", ["shape", "device", "part", "one"])
def test_fold_plans_leaves_plans_it_cannot_fold(change):
    plans, _ = _plans(2 if change != "one" else 1)
    if change == "shape":
        plans[1].scores = plans[1].scores[..., :30]
    elif change == "device":  # a model spread over devices: its layers' plans stay apart
        plans[1].scores = plans[1].scores.to("meta")
    elif change == "part":
        del plans[1].parts[jacap_module.LAST]
    groups, count = fold_plans(plans, ("leverage", jacap_module.LAST))
    assert count == 1 and groups is plans


@pytest.mark.parametrize("options", [
    {},  # the defaults: carry from the last query's lenders, consensus, lookup, sinks
    dict(carry_force=0.1, carry_top=0.5, carry_peak=1.5),
    dict(consensus=0.0, carry=0.0),
])
@pytest.mark.parametrize("room", [False, True])
def test_across_layers_folded_equals_plan_by_plan(monkeypatch, options, room):
    """Jacap's cross-layer step gives every plan bit for bit the scores it gives plan by plan."""
    folded_plans, key_valid = _plans(room=room)
    single_plans, _ = _plans(room=room)
    strength = torch.zeros(2, 40)
    strength[:, 10:14] = 0.5  # a run the prompt lookup marks (its part is the first plan's)
    for plans in (folded_plans, single_plans):
        plans[0].parts[lookup.PART] = strength
    before = [p.scores.clone() for p in folded_plans]
    method = methods.Jacap(lookup_free=0, **options)
    calls = []
    real = jacap_module.fold_plans

    def counted(plans, parts=()):
        groups, count = real(plans, parts)
        calls.append(count)
        return groups, count

    monkeypatch.setattr(jacap_module, "fold_plans", counted)
    method.across_layers(folded_plans, key_valid, 4)
    assert calls == [4]
    monkeypatch.setattr(jacap_module, "fold_plans", lambda plans, parts=(): (plans, 1))  # plan by plan
    method.across_layers(single_plans, key_valid, 4)
    for folded, single in zip(folded_plans, single_plans):
        assert torch.equal(folded.scores, single.scores)
    assert not all(torch.equal(p.scores, s) for p, s in zip(folded_plans, before))  # the step moved something
