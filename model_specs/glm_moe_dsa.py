"""GLM-5 (HF `glm_moe_dsa`): DeepSeek-V3.2's format (multi-latent attention with DeepSeek sparse attention's
indexer, dense first layers, shared experts, sigmoid routing with expert bias, MTP layers) with GLM's values and
two differences: the indexer applies interleaved rope (transformers 5.24 modeling_glm_moe_dsa.py
`GlmMoeDsaIndexer.forward`: `apply_rotary_pos_emb_interleave`), and GLM-5.2's IndexShare (`indexer_types`:
"shared" layers reuse the previous full layer's top-k and have no indexer tensors)."""

from .deepseek_v32 import DSA


class GlmMoeDsa(DSA):
    hf_architecture = "GlmMoeDsaForCausalLM"
    rope_interleaved = True


SPEC = GlmMoeDsa()
