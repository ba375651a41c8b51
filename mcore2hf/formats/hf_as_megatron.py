"""An HF directory read as the Megatron tensors the import writes from it: the HF names read back through an
architecture's rule table (`megatron_names`: each rule's first HF template matched, its placeholders become
numbers), each Megatron tensor's full shape from its HF tensors' (`full_shape`, the layout op's inverse), and
`HFBaseReader`, the checkpoint reader of those tensors (the base weights of an adapter-only checkpoint, given as
an HF directory). The offline import (`importer`) plans from the same two functions."""

from __future__ import annotations

import os

import torch

from ..arch.mapping import NAME, Converter, ModelDims, compile_pattern, match_fields
from ..arch.registry import get_converter
from ..errors import UnknownParametersError
from ..layouts.ops import VocabRows, shape_of
from .checkpoint_keys import HF_TOWER, VISION_MODEL, CkptSource
from .hf_dir import HFDirectory, as_published


def megatron_names(converter: Converter, dims: ModelDims, hf_names: set[str], vision_tower: str | None = None
                   ) -> tuple[dict[str, object], list[str]]:
    """{canonical Megatron name: Resolved} for the HF tensors, by reading each rule's first HF template back
    (placeholders become numbers; MTP rules' {L} is num_layers + M); also the HF names no rule explains.
    `vision_tower`: which of a vision-language table's tower rules are read back, "hf" the pass-through ones
    (`{NAME}`: an embedded transformers tower), "native" the others (a native Megatron tower)."""
    rules = [r for r in converter.rules if vision_tower is None
             or (f"{{{NAME}}}" in r.megatron) == (vision_tower == HF_TOWER)
             or not r.megatron.startswith(VISION_MODEL)]
    templates = [(compile_pattern(rule.hf[0]), rule) for rule in rules]
    found: dict[str, object] = {}
    used: set[str] = set()
    for hf_name in sorted(hf_names):
        for pattern, rule in templates:
            m = pattern.fullmatch(hf_name)
            if m is None:
                continue
            fields = match_fields(m)
            if "{M}" in rule.megatron:
                fields["M"] = fields.get("L", -1) - dims.num_layers
                if fields["M"] < 0:
                    continue
            # a stacked HF tensor (gpt-oss's experts.gate_up_proj [E, ...]) holds one Megatron tensor per item
            items = [{}] if rule.stack is None else [{rule.stack: e} for e in range(dims.num_experts)]
            rs = [(n, converter.resolve(n, dims)) for n in (rule.megatron.format(**fields, **i) for i in items)]
            if any(r is None or r.hf_names[0] != hf_name for _, r in rs):
                continue  # an earlier rule owns this Megatron name: not this one's inverse
            for name, r in rs:
                found[name] = r
                used.update(r.hf_names)
            break
    unexplained = sorted(n for n in hf_names - used if not converter.ignored_on_load(n, dims))
    return found, unexplained


def full_shape(op, hf_shapes: list[tuple[int, ...]], padded_vocab: int) -> tuple[int, ...]:
    """The Megatron tensor's shape from its HF tensors' shapes (the op's inverse), with the vocab padding chosen."""
    if isinstance(op, VocabRows):
        return (padded_vocab, *hf_shapes[0][1:])
    return op.full_shape(hf_shapes)


class HFBaseReader:
    """An HF directory read as the Megatron tensors an import would write from it (one TP-1 shard each, keyed by
    canonical name), through the checkpoint readers' interface (`formats.CheckpointReader`; opened by
    `formats.open_checkpoint(path, hf_config=...)`): the base weights of a Megatron-Bridge adapter-only
    checkpoint, given as the HF directory it was trained from (`formats.CombinedReader`). Each tensor is rebuilt by
    its layout op's inverse when read, as the import does."""

    def __init__(self, hf_dir: str | os.PathLike, cfg):
        converter = get_converter(cfg.model_type)
        dims = converter.spec.dims(cfg)
        self.path = os.fspath(hf_dir)
        self.dir = as_published(HFDirectory(hf_dir, role="base checkpoint"), cfg)
        held = {n for n in self.dir.names() if not converter.not_held_by_model(n)}
        resolved, unexplained = megatron_names(converter, dims, held)
        if unexplained:
            raise UnknownParametersError(converter.model_type, [f"{n} (a tensor of the base {self.path} no rule of "
                                                                f"the {converter.model_type} table produces)"
                                                                for n in unexplained])
        self._resolved, self.tensors, self.bytes_read = resolved, {}, 0
        for name, r in resolved.items():
            hf = [self.dir.slice(n) for n in r.hf_names]
            self.tensors[name] = (full_shape(r.op, [shape_of(x) for x in hf], dims.vocab_size), hf[0].dtype)

    def sources(self, num_layers: int, tied: bool, hybrid=None) -> tuple[list[CkptSource], list[str]]:
        return [CkptSource(n, n, [[(n, ())]], shape, dtype) for n, (shape, dtype) in self.tensors.items()], []

    def read(self, key: str, lead: tuple[int, ...] = ()) -> torch.Tensor:
        r = self._resolved[key]
        t = r.op.shard_from_hf([self.dir.slice(n) for n in r.hf_names], 0, 1, self.tensors[key][0])
        self.bytes_read += t.nbytes
        return t[lead] if lead else t

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key][1]

    def check_files(self, keys) -> None:
        pass  # the directory was validated when it was opened

    def tp_of(self, source) -> int:
        return 1  # exactly vocab_size rows, as the import writes them

    def checkpoint_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, f)) for f in os.listdir(self.path)
                   if f.endswith(".safetensors"))
