"""Qwen3-VL's vision tower built natively in Megatron (layout 1 of issue 26), with megatron-core layers.

Megatron-Bridge 0.6.2 builds it in models/qwen_vl/modelling_qwen3_vl/ (vision_model.py `Qwen3VLVisionModel`,
transformer_block.py `Qwen3VLVisionTransformerBlock`, utils.py `Qwen3VLVisionPatchEmbed` / `Qwen3VLVisionPatchMerger`,
transformer_config.py `get_vision_model_config`); mbridge's qwen3_vl (github ISEEKYAN/mbridge main, no PyPI release)
is where Bridge copied it from (transformer_block.py:16-18). Bridge 0.6.2 needs megatron-core 0.19 and Python 3.12,
so it does not run beside megatron-core 0.16.1 here: this module rebuilds the tower with the same module tree (every
parameter name below is Bridge's, cited per module), from megatron-core 0.16.1's ViT layer spec
(models/vision/vit_layer_specs.py `get_vit_layer_with_local_spec`, Bridge uses its TE twin, model.py:329) with
bidirectional attention over each frame, as Bridge's packed `thd` attention (vision_model.py:381-393) and
transformers' `cu_seqlens` compute.

One deliberate difference: the patch mergers' activation. Bridge's merger applies the ViT config's
`activation_func` (utils.py:166, tanh-approximated GELU, transformer_config.py:128), transformers 5.24's
`Qwen3VLVisionPatchMerger` exact `nn.GELU()`; mcore2hf's tower follows transformers, the published checkpoints'
reference, so that its forward is transformers' (parameters are the same either way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from mcore2hf.hf_config import get

from .common import supported_kwargs


def vision_dims(vision_cfg) -> dict:
    """`ModelDims` fields of the tower: heads and head dim (Bridge transformer_config.py:127 `kv_channels = hidden
    // heads`, :128 `num_query_groups = num_attention_heads`)."""
    return dict(vision_num_heads=vision_cfg.num_heads, vision_head_dim=vision_cfg.hidden_size // vision_cfg.num_heads,
                vision_merged_size=vision_cfg.hidden_size * vision_cfg.spatial_merge_size ** 2)


def vision_transformer_config(vision_cfg, lm_config):
    """The tower's TransformerConfig: Bridge 0.6.2 transformer_config.py:64-158 `get_vision_model_config` (LayerNorm
    eps 1e-6, biased linears, tanh GELU MLP, no GQA, TP of the language model, no PP / SP / CP), with the
    language model's dtype and CPU initialization."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=vision_cfg.depth, hidden_size=vision_cfg.hidden_size, num_attention_heads=vision_cfg.num_heads,
        num_query_groups=vision_cfg.num_heads, kv_channels=vision_cfg.hidden_size // vision_cfg.num_heads,
        ffn_hidden_size=vision_cfg.intermediate_size, add_bias_linear=True, add_qkv_bias=True,
        gated_linear_unit=False, activation_func=_hidden_act(vision_cfg), normalization="LayerNorm",
        layernorm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0, apply_rotary_pos_emb_in_fp32=True,
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False, layernorm_zero_centered_gamma=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=lm_config.tensor_model_parallel_size, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, sequence_parallel=False, context_parallel_size=1,
        expert_model_parallel_size=1, num_moe_experts=None,
        params_dtype=lm_config.params_dtype, pipeline_dtype=lm_config.params_dtype, bf16=lm_config.bf16,
        fp16=lm_config.fp16, use_cpu_initialization=lm_config.use_cpu_initialization,
        perform_initialization=lm_config.perform_initialization,
    )
    return TransformerConfig(**supported_kwargs(TransformerConfig.__init__, **fields))


