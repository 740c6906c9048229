"""`generate.capture_method=forward`: the verifier's own forward pass writes the captured layers' rows, in a plain vLLM
engine, without vLLM's `extract_hidden_states` method.

vLLM's models that serve EAGLE-3 already return the aux layers' hidden states next to the last one when
`set_aux_hidden_state_layers` was called (`SupportsEagle3`); only a speculative method makes the model runner ask
for them. This module makes, for the verifier's architecture `A`, the subclass `Eagle3RayCapture_A` that asks for
them itself and hands them, stacked `[tokens, layers, hidden]`, to one vLLM `CacheOnlyAttentionLayer` (the cache
layer of `extract_hidden_states`) under the same module name, `cache_only_layers.<num_hidden_layers>`. vLLM then
sizes and pages that cache as it does for the method (`HiddenStateCacheSpec`), and the project's connector finds and
reads it by block ids, as before. What changes is the engine around it: no drafter, no draft slot, no rejection
sampler, and the engine is free to schedule asynchronously and to run decode steps as full CUDA graphs.

Padded token slots (-1: CUDA-graph padding) go to the null block (block 0, never a request's): vLLM 0.24's
`basic_cache` sends them to the last block's last slot, which may be a request's.

The classes are registered with vLLM in every vLLM process through the `vllm.general_plugins` entry point
(`register`, pyproject.toml): lazily, one name per architecture vLLM knows, each made on first use by this module's
`__getattr__`. The engine (generate/engine.py) names the subclass through `hf_overrides`: `architectures` and
CAPTURE_LAYERS_KEY, the captured layer ids. vLLM is imported inside the functions, none of them on the forward path:
engine.py imports this module for its names, and the driver and evaluate use engine.py without loading vLLM.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

PREFIX = "Eagle3RayCapture_"
CAPTURE_LAYERS_KEY = "eagle3_ray_capture_layer_ids"
PLUGIN = "eagle3_ray_capture"  # the entry point's name (pyproject.toml), for VLLM_PLUGINS


def register() -> None:
    """vLLM's general plugin: a lazy registration of `Eagle3RayCapture_<arch>` for every architecture vLLM knows."""
    from vllm import ModelRegistry

    for arch in list(ModelRegistry.get_supported_archs()):
        if not arch.startswith(PREFIX):
            ModelRegistry.register_model(PREFIX + arch, f"{__name__}:{PREFIX}{arch}")


def capture_architecture(arch: str) -> str:
    return PREFIX + arch


def __getattr__(name: str) -> Any:
    """`Eagle3RayCapture_<arch>`: made from vLLM's class for `<arch>` on first use (vLLM imports it by this name)."""
    if not name.startswith(PREFIX):
        raise AttributeError(name)
    from vllm import ModelRegistry

    arch = name[len(PREFIX) :]
    if arch not in ModelRegistry.models:
        raise AttributeError(f"{name}: vLLM has no model class for architecture {arch!r}")
    base = ModelRegistry.models[arch].load_model_cls()
    cls = type(name, (_CaptureMixin, base), {"__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


class _CaptureMixin:
    """Put before the verifier's vLLM class: the captured layers' rows go into the hidden-state cache layer at every
    forward pass, and the model runner gets the last hidden states alone, as from the plain model."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        from eagle3_ray.core.vllm_support import maybe_prefix

        super().__init__(vllm_config=vllm_config, prefix=prefix)
        model_config = vllm_config.model_config
        layer_ids = getattr(model_config.hf_config, CAPTURE_LAYERS_KEY, None)
        if not layer_ids:
            raise ValueError(f"{type(self).__name__}: hf_overrides must set {CAPTURE_LAYERS_KEY}")
        if not hasattr(self, "set_aux_hidden_state_layers"):
            raise ValueError(
                f"{type(self).__name__}: vLLM's model for this architecture does not return aux hidden states "
                "(it does not serve EAGLE-3); use generate.capture_method=extract_hidden_states"
            )
        self.set_aux_hidden_state_layers(tuple(int(i) for i in layer_ids))
        cache_config = vllm_config.cache_config
        if cache_config is not None and cache_config.cache_dtype not in ("auto", "bfloat16", "float16"):
            cache_config = replace(cache_config, cache_dtype="auto")  # rows are stored in the model's dtype
        name = str(model_config.get_total_num_hidden_layers())
        self.cache_only_layers = nn.ModuleDict(
            {
                name: _hidden_state_cache(
                    num_heads=len(layer_ids),
                    head_size=model_config.get_hidden_size(),
                    cache_config=cache_config,
                    prefix=maybe_prefix(prefix, f"cache_only_layers.{name}"),
                )
            }
        )
        self._cache_layer = self.cache_only_layers[name]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if not isinstance(out, tuple):  # a pipeline stage's intermediate tensors
            return out
        hidden_states, aux = out
        self._cache_layer(torch.stack(aux, dim=1))
        return hidden_states


def _hidden_state_cache(**kwargs: Any) -> Any:
    """vLLM's CacheOnlyAttentionLayer, with padded slots (-1) written to the null block, on a backend that lets vLLM
    capture whole steps as CUDA graphs.

    vLLM sets an engine's CUDA-graph mode to the least any KV cache group's metadata builder supports, and vLLM's
    cache-only builder says NEVER, which turns the verifier's full decode graphs into piecewise ones. The write needs
    nothing a graph cannot replay: it indexes the cache with this step's slot mapping, a slice of the model runner's
    persistent buffer (padded with -1), and the connector does nothing per layer (it reads finished requests' blocks
    afterwards). So the builder here says ALWAYS.
    """
    from eagle3_ray.core.vllm_support import (
        AttentionCGSupport,
        CacheOnlyAttentionBackend,
        CacheOnlyAttentionImpl,
        CacheOnlyAttentionLayer,
        CacheOnlyAttentionMetadataBuilder,
    )

    class PaddingSafeImpl(CacheOnlyAttentionImpl):
        def do_kv_cache_update(self, layer, to_cache, kv_cache, slot_mapping):
            super().do_kv_cache_update(layer, to_cache, kv_cache, slot_mapping.clamp_min(0))

    class GraphableBuilder(CacheOnlyAttentionMetadataBuilder):
        _cudagraph_support = AttentionCGSupport.ALWAYS

    class GraphableBackend(CacheOnlyAttentionBackend):
        @staticmethod
        def get_builder_cls() -> type[CacheOnlyAttentionMetadataBuilder]:
            return GraphableBuilder

    layer = CacheOnlyAttentionLayer(**kwargs)
    impl = layer.impl
    layer.impl = PaddingSafeImpl(impl.num_heads, impl.head_size, impl.kv_cache_dtype, impl.kv_cache_torch_dtype)
    layer.attn_backend = GraphableBackend
    return layer
