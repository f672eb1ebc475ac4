"""Float8 training of the large linear layers through torchao."""

from __future__ import annotations

from torch import nn

from nsa_models.model import HIGH_PRECISION_MODULES
from parallelisms.config import Float8Config, PlanError


def _is_float8_worthy(module: nn.Module, fqn: str, min_features: int) -> bool:
    if not isinstance(module, nn.Linear) or HIGH_PRECISION_MODULES & set(fqn.split(".")):
        return False
    dims = (module.in_features, module.out_features)
    # torch._scaled_mm needs multiples of 16; below min_features the casts cost more than the fp8 matmul saves.
    return all(d % 16 == 0 and d >= min_features for d in dims)


def apply_float8(model: nn.Module, cfg: Float8Config) -> None:
    """Swap eligible nn.Linear modules for torchao Float8Linear (in place) with the configured scaling recipe."""
    # Imported here: torchao is only needed (and, on some machines, only installed) for float8 runs.
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    worthy = {fqn for fqn, module in model.named_modules() if _is_float8_worthy(module, fqn, cfg.min_features)}
    if not worthy:
        # Converting nothing would train in bf16 while the recipe says float8: say so instead.
        raise PlanError(f"float8.min_features = {cfg.min_features}: no linear layer has both dimensions >= it, so "
                        "float8 would change nothing; lower float8.min_features (e.g. to model.dim) or set "
                        "float8.enable = false")
    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in worthy)
