"""The one check of a Megatron model against an HF config, whichever entry point holds it: the live export and
the loader (the model's TransformerConfig, every rank's tensors), the offline export (a checkpoint's tensors), the
import (an HF checkpoint's tensors) and the dry run (meta models). Each kind of mismatch has one message, naming
`what` was checked ("the Megatron model", "the checkpoint DIR", ...); every mismatch found is reported at once.

Kinds: the architecture itself (`check_mapped`: every tensor has a rule of the config's table; checked first, so a
checkpoint of another architecture is named as such), the TransformerConfig fields the spec derives from the HF config (`model_config`), a hybrid model's layer
pattern, MTP layers (`checked_dims`), the decoder layers, the dense/MoE pattern, routed experts, tied embeddings,
a native vision tower's blocks and deepstack mergers (`names`), and every HF tensor's shape against the model
transformers builds from the config (`shapes`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from ..arch.hf_config import hf_tensor_shapes, shape_problems
from ..arch.mapping import Converter, ModelDims
from ..arch.naming import parse_name
from ..arch.registry import formats_mapping
from ..errors import (
    ConfigMismatchError,
    Problem,
    ShapeMismatchError,
    UnknownParametersError,
    option,
    problem_list,
)


def check_mapped(converter: Converter, names: Mapping[str, str], what: str) -> None:
    """Every canonical Megatron name (`names`: name -> how an error shows it, e.g. with its checkpoint key) has a rule
    of the HF config's table (UnknownParametersError). Checked before any count: a checkpoint of another
    architecture is that, not a wrong number of layers, so the error starts with the registered architectures
    whose tables map all of `what`."""
    unknown = [shown for name, shown in names.items() if not converter.maps(name)]
    if not unknown:
        return
    fits = formats_mapping(names)
    first = (f"{what} holds another architecture than the HF config's model_type {converter.model_type!r}: every "
             f"tensor of it maps as {', '.join(fits)}; pass that model's HF config ({option('hf_config', None)}). "
             if fits else "")
    raise UnknownParametersError(converter.model_type, unknown, first=first)


def checked_dims(spec, hf_config, mtp_layers: int, what: str) -> ModelDims:
    """The spec's dims for the HF config, with the MTP layers `what` has: a model trained without MTP exports (and
    loads) the main model only; more MTP layers than the config has is an error."""
    dims = spec.dims(hf_config)
    if mtp_layers > dims.num_mtp_layers:
        raise ConfigMismatchError(f"the HF config ({hf_config.model_type}) disagrees with {what}:\n  MTP layers: HF "
                                  f"config implies at most {dims.num_mtp_layers} (num_nextn_predict_layers), {what} "
                                  f"has {mtp_layers}")
    return dataclasses.replace(dims, num_mtp_layers=mtp_layers) if mtp_layers < dims.num_mtp_layers else dims


def check(spec, hf_config, dims: ModelDims, *, what: str, model_config=None, names: Iterable[str] | None = None,
          shapes: dict[str, tuple[int, ...]] | None = None, not_held: Callable[[str], bool] | None = None,
          problems: Iterable[Problem | str] = ()) -> None:
    """Raise every mismatch between `what` and the HF config at once (ConfigMismatchError; ShapeMismatchError when
    only tensor shapes differ): its TransformerConfig (`model_config`), its canonical tensor names (`names`), the
    HF tensors it gives (`shapes`, against transformers' model of the config less `not_held`), and `problems` an
    entry point found on its own (e.g. the vocab padding of a checkpoint)."""
    structural: list[Problem | str] = []
    if model_config is not None:
        structural += config_problems(model_config, spec, hf_config, what)
    if names is not None:
        structural += structure_problems(list(names), spec, hf_config, dims, what)
    found = list(problems)
    if shapes is not None and not found:  # a tensor the entry point could not shape has no shape to compare
        found += shape_problems(shapes, hf_tensor_shapes(hf_config, dims.num_mtp_layers, not_held))
    if structural or found:
        error = ConfigMismatchError if structural else ShapeMismatchError
        raise error(f"the HF config ({hf_config.model_type}) disagrees with {what}:\n  "
                    + problem_list(structural + found))


def config_problems(model_config, spec, hf_config, what: str) -> list[str]:
    """The TransformerConfig fields the spec derives from the HF config that the Megatron model has otherwise (and
    a hybrid model's layer pattern)."""
    diffs = []
    for name, want in spec.structural_fields(hf_config).items():
        have = getattr(model_config, name, None)
        if have != want:
            diffs.append(f"{name}: HF config implies {want!r}, {what} has {have!r}")
    if getattr(model_config, "hybrid_layout", None) is not None:  # a hybrid model (naming.model_config)
        from ..model_specs.hybrid import hybrid_pattern_problems

        diffs += hybrid_pattern_problems(model_config.hybrid_layout, spec, hf_config)
    return diffs


def structure_problems(names: list[str], spec, hf_config, dims: ModelDims, what: str) -> list[str]:
    """What the per-tensor ops cannot see: the layer set, the dense/MoE pattern, experts, tied embeddings and a
    native vision tower, from the canonical names of every tensor."""
    problems = []
    layers: dict[int, set] = {}
    for name in names:
        p = parse_name(name)
        if p.stack == "decoder":
            layers.setdefault(p.layer, set()).add(p)
    want = set(range(dims.num_layers + dims.num_mtp_layers))
    if set(layers) != want:
        problems.append(f"decoder layers: HF config implies {dims.num_layers} (+{dims.num_mtp_layers} MTP), "
                        f"{what} has layers {sorted(layers)}")
    for layer, found in sorted(layers.items()):
        has_router = any(p.rest == "mlp.router.weight" for p in found)
        if layer < dims.num_layers and has_router != spec.is_moe_layer(hf_config, layer):
            problems.append(f"layer {layer}: HF config says {'MoE' if not has_router else 'dense'}, "
                            f"{what} has {'MoE' if has_router else 'dense'}")
        experts = {p.expert for p in found if p.expert is not None}
        if has_router and experts != set(range(dims.num_experts)):
            problems.append(f"layer {layer}: HF config has {dims.num_experts} experts, {what} has experts "
                            f"{sorted(experts)[:8]}{'...' if len(experts) > 8 else ''} ({len(experts)})")
    problems += vision_tower_problems(names, hf_config, what)
    has_output = "output_layer.weight" in names
    if dims.tie_word_embeddings and has_output:
        problems.append(f"HF config ties word embeddings, {what} has a separate output_layer")
    if not dims.tie_word_embeddings and not has_output:
        problems.append(f"HF config has a separate lm_head, {what} shares embedding and output weights")
    return problems


def vision_tower_problems(names, hf_config, what: str = "the model") -> list[str]:
    """A native vision tower (Qwen3-VL's) against the HF vision_config: its blocks are 0..depth-1 and its deepstack
    mergers one per `deepstack_visual_indexes` entry (the ops check each tensor's shape, not how many there are)."""
    found: dict[str, set[int]] = {"layers": set(), "deepstack_merger_list": set()}
    for name in names:
        p = parse_name(name)
        if p.stack in found and name.startswith("vision_model."):
            found[p.stack].add(p.layer)
    vision = getattr(hf_config, "vision_config", None)
    if not found["layers"] or vision is None:
        return []
    problems = []
    if found["layers"] != set(range(vision.depth)):
        problems.append(f"vision tower blocks: HF vision_config has depth {vision.depth}, {what} has blocks "
                        f"{sorted(found['layers'])}")
    want = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    if found["deepstack_merger_list"] != set(range(want)):
        problems.append(f"vision tower deepstack mergers: HF vision_config has {want} "
                        f"(deepstack_visual_indexes), {what} has {sorted(found['deepstack_merger_list'])}")
    return problems
