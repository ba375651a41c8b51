"""Megatron-Bridge's own PEFT LoRA (megatron-bridge 0.3.1, the last release for megatron-core < 0.17 and Python
3.11) on CPU beside megatron-core 0.16.1, to wrap the models the tests build exactly as Bridge users' models are
wrapped: `<module>.to_wrap.weight` (the frozen base), `<module>.adapter.linear_in.weight` (A) and
`<module>.adapter.linear_out.weight` (B).

The wheel (which requires transformers < 5 and Transformer Engine) is unpacked without its dependencies
(harness.wheels) and only its `peft` and `utils` subpackages are imported, in gloo worker processes (never in the
pytest process). What that takes, each item with why:

1. `megatron.bridge` registered as a bare package with the wheel's `__path__`: its `__init__` imports
   `AutoBridge` (models/conversion: transformers < 5, every model bridge); `peft/*` needs none of it. `megatron`
   is megatron-core's namespace package, so only the subpackage is added.
2. `transformer_engine` and `transformer_engine.pytorch` stubbed, and only AFTER megatron-core (and its
   `extensions.transformer_engine`, which mcore2hf's CPU shims import) is imported: megatron-core must keep seeing
   no TE (it picks TE code paths when `import transformer_engine` succeeds). Bridge needs the names at import:
   peft/lora.py:21 and peft/lora_layers.py:20 `import transformer_engine.pytorch as te`; lora_layers.py:81
   `class TELinearAdapter(te.Linear)`; lora.py:114/125 `module.__class__ == te.Linear`; lora_layers.py:236-263
   `te.ops.Sequential`, `te.Linear`, `te.LayerNormLinear` (only in the TE op-fuser path, never taken here);
   dora_layers / canonical_lora reach `te.GroupedLinear` likewise. So: placeholder classes `Linear`,
   `LayerNormLinear`, `GroupedLinear` (nothing is an instance of them) and `ops.Sequential`.
3. `megatron.bridge.peft.utils.HAVE_TE = False`: utils.py:37-63 `safe_import_from`s the TE wrappers from
   `megatron.core.extensions.transformer_engine`, which without TE holds MagicMock stand-ins, so HAVE_TE would be
   True and `isinstance(m, TECL)` (utils.py:129) would test against mocks; with False, local-spec linears take the
   ColumnParallelLinear / RowParallelLinear branches (utils.py:166-173). module_matcher.py:26-36 does the same for
   its untargeted mode: its HAVE_TE_* flags are set False too.
"""

from __future__ import annotations

import sys
import types

#: the Bridge release whose PEFT the tests run (requires megatron-core < 0.17, Python >= 3.10)
BRIDGE_VERSION = "0.3.1"
#: what is unpacked from its wheel
BRIDGE_FILES = ("megatron/bridge/peft/*", "megatron/bridge/utils/*")


def bridge_root() -> str:
    """The unpacked wheel's root (download once, cached); call in the test process, pass to the workers."""
    from harness.wheels import unpacked_wheel

    return str(unpacked_wheel("megatron-bridge", BRIDGE_VERSION, BRIDGE_FILES))


class _Placeholder:
    """A Transformer Engine class stand-in: nothing is an instance of it."""


def _stub_transformer_engine() -> None:
    if "transformer_engine" in sys.modules:
        return
    te = types.ModuleType("transformer_engine")
    te.__path__ = []
    pt = types.ModuleType("transformer_engine.pytorch")
    for name in ("Linear", "LayerNormLinear", "GroupedLinear"):
        setattr(pt, name, type(name, (_Placeholder,), {}))
    pt.ops = types.SimpleNamespace(Sequential=type("Sequential", (_Placeholder,), {}))
    te.pytorch = pt
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = pt


def import_bridge_peft(root: str) -> types.ModuleType:
    """`megatron.bridge.peft.lora` from the unpacked wheel at `root` (in a worker process)."""
    import megatron
    import megatron.core  # noqa: F401 - before the TE stub: megatron-core must see no TE

    from mcore2hf.runtime.cpu import apply_cpu_shims

    apply_cpu_shims()  # imports megatron.core.extensions.transformer_engine (MagicMock TE classes), also first
    import megatron.core.extensions.transformer_engine  # noqa: F401

    if "megatron.bridge" not in sys.modules:
        bridge = types.ModuleType("megatron.bridge")
        bridge.__path__ = [f"{root}/megatron/bridge"]
        sys.modules["megatron.bridge"] = bridge
        megatron.bridge = bridge
    _stub_transformer_engine()
    from megatron.bridge.peft import lora, module_matcher, utils

    utils.HAVE_TE = False
    for flag in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        setattr(module_matcher, flag, False)
    return lora


def apply_lora(root: str, chunks: list, target_modules: list[str], dim: int, alpha: int, canonical: bool = False,
               **kw) -> list:
    """Bridge's `LoRA(target_modules, dim, alpha)` applied to the model chunks (PEFT.__call__, peft/base.py:83:
    freezes the base, wraps each matched linear in LoRALinear(to_wrap, ParallelLinearAdapter)); `canonical`:
    its `CanonicalLoRA` (peft/canonical_lora.py:165: separate q/k/v and gate/up adapters). Returns the chunks."""
    lora = import_bridge_peft(root)
    if canonical:
        from megatron.bridge.peft.canonical_lora import CanonicalLoRA

        peft = CanonicalLoRA(target_modules=list(target_modules), dim=dim, alpha=alpha, **kw)
    else:
        peft = lora.LoRA(target_modules=list(target_modules), dim=dim, alpha=alpha, **kw)
    return peft(chunks, training=False)
