"""The engines' own MTP draft classes on CPU, fed what a sync sends their draft, and run forward
(`python -m harness.engine_drafts sglang|vllm SITE_DIR IN.json OUT.json`, one release per process; VLLM_TARGET_DEVICE
=cpu for vLLM).

The classes, built as each engine builds its draft:
* SGLang 0.5.23: DeepseekV3ForCausalLMNextN (models/deepseek_nextn.py) and Glm4MoeForCausalLMNextN
  (models/glm4_moe_nextn.py), the classes its model registry resolves for the draft of an MTP model, built from the
  target's config (harness.sglang_vlm_load's setup: a gloo world of one, the release's config parser). The draft's
  embedding and head are the target's (speculative/eagle_worker_v2.py:378 set_embed_and_head), given as `shared`.
* vLLM 0.33.0: DeepSeekMTP (models/deepseek_mtp.py) and Glm4MoeMTP (models/glm4_moe_mtp.py), built by its own
  initialize_model from the draft ModelConfig its own SpeculativeConfig(method="mtp") derives from the target's
  (config/speculative.py hf_config_override: DeepSeekMTPModel / Glm4MoeMTPModel), as llm_base_proposer.py:1318
  load_model does; its embedding and head copies are loaded into them by the draft session.

Per case (IN.json: {key: {"config", "tensors", "shared", "hf_layer", "forward", "missing"}}):
* `load`: harness.vlm_load's load_contract over the draft's tensors (`tensors`: the safetensors file of what the
  sync sends the draft), the target's `shared` ones set first: every name lands in a parameter, whole-parameter
  copies are bit-identical, no parameter is left unfilled, none of the target's is written. `missing`: the same with
  those tensors left out (the contract must name the parameters they fill).
* `forward` (a torch file {"embeds", "hidden", "positions"}): the class's own MTP forward (SGLang
  DeepseekModelNextN.forward / Glm4MoeModelNextN.forward, vLLM DeepSeekMultiTokenPredictorLayer.forward /
  Glm4MoeMultiTokenPredictorLayer.forward: enorm on the next token's embedding, hnorm on the previous hidden
  state, eh_proj of the two, the decoder layer, the final norm) on its loaded weights, then the logits through its
  head. One substitution, because attention kernels and their batch metadata do not run on CPU: the MTP layer's
  decoder layer is transformers' own (`hf_layer`: an HF directory whose last layer is the MTP layer's decoder
  tensors as exported, loaded by from_pretrained), an oracle independent of the exporter. RMSNorm runs its
  forward_native (SGLang's BaseFusedOp picks it on a CPU without AMX, kernels/fused_op.py `_platform_key`; vLLM's
  CustomOp the same). The output (normalized hidden states and logits) goes to OUT.json's file.
"""

from __future__ import annotations

import json
import os
import sys