def _hidden_act(vision_cfg):
    act = get(vision_cfg, "hidden_act", default="gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        from mcore2hf.errors import ConfigMismatchError

        raise ConfigMismatchError(f"Qwen3-VL vision tower: hidden_act {act!r} (expected gelu_pytorch_tanh or gelu)")
    return lambda x: F.gelu(x, approximate="tanh" if act == "gelu_pytorch_tanh" else "none")


def vision_layer_spec():
    """megatron-core 0.16.1's local ViT layer (vit_layer_specs.py:61-84) with bidirectional attention under an
    explicit mask (one block per frame); Bridge (model.py:329) uses the TE spec, whose fused norms naming.TE_RENAMES
    maps to these names."""
    import copy

    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.self_attention.params = {"attn_mask_type": AttnMaskType.arbitrary}
    return spec


class PatchEmbed(nn.Module):
    """Bridge utils.py:32-63 `Qwen3VLVisionPatchEmbed`: `proj`, a Conv3d over (temporal, patch, patch), replicated."""

    def __init__(self, vision_cfg, dtype: torch.dtype):
        super().__init__()
        self.in_channels, self.t, self.p = vision_cfg.in_channels, vision_cfg.temporal_patch_size, vision_cfg.patch_size
        self.embed_dim = vision_cfg.hidden_size
        k = (self.t, self.p, self.p)
        self.proj = nn.Conv3d(self.in_channels, self.embed_dim, kernel_size=k, stride=k, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.in_channels, self.t, self.p, self.p).to(self.proj.weight.dtype)
        return self.proj(x).view(-1, self.embed_dim)


class PatchMerger(nn.Module):
    """Bridge utils.py:97-177 `Qwen3VLVisionPatchMerger`: `patch_norm` (LayerNorm, over the tower width, or over
    the merged width with `postshuffle` for the deepstack mergers), `linear_fc1` column- and `linear_fc2`
    row-parallel over the language model's TP group, both biased; exact GELU between (transformers'; see the
    module docstring)."""

    def __init__(self, config, out_hidden_size: int, merge: int, postshuffle: bool):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.merged = config.hidden_size * merge * merge
        self.postshuffle = postshuffle
        self.patch_norm = nn.LayerNorm(self.merged if postshuffle else config.hidden_size, eps=1e-6,
                                       dtype=config.params_dtype)
        self.linear_fc1 = ColumnParallelLinear(self.merged, self.merged, config=config, init_method=config.init_method,
                                               gather_output=False, bias=True, skip_bias_add=False)
        self.linear_fc2 = RowParallelLinear(self.merged, out_hidden_size, config=config, bias=True,
                                            init_method=config.output_layer_init_method, input_is_parallel=True,
                                            skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_norm(x.view(-1, self.merged) if self.postshuffle else x).view(-1, self.merged)
        x, _ = self.linear_fc1(x)
        x, _ = self.linear_fc2(F.gelu(x))
        return x


def _vision_block_class():
    from megatron.core.transformer.transformer_block import TransformerBlock

    class VisionTransformerBlock(TransformerBlock):
        """Bridge transformer_block.py:56-100 `Qwen3VLVisionTransformerBlock`: the ViT layers (no final norm) and
        `deepstack_merger_list`, one postshuffle merger per `deepstack_visual_indexes` entry, applied to the
        output of that layer (:364-369)."""

        def __init__(self, config, spec, vision_cfg):
            super().__init__(config=config, spec=spec, post_layer_norm=False, pre_process=True, post_process=True)
            self.deepstack_visual_indexes = list(get(vision_cfg, "deepstack_visual_indexes", default=[]) or [])
            merge = vision_cfg.spatial_merge_size
            self.deepstack_merger_list = nn.ModuleList(
                [PatchMerger(config, vision_cfg.out_hidden_size, merge, postshuffle=True)
                 for _ in self.deepstack_visual_indexes])

        def forward(self, hidden_states, attention_mask, rotary_pos_emb):
            features = []
            for i, layer in enumerate(self.layers):
                hidden_states, _ = layer(hidden_states=hidden_states, attention_mask=attention_mask,
                                         rotary_pos_emb=rotary_pos_emb)
                if i in self.deepstack_visual_indexes:
                    features.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](hidden_states))
            return hidden_states, features

    return VisionTransformerBlock


