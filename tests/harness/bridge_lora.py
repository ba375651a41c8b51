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

Megatron-Bridge 0.6.2 (`BRIDGE_062`: Python >= 3.12 and megatron-core 0.19, so it runs only on the GPU machines'
stack, bench/device_tests.sh; its tests skip elsewhere) takes the same three, read in its wheel, plus two:

1'. `megatron.bridge` bare, as above (0.6.2 `__init__.py` imports AutoBridge: transformers <= 5.12.1).
2'. TE stubbed after megatron-core as above: 0.6.2 peft/lora_layers.py:20 `import transformer_engine.pytorch as te`;
   lora_layers.py:111/186/253 annotate with `te.ops.Sequential` (evaluated when the class is defined); `te.Linear` /
   `te.LayerNormLinear` are used only inside TEFusedLoRALinear (lora.py:170-176: the TE op fuser, TP 1 with
   `use_transformer_engine_op_fuser`, never taken here). Here the stubs are removed from sys.modules again once
   Bridge's modules are imported (they keep their own `te`), so megatron-core's later `import transformer_engine`
   fails as without them.
3'. `megatron.bridge.peft.utils.HAVE_TE = False` as above (0.6.2 utils.py:57-94 `safe_import_from`s the TE wrappers:
   MagicMocks without TE; get_adapter_attributes_from_linear's TE branches utils.py:591-632 would test
   `isinstance(m, <mock>)`); the local linears take utils.py:633-640. Likewise utils.py's
   HAVE_TE_PYTORCH_GROUPED_LINEAR (it would find stub 2's placeholder) and module_matcher.py:30-40's flags.
4'. `megatron.bridge.utils.common_utils` replaced by a module holding only `print_rank_0` (0.6.2
   utils/common_utils.py:97-105, copied): peft/recompute.py:24 imports that one function, while the module itself
   imports Megatron-LM's `megatron.training` (common_utils.py:29: its package `__init__` pulls global_vars,
   tokenizers and `typing.override`) and `megatron.bridge.training` (common_utils.py:31), none of which LoRA uses.
"""

from __future__ import annotations

import os
import sys
import types

import torch

#: the Bridge release whose PEFT the tests run (requires megatron-core < 0.17, Python >= 3.10)
BRIDGE_VERSION = "0.3.1"
#: the current release (requires megatron-core 0.19 and Python >= 3.12: the GPU machines' stack)
BRIDGE_062 = "0.6.2"
#: what is unpacked from its wheel
BRIDGE_FILES = ("megatron/bridge/peft/*", "megatron/bridge/utils/*")


def bridge_root(version: str = BRIDGE_VERSION) -> str:
    """The unpacked wheel's root (download once, cached); call in the test process, pass to the workers."""
    from harness.wheels import unpacked_wheel

    return str(unpacked_wheel("megatron-bridge", version, BRIDGE_FILES))


def root_version(root: str) -> str:
    """The Bridge release unpacked at `root` (harness.wheels writes the wheel's name to `.complete`)."""
    import os

    with open(os.path.join(root, ".complete")) as f:
        return f.read().split("-")[1]


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

    from mcore2hf.arch.cpu_shims import apply_cpu_shims

    apply_cpu_shims()  # imports megatron.core.extensions.transformer_engine (MagicMock TE classes), also first
    import megatron.core.extensions.transformer_engine  # noqa: F401

    here = f"{root}/megatron/bridge"
    if "megatron.bridge" in sys.modules and sys.modules["megatron.bridge"].__path__ != [here]:
        # another release imported by an earlier world of this worker process: forget it (its models are gone)
        for name in [n for n in sys.modules if n == "megatron.bridge" or n.startswith("megatron.bridge.")]:
            del sys.modules[name]
    if "megatron.bridge" not in sys.modules:
        bridge = types.ModuleType("megatron.bridge")
        bridge.__path__ = [here]
        sys.modules["megatron.bridge"] = bridge
        megatron.bridge = bridge
    new = root_version(root) != BRIDGE_VERSION
    if new and "megatron.bridge.utils.common_utils" not in sys.modules:  # stub 4'
        import megatron.bridge.utils

        common = types.ModuleType("megatron.bridge.utils.common_utils")

        def print_rank_0(message: str) -> None:  # 0.6.2 utils/common_utils.py:97-105
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                print(message, flush=True)

        common.print_rank_0 = print_rank_0
        sys.modules[common.__name__] = megatron.bridge.utils.common_utils = common
    stubbed = "transformer_engine" not in sys.modules
    _stub_transformer_engine()
    from megatron.bridge.peft import canonical_lora, dora, lora, module_matcher, utils  # noqa: F401 - all with TE stubbed

    if new and stubbed:  # stub 2': megatron-core must not find the placeholder TE later
        for name in ("transformer_engine.pytorch", "transformer_engine"):
            sys.modules.pop(name, None)
    utils.HAVE_TE = False
    for flag in ("HAVE_TE_PYTORCH_GROUPED_LINEAR", "HAVE_TE_PYTORCH_GROUPED_LINEAR_AUTOGRAD",
                 "HAVE_TE_PYTORCH_CPU_OFFLOAD_STATUS"):
        if hasattr(utils, flag):
            setattr(utils, flag, False)
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


