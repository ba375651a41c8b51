"""The load contract both engines' multimodal classes are held to (harness.sglang_vlm_load for SGLang,
harness.vllm_vlm_names for vLLM): one engine model, built on CPU by the engine's own code, and the names and
tensors an mcore2hf export sends.

Every parameter is filled with NaN, then each sent name is loaded alone and must write into at least one parameter
(SGLang's loaders skip names they have no parameter for silently: qwen3_vl.py:1762-1765), a whole-parameter copy
must be that tensor exactly; then all names are loaded together, in the order sent, and no parameter may keep a NaN
(nothing the engine needs is missing)."""

from __future__ import annotations


def local_init_method() -> str:
    """A tcp:// init method on a free local port: an engine's own one-process gloo world."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _nan_fill(model, shared: dict | None = None) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if shared and name in shared:  # the target's, by reference: its values, never the draft's to write
                p.copy_(shared[name])
            else:
                p.fill_(float("nan"))


def load_contract(model, tensors: dict, shared: dict | None = None) -> dict:
    """`model.load_weights` (the engine's own) run on `tensors` one name at a time, then all at once (see the
    module docstring): the names that landed nowhere (`deferred`: those the full load needs, fused with a partner
    that was not there alone), the whole-parameter copies that differ, the parameters left unfilled, and where each
    name landed. `shared` (parameter -> tensor): parameters a draft model shares with
    its target (SGLang's MTP drafts read the target's embedding and head), set to those values instead of NaN;
    `shared_written` names those the loads changed (a draft must not write the target's)."""
    import torch

    params = dict(model.named_parameters())
    shared = shared or {}
    dropped, partial_mismatch, landed = [], [], {}
    for name, t in tensors.items():
        _nan_fill(model, shared)
        model.load_weights(iter([(name, t.clone())]))
        written = [p for p, v in params.items() if p not in shared and not v.isnan().all()]
        landed[name] = written
        if not written:
            dropped.append(name)
        for p in written:
            v = params[p]
            if not v.isnan().any() and v.shape == t.shape and not torch.equal(v.detach(), t):
                partial_mismatch.append((name, p))
    # a name that lands nowhere alone but without which the full load leaves a parameter unfilled is held for a
    # partner it is fused with (SGLang's DeepSeek loader joins q_a_proj and kv_a_proj_with_mqa into
    # fused_qkv_a_proj_with_mqa once both arrived, deepseek_weight_loader.py:436-519): deferred, not dropped
    deferred = []
    for name in list(dropped):
        _nan_fill(model, shared)
        model.load_weights(iter([(n, t.clone()) for n, t in tensors.items() if n != name]))
        if any(v.isnan().any() for p, v in params.items() if p not in shared):
            dropped.remove(name)
            deferred.append(name)
    _nan_fill(model, shared)
    model.load_weights(iter([(n, t.clone()) for n, t in tensors.items()]))
    unfilled = sorted(p for p, v in params.items() if v.isnan().any())
    shared_written = sorted(p for p in shared if not torch.equal(params[p].detach(), shared[p]))
    return {"sent": len(tensors), "dropped": dropped, "mismatch": partial_mismatch, "unfilled": unfilled,
            "shared_written": shared_written, "deferred": deferred,
            "params": len(params), "visual_params": sum(p.startswith("visual.") for p in params), "landed": landed}


def read_tensors(ckpt_dir: str) -> dict:
    """The checkpoint's tensors, in the order of its files (what an export sends)."""
    import os

    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(ckpt_dir, name)))
    return tensors
