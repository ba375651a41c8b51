"""Megatron-LM legacy checkpoints (`--ckpt-format torch`): one `model_optim_rng.pt` per model-parallel rank.

How Megatron-LM writes them (NVIDIA/Megatron-LM megatron/training/checkpointing.py at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553):

* `get_checkpoint_name`: `CKPT/iter_NNNNNNN/` (or `release/`) + `mp_rank_{tp:02d}`, then `_{pp:03d}` when PP > 1,
  then `_{ep:03d}` when EP > 1, + `/model_optim_rng.pt`; `latest_checkpointed_iteration.txt` names the iteration.
* `save_checkpoint`: for LEGACY checkpoints a rank writes when its data-parallel rank or its expert-data-parallel
  rank is 0, so every (tp, pp, ep) shard that exists is written once; a dense TP shard may appear in several files
  (replicas), and with expert-TP != TP not every (tp, ep) pair has a file.
* `generate_state_dict`: `args` (the training argparse.Namespace), `checkpoint_version` 3.0, `iteration`,
  `model` (or `model0`, `model1`... one per virtual-PP chunk) = `state_dict_for_save_checkpoint()` (local names:
  PP-local layer numbers, EP-local expert indices), then `optimizer`, `opt_param_scheduler`, `rng_state`
  (`random.getstate()`, `np.random.get_state()`, torch and CUDA rng tensors, the TP rng tracker's states).

Files are read with torch's weights-only unpickler plus the few non-tensor globals such files hold (the allow-list
below): a checkpoint naming any other global is refused before it is unpickled, naming the global. Numpy rng
arrays and Megatron's enums in `args` become inert placeholders (nothing here needs their values, and numpy or
Megatron need not be importable). Tensors are memory-mapped, so reading the model costs no more than its bytes.

Shards are mapped to canonical names with `naming.canonical_layer_name` (global layer numbers from the stages' own
layer counts, in Megatron's (virtual stage, stage) order; global experts from the EP rank) and left as TP shards,
which the converter's layout ops turn into HF tensors exactly as in the live export.
"""

from __future__ import annotations

import argparse
import os
import pickletools
import types
import zipfile
from collections import defaultdict

import regex
import torch
from torch import _weights_only_unpickler

from ..arch.naming import HYBRID_FINAL_NORM, canonical_layer_name, mtp_inner, parse_name
from ..errors import ConfigMismatchError, LegacyFormatError, Problem, problem_list
from .checkpoint_keys import LAYER_KEY, MODEL_PREFIXES, CkptSource

FILE = "model_optim_rng.pt"
RANK_DIR = regex.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LOCAL_EXPERT = regex.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc[12]\.(?:weight|bias)(\d+)$)")


class Placeholder:
    """What an allow-listed non-tensor global (a numpy rng array, a Megatron enum in `args`) unpickles to: its
    arguments and state, kept inert (never called, never imported)."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"Placeholder{getattr(self, 'args', ())}"


# Non-tensor globals in Megatron-LM's legacy files besides what torch's weights-only unpickler allows already
# (tensors, storages, dtypes, OrderedDict, plain containers): megatron-core 0.16.1 megatron/core/safe_globals.py
# SAFE_GLOBALS (what Megatron itself allows when it loads them: numpy rng arrays, args' enums and paths, TE's
# BytesIO _extra_state, the rerun state machine), plus numpy 2's `numpy._core` spelling and the enums that
# Megatron-LM's arguments.py (commit above) puts into args (CudaGraphModule, InferenceCudaGraphScope).
# argparse.Namespace and SimpleNamespace are built for real (plain attribute bags); the rest are Placeholders.
_PLACEHOLDERS = [
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType", "pathlib.PosixPath", "io.BytesIO", "signal.Signals", "_io.BytesIO",
    "megatron.core.enums.ModelType", "megatron.core.optimizer.OptimizerConfig",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig", "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.CudaGraphModule", "megatron.core.transformer.enums.InferenceCudaGraphScope",
]
ALLOWED: dict[str, object] = {"argparse.Namespace": argparse.Namespace, "types.SimpleNamespace": types.SimpleNamespace,
                              **{name: Placeholder for name in _PLACEHOLDERS}}


def pickle_globals(path: str) -> set[str]:
    """Every global a torch.save zip file's data.pkl names, read statically (pickletools: nothing is unpickled)."""
    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise ValueError(f"expected one data.pkl, found {pkl}")
        data = zf.read(pkl[0])
    found = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name in ("STACK_GLOBAL", "INST", "OBJ"):  # torch.save (protocol 2) writes none of them
            found.add(f"<{op.name}: a global named at run time>")
    return found


