"""`mcore2hf import`: HF directory -> Megatron torch_dist checkpoint. Megatron's own dist_checkpointing.load
reads one import (vocab unpadded) at layouts of TP 1 and 2, and the live export is bit-identical to the HF
source; Megatron re-saving the loaded model writes our keys, shapes and dtypes but for its padded vocab rows;
import -> offline export is bit-identical without Megatron. The decoder layers' key form follows the model's
moe_layer_freq as megatron-core 0.16.1 decides it (transformer_block.py `sharded_state_dict`): an all-MoE model
built as Megatron-LM builds it by default (moe_layer_freq=1) loads stacked keys, one built with a list per-layer
keys, both at PP 2 x VPP 2. The norm keys follow `transformer_impl`: build_model's local-spec models load the
"local" import; the default (transformer_engine) import has exactly the keys of megatron-core's own TE spec for
every architecture, and loads into Qwen3-MoE and DeepSeek-V3 models under TE's names (PP 2 x VPP 2)."""

import json
import os
import re
import shutil

import pytest
import torch
import worlds
from conftest import ARCHS, ONLY, VLM_ARCHS
from harness.te_spec import expected_te_names
from oracle import logit_problems
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from mcore2hf.arch.hf_config import load_hf_config, text_config
from mcore2hf.arch.registry import get_converter, get_model_spec
from mcore2hf.errors import (
    ConfigMismatchError,
    HFDirectoryError,
    Mcore2HFError,
    ShapeMismatchError,
    UnknownParametersError,
    UsageError,
)
from mcore2hf.formats.checkpoint_keys import TRANSFORMER_IMPLS, pattern_text
from mcore2hf.importer import ImportTargetError, import_checkpoint
from mcore2hf.offline import VOCAB_KEYS, export_checkpoint
from mcore2hf.runtime.tiny import make_hf_checkpoint, read_hf_checkpoint, tiny_config
from mcore2hf.runtime.world import Layout, run_world, same_on_every_rank

LAYOUTS = [
    (Layout(tp=2, ep=2, etp=1), True),  # EP, ETP != TP; singleton_local_shards (per-expert keys, fc1 _w/_v)
    (Layout(tp=2, pp=2, vpp=2, ep=2, etp=1), False),  # virtual PP, stacked experts; vocab padded to 256
    (Layout(pp=2, first_stage_layers=1, last_stage_layers=3), False),  # uneven PP; vocab padded to 128
]


def model_keys(it_dir) -> dict:
    """The checkpoint's model keys. Not compared: optimizer state, and megatron-core >= 0.19's `common_state`
    object (0.19.2 dist_checkpointing/serialization.py saves the common state in the checkpoint instead of
    common.pt, and still reads a common.pt as ours)."""
    md = FileSystemReader(str(it_dir)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) if hasattr(v, "size") else "object"
            for k, v in md.items() if not k.startswith(("optimizer", "common_state"))}


#: the gated-DeltaNet hybrids, whose other worlds live in their own test files (tests/test_qwen3_next.py,
#: test_qwen3_5.py): here they run the import round trips with the others. Qwen3.5's checkpoints are multimodal.
HYBRID_ATTENTION = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module")
def all_ckpts(ckpts, tmp_path_factory) -> dict[str, str]:
    """Every registered architecture's tiny checkpoint."""
    root = tmp_path_factory.mktemp("hybrid-attention")
    return {**ckpts, **{mt: make_hf_checkpoint(tiny_config(mt), root / mt) for mt in HYBRID_ATTENTION
                        if not ONLY or mt in ONLY}}  # MCORE2HF_ARCHS: those alone


