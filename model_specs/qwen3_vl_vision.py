"""Qwen3-VL's vision tower built natively in Megatron (layout 1 of issue 26), with megatron-core layers.

Megatron-Bridge 0.6.2 builds it in models/qwen_vl/modelling_qwen3_vl/ (vision_model.py `Qwen3VLVisionModel`,
transformer_block.py `Qwen3VLVisionTransformerBlock`, utils.py `Qwen3VLVisionPatchEmbed` / `Qwen3VLVisionPatchMerger`,
transformer_config.py `get_vision_model_config`); mbridge's qwen3_vl (github ISEEKYAN/mbridge main, no PyPI release)
is where Bridge copied it from (transformer_block.py:16-18). Bridge 0.6.2 needs megatron-core 0.19 and Python 3.12,
so it does not run beside megatron-core 0.16.1 here: this module rebuilds the tower with the same module tree (every
parameter name below is Bridge's, cited per module), from megatron-core 0.16.1's ViT layer spec
(models/vision/vit_layer_specs.py `get_vit_layer_with_local_spec`, Bridge uses its TE twin, model.py:305) with
bidirectional attention over each frame, as Bridge's packed `thd` attention (vision_model.py:377-393) and
transformers' `cu_seqlens` compute.

One deliberate difference: the patch mergers' activation. Bridge's merger applies the ViT config's
`activation_func` (utils.py:154/177, tanh-approximated GELU, transformer_config.py:113), transformers 5.24's
`Qwen3VLVisionPatchMerger` exact `nn.GELU()`; mcore2hf's tower follows transformers, the published checkpoints'
reference, so that its forward is transformers' (parameters are the same either way)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from mcore2hf.arch.hf_config import get

from .common import supported_kwargs


def vision_dims(vision_cfg) -> dict:
    """`ModelDims` fields of the tower: heads and head dim (Bridge transformer_config.py:114 `kv_channels = hidden
    // heads`, :115 `num_query_groups = num_attention_heads`)."""
    return dict(vision_num_heads=vision_cfg.num_heads, vision_head_dim=vision_cfg.hidden_size // vision_cfg.num_heads,
                vision_merged_size=vision_cfg.hidden_size * vision_cfg.spatial_merge_size ** 2)


def vision_transformer_config(vision_cfg, lm_config):
    """The tower's TransformerConfig: Bridge 0.6.2 transformer_config.py:63-158 `get_vision_model_config` (LayerNorm
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
    explicit mask (one block per frame); Bridge (model.py:305) uses the TE spec, whose fused norms naming.TE_RENAMES
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


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class PatchMerger(nn.Module):
    """Bridge utils.py:112-177 `Qwen3VLVisionPatchMerger`: `patch_norm` (LayerNorm, over the tower width, or over
    the merged width with `postshuffle` for the deepstack mergers), `linear_fc1` column- and `linear_fc2`
    row-parallel over the language model's TP group, both biased; exact GELU between (transformers'; see the
    module docstring). Its checkpoint keys are a MegatronModule's, as Bridge's (`sharded_state_dict`)."""

    def __init__(self, config, out_hidden_size: int, merge: int, postshuffle: bool):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        self.config = config
        self.merged = config.hidden_size * merge * merge
        self.postshuffle = postshuffle
        self.patch_norm = nn.LayerNorm(self.merged if postshuffle else config.hidden_size, eps=1e-6,
                                       dtype=config.params_dtype)
        self.linear_fc1 = ColumnParallelLinear(self.merged, self.merged, config=config, init_method=config.init_method,
                                               gather_output=False, bias=True, skip_bias_add=False)
        self.linear_fc2 = RowParallelLinear(self.merged, out_hidden_size, config=config, bias=True,
                                            init_method=config.output_layer_init_method, input_is_parallel=True,
                                            skip_bias_add=False)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """MegatronModule's (Bridge's merger is one): patch_norm replicated, the linears' own (TP-split, with
        their `_extra_state`)."""
        return _megatron_module().sharded_state_dict(self, prefix, sharded_offsets, metadata)

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
        output of that layer (:366-369)."""

        def __init__(self, config, spec, vision_cfg):
            super().__init__(config=config, spec=spec, post_layer_norm=False, pre_process=True, post_process=True)
            self.deepstack_visual_indexes = list(get(vision_cfg, "deepstack_visual_indexes", default=[]) or [])
            merge = vision_cfg.spatial_merge_size
            self.deepstack_merger_list = nn.ModuleList(
                [PatchMerger(config, vision_cfg.out_hidden_size, merge, postshuffle=True)
                 for _ in self.deepstack_visual_indexes])

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            """Bridge transformer_block.py:393-465 `Qwen3VLVisionTransformerBlock.sharded_state_dict`: the layers as
            megatron-core's block keys them (stacked `layers.<name>`, the block a leading axis of `depth`), the
            deepstack mergers stacked the same way under `deepstack_merger_list.<name>` (a leading axis of their
            count); both keyed per index (`layers.<i>.`, `deepstack_merger_list.<i>.`) with the metadata flag
            `non_homogeneous_layers`."""
            from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

            mergers = f"{prefix}deepstack_merger_list."
            out = {k: v for k, v in super().sharded_state_dict(prefix, sharded_offsets, metadata).items()
                   if not k.startswith(mergers)}
            per_index = metadata is not None and metadata.get("non_homogeneous_layers", False)
            count = len(self.deepstack_merger_list)
            for i, merger in enumerate(self.deepstack_merger_list):
                local = f"{mergers}{i}."
                sd = merger.sharded_state_dict(local, [] if per_index else [(0, i, count)], metadata)
                replace_prefix_for_sharding(sd, local, local if per_index else mergers)
                out.update(sd)
            return out

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
    `Qwen3VLVisionModel` returns them (pooler_output, deepstack_features). Checkpoint keys: a MegatronModule's
    (Bridge's is a VisionModule), each child under its attribute name."""

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

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        return _megatron_module().sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def rot_pos_emb(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Bridge vision_model.py:188-225: per patch the rotary frequencies of its row and column (patches in
        merge-window order), dim head_dim // 2 (theta 10000, utils.py:70-92)."""
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
        """Bridge vision_model.py:227-286 `fast_pos_embed_interpolate`: pos_embed's n x n grid bilinearly
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

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor):
        """`hidden_states`: the pixel patches [patches, channels x temporal x patch x patch] (Bridge's name)."""
        x = self.patch_embed(hidden_states) + self.pos_embeds(grid_thw)
        s = x.shape[0]
        rotary = self.rot_pos_emb(grid_thw).reshape(s, 1, 1, -1).repeat(1, 1, 1, 2)
        # one attention block per frame (Bridge vision_model.py:381-393 build_packed_seq_params), True = masked
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        ids = torch.repeat_interleave(torch.arange(len(frames)), frames)
        mask = (ids[:, None] != ids[None, :])[None, None]
        x, features = self.decoder(x[:, None], mask, rotary)
        return self.merger(x[:, 0]), features


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, merge: int,
                    image_token_id: int, vision_start_token_id: int) -> torch.Tensor:
    """The [3, batch, seq] (t, h, w) rope positions of a text + image input: Bridge 0.6.2 rope.py:245-321
    `_build_llm_rope_positions` (transformers' `Qwen3VLModel.get_rope_index`), images only: text tokens count on
    from the previous maximum, an image's tokens get (0, row, column) of its merged grid after the text before it."""
    b, s = input_ids.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    index = 0
    for i in range(b):
        ids = input_ids[i].tolist()
        starts = [j + 1 for j, t in enumerate(ids[:-1]) if t == vision_start_token_id and ids[j + 1] == image_token_id]
        parts, st = [], 0
        for ed in starts:
            t, h, w = image_grid_thw[index].tolist()
            index += 1
            gh, gw = h // merge, w // merge
            base = int(parts[-1].max()) + 1 if parts else 0
            parts.append(torch.arange(ed - st).expand(3, -1) + base)
            grid = torch.stack([torch.arange(t).repeat_interleave(gh * gw), torch.arange(gh).repeat_interleave(gw).repeat(t),
                                torch.arange(gw).repeat(t * gh)])
            parts.append(grid + ed - st + base)
            st = ed + t * gh * gw
        if st < s:
            base = int(parts[-1].max()) + 1 if parts else 0
            parts.append(torch.arange(s - st).expand(3, -1) + base)
        out[:, i] = torch.cat(parts, dim=1)
    return out


def mrope_freqs(position_ids: torch.Tensor, inv_freq: torch.Tensor, section: list[int]) -> torch.Tensor:
    """Qwen3-VL's interleaved multimodal rope as per-token rotary frequencies [seq, batch, 1, head_dim] (Bridge
    0.6.2 rope.py:143-204 `Qwen3VLMultimodalRotaryEmbedding`; transformers 5.24 `apply_interleaved_mrope`):
    frequency i takes the height position where i % 3 == 1 and i < 3 x section[1], the width position where
    i % 3 == 2 and i < 3 x section[2], else the temporal one."""
    freqs = position_ids.float()[..., None] * inv_freq  # [3, b, s, d/2]
    out = freqs[0].clone()
    for dim, offset in ((1, 1), (2, 2)):
        idx = slice(offset, section[dim] * 3, 3)
        out[..., idx] = freqs[dim, ..., idx]
    emb = torch.cat((out, out), dim=-1)  # [b, s, d]
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


#: transformers 5.24's mrope_section when the config has none (modeling_qwen3_vl.py Qwen3VLTextRotaryEmbedding,
#: modeling_qwen3_5.py / modeling_qwen3_5_moe.py Qwen3_5TextRotaryEmbedding `rope_parameters.get("mrope_section", ...)`)
DEFAULT_MROPE_SECTION = {"qwen3_vl": [24, 20, 20], "qwen3_vl_moe": [24, 20, 20], "qwen3_5": [11, 11, 10],
                         "qwen3_5_moe": [11, 11, 10]}


class NativeVLModel(nn.Module):
    """A Qwen3-VL model chunk with the native tower, the module tree of Megatron-Bridge 0.6.2's `Qwen3VLModel`
    (modelling_qwen3_vl/model.py:209-381): `vision_model` (VisionModel, only where the chunk holds the first
    pipeline stage's embedding: model.py:302 `if self.pre_process and self.add_encoder`) beside `language_model`,
    the GPT decoder (here megatron-core's GPTModel; its rope module is not used: this forward computes Qwen3-VL's
    interleaved multimodal rope, Bridge's Qwen3VLGPTModel does the same).

    `forward(input_ids, position_ids, attention_mask, pixel_values=None, image_grid_thw=None)`: Bridge's forward
    (model.py:499-931) for images: the tower's embeddings replace the image tokens' (model.py:714), the rope
    positions from the image grids (`mrope_positions`, when `position_ids` is not [3, b, s]), the deepstack features
    added to the image tokens' hidden states after decoder layers 0..k-1 (transformer_block.py:760-767, 794-801;
    they must be on the first stage, as Bridge asserts, model.py:357-364). Returns the language model's output:
    logits [b, s, vocab / TP] on the last stage, hidden states [s, b, h] before it."""

    def __init__(self, language_model, vision_model: VisionModel | None, hf_config):
        super().__init__()
        self.language_model, self.vision_model = language_model, vision_model
        self.config = language_model.config
        self.pre_process, self.post_process = language_model.pre_process, language_model.post_process
        text = hf_config.text_config
        rope = get(text, "rope_parameters", default=None) or get(text, "rope_scaling", default=None) or {}
        self.mrope_section = list(rope.get("mrope_section") or DEFAULT_MROPE_SECTION[hf_config.model_type])
        theta = float(rope.get("rope_theta", get(text, "rope_theta", default=10000.0)))
        # partial rotary (Qwen3.5: 0.25): the first dims of each head rotate, as Megatron applies freqs narrower
        # than the head (rope_utils.py _apply_rotary_pos_emb_bshd) and transformers computes inv_freq
        dim = int(self.config.kv_channels * float(rope.get("partial_rotary_factor", 1.0)))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.merge = hf_config.vision_config.spatial_merge_size
        self.image_token_id, self.vision_start_token_id = hf_config.image_token_id, hf_config.vision_start_token_id

    @property
    def decoder(self):
        """The language model's decoder (Bridge model.py:404-411 exposes it the same way)."""
        return self.language_model.decoder

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """What Megatron saves of the chunk: Bridge's Qwen3VLModel is a MegatronModule without an override, so
        each child is keyed under its name, `language_model.` (the GPTModel's own keys) and `vision_model.`."""
        return _megatron_module().sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(self, input_ids, position_ids=None, attention_mask=None, pixel_values=None, image_grid_thw=None,
                **kwargs):
        lm = self.language_model
        if position_ids is None or position_ids.dim() != 3:
            position_ids = mrope_positions(input_ids, image_grid_thw, merge=self.merge,
                                           image_token_id=self.image_token_id,
                                           vision_start_token_id=self.vision_start_token_id)
        rotary = mrope_freqs(position_ids, self.inv_freq, self.mrope_section)
        deepstack, image_mask = [], None
        if self.pre_process:
            hidden = lm.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
            if pixel_values is not None:
                embeds, deepstack = self.vision_model(pixel_values, image_grid_thw)
                image_mask = input_ids == self.image_token_id  # [b, s]
                hidden = hidden.transpose(0, 1).clone()
                hidden[image_mask] = embeds.to(hidden.dtype)
                hidden = hidden.transpose(0, 1).contiguous()
        else:
            hidden = lm.decoder.input_tensor
        for layer in lm.decoder.layers:
            hidden, _ = layer(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=rotary)
            n = layer.layer_number - 1
            if n < len(deepstack):
                hidden = hidden.transpose(0, 1).clone()
                hidden[image_mask] = hidden[image_mask] + deepstack[n].to(hidden.dtype)
                hidden = hidden.transpose(0, 1).contiguous()
        if deepstack and len(deepstack) > len(lm.decoder.layers):
            from mcore2hf.errors import ConfigMismatchError

            raise ConfigMismatchError(f"{len(deepstack)} deepstack features need the first pipeline stage to hold "
                                      f"decoder layers 0..{len(deepstack) - 1}; it holds {len(lm.decoder.layers)}")
        if not self.post_process:
            return hidden
        hidden = lm.decoder.final_layernorm(hidden)
        weight = lm.shared_embedding_or_output_weight() if lm.share_embeddings_and_output_weights else None
        logits, _ = lm.output_layer(hidden, weight=weight)
        return logits.transpose(0, 1).contiguous()


def wrap_native(chunks: list, hf_config) -> list[NativeVLModel]:
    """The language-model chunks (GPTModel, one per virtual stage) of a Qwen3-VL model as `NativeVLModel`s, the
    tower built in the chunk that holds the embedding (first pipeline stage, first virtual stage)."""
    return [NativeVLModel(c, VisionModel(hf_config.vision_config, c.config) if c.pre_process else None, hf_config)
            for c in chunks]