def load_restricted(path: str) -> dict:
    """torch.load with the weights-only unpickler and ALLOWED. Every global the file names must be one that torch
    itself allows (tensors, storages, dtypes; torch 2.13 _weights_only_unpickler._get_allowed_globals, not what an
    application added) or in ALLOWED: anything else is refused, named, before the file is unpickled."""
    try:
        named = pickle_globals(path)
    except Exception as e:  # noqa: BLE001  (not a zip-format torch.save file)
        raise LegacyFormatError(f"{path} is not a torch.save checkpoint that can be read safely "
                                f"({type(e).__name__}: {e})") from None
    refused = sorted(g for g in named if g not in ALLOWED and g not in _weights_only_unpickler._get_allowed_globals())
    if refused:
        raise LegacyFormatError(f"{path} refers to global(s) this reader does not allow: {refused}. Allowed beyond "
                                f"tensors and plain containers: {sorted(ALLOWED)}. Nothing was unpickled.")
    globals_ = [(obj, name) for name, obj in ALLOWED.items() if name in named]
    # torch's allow-list is one process-wide set that others fill too (importing megatron.core registers the real
    # numpy _reconstruct, megatron-core 0.16.1 safe_globals.py), and a name in it twice resolves to either entry:
    # while this file loads, the set holds ALLOWED's entries only.
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        torch.serialization.add_safe_globals(globals_)
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001
        raise LegacyFormatError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)
    if not isinstance(state, dict):
        raise LegacyFormatError(f"{path} holds a {type(state).__name__}, not a Megatron-LM checkpoint dict")
    return state


def is_legacy_dir(path: str) -> bool:
    return os.path.isdir(path) and any(RANK_DIR.fullmatch(d) and os.path.isfile(os.path.join(path, d, FILE))
                                       for d in os.listdir(path))


