"""NSA attention: the functional core (`nsa_attention`) and its backends."""

from nsa_models.nsa.core import (
    AC_ALWAYS_SAVE_OPS,
    AC_SELECTIVE_SAVE_OPS,
    BACKENDS,
    check_backend,
    nsa_attention,
    window_mask,
)

__all__ = ["AC_ALWAYS_SAVE_OPS", "AC_SELECTIVE_SAVE_OPS", "BACKENDS", "check_backend", "nsa_attention", "window_mask"]
