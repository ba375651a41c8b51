"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (HF `glm4_moe`): dense first layers, shared experts, expert bias, q/k/v bias,
q/k norms, MTP layers (with the embedding and head copies the published checkpoints keep in layer N)."""

from mcore2hf.arch.mapping import Converter
from mcore2hf.arch.registry import register

from .common import dense_mlp, embeddings, fp8_policy, gqa_attention, moe, mtp

GLM4_MOE = register(Converter(
    model_type="glm4_moe",
    spec="mcore2hf.model_specs.glm4_moe",
    rules=embeddings(mtp_copies=True) + gqa_attention() + dense_mlp()
    + moe(shared_experts=True, expert_bias=True) + mtp(),
    fp8=fp8_policy(mtp=True, source="GLM-4.5-FP8's unquantized tensors (that checkpoint is per-channel "
                   "compressed-tensors) but shared_head.head, bf16 as in DeepSeek-V3; router gates listed for vLLM"),
))