class VisionModel(nn.Module):
    """Bridge vision_model.py:112-393 `Qwen3VLVisionModel`: `patch_embed`, `pos_embed` (nn.Embedding of
    num_position_embeddings, replicated, bilinearly interpolated to the grid), 2-D rotary embeddings of each
    patch's (row, column), the ViT `decoder` with its deepstack mergers, and `merger`. `forward(pixel_values,
    grid_thw)` -> (merged embeddings [tokens, out_hidden_size], deepstack features), as transformers'
    `Qwen3VLVisionModel` returns them (pooler_output, deepstack_features)."""

    def __init__(self, vision_cfg, lm_config):
        super().__init__()
        self.config = vision_transformer_config(vision_cfg, lm_config)
        self.vision_cfg = vision_cfg
        self.merge = vision_cfg.spatial_merge_size
        dtype = self.config.params_dtype
        self.patch_embed = PatchEmbed(vision_cfg, dtype)
        self.pos_embed = nn.Embedding(vision_cfg.num_position_embeddings, vision_cfg.hidden_size, dtype=dtype)
        self.num_grid_per_side = int(vision_cfg.num_position_embeddings ** 0.5)
        self.head_dim = vision_cfg.hidden_size // vision_cfg.num_heads
        self.decoder = _vision_block_class()(self.config, vision_layer_spec(), vision_cfg)
        self.merger = PatchMerger(self.config, vision_cfg.out_hidden_size, self.merge, postshuffle=False)

    def rot_pos_emb(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Bridge vision_model.py:184-221: per patch the rotary frequencies of its row and column (patches in
        merge-window order), dim head_dim // 2 (theta 10000, utils.py:66-92)."""
        dim = self.head_dim // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        m = self.merge
        coords = []
        for t, h, w in grid_thw.tolist():
            rows = (torch.arange(h // m)[:, None, None, None] * m + torch.arange(m)[None, None, :, None])
            cols = (torch.arange(w // m)[None, :, None, None] * m + torch.arange(m)[None, None, None, :])
            rows = rows.expand(h // m, w // m, m, m).reshape(-1)
            cols = cols.expand(h // m, w // m, m, m).reshape(-1)
            coords.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
        pos = torch.cat(coords)
        table = torch.outer(torch.arange(int(grid_thw[:, 1:].max())), inv_freq)
        return table[pos].flatten(1)

    def pos_embeds(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Bridge vision_model.py:223-282 `fast_pos_embed_interpolate`: pos_embed's n x n grid bilinearly
        interpolated (corners aligned) to each image's h x w, repeated over t, in merge-window order."""
        n, m = self.num_grid_per_side, self.merge
        weight = self.pos_embed.weight
        out = []
        for t, h, w in grid_thw.tolist():
            hs, ws = torch.linspace(0, n - 1, h), torch.linspace(0, n - 1, w)
            h0, w0 = hs.int(), ws.int()
            h1, w1 = (h0 + 1).clip(max=n - 1), (w0 + 1).clip(max=n - 1)
            dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
            corners = [(h0, w0, (1 - dh) * (1 - dw)), (h0, w1, (1 - dh) * dw), (h1, w0, dh * (1 - dw)), (h1, w1, dh * dw)]
            emb = sum(self.pos_embed((a[:, None] * n + b[None, :]).flatten()) * wt.flatten()[:, None].to(weight.dtype)
                      for a, b, wt in corners)
            emb = emb.repeat(t, 1).view(t, h // m, m, w // m, m, -1).permute(0, 1, 3, 2, 4, 5).flatten(0, 4)
            out.append(emb)
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        x = self.patch_embed(pixel_values) + self.pos_embeds(grid_thw)
        s = x.shape[0]
        rotary = self.rot_pos_emb(grid_thw).reshape(s, 1, 1, -1).repeat(1, 1, 1, 2)
        # one attention block per frame (Bridge vision_model.py:381-393 build_packed_seq_params), True = masked
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        ids = torch.repeat_interleave(torch.arange(len(frames)), frames)
        mask = (ids[:, None] != ids[None, :])[None, None]
        x, features = self.decoder(x[:, None], mask, rotary)
        return self.merger(x[:, 0]), features


def build_vision_model(hf_config, lm_config) -> VisionModel:
    """The tower of the HF config's `vision_config`, tensor-parallel like `lm_config` (the language model's)."""
    return VisionModel(hf_config.vision_config, lm_config)
