"""What `mcore2hf list` shows of every registered architecture, as plain data (`catalog.json` beside this module),
so the command answers at once: the converters import torch and megatron-core, transformers' auto mappings take
seconds more, and `list` needs neither.

Not a second registry: the registered `Architecture`s (converters/<model_type>.py) are the one source. The file is
their snapshot (`derive`: model types and aliases, FP8 policy, verified text from the registry; the HF class from
transformers' auto mappings), written by `python -m mcore2hf.arch.catalog`, never by hand;
tests/test_registry_coverage.py fails when it and the registry disagree. Imports nothing heavy."""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "catalog.json")


class Listed(NamedTuple):
    """One registered model_type as `mcore2hf list` shows it."""

    hf_class: str  # the model class transformers registers for it (the checkpoints' `architectures`)
    fp8: bool  # its converter has an FP8 policy
    verified: str  # what the test suite verifies (Architecture.verified)
    format_of: str | None = None  # an alias: the registered model_type whose format it is


@functools.cache
def catalog() -> dict[str, Listed]:
    """The snapshot: every registered model_type (aliases too), sorted."""
    with open(PATH) as f:
        return {mt: Listed(**entry) for mt, entry in json.load(f).items()}


def derive() -> dict[str, Listed]:
    """The catalog as the registry says it now (imports every converter and transformers' auto mappings)."""
    from .hf_config import architecture_classes
    from .registry import get_architecture, list_architectures

    out = {}
    for name in list_architectures():
        arch = get_architecture(name)
        classes = sorted(architecture_classes(arch.model_type))
        hf_class = next((c for suffix in ("ForConditionalGeneration", "ForCausalLM") for c in classes
                         if c.endswith(suffix)), "")
        out[name] = Listed(hf_class, arch.converter.fp8 is not None, arch.verified,
                           None if name == arch.model_type else arch.model_type)
    return out


def write(entries: dict[str, Listed], path: str = PATH) -> None:
    with open(path, "w") as f:
        json.dump({mt: e._asdict() for mt, e in sorted(entries.items())}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":  # python -m mcore2hf.arch.catalog: rewrite the snapshot from the registry
    write(derive())
    print(f"wrote {PATH}")
