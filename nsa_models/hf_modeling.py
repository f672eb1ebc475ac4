"""transformers wrappers of `nsa_models.Transformer`: a config carrying this repo's ModelArgs, and a causal LM.

`nsa_training/hf_export.py` copies this file into every export as `modeling_nsa_titan.py`, where the config's
`auto_map` finds it: `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` then runs this repo's
model (the `nsa_models` package must be installed). `generate()` decodes with NSA's key/value cache
(`nsa_models.decoding`), as `scripts/generate.py` does: the prompt in one full forward, then one step per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nsa_models.args import ModelArgs, NSAArgs
from nsa_models.decoding import DecodeCache, decode_step, prefill
from nsa_models.model import Transformer, rope_cache

# The oldest transformers this file was tested with (loading: v5's meta-device init and non-persistent buffers).
MIN_TRANSFORMERS = "5.24"
if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
    raise ImportError(f"transformers {transformers.__version__} is too old for NSA exports: they need "
                      f"transformers>={MIN_TRANSFORMERS}")

MODEL_TYPE = "nsa_titan"
MODULE_NAME = "modeling_nsa_titan"  # this file's name inside an export directory
IGNORE_INDEX = -100  # labels at this value add nothing to the loss (transformers' convention)


def model_args_from_dict(values: dict[str, Any]) -> ModelArgs:
    """ModelArgs from `dataclasses.asdict(args)` (as a config.json stores them)."""
    return ModelArgs(**{**values, "nsa": NSAArgs(**values["nsa"])})


class NSATitanConfig(PretrainedConfig):
    """The model's `ModelArgs` (as a dict, `model_args`) and the tokenizer it was trained with (`tokenizer`: `byte`
    or `tokenizer.json`, the file beside config.json)."""

    model_type = MODEL_TYPE

    def __init__(self, model_args: dict[str, Any] | None = None, tokenizer: str = "byte", **kwargs: Any) -> None:
        self.model_args = model_args if model_args is not None else dataclasses.asdict(ModelArgs())
        self.tokenizer = tokenizer
        # The names transformers' generic code reads (generation, pipelines), derived from model_args.
        self.vocab_size = self.model_args["vocab_size"]
        self.hidden_size = self.model_args["dim"]
        self.num_hidden_layers = self.model_args["n_layers"]
        self.max_position_embeddings = self.model_args["max_seq_len"]
        kwargs.setdefault("use_cache", False)  # no key/value cache: every step recomputes the context
        kwargs["tie_word_embeddings"] = self.model_args["tie_embeddings"]
        super().__init__(**kwargs)

    def nsa_model_args(self) -> ModelArgs:
        return model_args_from_dict(self.model_args)


class NSATitanForCausalLM(PreTrainedModel, GenerationMixin):
    """`nsa_models.Transformer` as a transformers causal LM; its weights are under `model.` (state-dict names of the
    repo's checkpoints otherwise)."""

    config_class = NSATitanConfig
    base_model_prefix = "model"
    _no_split_modules = ["TransformerBlock"]
    # With tie_embeddings the loader must keep the head and the embedding one tensor (it replaces each parameter).
    _tied_weights_keys = {"model.output.weight": "model.tok_embeddings.weight"}

    def __init__(self, config: NSATitanConfig) -> None:
        super().__init__(config)
        self.model = Transformer(config.nsa_model_args())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # transformers builds the model on the meta device and leaves non-persistent buffers empty: the RoPE table is
        # derived from the config, so it is recomputed here rather than loaded.
        if isinstance(module, Transformer):
            args = module.args
            module.rope.copy_(rope_cache(args.max_seq_len, args.head_dim, args.rope_theta, module.rope.device))
        else:
            super()._init_weights(module)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_embeddings

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.output

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits [B, T, vocab] of `input_ids` [B, T]; with `labels` [B, T] also the mean next-token loss (labels are
        shifted here, as in transformers; -100 is ignored). Rows must be unpadded: NSA has no padding mask.

        With `use_cache` the output carries an `nsa_models.decoding.DecodeCache` as `cache`; given one back,
        `input_ids` is the one new token per row [B, 1], decoded in one cached step (`generate()` does this)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padded batches are not supported (NSA has no padding mask): give one unpadded row, or "
                             "rows of equal length")
        if isinstance(cache, DecodeCache):
            logits = decode_step(self.model, input_ids[:, -1], cache)[:, None]
            return CausalLMOutputWithPast(logits=logits, cache=cache)
        if input_ids.shape[1] > self.model.args.max_seq_len:
            raise ValueError(f"{input_ids.shape[1]} tokens exceed the model's max_seq_len "
                             f"({self.model.args.max_seq_len})")
        cache = None  # another library's cache object (generate() makes one) holds nothing of ours
        if use_cache and labels is None:
            logits, cache = prefill(self.model, input_ids)
        else:
            logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, cache: Any = None,
                                      **kwargs: Any) -> dict[str, Any]:
        # A cache with room for the next position: only the newest token. Otherwise (the first step, another
        # library's cache object, or a full context: positions restart and the window slides, as scripts/generate.py
        # does) the last max_seq_len tokens in one full forward that fills a new cache.
        window = self.model.args.max_seq_len
        if isinstance(cache, DecodeCache) and cache.length < window:
            return {"input_ids": input_ids[:, -1:], "cache": cache, "use_cache": True}
        return {"input_ids": input_ids[:, -window:], "use_cache": True}
