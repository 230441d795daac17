"""A hyperparameter of the wrong type is refused with a TypeError that names it (torch.optim's own
checks fail there inside a comparison: "'<=' not supported between instances of 'float' and
'str'"), and Muon's adamw_names refuses a bare string (iterated, it would give its letters)."""

import re

import pytest
import torch

from kernel_factory.optimizers import Adafactor, AdamMini, AdamW, Muon, TurboAdam


def _build(cls, **kwargs):
    p = torch.nn.Parameter(torch.zeros(8, 8))
    if cls is AdamMini:
        return AdamMini([("layers.0.mlp.up_proj.weight", p)], dim=8, n_heads=2, **kwargs)
    return cls([p], **kwargs)


ADAM_KEYS = ("eps", "weight_decay", "betas[0]", "betas[1]")
CASES = [
    *((cls, key) for cls in (AdamW, TurboAdam, AdamMini) for key in ADAM_KEYS),
    (AdamMini, "fallback_capacity"),
    *((Adafactor, key) for key in ("lr", "beta2_decay", "d", "weight_decay", "eps[0]", "eps[1]")),
    *((Muon, key) for key in ("momentum", "weight_decay", "eps")),
]


@pytest.mark.parametrize(("cls", "key"), CASES, ids=lambda c: getattr(c, "__name__", c))
def test_a_hyperparameter_of_the_wrong_type_is_named(cls, key):
    name, _, index = key.partition("[")
    if index:
        pair = list({"betas": (0.9, 0.999), "eps": (None, 1e-3)}[name])
        pair[int(index[0])] = "0.1"
        kwargs = {name: tuple(pair)}
    else:
        kwargs = {name: "0.1"}
    with pytest.raises(TypeError, match="^" + re.escape(key) + " must be a real number"):
        _build(cls, **kwargs)


def test_numpy_scalars_are_real_numbers():
    np = pytest.importorskip("numpy")
    _build(AdamW, eps=np.float32(1e-8), weight_decay=np.float64(0.01))
    _build(Adafactor, d=np.float32(1.0))


def test_muons_adamw_names_refuses_a_bare_string():
    with pytest.raises(TypeError, match="adamw_names must be an iterable of name substrings, not a str"):
        _build(Muon, adamw_names="embed")
    opt = _build(Muon, adamw_names=("embed",))
    assert opt.adamw_names == ("embed",)
