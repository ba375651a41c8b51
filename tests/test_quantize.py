"""The block-FP8 quantizer against DeepGEMM's own reference code (fast, no Megatron world; oracle.DEEP_GEMM
names the published file)."""

import oracle
import pytest
import torch

from mcore2hf.quantize.fp8 import FP8Policy, ceil_to_ue8m0, dequantize_fp8, per_block_cast_to_fp8, scale_shape
from mcore2hf.quantize.scheme import SCHEMES, get_scheme, quantize_flat, quantized_tensors


@pytest.fixture(scope="module")
def deepgemm():
    return oracle.deepgemm()


def _weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])  # columns of very different magnitude
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1
                                                                     else a.view(torch.int32), b.view(torch.uint8)
                                                                     if b.dtype.itemsize == 1 else b.view(torch.int32))


@pytest.mark.parametrize("shape", [(128, 128), (300, 200), (129, 1000), (7, 5), (256, 384), (1, 129)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_bit_identical_to_deepgemm_per_block_cast_to_fp8(deepgemm, shape, dtype, ue8m0):
    x = _weights(shape, dtype)
    q, s = per_block_cast_to_fp8(x, ue8m0)
    rq, rs = deepgemm.per_block_cast_to_fp8(x, use_ue8m0=ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == scale_shape(shape) == ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
    assert _same_bits(q, rq) and _same_bits(s, rs)


def test_variants_that_are_not_the_reference_differ(deepgemm):
    """448 / amax instead of 1 / (amax / 448) changes bytes: the test above can tell them apart."""
    x = _weights((512, 512), torch.bfloat16, seed=3)
    q, _ = per_block_cast_to_fp8(x)
    padded = x.view(4, 128, 4, 128)
    amax = padded.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    other = (padded * (448.0 / amax)).to(torch.float8_e4m3fn).view(512, 512)
    assert not torch.equal(q.view(torch.uint8), other.view(torch.uint8))


def test_zero_blocks_300x200_give_finite_scales_and_zeros(deepgemm):
    x = _weights((300, 200), torch.bfloat16)
    x[:128, :128] = 0  # a whole zero block
    x[256:, 128:] = 0  # a zero edge block
    for ue8m0 in (False, True):
        q, s = per_block_cast_to_fp8(x, ue8m0)
        assert torch.isfinite(s).all() and (s > 0).all()
        assert torch.isfinite(q.float()).all()
        assert (q[:128, :128].float() == 0).all() and (q[256:, 128:].float() == 0).all()
        rq, rs = deepgemm.per_block_cast_to_fp8(x, use_ue8m0=ue8m0)
        assert _same_bits(q, rq) and _same_bits(s, rs)


def test_ue8m0_scales_300x200_are_powers_of_two_not_below_the_plain_scale():
    x = _weights((300, 200), torch.bfloat16)
    _, plain = per_block_cast_to_fp8(x, False)
    _, pow2 = per_block_cast_to_fp8(x, True)
    mantissa = pow2.view(torch.int32) & 0x7FFFFF
    assert (mantissa == 0).all()
    assert (pow2 >= plain).all() and (pow2 < 2 * plain).all()
    assert torch.equal(ceil_to_ue8m0(torch.tensor([1.0, 0.75, 3.0, 2.0**-20])),
                       torch.tensor([1.0, 1.0, 4.0, 2.0**-20]))


@pytest.mark.parametrize("shape", [(300, 200), (128, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequantized_300x200_is_within_fp8_rounding(shape):
    x = _weights(shape, torch.float32)
    q, s = per_block_cast_to_fp8(x)
    back = dequantize_fp8(q, s)
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of the value, plus subnormals near 0 (step
    # 2^-9 of the block scale)
    bound = x.abs() * 2.0**-4 + s.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]] * 2.0**-9
    assert ((back - x).abs() <= bound).all()
    with pytest.raises(ValueError, match=r"scale_inv of a \[300, 200\] weight must be \[3, 2\], got \[2, 2\]"):
        dequantize_fp8(torch.zeros(300, 200, dtype=torch.float8_e4m3fn), torch.ones(2, 2))


def test_policy_quantized_tensors_and_config():
    policy = FP8Policy(keep=(r"lm_head\.weight", r"model\.embed_tokens\.weight", r".*\.mlp\.gate\.weight"))
    tensors = [("model.embed_tokens.weight", (300, 64), torch.bfloat16, "a"),
               ("model.layers.0.mlp.gate.weight", (8, 64), torch.bfloat16, "b"),
               ("model.layers.0.self_attn.q_proj.weight", (300, 200), torch.bfloat16, "c"),
               ("model.layers.0.self_attn.q_proj.bias", (300,), torch.bfloat16, "c"),
               ("model.norm.weight", (64,), torch.bfloat16, "d")]
    out = quantized_tensors(tensors, policy, SCHEMES["fp8"])
    assert [(n, s, d) for n, s, d, _ in out] == [
        ("model.embed_tokens.weight", (300, 64), torch.bfloat16),
        ("model.layers.0.mlp.gate.weight", (8, 64), torch.bfloat16),
        ("model.layers.0.self_attn.q_proj.weight", (300, 200), torch.float8_e4m3fn),
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", (3, 2), torch.float32),
        ("model.layers.0.self_attn.q_proj.bias", (300,), torch.bfloat16),
        ("model.norm.weight", (64,), torch.bfloat16)]
    names = [(n, s) for n, s, _, _ in tensors]
    assert SCHEMES["fp8"].config(policy, names) == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.embed_tokens", "model.layers.0.mlp.gate", "model.norm"]}
    assert SCHEMES["fp8-ue8m0"].config(policy, names)["scale_fmt"] == "ue8m0"
    assert "modules_to_not_convert" not in SCHEMES["fp8"].config(FP8Policy(keep=(), list_not_converted=False), names)
    for bad in ("fp4", "FP8", 8):
        with pytest.raises(ValueError, match=r"quantize must be one of \['fp8', 'fp8-ue8m0'\] or None"):
            get_scheme(bad)


def test_policy_with_a_tower_lists_its_modules_and_prefixes():
    """A vision-language model's FP8 config lists the tower's modules and the tower prefixes themselves, also where
    the family lists nothing else (Kimi-K2.5, DeepSeek-V3's table): vLLM 0.33 skips layers by exact name, SGLang
    0.5.23 by module-path prefix after splitting fused qkv_proj (FP8Policy's docstring; the engines' own check:
    tests/test_vlm.py test_sglang_loads_the_names_we_send_for_qwen3_vl_and_qwen3_5)."""
    from mcore2hf.converters.common import fp8_policy

    names = [("vision_tower.encoder.blocks.0.wqkv.weight", (90, 30)), ("vision_tower.encoder.blocks.0.wqkv.bias", (90,)),
             ("mm_projector.proj.0.weight", (120, 120)), ("language_model.model.layers.0.mlp.gate.weight", (8, 30)),
             ("language_model.model.layers.0.self_attn.o_proj.weight", (30, 30))]
    policy = fp8_policy(list_not_converted=False, tower=("vision_tower.", "mm_projector."))
    assert not any(policy.quantized(n, s) for n, s in names[:3]) and policy.quantized(*names[4])
    assert SCHEMES["fp8"].config(policy, names)["modules_to_not_convert"] == [
        "mm_projector", "mm_projector.proj.0", "vision_tower", "vision_tower.encoder.blocks.0.wqkv"]
    listed = SCHEMES["fp8"].config(fp8_policy(tower=("model.visual.",)), [
        ("model.visual.blocks.0.attn.qkv.weight", (9, 3)), ("model.language_model.layers.0.mlp.gate.weight", (8, 3)),
        ("lm_head.weight", (5, 3))])["modules_to_not_convert"]
    assert listed == ["lm_head", "model.language_model.layers.0.mlp.gate", "model.visual",
                      "model.visual.blocks.0.attn.qkv"], listed


def test_quantize_flat_bucket_300x200_matches_per_tensor_quantization():
    from mcore2hf.plan.export import pack_tight

    policy = FP8Policy(keep=())
    a, b, norm = _weights((300, 200), torch.bfloat16), _weights((64, 300), torch.bfloat16, 1), torch.ones(64)
    tensors = [("x.weight", (300, 200), torch.bfloat16, "s"), ("y.weight", (64, 300), torch.bfloat16, "s"),
               ("n.weight", (64,), torch.float32, "s")]
    entries = pack_tight(tensors)
    flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
    for e, t in zip(entries, [norm, a, b] if entries[0].name == "n.weight" else [a, b, norm]):
        flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape).copy_(t)
    src = {e.name: flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape) for e in entries}
    out_entries = pack_tight(quantized_tensors(tensors, policy, SCHEMES["fp8-ue8m0"]))
    out = quantize_flat(flat, entries, out_entries, SCHEMES["fp8-ue8m0"])
    got = {e.name: out[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape) for e in out_entries}
    for name in ("x.weight", "y.weight"):
        q, s = per_block_cast_to_fp8(src[name], True)
        assert _same_bits(got[name], q) and _same_bits(got[name + "_scale_inv"], s)
    assert torch.equal(got["n.weight"], norm)
    assert all(e.start % e.dtype.itemsize == 0 for e in out_entries)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_batched_3x300x200_equals_one_by_one(deepgemm, ue8m0):
    from mcore2hf.quantize.fp8 import per_block_cast_to_fp8_batched

    x = torch.stack([_weights((300, 200), torch.bfloat16, seed=k) for k in range(3)])
    x[1, :128, :128] = 0
    q, s = per_block_cast_to_fp8_batched(x, ue8m0)
    for k in range(3):
        rq, rs = deepgemm.per_block_cast_to_fp8(x[k], use_ue8m0=ue8m0)
        assert _same_bits(q[k], rq) and _same_bits(s[k], rs)


def test_batches_are_bounded_by_elements():
    from mcore2hf.quantize.scheme import chunks

    assert chunks(list(range(5)), 300 * 200, limit=2 * 300 * 200) == [[0, 1], [2, 3], [4]]
    assert chunks(list(range(2)), 10**9, limit=10) == [[0], [1]]  # a tensor over the limit goes alone
    assert chunks([], 100) == []


@pytest.mark.parametrize("op_name,shape,count,eligible", [
    ("Row", (300, 128), 2, True),  # row-parallel: column pieces, 300-row edge blocks
    ("Row", (200, 256), 3, True),
    ("Row", (300, 96), 2, False),  # 96-column shards: blocks would straddle shards
    ("GatedColumn", (512, 200), 2, True),  # [gate_i; up_i] of 128 rows each
    ("GatedColumn", (320, 200), 1, False),  # 160-row halves: a block straddles gate and up
    ("Column", (256, 72), 3, True),
    ("Replicated", (300, 200), 1, True),
], ids=lambda v: str(v))
def test_quantizing_shards_then_layout_equals_quantizing_hf_tensors(op_name, shape, count, eligible):
    """The plan's on-shard path in miniature: each shard quantized alone into its blob, FP8RowSlices' copies
    from the stacked blobs, versus the reference quantizer on the HF tensors the original op makes."""
    from mcore2hf.layouts import ops as layouts
    from mcore2hf.quantize.fp8 import FP8RowSlices, row_pieces

    op = getattr(layouts, op_name)()
    found = row_pieces(op, shape, count)
    assert (found is not None) == eligible, found
    if not eligible:
        return
    shards = [_weights(shape, torch.bfloat16, seed=i) for i in range(count)]
    fo = FP8RowSlices(*shape, *found)
    blobs = torch.zeros(count, FP8RowSlices.blob_nbytes(*shape), dtype=torch.uint8)
    for i, shard in enumerate(shards):
        q, s = per_block_cast_to_fp8(shard)
        blobs[i, :shape[0] * shape[1]] = q.view(torch.uint8).reshape(-1)
        blobs[i, fo.scale_offset:] = s.view(torch.uint8).reshape(-1)
    shapes = fo.hf_shapes(None)
    outs = [torch.empty(w, dtype=torch.uint8) if k % 2 == 0 else torch.empty(w[0], w[1] * 4, dtype=torch.uint8)
            for k, w in enumerate(shapes)]
    fo.to_hf(list(blobs), outs)
    for k, t in enumerate(op.hf_tensors(shards)):
        q, s = per_block_cast_to_fp8(t)
        assert torch.equal(outs[2 * k], q.view(torch.uint8)) and torch.equal(outs[2 * k + 1].view(torch.float32), s)
