"""torch.optim's own argument rules: where ours and torch's optimizer take the same arguments, bad
ones raise the same exception type with torch's message."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.optimizers import Adam, AdamMini, AdamW, Muon


def _leaf(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, requires_grad=True)


def _raised(build):
    with pytest.raises(Exception) as info:  # noqa: B017 - the type is what is compared
        build()
    return info.value


def _names(*shapes):
    return [(f"layers.0.w{i}", _leaf(*s)) for i, s in enumerate(shapes)]


# (ours, torch's): each builds an optimizer from the same bad arguments.
CASES = {
    "AdamW betas float and Tensor": (lambda: AdamW([_leaf(3)], betas=(0.9, torch.tensor(0.99))),
                                     lambda: torch.optim.AdamW([_leaf(3)], betas=(0.9, torch.tensor(0.99)))),
    "Adam betas Tensor and float": (lambda: Adam([_leaf(3)], betas=(torch.tensor(0.9), 0.99)),
                                    lambda: torch.optim.Adam([_leaf(3)], betas=(torch.tensor(0.9), 0.99))),
    "AdamW betas int": (lambda: AdamW([_leaf(3)], betas=(0, 0.99)),
                        lambda: torch.optim.AdamW([_leaf(3)], betas=(0, 0.99))),
    "AdamW beta out of range": (lambda: AdamW([_leaf(3)], betas=(0.9, 1.5)),
                                lambda: torch.optim.AdamW([_leaf(3)], betas=(0.9, 1.5))),
    "Muon bare tensor": (lambda: Muon(torch.randn(3, 3)), lambda: torch.optim.Muon(torch.randn(3, 3))),
    "AdamW bare tensor": (lambda: AdamW(torch.randn(3, 3)), lambda: torch.optim.AdamW(torch.randn(3, 3))),
    "AdamMini bare tensor": (lambda: AdamMini(torch.randn(3, 3), dim=4, n_heads=1),
                             lambda: torch.optim.AdamW(torch.randn(3, 3))),
    "Muon empty": (lambda: Muon([]), lambda: torch.optim.Muon([])),
    "Muon names on some params": (lambda: Muon([("w", _leaf(3, 3)), _leaf(3, 3)]),
                                  lambda: torch.optim.Muon([("w", _leaf(3, 3)), _leaf(3, 3)])),
    "AdamMini names on some params": (lambda: AdamMini([("w", _leaf(3, 3)), _leaf(3, 3)], dim=4, n_heads=1),
                                      lambda: torch.optim.AdamW([("w", _leaf(3, 3)), _leaf(3, 3)])),
    "AdamW names on some params": (lambda: AdamW([("w", _leaf(3)), _leaf(3)]),
                                   lambda: torch.optim.AdamW([("w", _leaf(3)), _leaf(3)])),
    "Muon a group without names after one with": (
        lambda: Muon([{"params": [("w", _leaf(3, 3))]}, {"params": [_leaf(3, 3)]}]),
        lambda: torch.optim.Muon([{"params": [("w", _leaf(3, 3))]}, {"params": [_leaf(3, 3)]}])),
    "Muon a group with names after one without": (
        lambda: Muon([{"params": [_leaf(3, 3)]}, {"params": [("w", _leaf(3, 3))]}]),
        lambda: torch.optim.Muon([{"params": [_leaf(3, 3)]}, {"params": [("w", _leaf(3, 3))]}])),
    "AdamMini a group without names after one with": (
        lambda: AdamMini([{"params": _names((3, 3))}, {"params": [_leaf(3, 3)]}], dim=4, n_heads=1),
        lambda: torch.optim.AdamW([{"params": _names((3, 3))}, {"params": [_leaf(3, 3)]}])),
    "Muon a set of params": (lambda: Muon([{"params": {_leaf(3, 3)}}]),
                             lambda: torch.optim.Muon([{"params": {_leaf(3, 3)}}])),
    "Muon a param that is not a tensor": (lambda: Muon([_leaf(3, 3), 1.0]),
                                          lambda: torch.optim.Muon([_leaf(3, 3), 1.0])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_arguments_raise_torchs_exception_and_message(case):
    ours, theirs = (_raised(build) for build in CASES[case])
    assert type(ours) is type(theirs), (ours, theirs)
    assert str(theirs) in str(ours), (str(ours), str(theirs))


def test_complex_parameters_in_muon_raise_torchs_runtime_error():
    errors = []
    for cls in (Muon, torch.optim.Muon):
        p = _leaf(4, 4, dtype=torch.complex64)
        opt = cls([p])
        p.grad = torch.ones_like(p)
        errors.append(_raised(opt.step))
    ours, theirs = errors
    assert type(ours) is type(theirs) is RuntimeError
    assert str(theirs) in str(ours) and "shape (4, 4)" in str(ours)


def test_multi_element_tensor_betas_get_a_clear_error():
    # torch's own check fails on bool() of a 2-element tensor first
    with pytest.raises(ValueError, match=r"Tensor betas\[1\] must be 1-element"):
        AdamW([_leaf(3)], betas=(torch.tensor(0.9), torch.tensor([0.99, 0.9])))


@pytest.mark.parametrize("kwargs", [dict(lr=torch.tensor(1e-2)), dict(betas=(torch.tensor(0.9), torch.tensor(0.99)))])
def test_tensor_lr_and_betas_work_with_foreach_where_torchs_foreach_path_refuses(kwargs):
    with pytest.raises(ValueError, match="not supported for capturable=False and foreach=True"):
        torch.optim.AdamW([_leaf(3)], foreach=True, **kwargs)
    p, q = _leaf(8), _leaf(8)
    ours, theirs = AdamW([p], foreach=True, **kwargs), torch.optim.AdamW([q], fused=True, **kwargs)
    for _ in range(3):
        p.grad = torch.randn(8)
        q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(p, q)  # torch's fused CPU kernel on both sides


def test_named_params_keep_their_names_like_torch():
    named = _names((3, 3), (5,))
    ours, theirs = Muon(named), torch.optim.Muon([named[0]])
    assert ours.param_groups[0]["param_names"] == theirs.param_groups[0]["param_names"] == ["layers.0.w0"]
    assert ours.param_groups[1]["param_names"] == ["layers.0.w1"]  # AdamW's group
    assert AdamW(named).param_groups[0]["param_names"] == ["layers.0.w0", "layers.0.w1"]