#: Megatron-Bridge 0.3.1's training checkpointing (what its `save_checkpoint` writes for a PEFT run), unpacked beside
#: `peft` and `utils` (its own cache directory)
CHECKPOINTING_FILES = ("megatron/bridge/training/checkpointing.py", "megatron/bridge/training/utils/checkpoint_utils.py")
#: the functions of those files that save_checkpoint (training/checkpointing.py:463-853) calls to name, build and
#: filter what it saves, by file
CHECKPOINTING_FUNCTIONS = {
    "megatron/bridge/training/checkpointing.py": ("_build_sharded_state_dict_metadata", "_generate_model_state_dict",
                                                  "generate_state_dict", "apply_peft_adapter_filter_to_state_dict",
                                                  "_is_model_section"),
    "megatron/bridge/training/utils/checkpoint_utils.py": ("get_checkpoint_name", "get_checkpoint_tracker_filename"),
}


def checkpointing_root(version: str = BRIDGE_VERSION) -> str:
    """The unpacked training checkpointing files (download once, cached); call in the test process."""
    from harness.wheels import unpacked_wheel

    return str(unpacked_wheel("megatron-bridge", version, CHECKPOINTING_FILES))


def bridge_checkpointing(root: str) -> types.SimpleNamespace:
    """CHECKPOINTING_FUNCTIONS compiled from the wheel's own source, with their line numbers. The modules
    themselves import what these functions do not use and this machine lacks (checkpointing.py:53 modelopt,
    :60-65 Bridge's training config, state, tokenizers, wandb / mlflow utils; checkpoint_utils.py:27-29 its
    TrainState and config utils), so the functions are taken out of them; the names their annotations use are
    stand-ins (`object`), as the annotations are evaluated when a function is defined."""
    import ast
    import builtins

    ns: dict = {"torch": torch, "os": os}
    for rel, names in CHECKPOINTING_FUNCTIONS.items():
        path = os.path.join(root, rel)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        assert sorted(d.name for d in defs) == sorted(names), (path, [d.name for d in defs])
        for node in ast.walk(ast.Module(body=defs, type_ignores=[])):
            if isinstance(node, ast.Name) and node.id not in ns and not hasattr(builtins, node.id):
                ns.setdefault(node.id, object)  # annotations (Optional, Any, MegatronModule, ...); bodies use none
        exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), ns)
    return types.SimpleNamespace(**{n: ns[n] for names in CHECKPOINTING_FUNCTIONS.values() for n in names})


def save_peft_checkpoint(root: str, chunks: list, peft, save_dir: str, step: int) -> str:
    """A torch_dist checkpoint as Megatron-Bridge 0.3.1's `save_checkpoint` writes it for a PEFT run (GLOBAL, no
    distributed optimizer, synchronous), on every rank: its calls in its order, with its functions
    (bridge_checkpointing). Left out: the optimizer and RNG states (save_optim / save_rng off: `optimizer` None), the
    dataloader and ModelOpt states, train_state.pt and run_config.yaml (Bridge's TrainState and config); `peft`
    is the Bridge PEFT object whose `set_params_to_save` ran (training/setup.py:443). Returns the iteration's
    directory."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    fn = bridge_checkpointing(root)
    cfg = types.SimpleNamespace(ckpt_format="torch_dist", save_optim=False, save_rng=False,
                                dist_ckpt_optim_fully_reshardable=False)
    checkpoint_name = fn.get_checkpoint_name(save_dir, step, release=False)  # :564
    metadata = fn._build_sharded_state_dict_metadata(False, cfg)  # :593
    metadata["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)  # :594 pg_collection.dp_cp
    state_dict = fn.generate_state_dict(cfg, chunks, None, None, None, iteration=step,  # :605-616
                                        optim_sd_kwargs=dict(metadata=metadata), model_sd_kwargs=dict(metadata=metadata),
                                        rerun_state=None)
    state_dict = fn.apply_peft_adapter_filter_to_state_dict(state_dict, peft)  # :619-621 (cfg.peft is not None)
    if torch.distributed.get_rank() == 0:
        os.makedirs(checkpoint_name, exist_ok=True)  # :624-626 ensure_directory_exists(checkpoint_name)
    torch.distributed.barrier()
    dist_checkpointing.save(state_dict, checkpoint_name, get_default_save_sharded_strategy(cfg.ckpt_format),  # :650-672
                            async_sharded_save=False, validate_access_integrity=True,
                            preprocess_common_before_consistancy_check=None,
                            content_metadata=_clean_metadata_for_serialization(metadata))
    torch.distributed.barrier()  # :726-728
    if torch.distributed.get_rank() == 0:  # :759-762 the Megatron-LM tracker file
        with open(fn.get_checkpoint_tracker_filename(save_dir), "w") as f:
            f.write(str(step))
    torch.distributed.barrier()
    return checkpoint_name