def held(ckpt: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors the Megatron model holds (all but a text model's vision tower)."""
    conv = get_converter(load_hf_config(ckpt).model_type)
    return {n: t for n, t in read_hf_checkpoint(ckpt).items() if not conv.not_held_by_model(n)}


def test_every_registered_architecture_is_imported():
    from mcore2hf.arch.registry import canonical_model_type, list_architectures

    # the vision-language models' imports run in tests/test_vlm.py (import -> offline export = the checkpoint)
    assert {canonical_model_type(m) for m in list_architectures()} == set(ARCHS) | set(HYBRID_ATTENTION) | set(VLM_ARCHS)


def moe_pattern(ckpt: str) -> int | list[int] | None:
    """The moe_layer_freq build_model gives an MoE model (model_specs/common.py `moe_fields`, as Megatron-LM's
    arguments do: the int 1 when every layer is MoE, else the HF config's dense/MoE pattern as a list), None for a
    dense one."""
    cfg = load_hf_config(ckpt)
    spec = get_model_spec(cfg.model_type)
    dims = spec.dims(cfg)
    if not dims.num_experts:
        return None
    pattern = [int(spec.is_moe_layer(cfg, i)) for i in range(dims.num_layers)]
    return 1 if all(pattern) else pattern


#: an all-MoE model also built with a list (`--moe-layer-freq '([1]*4)'`), in the PP 2 x VPP 2 world
LIST_BUILT = "qwen3_moe"
#: loaded from the default transformer_engine import into a model under TE's names, in the PP 2 x VPP 2 world:
#: issue 29's Qwen3-MoE (separate pre-MLP norm in MoE layers) and MLA (fused q/kv norms, dense first layer, MTP)
TE_LOADED = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def imported(all_ckpts, tmp_path_factory) -> dict[object, str]:
    """One import per architecture and key layout (singleton_local_shards or not), with no --tp: every layout
    below loads the same checkpoint. Each with the moe_layer_freq the model is built with (build_model: Megatron-LM's
    default, the int 1, for all-MoE models); under "list" Qwen3-MoE's as Megatron-LM's list expression."""
    roots = {s: tmp_path_factory.mktemp(f"imported-{int(s)}") for s in (False, True)}
    for singleton, root in roots.items():
        for mt, ckpt in all_ckpts.items():
            freq = moe_pattern(ckpt)
            if mt == LIST_BUILT:
                assert freq == 1
                freq = None  # the default: Megatron-LM's
            r = import_checkpoint(ckpt, root / mt, singleton_local_shards=singleton, iteration=5, progress=False,
                                  moe_layer_freq=freq, transformer_impl="local")  # build_model: the local spec
            gdn = mt in HYBRID_ATTENTION  # gated DeltaNet layers: per layer whatever moe_layer_freq is
            per_layer = isinstance(freq, list) or singleton or gdn
            assert r.layer_keys.startswith("per layer" if per_layer else "stacked"), (mt, r.layer_keys)
            if mt == LIST_BUILT and not singleton:
                assert r.layer_keys == "stacked (decoder.layers.<name>, layer axis sharded over PP): moe_layer_freq=1"
    te = tmp_path_factory.mktemp("imported-te")  # the default transformer_engine import, for TE-named models
    for mt in (mt for mt in TE_LOADED if mt in all_ckpts):
        r = import_checkpoint(all_ckpts[mt], te / mt, iteration=5, progress=False, moe_layer_freq=moe_pattern(all_ckpts[mt]))
        assert r.transformer_impl == "transformer_engine"
    root = tmp_path_factory.mktemp("imported-list")
    if LIST_BUILT in all_ckpts:
        r = import_checkpoint(all_ckpts[LIST_BUILT], root / LIST_BUILT, iteration=5, progress=False,
                              moe_layer_freq="([1]*4)", transformer_impl="local")
        assert r.layer_keys.startswith("per layer"), r.layer_keys
    return {**{s: str(r) for s, r in roots.items()}, "list": str(root), "te": str(te)}


@pytest.mark.parametrize("case", LAYOUTS, ids=[f"{lay}{'-singleton' if s else ''}" for lay, s in LAYOUTS])
def test_megatron_loads_the_import_and_exports_the_source_bit_for_bit(case, all_ckpts, imported, tmp_path):
    layout, singleton = case
    root, ckpts = imported[singleton], dict(all_ckpts)
    # PP 2 x VPP 2: also the per-layer import of a list moe_layer_freq, into a model built with that list
    built = {"list": (LIST_BUILT, imported["list"], {"moe_layer_freq": [1] * 4})} \
        if layout.vpp and LIST_BUILT in ckpts else {}
    if layout.vpp:  # the transformer_engine import into models whose sharded state dict has TE's keys
        built.update({f"te-{mt}": (mt, imported["te"], {"te_names": True}) for mt in TE_LOADED if mt in ckpts})
    per_rank = run_world(worlds.load_imports, layout, ckpts, layout, root, singleton, str(tmp_path / "resaved"), built)
    roots = {mt: (root, mt, tmp_path / "resaved") for mt in ckpts}
    # what Megatron's own dist_checkpointing.load put into the model from our import: its forward is transformers'
    problems = logit_problems([{mt: res[mt].pop("logits") for mt in ckpts}
                               for res in per_rank], ckpts, worlds.TOKENS, f"{layout} import")
    for name, (mt, other, config) in built.items():
        roots[name] = (other, mt, tmp_path / f"resaved-{name}")
        if config.get("te_names"):  # its forward is not run: the export equals the source bit for bit
            assert all(res[name]["logits"] is None for res in per_rank)
            continue
        problems += logit_problems([{mt: res[name].pop("logits")} for res in per_rank], ckpts, worlds.TOKENS,
                                   f"{layout} import into a model built with {config}")
    same_on_every_rank(per_rank)
    assert not problems, "\n".join(problems)
    assert set(per_rank[0]) == set(roots)
    for name, (where, mt, resaved) in roots.items():  # what Megatron writes for the model it loaded is what we
        ours, megatron = model_keys(os.path.join(where, mt, "iter_0000005")), model_keys(resaved / mt)  # wrote
        if mt == LIST_BUILT:  # but for its vocab padding; the int 1 stacks the layers, a list does not
            stacked = "decoder.layers.self_attention.linear_proj.weight"
            per_layer = "decoder.layers.0.self_attention.linear_proj.weight"
            listed = name == "list" or singleton
            assert (stacked in ours, per_layer in ours) == ((False, True) if listed else (True, False)), name
        vocab = text_config(tiny_config(mt)).vocab_size
        padded = -(-vocab // (128 * layout.tp)) * 128 * layout.tp
        for k in ours:  # ours: exactly vocab_size rows; Megatron's: padded to 128 x TP (zeros, loaded at any TP)
            if k in VOCAB_KEYS or k.endswith(".embedding.word_embeddings.weight"):
                assert ours[k][0][0] == vocab and megatron[k][0] == (padded, *ours[k][0][1:]), (mt, k, megatron[k])
                megatron[k] = ours[k]
        if name.startswith("te-"):  # TE's own `_extra_state` objects (TENorm): a local model has none to save
            ours = {k: v for k, v in ours.items() if v != "object" or k in megatron}
            assert "decoder.layers.pre_mlp_layernorm.weight" in ours or mt != "qwen3_moe", sorted(ours)[:10]
        assert ours == megatron, (name, sorted(set(ours) ^ set(megatron))[:6],
                                  [k for k in ours if k in megatron and ours[k] != megatron[k]][:6])


def test_import_then_offline_export_is_bit_identical_without_megatron(all_ckpts, tmp_path):
    for mt, ckpt in all_ckpts.items():
        ref = held(ckpt)
        cfg = load_hf_config(ckpt)  # models with dense first layers (glm4_moe, deepseek_v3, ...) are never stacked
        tc = text_config(cfg)  # nor are those mixing linear and full attention (qwen3_next, qwen3_5)
        linear = [t == "linear_attention" for t in getattr(tc, "layer_types", None) or [None] * tc.num_hidden_layers]
        kinds = {(get_model_spec(mt).is_moe_layer(cfg, i), linear[i]) for i in range(tc.num_hidden_layers)}
        alike = len(kinds) == 1 and not any(linear)
        # any list: per-layer keys, dense models too
        pattern = [int(get_model_spec(mt).is_moe_layer(cfg, i)) for i in range(tc.num_hidden_layers)]
        for singleton, freq, tp in ((False, None, None), (False, None, 1), (True, None, 2), (False, pattern, 2)):
            name = f"{mt}-{int(singleton)}{freq is None}{tp}"
            r = import_checkpoint(ckpt, tmp_path / name, tp=tp, singleton_local_shards=singleton, moe_layer_freq=freq,
                                  file_size="20KB", progress=False)
            keys = model_keys(tmp_path / name / "iter_0000000")
            stacked = alike and freq is None and not singleton
            assert {bool(re.match(r"decoder\.layers\.\d+\.", k)) for k in keys if k.startswith("decoder.layers.")} \
                == {not stacked}, (name, r.layer_keys)
            assert r.layer_keys.startswith("stacked" if stacked else "per layer"), (name, r.layer_keys)
            assert len([f for f in os.listdir(tmp_path / name / "iter_0000000") if f.endswith(".distcp")]) > 1
            rows = keys["embedding.word_embeddings.weight"][0][0]
            assert rows == (100 if tp is None else 128 * tp), (name, rows)  # vocab_size 100: unpadded, or padded
            export_checkpoint(tmp_path / name, tmp_path / f"{name}-hf", ckpt, progress=False)
            worlds.assert_same(read_hf_checkpoint(tmp_path / f"{name}-hf"), ref, name)
        if 0 < sum(pattern) < len(pattern):  # dense and MoE layers: Megatron-LM's default int 1 cannot build it
            with pytest.raises(ConfigMismatchError, match=re.escape(f"the HF config has {pattern_text(pattern)}")):
                import_checkpoint(ckpt, tmp_path / f"{mt}-freq1", moe_layer_freq=1, progress=False)
            assert not (tmp_path / f"{mt}-freq1").exists()
        # --dtype bf16: floating tensors cast, except those HF keeps in fp32 (e_score_correction_bias)
        import_checkpoint(ckpt, tmp_path / f"{mt}-bf16", dtype="bf16", progress=False)
        meta = model_keys(tmp_path / f"{mt}-bf16" / "iter_0000000")
        assert {d for k, v in meta.items() if v != "object" for d in [v[1]] if not k.endswith("expert_bias")} \
            == {torch.bfloat16}, mt
        assert all(v[1] == torch.float32 for k, v in meta.items() if k.endswith("expert_bias")), mt
        export_checkpoint(tmp_path / f"{mt}-bf16", tmp_path / f"{mt}-bf16-hf", ckpt, progress=False)
        want = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16) for k, v in ref.items()}
        for k in want:  # zero-centred gamma (layouts.ZeroCentered): stored as bf16(w - 1), exported as bf16(that + 1)
            if k.endswith("linear_attn.norm.weight"):
                want[k] = ((ref[k] - 1).to(torch.bfloat16) + 1).to(torch.bfloat16)
        worlds.assert_same(read_hf_checkpoint(tmp_path / f"{mt}-bf16-hf"), want, f"{mt} bf16")


def _listing(root) -> dict:
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


def test_output_guards_overwrite_and_atomicity(ckpts, tmp_path, monkeypatch):
    src = ckpts["qwen3_moe"]
    out = tmp_path / "ckpt"
    import_checkpoint(src, out, iteration=1, progress=False)
    import_checkpoint(src, out, iteration=2, progress=False)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    before = _listing(out)
    with pytest.raises(ImportTargetError, match="iter_0000002 exists"):
        import_checkpoint(src, out, iteration=2, progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep")
    with pytest.raises(ImportTargetError, match="not a Megatron checkpoint directory"):
        import_checkpoint(src, tmp_path / "busy", progress=False)
    (out / "iter_0000003").mkdir()
    (out / "iter_0000003" / "mine").write_text("keep")
    with pytest.raises(ImportTargetError, match="not a torch_dist checkpoint directory"):
        import_checkpoint(src, out, iteration=3, overwrite=True, progress=False)
    for inside in (os.path.join(src, "megatron"), os.path.dirname(src)):
        with pytest.raises(ImportTargetError, match="overlaps the input"):
            import_checkpoint(src, inside, progress=False)

    # a failure mid-write leaves the previous iteration, the tracker and nothing else
    from mcore2hf.formats.torch_dist import DistcpWriter

    calls = {"n": 0}
    real = DistcpWriter.tensor

    def failing(self, *a):
        calls["n"] += 1
        if calls["n"] == 20:
            raise OSError("disk full")
        return real(self, *a)

    monkeypatch.setattr(DistcpWriter, "tensor", failing)
    with pytest.raises(ImportTargetError, match=r"cannot write .*iter_0000002: disk full; .*iter_0000002 is as it was"):
        import_checkpoint(src, out, iteration=2, overwrite=True, progress=False)
    calls["n"] = 0
    with pytest.raises(ImportTargetError, match="disk full; .* was not created"):
        import_checkpoint(src, tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    assert {k: v for k, v in _listing(out).items() if "iter_0000003" not in k} == before
    assert sorted(os.listdir(out)) == ["iter_0000001", "iter_0000002", "iter_0000003",
                                       "latest_checkpointed_iteration.txt"]
    import_checkpoint(src, out, iteration=2, overwrite=True, dtype="bf16", progress=False)  # replaces iter 2 only
    assert model_keys(out / "iter_0000002")["output_layer.weight"][1] == torch.bfloat16
    assert (out / "iter_0000003" / "mine").read_text() == "keep"
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep"


def test_bad_input_is_reported_at_once_before_anything_is_written(ckpts, tmp_path):
    # moe_layer_freq: Megatron-LM's spellings, never executed; a value that does not build the HF model
    for bad in ("__import__('os').system('true')", "[1]*4+[2]", "0", "(1, 1, 1, 1)", "[1]*10**9"):
        with pytest.raises(UsageError, match="moe_layer_freq"):
            import_checkpoint(ckpts["qwen3_moe"], tmp_path / "bad", moe_layer_freq=bad, progress=False)
    for bad, found in ((2, "[1]+[0]+[1]+[0]"), ("[1]*3", "[1]*3"), ([0, 1, 1, 1], "[0]+[1]*3")):
        with pytest.raises(ConfigMismatchError, match=re.escape(f"gives the dense (0) / MoE (1) layers {found}, the HF "
                                                                "config has [1]*4: pass the value the Megatron model "
                                                                "is built with (1 (stacked keys) or '[1]*4'")):
            import_checkpoint(ckpts["qwen3_moe"], tmp_path / "bad", moe_layer_freq=bad, progress=False)
    assert not (tmp_path / "bad").exists()
    src = tmp_path / "src"
    shutil.copytree(ckpts["glm4_moe"], src)
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    tensors = {f: load_file(src / f) for f in files}
    f0 = next(f for f in files if "model.layers.1.self_attn.k_proj.weight" in tensors[f])
    t = dict(tensors[f0])
    del t["model.layers.1.self_attn.k_proj.weight"]
    t["model.layers.1.self_attn.o_proj.weight"] = t["model.layers.1.self_attn.o_proj.weight"][:, :32].contiguous()
    save_file(t, src / f0, metadata={"format": "pt"})
    with pytest.raises(HFDirectoryError) as e:  # the index still names k_proj: its file lacks it
        import_checkpoint(src, tmp_path / "o1", progress=False)
    assert f"k_proj.weight to {src / f0}, whose header lacks it" in str(e.value), str(e.value)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.k_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ShapeMismatchError) as e:
        import_checkpoint(src, tmp_path / "o1", progress=False)
    assert "k_proj.weight'] missing" in str(e.value), str(e.value)
    t["model.layers.1.self_attn.k_proj.weight"] = tensors[f0]["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, src / f0, metadata={"format": "pt"})
    index["weight_map"]["model.layers.1.self_attn.k_proj.weight"] = f0
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ShapeMismatchError, match=r"o_proj.weight: HF config implies shape \[64, 64\], the "
                                                 r"checkpoint gives \[64, 32\]"):
        import_checkpoint(src, tmp_path / "o1", progress=False)
    t["model.layers.1.self_attn.o_proj.weight"] = tensors[f0]["model.layers.1.self_attn.o_proj.weight"]
    t["model.layers.1.mystery.weight"] = torch.zeros(3)
    save_file(t, src / f0, metadata={"format": "pt"})
    index["weight_map"]["model.layers.1.mystery.weight"] = f0
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UnknownParametersError, match="model.layers.1.mystery.weight"):
        import_checkpoint(src, tmp_path / "o2", progress=False)
    with pytest.raises(ShapeMismatchError, match="linear_qkv"):  # the config says 4 KV heads, the tensors 2
        import_checkpoint(ckpts["qwen3_moe"], tmp_path / "o3", hf_config=tiny_config("qwen3_moe", num_key_value_heads=4),
                          progress=False)
    (tmp_path / "o1x").mkdir()
    with pytest.raises(Mcore2HFError, match="neither model.safetensors.index.json nor model.safetensors"):
        import_checkpoint(tmp_path / "o1x", tmp_path / "o4", hf_config=ckpts["llama"], progress=False)
    assert sorted(os.listdir(tmp_path)) == ["o1x", "src"]


def test_cli(ckpts, tmp_path):
    r = worlds.cli_run("import", ckpts["deepseek_v3"], str(tmp_path / "c"), "--iteration", "12", "--tp", "2",
                       "--singleton-local-shards", "--dtype", "bf16", "--moe-layer-freq", "[0]+[1]*3")
    assert r.returncode == 0, r.stderr
    assert "decoder layer keys: per layer: singleton_local_shards" in r.stdout, r.stdout
    assert "norm keys: as a model built with --transformer-impl transformer_engine saves them" in r.stdout, r.stdout
    assert "peak RSS" in r.stdout and (tmp_path / "c" / "latest_checkpointed_iteration.txt").read_text() == "12"
    meta = model_keys(tmp_path / "c" / "iter_0000012")
    assert meta["embedding.word_embeddings.weight"] == ((256, 64), torch.bfloat16)  # 100 padded to 128 x TP 2
    assert "decoder.layers.1.mlp.experts.experts.7.linear_fc1.weight_v" in meta
    assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in meta  # TE: MLA's fused q norm
    r = worlds.cli_run("import", ckpts["deepseek_v3"], str(tmp_path / "l"), "--transformer-impl", "local")
    assert r.returncode == 0 and "--transformer-impl local" in r.stdout, r.stderr
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in model_keys(tmp_path / "l" / "iter_0000000")
    r = worlds.cli_run("import", "--help")
    assert "{" + ",".join(TRANSFORMER_IMPLS) + "}" in r.stdout.replace("\n", "").replace(" ", ""), r.stdout
    r = worlds.cli_run("import", ckpts["deepseek_v3"], str(tmp_path / "c"), "--iteration", "12")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "--overwrite" in r.stderr, r.stderr
    r = worlds.cli_run("import", ckpts["deepseek_v3"], str(tmp_path / "d"), "--file-size", "lots")
    assert r.returncode == 2 and "--file-size" in r.stderr
    r = worlds.cli_run("import", ckpts["qwen3_moe"], str(tmp_path / "f"), "--moe-layer-freq", "[0]+[1]*3")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "[0]+[1]*3" in r.stderr, r.stderr
    assert not (tmp_path / "f").exists()


def test_tied_embeddings_import_has_no_output_layer(tmp_path):
    src = make_hf_checkpoint(tiny_config("llama"), tmp_path / "llama")
    import_checkpoint(src, tmp_path / "c", progress=False)
    meta = model_keys(tmp_path / "c" / "iter_0000000")
    assert "output_layer.weight" not in meta and "embedding.word_embeddings.weight" in meta
    assert meta["decoder.layers.self_attention.linear_qkv.weight"][0] == (4, 128, 64)  # stacked: a dense model


# -- the transformer_engine import against megatron-core's own TE spec ----------------------------------------------

_TE_STATE = {"TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELinear", "TENorm"}


def _skeleton(names: list[str], num_layers: int) -> torch.nn.Module:
    """A module tree holding the canonical names as a local-spec GPTModel at TP 1 / PP 1 / EP 1 names them (expert
    e under `local_experts.e`, MTP layer m's inner layer under `mtp.layers.m.transformer_layer`): empty parameters,
    decoder layers with their layer_number, for harness.te_spec.expected_te_names."""
    root = torch.nn.Module()
    for name in names:
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m is not None:
            i, rest = int(m[1]), re.sub(r"^mlp\.experts\.(\d+)\.", r"mlp.experts.local_experts.\1.", m[2])
            name = (f"decoder.layers.{i}.{rest}" if i < num_layers else
                    f"mtp.layers.{i - num_layers}.transformer_layer.{rest}")
        *path, leaf = name.split(".")
        node = root
        for j, part in enumerate(path):
            if part not in node._modules:
                node.add_module(part, torch.nn.ModuleList() if part in ("layers", "local_experts") else torch.nn.Module())
            child = node._modules[part]
            if isinstance(child, torch.nn.ModuleList) and j + 1 < len(path):
                k = int(path[j + 1])
                while len(child) <= k:
                    child.append(torch.nn.Module())
            node = child
        node.register_parameter(leaf, torch.nn.Parameter(torch.empty(0)))
    for i, layer in enumerate(root.decoder.layers):
        layer.layer_number = i + 1
    return root


def _te_state_objects(module: torch.nn.Module, tree: dict, prefix: str) -> list[str]:
    """The modules of the TE model at `tree` that hold an `_extra_state` (TE linears and TENorm; TEGroupedMLP's
    linears; TEDotProductAttention where it has parameters), by their local-spec path."""
    cls = tree["class"]
    if cls == "IdentityOp" or module is None:
        return []
    if cls == "TEGroupedMLP":
        return [f"{prefix}experts.{fc}" for fc in ("linear_fc1", "linear_fc2")]  # its sharded_state_dict's prefix
    out = [prefix[:-1]] if cls in _TE_STATE or (cls == "TEDotProductAttention" and len(list(module.parameters()))) \
        else []
    for field, sub in tree.get("sub", {}).items():
        attr = "final_layernorm" if field == "layer_norm" else field
        out += _te_state_objects(module._modules.get(attr), sub, f"{prefix}{attr}.")
    return out


def te_checkpoint_keys(names: list[str], tree: dict, num_layers: int, stacked: bool) -> tuple[set[str], set[str]]:
    """(tensor keys, `_extra_state` object keys without their shard suffix) of the model megatron-core's TE spec
    `tree` builds holding the canonical `names`, as its sharded_state_dict keys them (megatron-core 0.16.1:
    transformer_block.py stacks `decoder.layers.<i>.` into `decoder.layers.` unless per layer; TEGroupedMLP keys
    expert e's `linear_fcN.weight<e>` as `experts.linear_fcN.weight` with an expert axis, as SequentialMLP's TE
    linears do (moe/experts.py); MTP layers per layer)."""
    model = _skeleton(names, num_layers)
    params = expected_te_names(model, tree)
    objects = [f"decoder.layers.{i}.{o}" for i, layer in enumerate(model.decoder.layers)
               for o in _te_state_objects(layer, tree["layers"][i], "")]
    objects += [f"mtp.layers.{m}.{o}" for m, layer in enumerate(model.mtp.layers if hasattr(model, "mtp") else [])
                for o in _te_state_objects(layer, tree["mtp"][m], "")]
    if tree["final_layernorm"] and tree["final_layernorm"]["class"] == "TENorm":
        objects.append("decoder.final_layernorm")

    def key(name: str) -> str:
        name = re.sub(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)\d+$", r".mlp.experts.experts.\1.\2", name)
        name = re.sub(r"\.mlp\.experts\.local_experts\.\d+\.", ".mlp.experts.experts.", name)
        return re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", name) if stacked else name

    return {key(n) for n in params}, {key(f"{o}._extra_state") for o in objects}


def test_transformer_engine_import_has_the_keys_of_megatron_cores_te_spec(all_ckpts, te_specs, tmp_path):
    """For every registered architecture, the default (transformer_engine) import's tensor keys and `_extra_state`
    objects are exactly those of the model megatron-core's own TE spec builds (harness.te_spec: which norms are
    fused, which are TENorm), keyed by megatron-core's stacking rules (hybrid stacks: not checked here)."""
    from mcore2hf.formats.checkpoint_keys import split_part
    from mcore2hf.formats.hf_as_megatron import megatron_names

    for mt, ckpt in all_ckpts.items():
        cfg = load_hf_config(ckpt)
        conv = get_converter(cfg.model_type)
        dims = get_model_spec(cfg.model_type).dims(cfg)
        names = sorted(megatron_names(conv, dims, set(held(ckpt)))[0])
        r = import_checkpoint(ckpt, tmp_path / mt, moe_layer_freq=moe_pattern(ckpt), progress=False)
        assert r.transformer_impl == "transformer_engine"
        got = model_keys(tmp_path / mt / "iter_0000000")
        tensors = {split_part(k)[0] for k, v in got.items() if v != "object"}  # gated DeltaNet parts: one tensor
        objects = {k.split("/shard_")[0] for k, v in got.items() if v == "object"}
        want_tensors, want_objects = te_checkpoint_keys(names, te_specs[cfg.model_type], dims.num_layers,
                                                        r.layer_keys.startswith("stacked"))
        assert tensors == want_tensors, (mt, sorted(tensors - want_tensors)[:6], sorted(want_tensors - tensors)[:6])
        assert objects == want_objects, (mt, sorted(objects - want_objects)[:6], sorted(want_objects - objects)[:6])