class LegacyCheckpointReader:
    """All `mp_rank_*` files of one iteration directory: their model chunks' tensors by key
    `mp_rank_XX[_YYY][_ZZZ]/model[N]/<local name>`, the stored `args`, and the layout (TP, PP, EP, VPP, ETP)."""

    def __init__(self, path: str):
        self.path = path
        names = sorted(d for d in os.listdir(path) if RANK_DIR.fullmatch(d)
                       and os.path.isfile(os.path.join(path, d, FILE)))
        if not names:
            raise LegacyFormatError(f"{path} holds no mp_rank_*/{FILE}")
        states = {d: load_restricted(os.path.join(path, d, FILE)) for d in names}
        first = states[names[0]]
        self.args = first.get("args")
        version = first.get("checkpoint_version", 0)
        if version is None or version < 3.0:  # QKV row order before 3.0: checkpointing.fix_query_key_value_ordering
            raise LegacyFormatError(f"{path}: checkpoint_version {version}; only 3.0 (Megatron-Core models) is read")
        self.files = {d: self._ranks(d, states) for d in names}
        self.chunks: dict[str, list[str]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.other: list[str] = []
        not_model = []
        for d, state in states.items():
            keys = ["model"] if "model" in state else sorted((k for k in state if regex.fullmatch(r"model\d+", k)),
                                                            key=lambda k: int(k[5:]))
            if not keys:
                raise LegacyFormatError(f"{path}/{d}/{FILE} has no 'model' entry (keys: {sorted(state)})")
            self.chunks[d] = keys
            for mk in keys:
                for name, value in state[mk].items():
                    key = f"{d}/{mk}/{name}"
                    if not isinstance(value, torch.Tensor):
                        self.other.append(key)  # _extra_state (TE fp8 metadata, None)
                    elif not name.startswith(MODEL_PREFIXES):
                        not_model.append(key)
                    else:
                        self.tensors[key] = value
        if not_model:
            raise LegacyFormatError(f"{path}: model entries outside Megatron-Core's GPTModel names {MODEL_PREFIXES} "
                                    f"(a legacy megatron.legacy model?): {not_model[:5]}")
        if any(k.endswith("/" + HYBRID_FINAL_NORM) for k in self.tensors):  # MambaModel / HybridModel
            raise LegacyFormatError(f"{path}: a hybrid model's legacy checkpoint (decoder.final_norm): not "
                                    "supported; save it with --ckpt-format torch_dist")
        self.tp = 1 + max(r[0] for r in self.files.values())
        self.pp = 1 + max(r[1] for r in self.files.values())
        self.ep = 1 + max(r[2] for r in self.files.values())
        self.vpp = len(self.chunks[names[0]])
        etp = self._arg("expert_tensor_parallel_size")
        self.etp = etp if etp is not None else self.tp  # Megatron's default: expert-TP = TP
        self._check_layout()

    def _arg(self, name: str):
        return getattr(self.args, name, None) if isinstance(self.args, argparse.Namespace) else None

    def _ranks(self, d: str, states: dict) -> tuple[int, int, int]:
        """(tp, pp, ep) of a rank directory; one suffix is PP when PP > 1, else EP (get_checkpoint_name)."""
        m = RANK_DIR.fullmatch(d)
        tp, a, b = int(m.group(1)), m.group(2), m.group(3)
        if b is not None:
            return tp, int(a), int(b)
        if a is None:
            return tp, 0, 0
        pp = self._arg("pipeline_model_parallel_size")
        if pp is None:  # no args: only PP stages differ in whether they hold the embedding
            pp = 1 if all(any(k.startswith("embedding.") for k in s.get("model", s.get("model0", {})))
                          for s in states.values()) else 2
        return (tp, int(a), 0) if pp > 1 else (tp, 0, int(a))

    def _check_layout(self) -> None:
        problems: list[Problem | str] = []
        for what, found, arg in (("TP", self.tp, "tensor_model_parallel_size"),
                                 ("PP", self.pp, "pipeline_model_parallel_size"),
                                 ("EP", self.ep, "expert_model_parallel_size")):
            want = self._arg(arg)
            if want is not None and want != found:
                problems.append(f"{what}: args.{arg} = {want}, the rank directories give {found}")
        vpp = self._arg("virtual_pipeline_model_parallel_size")
        if vpp is not None and vpp != self.vpp:
            problems.append(f"VPP: args.virtual_pipeline_model_parallel_size = {vpp}, the files hold {self.vpp} "
                            "model chunk(s)")
        have = set(self.files.values())
        for pp in range(self.pp):
            for tp in range(self.tp):
                if not any((tp, pp) == r[:2] for r in have):
                    problems.append(Problem(f"TP rank {tp}, PP stage {pp}", "no mp_rank_* file"))
            for ep in range(self.ep):
                if not any((pp, ep) == r[1:] for r in have):
                    problems.append(Problem(f"PP stage {pp}, EP rank {ep}", "no mp_rank_* file"))
        if self.tp % self.etp:  # a file's expert-TP rank is tp % ETP only when ETP divides TP (RankGenerator)
            problems.append(f"expert-TP {self.etp} does not divide TP {self.tp}: a file's expert-TP rank "
                            "cannot be told from its name")
        if problems:
            raise LegacyFormatError(f"{self.path}:\n  " + problem_list(problems))

    def read(self, key: str, lead: tuple[int, ...] = ()) -> torch.Tensor:
        t = self.tensors[key]
        return t[lead] if lead else t

    def check_files(self, keys) -> None:
        """Nothing to check: every file was read whole (memory-mapped) when the reader was built."""

    def tp_of(self, source) -> int:
        return len(source.reads)

    def checkpoint_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, d, FILE)) for d in self.files)

    def sources(self, num_layers: int, tied: bool, hybrid=None):
        """CkptSources (reads = the TP or expert-TP shards in rank order) and the keys that are not weights."""
        assert hybrid is None  # hybrid legacy checkpoints are refused when read (__init__)
        counts: dict[tuple[int, int], int] = {}  # (virtual stage, stage) -> decoder layers it holds
        layers: dict[tuple[str, str], set[str]] = defaultdict(set)  # (file, chunk) -> its decoder layer numbers
        experts: dict[tuple[str, str, str, str], set[int]] = defaultdict(set)  # its layers' local expert indices
        for key in self.tensors:
            d, mk, name = key.split("/", 2)
            m = LAYER_KEY.fullmatch(name)
            if m is None:
                continue
            if m.group(1) == "decoder":
                layers[(d, mk)].add(m.group(2))
            e = _LOCAL_EXPERT.match(mtp_inner(m.group(1), 0, m.group(3), 0)[2])
            if e is not None:
                experts[(d, mk, m.group(1), m.group(2))].add(int(e.group(1) or e.group(2)))
        for d, (_, pp, _) in self.files.items():
            for v, mk in enumerate(self.chunks[d]):
                n = len(layers[(d, mk)])
                if counts.setdefault((v, pp), n) != n:
                    raise LegacyFormatError(f"{self.path}: {d} {mk} holds {n} decoder layers, another file of PP "
                                            f"stage {pp} holds {counts[(v, pp)]}")
        offsets, total = {}, 0
        for vp in sorted(counts):  # Megatron orders layers by (virtual stage, stage)
            offsets[vp] = total
            total += counts[vp]
        if total != num_layers:
            raise ConfigMismatchError(f"{self.path} holds {total} decoder layers (per (virtual stage, stage): "
                                      f"{dict(sorted(counts.items()))}), the HF config has {num_layers}")

        shards: dict[str, dict[int, tuple[str, torch.Tensor]]] = defaultdict(dict)
        ignored = list(self.other)
        for key, t in self.tensors.items():
            d, mk, name = key.split("/", 2)
            tp, pp, ep = self.files[d]
            v = self.chunks[d].index(mk)
            m = LAYER_KEY.fullmatch(name)
            if m is None:
                canon = name
            else:
                kind, number, rest = m.group(1), int(m.group(2)), m.group(3)
                if kind == "decoder":
                    number += offsets[(v, pp)]
                local = len(experts[(d, mk, kind, m.group(2))])  # local indices are 0..local-1
                canon = canonical_layer_name(kind, number, rest, num_layers, ep * local)
            if canon == "output_layer.weight" and tied:
                if self._arg("untie_embeddings_and_output_weights"):
                    raise ConfigMismatchError(f"the HF config ties the word embeddings (tie_word_embeddings), the "
                                              f"checkpoint {self.path} was trained with untie_embeddings_and_output_"
                                              "weights=True: its output_layer.weight is a weight of its own")
                ignored.append(key)  # the last (or MTP) stage's copy of the tied embedding
                continue
            rank = tp
            if parse_name(canon).expert is not None:
                rank = tp % self.etp
            shards[canon].setdefault(rank, (key, t))  # the first of replicas (dense shards in several EP files)

        out = []
        for canon, by_rank in shards.items():
            count = self.etp if parse_name(canon).expert is not None else self.tp
            missing = sorted(set(range(count)) - set(by_rank))
            if missing:
                raise LegacyFormatError(f"{self.path}: {canon} lacks the shard(s) of rank(s) {missing} of {count}")
            first_key, first = by_rank[0]
            for r in range(1, count):
                k, t = by_rank[r]
                if t.shape != first.shape or t.dtype != first.dtype:
                    raise LegacyFormatError(f"{self.path}: shards of {canon} differ: {first_key} "
                                            f"{list(first.shape)} {first.dtype}, {k} {list(t.shape)} {t.dtype}")
            out.append(CkptSource(canon, first_key, [[(by_rank[r][0], ())] for r in range(count)],
                                  tuple(first.shape), first.dtype))
        return out, ignored


