"""GLM-4.7-Flash (HF `glm4_moe_lite`): DeepSeek-V3's multi-latent attention and format with GLM's routing
(sigmoid + expert bias, n_group 1) and its MoE layers listed in `mlp_layer_types` ("dense" / "sparse")."""

from .deepseek_v3 import MLA


class Glm4MoeLite(MLA):
    hf_architecture = "Glm4MoeLiteForCausalLM"

    def moe_layer(self, cfg, layer: int) -> bool:
        # transformers 5.23 modeling_glm4_moe_lite.py: MoE iff mlp_layer_types[layer_idx] == "sparse"
        return cfg.mlp_layer_types[layer] == "sparse"


SPEC = Glm4MoeLite()
