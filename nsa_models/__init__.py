"""Plain single-device NSA / dense LLaMA-style models.

Importing the package root loads no torch (recipes parse fast); the model, FLOPs and NSA core load on first use.
"""

from importlib import import_module

from nsa_models.args import FLAVORS, ModelArgs, NSAArgs, get_flavor

_LAZY = {"Transformer": "nsa_models.model", "TransformerBlock": "nsa_models.model",
         "flops_per_token": "nsa_models.flops", "FlopsPerToken": "nsa_models.flops"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nsa_models' has no attribute {name!r}")


__all__ = ["FLAVORS", "ModelArgs", "NSAArgs", "get_flavor", *_LAZY]
