"""MTP drafts against the engines' own draft classes (issue 37): what a sync sends an engine's MTP draft loads into
every parameter of SGLang 0.5.23's and vLLM 0.33.0's draft classes for DeepSeek-V3 and GLM-4.5, bit for bit, and
means what Megatron's MTP layer means: the class's own MTP forward on the exported weights equals the forward of
megatron-core's MultiTokenPredictionLayer (harness.engine_drafts: what runs and the one substitution).

One world of 2 ranks at TP 2 per run builds both models (tiny configs with the fields the engines read from the
published config.json: vocab 128, DeepSeek-V3's yarn rope, topk_method, moe_layer_freq), loads their checkpoints,
exports them and runs Megatron's MTP layer; one subprocess per engine runs its classes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.wheels import unpacked_wheel

from mcore2hf.runtime.world import Layout, run_world

SGLANG, VLLM = "0.5.23", "0.33.0"
REPO = Path(__file__).resolve().parents[1]
LAYOUT = Layout(tp=2)  # the MTP layer's eh_proj and decoder layer split over TP, gathered by the export
SEQ = 8
#: the published config.json fields the engines' draft classes read that transformers' tiny config lacks (DeepSeek-V3:
#: topk_method, scoring_func, moe_layer_freq, ep_size; SGLang's CPU rope takes DeepSeek's yarn only,
#: layers/rotary_embedding/factory.py:478); vocab 128: no padding rows in the engines' vocab-parallel tables
CONFIGS = {
    "deepseek_v3": dict(vocab_size=128, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "rope_theta": 10000.0}),
    "glm4_moe": dict(vocab_size=128),
}
#: the MTP layer's own modules (not its decoder layer); with them swapped, the negative control
MTP_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
#: max |engine - Megatron| of the MTP forward, measured (fp32, the tiny models above, both engines, 2026-11-28:
#: hidden 8.3e-7 to 9.5e-7, logits 4.0e-6 to 4.8e-6): the engine's own forward (its norms, eh_proj, final norm,
#: head) around transformers' decoder layer against megatron-core's MultiTokenPredictionLayer at TP 2. Tolerance:
#: 3x. With enorm and hnorm exchanged the same forwards miss by 0.88 to 1.9 (hidden), 4.2 to 9.1 (logits).
MEASURED = {"hidden": 1.0e-6, "logits": 4.8e-6}


def _megatron_side(ckpts: dict, out_dir: str) -> dict:
    """A rank of the world: per model, its checkpoint loaded into megatron-core at LAYOUT, exported, and (rank 0)
    the files each engine's draft gets; then Megatron's MTP layer on the same inputs."""
    import torch.distributed as dist
    import worlds
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import save_file

    from mcore2hf import HFExporter, load_hf_weights

    lead, out = dist.get_rank() == 0, {}
    for model_type, ckpt in ckpts.items():
        cfg, chunks = worlds.build(ckpt, LAYOUT)
        load_hf_weights(chunks, ckpt)
        ex = HFExporter(chunks, cfg)
        full, mtp = ex.state_dict(), ex.draft_tensors()
        n = cfg.num_hidden_layers
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ), generator=g)
        hidden = torch.randn(SEQ, cfg.hidden_size, generator=g)
        rolled = torch.roll(ids, -1, -1)
        rolled[0, -1] = 0  # megatron-core's roll_tensor: the last position's next token is 0
        files = {}
        if lead:
            d = os.path.join(out_dir, model_type)
            os.makedirs(d, exist_ok=True)
            own = {f"model.layers.{n}.{m}.weight" for m in MTP_OWN}
            swapped = {k: v.clone() for k, v in full.items() if k in mtp.layer}
            swapped[f"model.layers.{n}.enorm.weight"], swapped[f"model.layers.{n}.hnorm.weight"] = \
                full[f"model.layers.{n}.hnorm.weight"].clone(), full[f"model.layers.{n}.enorm.weight"].clone()
            sets = {"sglang": {k: full[k] for k in mtp.layer},  # SGLang's NextN drafts: the layer's own
                    "vllm": {k: full[k] for k in mtp.layer | mtp.copies},  # vLLM's MTP drafts: and the copies
                    "target": {k: full[k] for k in ("model.embed_tokens.weight", "lm_head.weight")},
                    "swapped_sglang": swapped,
                    "swapped_vllm": {**swapped, **{k: full[k] for k in mtp.copies}}}
            for name, tensors in sets.items():
                files[name] = os.path.join(d, f"{name}.safetensors")
                save_file({k: v.contiguous() for k, v in tensors.items()}, files[name])
            # transformers' model whose last decoder layer is the MTP layer's (the decoder the engines' forward runs)
            layer_dir = os.path.join(d, "hf_layer")
            os.makedirs(layer_dir, exist_ok=True)
            hf = json.loads(Path(ckpt, "config.json").read_text())
            hf.update(num_hidden_layers=n + 1, num_nextn_predict_layers=0)
            Path(layer_dir, "config.json").write_text(json.dumps(hf))
            save_file({k: v.contiguous() for k, v in full.items()
                       if k not in own and k not in mtp.copies}, os.path.join(layer_dir, "model.safetensors"))
            files["hf_layer"] = layer_dir
            files["forward"] = os.path.join(d, "forward.pt")
            torch.save({"embeds": full["model.embed_tokens.weight"][rolled[0]], "hidden": hidden,
                        "positions": torch.arange(SEQ)}, files["forward"])
        # megatron-core's MTP layer (transformer/multi_token_prediction.py:861 forward: the next token's embedding
        # through `embedding`, enorm / hnorm, eh_proj, the transformer layer, final_layernorm), then the output layer
        chunk = chunks[0].eval()
        layer = chunk.mtp.layers[0]
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        rope = None if chunk.config.multi_latent_attention else chunk.rotary_pos_emb(SEQ)
        with torch.no_grad():
            h, _, _ = layer(input_ids=ids, position_ids=torch.arange(SEQ).unsqueeze(0), hidden_states=hidden.unsqueeze(1),
                            attention_mask=mask, rotary_pos_emb=rope, embedding=chunk.embedding)
            logits, _ = chunk.output_layer(h)
            logits = gather_from_tensor_model_parallel_region(logits)[..., :cfg.vocab_size]
        out[model_type] = {"files": files, "hidden": h.squeeze(1), "logits": logits.squeeze(1),
                           "layer": sorted(mtp.layer), "copies": sorted(mtp.copies)}
    return out


def _run_engine(engine: str, cases: dict, tmp: Path) -> dict:
    if engine == "sglang":
        site, env = unpacked_wheel("sglang", SGLANG, include=("sglang/*",)), {}
    else:
        site = unpacked_wheel("vllm", VLLM, ("vllm/*.py", "vllm-*.dist-info/*"))
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"}
    inp, out = tmp / f"{engine}-in.json", tmp / f"{engine}-out.json"
    inp.write_text(json.dumps(cases))
    path = [str(site), str(REPO / "tests"), str(REPO)] if engine == "vllm" else [str(REPO / "tests"), str(REPO)]
    r = subprocess.run([sys.executable, "-m", "harness.engine_drafts", engine, str(site), str(inp), str(out)],
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(path), **env), cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert out.exists(), f"{engine} draft harness died (rc {r.returncode}):\n{r.stderr[-5000:]}"
    res = json.loads(out.read_text())
    assert res["file"].startswith(str(site)), res["file"]  # the wheel's code, not another
    return res


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict:
    """Megatron's side (rank 0's) and each engine's results, per model."""
    from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

    tmp = tmp_path_factory.mktemp("drafts")
    ckpts = {m: make_hf_checkpoint(tiny_config(m, **kw), tmp / "ckpt" / m) for m, kw in CONFIGS.items()}
    megatron = run_world(_megatron_side, LAYOUT, ckpts, str(tmp / "export"), timeout=900)[0]
    out = {"megatron": megatron}
    for engine in ("sglang", "vllm"):
        cases = {}
        for m, got in megatron.items():
            f = got["files"]
            first = next(k for k in got["layer"] if k.endswith(".enorm.weight"))
            cases[m] = {"config": ckpts[m], "tensors": f[engine], "shared": f["target"], "hf_layer": f["hf_layer"],
                        "forward": f["forward"], "missing": [first]}
            cases[f"{m}:swapped"] = {"config": ckpts[m], "tensors": f[f"swapped_{engine}"], "shared": f["target"],
                                     "hf_layer": f["hf_layer"], "forward": f["forward"]}
        out[engine] = _run_engine(engine, cases, tmp)
        for key in cases:
            assert "error" not in out[engine][key], f"{engine} {key}:\n{out[engine][key]['error']}"
    return out


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_every_draft_parameter_filled_bit_identical(drafts, engine, model_type):
    """What a sync sends the engine's MTP draft (SGLang: the MTP layer's own tensors, its embedding and head being
    the target's; vLLM: with the embedding / head copies) loads through the engine's own draft class: every name
    lands in a parameter, whole-parameter copies are bit-identical, no parameter is left unfilled, none of the
    target's is written; a draft tensor left out is named (the parameter it fills stays unfilled)."""
    got = drafts[engine][model_type]
    load = got["load"]
    assert not load["dropped"] and not load["mismatch"] and not load["unfilled"] and not load["shared_written"], load
    n = drafts["megatron"][model_type]
    assert load["sent"] == len(n["layer"]) + (len(n["copies"]) if engine == "vllm" else 0)
    missing = got["missing"]
    assert [p for p in missing["unfilled"] if p.endswith("enorm.weight")] and not missing["dropped"], missing


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_mtp_forward_equals_megatron(drafts, engine, model_type):
    """The engine's own MTP forward (its class's forward method on the weights the draft loaded; transformers'
    decoder layer in place of its attention-kernel one) equals megatron-core's MultiTokenPredictionLayer on the
    same inputs: the next token's embedding, the previous hidden state. Negative control: the same forward with
    the exported enorm and hnorm exchanged (what a converter swapping them in both load and export sends, though
    its round trip is bit-identical) misses Megatron by far more than the tolerance. vLLM's forward is given the
    sequence from position 1 (it zeroes position 0's embedding: harness.engine_drafts)."""
    meg = drafts["megatron"][model_type]
    ok = torch.load(drafts[engine][model_type]["forward"])
    bad = torch.load(drafts[engine][f"{model_type}:swapped"]["forward"])
    for what in ("hidden", "logits"):
        tol = 3 * MEASURED[what]
        diff = (ok[what] - meg[what]).abs().max().item()
        control = (bad[what] - meg[what]).abs().max().item()
        print(f"\n{engine} {model_type} MTP {what}: max |engine - megatron| {diff:.2e} (tolerance {tol:.1e}); "
              f"enorm/hnorm exchanged: {control:.2e}")
        assert diff <= tol, f"{engine} {model_type} {what}: {diff:.3e} > {tol:.1e}"
        assert control > 100 * tol, f"{engine} {model_type} {what}: the swap moved it only {control:.3e}"
