"""NSA attention: the functional core (`nsa_attention`) and its backends."""

from nsa_models.nsa.core import BACKENDS, nsa_attention, window_mask

__all__ = ["BACKENDS", "nsa_attention", "window_mask"]
