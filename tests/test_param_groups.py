"""``collect_param_groups``: the one place params and param groups are normalized (both
doors), with names from a model when asked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatzero.params import collect_param_groups


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3, bias=False))
    model[0].bias.requires_grad_(False)
    return model


def test_params_are_named_after_the_model():
    model = _model()
    groups = collect_param_groups(
        [{"params": [model[1].weight], "lr": 0.1}, {"params": model[0].parameters()}],
        names_from=model,
    )
    assert [g.names for g in groups] == [["1.weight"], ["0.weight"]]
    assert groups[0].options == {"lr": 0.1} and groups[1].frozen == [model[0].bias]
    # The model itself, or nothing with names_from: its named_parameters().
    assert collect_param_groups(None, names_from=model)[0].names == ["0.weight", "1.weight"]
    assert collect_param_groups(model)[0].names == ["0.weight", "1.weight"]
    # Without a model, unnamed params are named after their place.
    assert collect_param_groups(list(model.parameters()))[0].names == [
        "group0.param0",
        "group0.param2",
    ]


def test_a_param_that_is_not_the_models_is_named_in_the_error():
    model = _model()
    with pytest.raises(ValueError) as info:
        collect_param_groups(
            [nn.Parameter(torch.zeros(2))], names_from=model, where="model_parameters"
        )
    assert str(info.value) == (
        "model_parameters item 0 (shape (2,)) is not a parameter of model; pass the model's "
        "own parameters"
    )


def test_collected_groups_pass_through_unchanged():
    groups = collect_param_groups(_model())
    assert collect_param_groups(groups) is groups
