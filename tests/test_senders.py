"""The senders' wire formats on their own: the flattened bucket (SGLang's layout, the distributed receiver's
rebuild) and our serializer (round trip, restricted unpickling). The senders against the engines themselves,
failures and retries included, run against each release's own code: tests/test_sglang_contract.py and
tests/test_vllm_contract.py."""

import pytest
import torch

from mcore2hf.buckets import Bucket
from mcore2hf.plan import pack_tight
from mcore2hf.senders.receiver import tight_views
from mcore2hf.senders.serialize import deserialize, flattened_payload, reconstruct, serialize


def make_bucket(tensors: dict[str, torch.Tensor]) -> Bucket:
    entries = pack_tight([(n, tuple(t.shape), t.dtype, n) for n, t in tensors.items()])
    flat = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
    for e in entries:
        flat[e.start:e.start + e.nbytes].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    return Bucket(0, flat, entries)


MIXED = {"a.bf16": torch.randn(3, 5).bfloat16(), "b.fp32": torch.randn(7), "c.bf16": torch.randn(4, 4).bfloat16(),
         "d.fp32": torch.randn(2, 3), "e.i64": torch.arange(5)}


def test_flattened_bucket_is_sglangs_layout_mixed_dtypes():
    b = make_bucket(MIXED)
    meta = b.metadata()
    assert [m.name for m in meta] == ["e.i64", "b.fp32", "d.fp32", "a.bf16", "c.bf16"]  # widest first, stable
    # what SGLang's FlattenedTensorBucket(named_tensors=...) builds: flatten().view(uint8), concatenated in order
    theirs = torch.cat([MIXED[m.name].flatten().view(torch.uint8) for m in meta])
    assert torch.equal(b.flat, theirs)
    start = 0
    for m in meta:
        assert (m.start_idx, m.end_idx, m.numel) == (start, start + m.numel, MIXED[m.name].numel() * MIXED[m.name].element_size())
        start = m.end_idx
    for name, t in b:  # views, no copies
        assert torch.equal(t, MIXED[name]) and t.data_ptr() >= b.flat.data_ptr()
    # the distributed receiver's rebuild from names / dtypes / shapes in request order
    views = tight_views(b.flat, [m.name for m in meta], [str(m.dtype)[6:] for m in meta], [list(m.shape) for m in meta])
    assert all(torch.equal(t, MIXED[n]) for n, t in views)


def test_serializer_round_trip_and_restricted_unpickling():
    b = make_bucket(MIXED)
    for as_text in (True, False):
        data = serialize(flattened_payload(b), output_str=as_text)
        assert isinstance(data, str if as_text else bytes)
        payload = deserialize(data)
        assert {n: t.clone() for n, t in reconstruct(payload)}.keys() == MIXED.keys()
        assert all(torch.equal(t, MIXED[n]) for n, t in reconstruct(payload))
    import pickle

    class Evil:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    class Loader:  # a callable of torch's that a prefix allowlist of "torch." would admit
        def __init__(self, fn):
            self.fn = fn

        def __reduce__(self):
            return (self.fn, ("/tmp/payload.pt",))

    for bad in (Evil(), __import__("collections").Counter(), Loader(torch.load), Loader(torch.hub.load),
                Loader(torch.save)):
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            deserialize(pickle.dumps({"x": bad}))