# args fields (megatron/training/arguments.py) -> the HF config fields they give, for the --hf-config message
_ARG_FIELDS = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
               "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
               "kv_channels": "head_dim", "norm_epsilon": "rms_norm_eps", "rotary_base": "rope_theta",
               "max_position_embeddings": "max_position_embeddings", "num_experts": "num_experts",
               "moe_ffn_hidden_size": "moe_intermediate_size", "moe_router_topk": "num_experts_per_tok",
               "untie_embeddings_and_output_weights": "tie_word_embeddings (negated)"}


def training_args(it_dir: str):
    """The training args the checkpoint stores (legacy: `args` of a rank file; torch_dist: `args` in common.pt),
    or None."""
    if is_legacy_dir(it_dir):
        d = sorted(x for x in os.listdir(it_dir) if RANK_DIR.fullmatch(x))[0]
        return load_restricted(os.path.join(it_dir, d, FILE)).get("args")
    common = os.path.join(it_dir, "common.pt")
    if os.path.isfile(common):
        return load_restricted(common).get("args")
    return None


def missing_hf_config(it_dir: str) -> str:
    """Why no HF config is built from the checkpoint alone: what its args give and what they cannot say."""
    args = training_args(it_dir)
    if not isinstance(args, argparse.Namespace):
        return (f"no --hf-config given and {it_dir} stores no training args: pass --hf-config (the model's HF "
                "directory or config.json)")
    found = {hf: getattr(args, a) for a, hf in _ARG_FIELDS.items() if getattr(args, a, None) is not None}
    missing = ["model_type (Megatron's args do not name the HF architecture: llama, mistral, qwen2 and qwen3 train "
               "as the same GPTModel with the same args)",
               f"vocab_size (args hold only padded_vocab_size={getattr(args, 'padded_vocab_size', None)}; the "
               "tokenizer's own size is not stored)",
               "the architecture's own fields (rope_scaling, bos/eos_token_id, attention and MLP biases, MoE "
               "routing fields as transformers names them)"]
    missing += [f"{hf} (args.{a} not stored)" for a, hf in _ARG_FIELDS.items() if getattr(args, a, None) is None]
    return (f"cannot infer an HF config from the training args in {it_dir}; missing: " + "; ".join(missing)
            + f". The args give: {found}. Pass --hf-config (the model's HF directory or config.json).")