#: the draft class each engine's registry resolves for an MTP model (SGLang: models/registry.py EntryClass of each
#: module; vLLM: SpeculativeConfig.hf_config_override's architecture)
SGLANG_CLASSES = {"deepseek_v3": ("sglang.srt.models.deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
                  "glm4_moe": ("sglang.srt.models.glm4_moe_nextn", "Glm4MoeForCausalLMNextN")}


def _hf_layer(directory: str):
    """transformers' decoder layer of the MTP layer (the last of `directory`'s model) and its rotary embedding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(directory)
    cfg._attn_implementation = "sdpa"  # causal without a mask: the MTP layer attends over the sequence as Megatron's
    model = AutoModelForCausalLM.from_pretrained(directory, config=cfg, dtype=torch.float32).eval()
    return model.model.layers[-1], model.model.rotary_emb


def _decoder(layer, rotary, returns: str):
    """A module standing in for the engine's decoder layer: transformers' layer on the same positions. `returns`:
    "tensor" (SGLang GLM), "pair" (SGLang DeepSeek: hidden, topk indices), "residual" (vLLM: hidden, residual)."""
    import torch

    class Decoder(torch.nn.Module):
        use_sequence_parallel_moe = False  # vLLM's DeepSeek MTP reads it (deepseek_mtp.py:137)

        def forward(self, positions, hidden_states, *args, **kwargs):
            pos = positions.view(1, -1)
            h = hidden_states.unsqueeze(0)
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=rotary(h, pos))
            out = (out[0] if isinstance(out, tuple) else out).squeeze(0)
            if returns == "pair":
                return out, None
            if returns == "residual":
                return out, torch.zeros_like(out)
            return out

    return Decoder()


def _native_norms(model) -> None:
    for m in model.modules():
        if type(m).__name__ in ("RMSNorm", "GemmaRMSNorm") and hasattr(m, "forward_native"):
            m.forward = m.forward_native


# ---------------------------------------------------------------- SGLang

def _sglang_model(config_dir: str):
    import importlib

    from sglang.srt.utils.hf_transformers.config import get_config

    cfg = get_config(config_dir, trust_remote_code=False)
    module, cls = SGLANG_CLASSES[cfg.model_type]
    return getattr(importlib.import_module(module), cls)(cfg), cfg


def sglang_case(case: dict, out_file: str) -> dict:
    import types

    import torch
    from safetensors.torch import load_file

    from harness.vlm_load import load_contract

    model, cfg = _sglang_model(case["config"])
    target = load_file(case["shared"])
    # as the speculative worker shares them (eagle_worker_v2.py:378); its empty_cache / synchronize are GPU-only
    torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None
    model.set_embed_and_head(torch.nn.Parameter(target["model.embed_tokens.weight"].clone()),
                             torch.nn.Parameter(target["lm_head.weight"].clone()))
    shared = {"model.embed_tokens.weight": target["model.embed_tokens.weight"],
              "lm_head.weight": target["lm_head.weight"]}
    tensors = load_file(case["tensors"])
    res = {"class": f"{type(model).__module__}.{type(model).__name__}", "load": load_contract(model, tensors, shared)}
    if case.get("missing"):
        fresh, _ = _sglang_model(case["config"])
        fresh.set_embed_and_head(torch.nn.Parameter(target["model.embed_tokens.weight"].clone()),
                                 torch.nn.Parameter(target["lm_head.weight"].clone()))
        res["missing"] = load_contract(fresh, {n: t for n, t in tensors.items() if n not in case["missing"]}, shared)
    if case.get("forward"):
        inputs = torch.load(case["forward"])
        layer, rotary = _hf_layer(case["hf_layer"])
        deepseek = cfg.model_type == "deepseek_v3"
        model.model.decoder = _decoder(layer, rotary, "pair" if deepseek else "tensor")
        _native_norms(model)
        mode = types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False, is_draft_extend_v2=lambda: False)
        # the ForwardBatch fields the NextN forward reads (deepseek_nextn.py:186-245, glm4_moe_nextn.py:81-108)
        batch = types.SimpleNamespace(spec_info=types.SimpleNamespace(hidden_states=inputs["hidden"]),
                                      forward_mode=mode, mm_input_embeds=None, contains_mm_inputs=lambda: False,
                                      residual_stream=None, reuse_dsa_topk_indices=False)
        with torch.no_grad():
            hidden = model.model(torch.zeros(len(inputs["positions"]), dtype=torch.long), inputs["positions"], batch,
                                 input_embeds=inputs["embeds"])
            logits = hidden @ model.lm_head.weight.T  # the shared head (LogitsProcessor: hidden @ head.T)
        torch.save({"hidden": hidden, "logits": logits}, out_file)
        res["forward"] = out_file
    return res


# ---------------------------------------------------------------- vLLM

def _vllm_model(config_dir: str):
    """The draft model vLLM builds for an MTP target (see the module docstring)."""
    import torch
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import initialize_model

    from harness.vlm_load import local_init_method

    target = ModelConfig(model=config_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=target,
                             target_parallel_config=parallel)
    config = VllmConfig(model_config=target, device_config=DeviceConfig("cpu"), speculative_config=spec,
                        parallel_config=parallel)
    with set_current_vllm_config(config):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        else:
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=local_init_method())
        parallel_state.initialize_model_parallel(backend="gloo")
        torch.manual_seed(0)
        return initialize_model(config, model_config=spec.draft_model_config), config


def vllm_case(case: dict, out_file: str) -> dict:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

    from harness.vlm_load import load_contract

    model, config = _vllm_model(case["config"])
    tensors = load_file(case["tensors"])
    # as the IPC and NCCL transfer engines load a chunk (ipc_engine.py:240-245, nccl_engine.py:206-211): without
    # the MTP completeness check, which a chunk without the MTP layer would fail (deepseek_mtp.py:520-535)
    with set_current_vllm_config(config), disable_mtp_completeness_check():
        res = {"class": f"{type(model).__module__}.{type(model).__name__}", "load": load_contract(model, tensors)}
        if case.get("missing"):
            fresh, _ = _vllm_model(case["config"])
            res["missing"] = load_contract(fresh, {n: t for n, t in tensors.items() if n not in case["missing"]})
        if case.get("forward"):
            inputs = torch.load(case["forward"])
            layer, rotary = _hf_layer(case["hf_layer"])
            mtp = model.model.layers[str(model.model.mtp_start_layer_idx)]
            mtp.mtp_block = _decoder(layer, rotary, "residual")
            _native_norms(model)
            # vLLM zeroes the embedding at position 0 (deepseek_mtp.py:122, glm4_moe_mtp.py:115: "not needed by
            # MTP"), which Megatron's MTP reads: the sequence is placed from position 1 (attention depends on
            # relative positions only: the same function of the tokens)
            with torch.no_grad():
                out = mtp(torch.zeros(len(inputs["positions"]), dtype=torch.long), inputs["positions"] + 1,
                          inputs["hidden"], inputs["embeds"])
                hidden = out[1] if isinstance(out, tuple) else mtp.shared_head(out)  # DeepSeek: (pre, post) norm
                logits = hidden @ mtp.shared_head.head.weight.T  # compute_logits: the MTP layer's shared_head.head
            torch.save({"hidden": hidden, "logits": logits}, out_file)
            res["forward"] = out_file
    return res


def main(engine: str, site: str, inp: str, out: str) -> None:
    if engine == "sglang":
        from harness.sglang_vlm_load import _setup

        _setup(site)
        import sglang as package
    else:
        from harness.vllm_real import install_gpu_stubs
        from harness.vllm_vlm_names import _stub_for_model_building

        install_gpu_stubs()
        _stub_for_model_building()
        import vllm as package
    with open(inp) as f:
        cases = json.load(f)
    result = {"version": package.__version__, "file": package.__file__}
    run = sglang_case if engine == "sglang" else vllm_case
    for key, case in cases.items():
        try:
            result[key] = run(case, os.path.join(os.path.dirname(out), f"{engine}-{key}.pt"))
        except Exception:  # noqa: BLE001 - reported per case, the others still run
            import traceback

            result[key] = {"error": traceback.format_exc()[-4000:]}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
