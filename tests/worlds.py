"""Functions that run inside gloo worker processes (spawned by mcore2hf.runtime.world.run_world)."""

from __future__ import annotations

import contextlib
import os
import time

import regex
import torch
import torch.distributed as dist
from harness.te_spec import expected_te_names, megatron_fused_norm_names

from mcore2hf import HFExporter, build_model, load_hf_weights
from mcore2hf.arch.hf_config import load_hf_config
from mcore2hf.arch.registry import get_model_spec
from mcore2hf.layouts.stacked import Stacked
from mcore2hf.runtime.forward import megatron_logits
from mcore2hf.runtime.te_naming import te_names_of, to_te_names
from mcore2hf.runtime.tiny import read_hf_checkpoint
from mcore2hf.runtime.world import Layout


def build(ckpt: str, layout: Layout, dtype: torch.dtype = torch.float32, mtp: bool = True, model_class: str = "gpt",
          **config):
    """The model chunks at `layout`; `config`: TransformerConfig fields over the spec's (e.g. moe_layer_freq,
    sequence_parallel)."""
    cfg = load_hf_config(ckpt)
    overrides = dict(layout.config_overrides(), **config)
    if not mtp:
        overrides["mtp_num_layers"] = None
    if dtype != torch.float32:
        overrides.update(params_dtype=dtype, bf16=dtype == torch.bfloat16)
    with sequence_parallel_norms(bool(overrides.get("sequence_parallel"))):
        chunks = build_model(ckpt, use_te=False, model_class=model_class, **overrides)  # gloo CPU workers: the local spec, even where TE exists
    if dtype != torch.float32:
        chunks = [c.to(dtype) for c in chunks]  # what Megatron's Float16Module does in training
    return cfg, chunks


@contextlib.contextmanager
def sequence_parallel_norms(on: bool):
    """Sequence-parallel models on the local spec: megatron-core 0.16.1's torch norm refuses sequence parallelism
    (transformer/torch_norm.py:32), which Transformer Engine's norms, what such models are built with, do not;
    while `on`, it builds model_specs.common.SequenceParallelNorm, the same torch norm without the refusal (each
    rank normalizes its own rows; weights marked `sequence_parallel` as TE's are). The rest of the model (the
    embedding's scatter, the linears' sequence-parallel gathers and reduce-scatters, MoE) is megatron-core's."""
    from megatron.core.transformer import torch_norm

    from mcore2hf.model_specs.common import SequenceParallelNorm

    if not on:
        yield
        return
    cls = torch_norm.WrappedTorchNorm
    orig = cls.__new__
    cls.__new__ = lambda _, config, hidden_size, eps=1e-5, **kw: SequenceParallelNorm(config, hidden_size, eps)
    try:
        yield
    finally:
        cls.__new__ = orig


def vocab_padding(chunks, vocab_size: int) -> list[torch.Tensor]:
    """Views of this rank's rows of the vocab-parallel embedding and output layer past `vocab_size` (Megatron's
    padding: TP rank r holds rows r * rows ... (r + 1) * rows - 1 of the padded vocabulary)."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    out = []
    for c in chunks:
        for name, p in c.named_parameters():
            if name.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
                rows = p.shape[0]
                out.append(p.data[min(rows, max(0, vocab_size - tp_rank * rows)):])
    return out


def assert_same(got: dict, ref: dict, what: str) -> None:
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    assert not missing and not extra, f"{what}: missing {missing[:5]}, extra {extra[:5]}"
    diff = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k].cpu(), ref[k])]
    assert not diff, f"{what}: {len(diff)} tensors differ, e.g. {diff[:5]}"


def agree(error: str | None) -> None:
    """Raise on every rank if any rank failed a rank-local check (keeps the ranks' collectives in step)."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {r: e for r, e in enumerate(errors) if e}
    if failed:
        raise AssertionError("; ".join(f"rank {r}: {e}" for r, e in failed.items()))


def checked(fn) -> str | None:
    """Run a rank-local check; its failure as a string (for `agree`)."""
    try:
        fn()
    except AssertionError as e:
        return str(e) or "assertion failed"
    return None


def zero_(chunks) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()
            for n, b in c.named_buffers():
                if n.endswith("expert_bias"):
                    b.zero_()


#: the tokens of every logit-parity check (vocabularies of the tiny configs are >= 100)
TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def forward_oracle(ckpt: str, layout: Layout, chunks=None) -> torch.Tensor:
    """The Megatron forward at `layout` of the weights mcore2hf loaded (fp32; a model of another dtype is built
    again in fp32 from the same file), for comparison with transformers' forward of the HF source in the test
    process: the oracle that is not mcore2hf (a bug made alike in load and export still moves these logits)."""
    if chunks is None or next(chunks[0].parameters()).dtype != torch.float32:
        _, chunks = build(ckpt, layout)
        load_hf_weights(chunks, ckpt)
    from mcore2hf.arch.hf_config import text_config

    return megatron_logits(chunks, TOKENS, text_config(load_hf_config(ckpt)).vocab_size)


def te_renamed(chunks, tree: dict) -> str | None:
    """to_te_names(chunks), checked against megatron-core's own TE spec `tree` (harness.te_spec): each
    chunk has exactly the parameter names a TE-spec model has, and every fused `layer_norm_weight` holds the norm
    megatron-core pairs it with. This rank's problems (for `agree`), or None."""
    before = [{id(p): n for n, p in c.named_parameters()} for c in chunks]
    expected = [sorted(expected_te_names(c, tree)) for c in chunks]
    to_te_names(chunks)
    problems = []
    for i, c in enumerate(chunks):
        got = sorted(n for n, _ in c.named_parameters())
        if got != expected[i]:
            problems.append(f"chunk {i}: te_naming differs from megatron-core's TE spec: missing "
                            f"{sorted(set(expected[i]) - set(got))[:6]}, unexpected {sorted(set(got) - set(expected[i]))[:6]}"
                            f"{', duplicates' if len(set(got)) != len(got) else ''}")
        fused = {n: p for n, p in c.named_parameters() if ".layer_norm_" in n}
        megatron = megatron_fused_norm_names(list(fused))
        for n, p in fused.items():
            # gated DeltaNet's in_proj holds the layer's input norm (megatron-core 0.16.1
            # experimental_attention_variant_module_specs.py: input_layernorm IdentityOp, fuse_input_layernorm)
            gdn = n.replace(".self_attention.in_proj.layer_norm_", ".input_layernorm.") if ".in_proj." in n else None
            if before[i][id(p)] != megatron.get(n, gdn):
                problems.append(f"chunk {i}: {n} holds {before[i][id(p)]}, megatron-core pairs it with "
                                f"{megatron.get(n, gdn)}")
    return "; ".join(problems) or None


def layout_matrix(ckpt: str, layout: Layout, dtype_name: str, out_root: str, te_specs: dict[str, dict],
                  sequence_parallel: bool = False) -> dict:
    """Load the same HF weights at `layout` (a sequence-parallel model with `sequence_parallel`), export every
    way, and require bit-identical HF tensors; the rows Megatron pads the vocabulary with are zeros after the load
    (whatever they held); the Megatron forward at `layout` for the transformers oracle (`logits`); then the model
    under Transformer Engine's names (checked against megatron-core's TE spec `te_specs[model_type]`)."""
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    cfg, chunks = build(ckpt, layout, dtype, sequence_parallel=sequence_parallel)
    vocab = load_hf_config(ckpt).vocab_size
    for pad in vocab_padding(chunks, vocab):
        pad.fill_(1.0)
    load_hf_weights(chunks, ckpt)
    pads = vocab_padding(chunks, vocab)
    agree(None if all(bool((t == 0).all()) for t in pads) else
          f"{layout}: vocab padding rows are not zero after load_hf_weights ({[t.shape[0] for t in pads]} rows)")
    logits = forward_oracle(ckpt, layout, chunks)
    ref = read_hf_checkpoint(ckpt)
    ex = HFExporter(chunks, cfg)

    assert_same(ex.state_dict(), ref, f"{layout} all ranks")
    small = {n: t.clone() for b in ex.buckets(bucket_bytes=4096) for n, t in b}
    assert_same(small, ref, f"{layout} 4 KiB buckets")
    # two arenas: the next bucket's first collectives run while this one converts (and gpt-oss's rounds)
    overlapped = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, overlap=True) for n, t in b}
    assert_same(overlapped, ref, f"{layout} 4 KiB buckets, overlap")
    t0 = time.perf_counter()
    engine = engine_matrix(ex, ref, layout, cfg.model_type)
    engine_s = time.perf_counter() - t0  # what the engine-sharded checks add to the matrix (CI budget)
    plan = ex.plan(4096)
    for b in plan.buckets:  # byte bound: only a single oversized tensor (not with its MTP copies) may exceed it,
        # or the pieces of one stacked tensor (gpt-oss's experts.gate_up_proj), which fill one output together
        assert b.nbytes <= 4096 or (len(b.sources) == 1 and not b.sources[0].resolved.copies) or \
            len(b.entries) == 1 and isinstance(b.sources[0].resolved.op, Stacked), \
            (b.index, b.nbytes, [e.name for e in b.entries])

    got0 = ex.state_dict(receivers=0)
    agree(checked(lambda: assert_same(got0, ref, f"{layout} receivers=[0]") if rank == 0 else None)
          or (None if rank == 0 or not got0 else "a non-receiver got tensors"))
    # chosen receivers at 4 KiB buckets: P2P programs, and gpt-oss's stacked experts gathered in rounds
    got4k = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, receivers=0) for n, t in b}
    agree(checked(lambda: assert_same(got4k, ref, f"{layout} receivers=[0] 4 KiB") if rank == 0 else None)
          or (None if rank == 0 or not got4k else "a non-receiver got tensors"))
    last = dist.get_world_size() - 1
    got = ex.state_dict(receivers=[0, last])
    agree(checked(lambda: assert_same(got, ref, f"{layout} receivers=[0, {last}]") if rank in (0, last) else None)
          or (None if rank in (0, last) or not got else "a non-receiver got tensors"))

    out = os.path.join(out_root, cfg.model_type, str(layout))
    ex.save_pretrained(out, max_shard_size=20_000)

    def saved_ok():
        assert_same(read_hf_checkpoint(out), ref, f"{layout} save_pretrained")
        assert os.path.isfile(os.path.join(out, "config.json"))
        assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1  # sharded

    agree(checked(saved_ok) if rank == 0 else None)

    # the same model under Transformer Engine's names and attributes, reloaded from scratch
    agree(te_renamed(chunks, te_specs[cfg.model_type]))
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, te_names_of(chunks))
    names = sorted({n for rank_names in names for n in rank_names})
    zero_(chunks)
    load_hf_weights(chunks, ckpt)
    assert_same(HFExporter(chunks, cfg).state_dict(), ref, f"{layout} TE names")
    return {"tensors": len(ref), "buckets_4k": len(plan.buckets), "rank": rank, "engine": engine, "engine_s": engine_s,
            # the live plan at 4 KiB buckets, for the one-process dry run to equal (test_layout_matrix)
            "plan_4k": (plan.describe(), plan.records) if rank == 0 else None,
            "memory_4k": ex.executor(4096).memory_estimate(),
            "rounds_4k": sum(len(b.rounds or ()) for b in plan.buckets),  # stacked tensors gathered in rounds
            "te_names": names if rank == 0 else None, "logits": logits, "padding_rows": sum(t.shape[0] for t in pads)}


def dry_run_plans(ckpts: dict[str, str], layout: Layout, dtype_name: str, bucket_bytes: int) -> dict[str, tuple]:
    """The one-process dry run (mcore2hf.dry_run) of each checkpoint's model at `layout`: (describe(), records,
    every rank's memory estimate). Run in a fresh process: it sets up a fake torch.distributed world."""
    from mcore2hf.dry_run import dry_run

    out = {}
    for mt, ckpt in ckpts.items():
        plan, memory = dry_run(ckpt, layout, bucket_bytes=bucket_bytes, dtype=dtype_name)
        out[mt] = (plan.describe(), plan.records, memory)
    return out


def memory_by_rank_class(model_type: str, layout: Layout, bucket_bytes: int) -> dict:
    """The dry run's memory per rank (programs shared per rank class, transfer.builders.memory_estimates) and each rank's
    Executor.memory_estimate() from its own programs, one and two arenas, for a tiny model at `layout`."""
    import torch

    from mcore2hf.dry_run import dry_run, rank_contexts
    from mcore2hf.runtime.tiny import tiny_config
    from mcore2hf.transfer.builders import memory_estimates
    from mcore2hf.transfer.export import Executor

    plan, shared = dry_run(tiny_config(model_type), layout, bucket_bytes=bucket_bytes, dtype="float32")
    contexts = rank_contexts(layout)
    out = {"buckets": len(plan.buckets), "classes": shared}
    for arenas in (1, 2):
        out[arenas] = (memory_estimates(plan, contexts, arenas),
                       [Executor(plan, ctx, {}, None, torch.device("cpu"), arenas).memory_estimate()
                        for ctx in contexts])
    return out


def in_fresh_process(fn, *args):
    """fn(*args) in a fresh process (for what must not touch this one's torch.distributed or shims): forked from
    the workers' forkserver, which imported the modules and nothing else."""
    import concurrent.futures

    from mcore2hf.runtime.world import worker_context

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=worker_context()) as pool:
        return pool.submit(fn, *args).result()


def cli_run(*args, env: dict | None = None, cwd=None, workers: bool = True, check: bool = False, preexec=None):
    """`mcore2hf *args` as the command line runs it (cli_main: mcore2hf.cli.main's stdout, stderr and exit code) in
    a fresh process (in_fresh_process: no import to pay, no state of this one), with this process' environment or
    `env`, in `cwd`, after `preexec()` (a module-level function: a umask, a resource limit of that process).
    `workers=False`: starting a worker world fails the command; `check`: a failure raises. A subprocess of the
    installed script is for what needs a process of its own: its exit status, signals."""
    import subprocess

    args = [str(a) for a in args]
    code, out, err = in_fresh_process(cli_main, args, dict(os.environ) if env is None else env,
                                      None if cwd is None else str(cwd), workers, preexec)
    assert not check or code == 0, f"mcore2hf {' '.join(args)}: exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    return subprocess.CompletedProcess(["mcore2hf", *args], code, out, err)


def cli_main(args: list[str], env: dict | None = None, cwd: str | None = None, workers: bool = True,
             preexec=None) -> tuple[int, str, str]:
    """mcore2hf.cli.main(args) in this process: (exit code, stdout, stderr), an exception as the interpreter
    reports it (exit 1, its traceback on stderr). `workers=False`: World() raises."""
    import io

    from mcore2hf.cli import main

    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if preexec is not None:
        preexec()
    if not workers:
        from mcore2hf.runtime import world

        def refuse(*_, **__):
            raise AssertionError("a worker world was started")

        world.World.__init__ = refuse
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 - what the interpreter does with it (--debug raises)
            import traceback

            traceback.print_exc()
            code = 1
    return code, out.getvalue(), err.getvalue()


def for_each_arch(fn, ckpts: dict[str, str], *args) -> dict[str, object]:
    """fn(ckpt, *args) per architecture in one world. Every architecture runs even after one failed (a failing
    check raises on every rank alike, so the collectives stay in step); then, if any architecture failed on any
    rank, every rank raises with all the failures, rank by rank."""
    import traceback

    out, failed = {}, {}
    for mt, ckpt in ckpts.items():
        try:
            out[mt] = fn(ckpt, *args)
        except Exception:  # noqa: BLE001 - collected, then raised on every rank below
            failed[mt] = traceback.format_exc()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failed)
    report = [f"--- {mt} on rank {r}:\n{tb}" for r, f in enumerate(everyone) for mt, tb in f.items()]
    if report:
        raise AssertionError("\n".join(report))
    return out


def parity(ckpt: str, layout: Layout, out_root: str, tokens: torch.Tensor, te_names: bool = False):
    """Load HF weights at `layout`, save them back with HFExporter, and return the Megatron logits.

    Without MTP layers: Megatron's MTP forward needs labels, transformers ignores MTP, and loading a checkpoint
    that has MTP tensors into a model without MTP must work (RL runs often train without it)."""
    cfg, chunks = build(ckpt, layout, mtp=False)
    out_dir = os.path.join(out_root, os.path.basename(ckpt))  # family members share a model_type
    load_hf_weights(chunks, ckpt)
    logits = megatron_logits(chunks, tokens, cfg.vocab_size)
    if te_names:
        to_te_names(chunks)
    HFExporter(chunks, cfg).save_pretrained(out_dir)
    return logits


def error_suite(ckpt: str, layout: Layout, tmp: str) -> list[str]:
    """Every user error gets a clear exception naming what was expected and found; nothing partial is written."""
    import pytest

    from mcore2hf.errors import (
        ConfigMismatchError,
        LayoutError,
        Mcore2HFError,
        MissingWeightsError,
        ShapeMismatchError,
        UnknownParametersError,
    )
    from mcore2hf.formats import safetensors as st
    from mcore2hf.runtime.tiny import tiny_config

    rank = dist.get_rank()
    seen = []

    def fresh():
        cfg, chunks = build(ckpt, layout)
        load_hf_weights(chunks, ckpt)
        return cfg, chunks

    # unknown Megatron parameters: all listed in one error
    cfg, chunks = fresh()
    layers = chunks[0].decoder.layers
    layers[0].mlp.register_parameter("mystery", torch.nn.Parameter(torch.zeros(3)))
    layers[1].self_attention.register_parameter("extra_scale", torch.nn.Parameter(torch.zeros(3)))
    with pytest.raises(UnknownParametersError) as e:
        HFExporter(chunks, cfg).plan()
    msg = str(e.value)
    assert "decoder.layers.0.mlp.mystery" in msg and "decoder.layers.1.self_attention.extra_scale" in msg, msg
    seen.append(msg)

    # HF config disagreeing with the model: every difference listed
    cfg, chunks = fresh()
    bad = tiny_config("qwen3_moe", num_experts=16, num_attention_heads=8)
    with pytest.raises(ConfigMismatchError) as e:
        HFExporter(chunks, bad).plan()
    msg = str(e.value)
    assert "num_moe_experts: HF config implies 16, the Megatron model has 8" in msg, msg
    assert "num_attention_heads: HF config implies 8, the Megatron model has 4" in msg, msg
    seen.append(msg)
    with pytest.raises(ConfigMismatchError, match="num_layers: HF config implies 6"):
        HFExporter(chunks, tiny_config("qwen3_moe", num_hidden_layers=6)).plan()
    with pytest.raises(ShapeMismatchError, match=r"embedding.word_embeddings.weight.*expected >= 300, got 256"):
        HFExporter(chunks, tiny_config("qwen3_moe", vocab_size=300)).plan()
    with pytest.raises(ConfigMismatchError, match="ties word embeddings"):
        HFExporter(chunks, tiny_config("qwen3_moe", tie_word_embeddings=True)).plan()
    with pytest.raises(ConfigMismatchError, match="layer 0: HF config says dense"):
        HFExporter(chunks, tiny_config("qwen3_moe", mlp_only_layers=[0])).plan()

    # bucket budget
    ex = HFExporter(chunks, cfg)
    for budget in (0, -5):
        with pytest.raises(ValueError, match=f"bucket_bytes must be a positive int, got {budget}"):
            next(iter(ex.buckets(bucket_bytes=budget)))
    with pytest.raises(ValueError, match="receivers"):
        next(iter(ex.buckets(receivers=[99])))

    # sharding attributes the converter does not expect
    cfg, chunks = fresh()
    chunks[0].decoder.layers[0].self_attention.linear_proj.weight.partition_stride = 3
    with pytest.raises(LayoutError, match=r"linear_proj.weight.*partition_stride=3 is not supported by Row"):
        HFExporter(chunks, cfg).plan()
    cfg, chunks = fresh()
    chunks[0].decoder.layers[1].self_attention.linear_qkv.weight.partition_dim = 1
    with pytest.raises(LayoutError, match=r"linear_qkv.weight.*partition_dim=1, but its mapping \(QKV\) shards along dim 0"):
        HFExporter(chunks, cfg).plan()
    cfg, chunks = fresh()
    chunks[0].decoder.layers[0].mlp.router.weight.tensor_model_parallel = True
    chunks[0].decoder.layers[0].mlp.router.weight.partition_dim = 0
    with pytest.raises(LayoutError, match=r"router.weight.*expects a tensor replicated"):
        HFExporter(chunks, cfg).plan()

    # save_pretrained: refuses a non-empty directory, and leaves nothing behind when it fails midway
    cfg, chunks = fresh()
    ex = HFExporter(chunks, cfg)
    busy = os.path.join(tmp, "busy")
    if rank == 0:
        os.makedirs(busy, exist_ok=True)
        open(os.path.join(busy, "keep.txt"), "w").close()
    dist.barrier()
    with pytest.raises(Mcore2HFError, match="exists and is not empty"):
        ex.save_pretrained(busy)
    assert os.listdir(busy) == ["keep.txt"]

    calls = {"n": 0}
    real_send = st.SafetensorsWriter.send

    def failing_send(self, bucket):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("No space left on device (simulated)")
        real_send(self, bucket)

    st.SafetensorsWriter.send = failing_send
    target = os.path.join(tmp, "partial")
    try:
        with pytest.raises(Mcore2HFError, match="No space left on device"):
            ex.save_pretrained(target, bucket_bytes=4096)  # every rank raises, not only the writer
    finally:
        st.SafetensorsWriter.send = real_send
    dist.barrier()
    assert not os.path.exists(target)
    assert not [f for f in os.listdir(tmp) if f.startswith(".partial")], os.listdir(tmp)

    # loading: missing tensors listed at once, wrong shapes named, unused HF tensors refused (strict)
    from mcore2hf.runtime.tiny import read_hf_checkpoint

    sd = read_hf_checkpoint(ckpt)
    cfg, chunks = fresh()
    partial = {k: v for k, v in sd.items() if k not in ("model.layers.1.self_attn.q_proj.weight", "model.norm.weight")}
    with pytest.raises(MissingWeightsError) as e:
        load_hf_weights(chunks, partial, cfg)
    assert "model.layers.1.self_attn.q_proj.weight" in str(e.value) and "model.norm.weight" in str(e.value)
    wrong = dict(sd)
    wrong["model.layers.2.mlp.experts.3.up_proj.weight"] = torch.zeros(7, 64)
    with pytest.raises(ShapeMismatchError, match=r"experts.3.linear_fc1.weight.*expected HF shapes \[\[32, 64\], \[32, 64\]\], found \[\[32, 64\], \[7, 64\]\]"):
        load_hf_weights(chunks, wrong, cfg)
    extra = dict(sd)
    extra["model.layers.9.mlp.gate.weight"] = torch.zeros(8, 64)
    with pytest.raises(Mcore2HFError, match="model.layers.9.mlp.gate.weight"):
        load_hf_weights(chunks, extra, cfg)
    load_hf_weights(chunks, extra, cfg, strict=False)
    return seen


def plan_suite(ckpt: str, layout: Layout) -> dict:
    """Plan once, run many; the dry run lists everything; perform_initialization=False; bucket balance."""
    cfg = load_hf_config(ckpt)
    ref = read_hf_checkpoint(ckpt)
    # megatron-core 0.16 sets TP attributes only when it initializes weights: the layout ops must not depend on
    # them (strip them, so this holds whatever the release does)
    chunks = build_model(cfg, use_te=False, perform_initialization=False)
    for c in chunks:
        for p in c.parameters():
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(p, attr):
                    delattr(p, attr)
    load_hf_weights(chunks, ckpt)
    logits = forward_oracle(ckpt, layout, chunks)
    ex = HFExporter(chunks, cfg)
    assert_same(ex.state_dict(), ref, f"{layout} perform_initialization=False")

    plan = ex.plan(8192)
    text = plan.describe()
    assert all(name in text for name in ref), "dry run must list every HF tensor"
    assert ex.plan(8192) is plan and ex.executor(8192) is ex.executor(8192)

    calls = {"n": 0}
    real = dist.all_gather_object

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    dist.all_gather_object = counting
    try:
        for _ in range(2):
            assert sum(len(b) for b in ex.buckets(bucket_bytes=8192)) == len(ref)
    finally:
        dist.all_gather_object = real
    assert calls["n"] == 0, "later exports must not rebuild the plan"

    # a consumer that drops each bucket keeps one output buffer alive; grad mode is the caller's between buckets
    import weakref

    prev, n = [None], 0

    def built(k: int) -> None:  # called once bucket k is converted, before it is yielded
        # gloo's worker thread drops its reference to a finished all-gather's output (in C++, no Python referrer)
        # a few ms after wait() returns (seen: 40 ms under load); a reference we kept would never go
        deadline = time.monotonic() + 5
        while prev[0] is not None and prev[0]() is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert prev[0] is None or prev[0]() is None, f"bucket {k - 1}'s buffer is alive while bucket {k} is built"

    for bucket in ex.executor(8192).run(on_bucket=built):
        assert torch.is_grad_enabled()
        prev[0], n = weakref.ref(bucket.flat), n + 1
        del bucket
    assert n > 3

    # the output pool's lifetime rule (issue 24): a bucket that is kept stays valid and unchanged while later
    # buckets and whole later exports run (each kept bucket has a buffer of its own); dropped buckets' buffers are
    # reused, at most two kept between exports (three where a collective lands in the output)
    executor = ex.executor(8192)
    kept = [(b, {name: t.clone() for name, t in b}) for b in executor.run()]
    assert len({b.flat.data_ptr() for b, _ in kept}) == len(kept), "a held bucket's buffer was handed out again"
    for _ in range(2):
        for b in executor.run():  # a plain for loop: holds the previous bucket while the next is built
            assert b.flat is not None
    for b, want in kept:
        got = dict(b)
        assert all(torch.equal(got[name], t) for name, t in want.items()), f"held bucket {b.index} was overwritten"
    del kept, got
    pool = executor.core.pool
    assert pool is not None and len(pool.buffers) == pool.limit in (2, 3), pool and len(pool.buffers)
    ptrs = set()
    for b in executor.run():  # a bucket whose collective lands in its output starts while two are alive
        ptrs.add(b.flat.data_ptr())
        del b
    pooled = {x.data_ptr() for x in pool.buffers}
    assert ptrs & pooled and len(pool.buffers) == pool.limit, (len(ptrs), len(ptrs & pooled), len(pool.buffers))
    # training swapped every parameter's storage (the old one zeroed): the pooled buffers' prepared copies and the
    # FP8 weights quantized straight from the parameters follow (recompiled), bf16 and FP8 alike
    fp8_before = {n: t.clone() for b in ex.buckets(bucket_bytes=8192, quantize="fp8") for n, t in b}
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                old = p.data
                p.data = old.clone()
                old.zero_()
    assert_same({n: t.clone() for b in executor.run() for n, t in b}, ref, f"{layout} after a storage swap")
    fp8_after = {n: t.clone() for b in ex.buckets(bucket_bytes=8192, quantize="fp8") for n, t in b}
    assert fp8_before.keys() == fp8_after.keys() and all(
        torch.equal(fp8_before[n].view(torch.uint8), fp8_after[n].view(torch.uint8)) for n in fp8_before)

    # two exports iterated in step: with other settings they interleave (each has its own arena), with the same
    # settings the second is refused before anything moves (they would share one staging arena and buffers)
    import itertools

    from mcore2hf.errors import UsageError

    got: list[dict] = [{}, {}]
    for step in itertools.zip_longest(ex.buckets(bucket_bytes=8192), ex.buckets(bucket_bytes=4096)):
        for into, b in zip(got, step):
            if b is not None:
                into.update({n: t.clone() for n, t in b})
    for into in got:
        assert_same(into, ref, f"{layout} two exports zipped")
    first = ex.buckets(bucket_bytes=8192)
    next(first)
    try:
        next(ex.buckets(bucket_bytes=8192))
        raise AssertionError("a second export with the same settings ran beside the first")
    except UsageError as e:
        assert "still being iterated" in str(e), e
    for b in first:
        del b
    assert_same({n: t.clone() for b in ex.buckets(bucket_bytes=8192) for n, t in b}, ref, f"{layout} after a refusal")

    # interleaving stages and EP ranks keeps the padded PP collective close to the real bytes
    plan = ex.plan(256 * 1024)  # ~20 tensors per bucket (an expert's fc1 is 16 KiB here)
    pp = layout.pp
    padded = sum(pp * max(sum(s.stacked_nbytes for s in b.sources if s.stage == st) for st in range(pp))
                 for b in plan.buckets)
    real_bytes = sum(s.stacked_nbytes for b in plan.buckets for s in b.sources)
    return {"pp_padding": padded / real_bytes, "buckets": len(plan.buckets), "logits": logits}


@contextlib.contextmanager
def optimizer_on_cpu():
    """megatron-core 0.16.1's mixed-precision optimizers on a CPU-only machine: they make three scalars with
    device='cuda' (optimizer/optimizer.py:473-485) and accept only parameters whose `type()` is a CUDA one
    (distrib_optimizer.py:361-435). Meanwhile tensors asked for on 'cuda' are made on the CPU and `type()` names
    the CUDA type of the same dtype; the optimizer's own code runs unchanged."""
    tensor, type_of = torch.tensor, torch.Tensor.type

    def on_cpu(*args, device=None, **kw):
        return tensor(*args, device="cpu" if device == "cuda" else device, **kw)

    def cuda_type(self, *args, **kw):
        out = type_of(self, *args, **kw)
        return out.replace("torch.", "torch.cuda.", 1) if not args and not kw and self.device.type == "cpu" else out

    torch.tensor, torch.Tensor.type = on_cpu, cuda_type
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.type = tensor, type_of


def as_trained(chunks: list) -> tuple[list, object]:
    """The model as Megatron-LM trains it with --bf16 --use-distributed-optimizer: each chunk in megatron-core's
    Float16Module (its parameters cast to bf16) inside its DistributedDataParallel (gradient buffers, parameters
    sharded over data-parallel ranks for the optimizer), and megatron-core's DistributedOptimizer (fp32 main
    parameters, Adam) built by get_megatron_optimizer; its Adam state from one zero-gradient step (no weight
    decay: the weights do not move). Returns (the wrapped chunks, the optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    wrapped = []
    for i, c in enumerate(chunks):
        c.config.bf16 = True
        wrapped.append(DistributedDataParallel(c.config, ddp_config, Float16Module(c.config, c),
                                               disable_bucketing=i > 0))
    with optimizer_on_cpu():
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=True,
                                                     use_distributed_optimizer=True), wrapped)
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.optimizer.step()
    return wrapped, opt


def save_dist_checkpoint(ckpt: str, layout: Layout, root: str, iteration: int = 7, singleton: bool = False,
                         model_class: str = "gpt", built: tuple | None = None, trained: bool = False,
                         **build_kw) -> str:
    """Megatron training output at `layout`: a torch_dist checkpoint with model and Adam state under
    root/<arch>/ckpt (latest_checkpointed_iteration.txt + iter_NNNNNNN), and the live export under root/<arch>/live.
    `built`: (cfg, chunks) of a model already built and loaded (e.g. Megatron-Bridge's), saved as it is; else the
    model is built (`build_kw`: e.g. vision_tower="native") and loaded from the HF checkpoint. `trained`: the model
    wrapped as Megatron-LM trains it (`as_trained`: bf16, DDP, the distributed optimizer), exported live through
    its wrappers and saved as Megatron-LM saves it (the unwrapped chunks' sharded_state_dict, the optimizer's
    `dp_reshardable` state, Megatron-LM's default); else Megatron's FP32Optimizer with Adam.
    Returns {"base": root/<arch>, "logits": the Megatron forward of the saved model (the oracle; None for hybrid
    and for a model passed in)}."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CPUFP32Optimizer(FP32Optimizer):
        """Megatron's FP32Optimizer (and its sharded_state_dict) with its loss scale on the CPU."""

        def __init__(self, optimizer, config, init_state_fn):
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0])
            self.is_stub_optimizer = optimizer is None

    if built is None:
        cfg, chunks = build(ckpt, layout, model_class=model_class, **build_kw)
        load_hf_weights(chunks, ckpt)
    else:
        cfg, chunks = built
    logits = forward_oracle(ckpt, layout, chunks) if model_class == "gpt" and built is None else None
    base = os.path.join(root, cfg.model_type)
    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True), "singleton_local_shards": singleton}
    if trained:
        wrapped, opt = as_trained(chunks)
        md["distrib_optim_sharding_type"] = "dp_reshardable"
        # megatron-core's router turns the expert bias Float16Module cast to bf16 back to fp32 when it saves (and
        # at every forward and load: moe/router.py `_maintain_float32_expert_bias`): exported after the save's
        # state dict, as after a training step
        sd = model_state(chunks, lambda c: c.sharded_state_dict(metadata=md))
        HFExporter(wrapped, cfg).save_pretrained(os.path.join(base, "live"))
    else:
        HFExporter(chunks, cfg).save_pretrained(os.path.join(base, "live"))
        params = [p for c in chunks for p in c.parameters()]
        opt = CPUFP32Optimizer(torch.optim.Adam(params, lr=1e-3), OptimizerConfig(optimizer="adam", lr=1e-3), None)
        for p in params:  # Adam state from a zero-gradient step: the weights do not move
            p.grad = torch.zeros_like(p)
        opt.optimizer.step()
        sd = model_state(chunks, lambda c: c.sharded_state_dict(metadata=md))
    if trained:  # nested: VPP chunks share local key names
        with optimizer_on_cpu():
            sd["optimizer"] = opt.sharded_state_dict(dict(sd), metadata=md)
    else:
        sd["optimizer"] = opt.sharded_state_dict(dict(sd))
    save_megatron(sd, os.path.join(base, "ckpt"), iteration)
    return {"base": base, "logits": logits}


def model_state(chunks: list, per_chunk) -> dict:
    """The model entries of a Megatron checkpoint: "model", or "model{i}" per virtual-PP chunk."""
    if len(chunks) == 1:
        return {"model": per_chunk(chunks[0])}
    return {f"model{i}": per_chunk(c) for i, c in enumerate(chunks)}


def save_megatron(sd: dict, ckpt_dir: str, iteration: int = 1) -> None:
    """megatron-core's dist_checkpointing save of `sd` (every rank) in Megatron-LM's directory layout:
    ckpt_dir/iter_NNNNNNN and latest_checkpointed_iteration.txt."""
    from megatron.core import dist_checkpointing

    it_dir = os.path.join(ckpt_dir, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(it_dir, exist_ok=True)
        with open(os.path.join(ckpt_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    dist_checkpointing.save(sd, it_dir)


def sender_suite(ckpt: str, layout: Layout, kind: str, urls: list[str], engine_tp: int, port: int,
                 bucket_bytes: int = 64 * 1024, timeout: float = 30.0, rounds: int = 2, group_backend: str = "gloo",
                 dtype: torch.dtype = torch.float32):
    """Sync a real model `rounds` times through an SGLang sender to the engines at `urls` (bench/gpu_senders.py, on
    GPUs); the number of buckets of each sync."""
    from mcore2hf.senders import SGLangColocatedSender, SGLangDistributedSender, SGLangHTTPEngine, sync

    cfg, chunks = build(ckpt, layout, dtype)
    load_hf_weights(chunks, ckpt)
    ex = HFExporter(chunks, cfg)
    rank = dist.get_rank()
    if kind == "sglang-colocated":
        engine = SGLangHTTPEngine(urls[rank // engine_tp], timeout=timeout) if rank % engine_tp == 0 else None
        sender = SGLangColocatedSender(engine, engine_tp, timeout=timeout)
    elif kind == "sglang-distributed":
        engines = [SGLangHTTPEngine(u, timeout=timeout) for u in urls] if rank == 0 else None
        sender = SGLangDistributedSender(engines, [1] * len(urls), "127.0.0.1", port, backend=group_backend,
                                         timeout=timeout)
    else:  # vLLM senders speak vLLM's native API: tested against vLLM's code in tests/test_vllm_contract.py
        raise ValueError(f"unknown sender kind {kind!r}")
    reports = [sync(ex, sender, bucket_bytes=bucket_bytes, progress=False) for _ in range(rounds)]
    assert sender.version == rounds, sender.version
    return [r.buckets for r in reports]


def outputs_suite(ckpt: str, layout: Layout, src_dir: str, tmp: str) -> dict:
    """save_pretrained writes the user's config.json and companion files; name filters act on the plan."""
    import json

    import pytest

    from mcore2hf.arch.naming import NameFilter

    _, chunks = build(ckpt, layout)
    load_hf_weights(chunks, ckpt)
    logits = forward_oracle(ckpt, layout, chunks)
    ex = HFExporter(chunks, src_dir)  # a transformers-4.x-style config.json with tokenizer files beside it
    out = os.path.join(tmp, "out")
    ex.save_pretrained(out, progress=False)
    ref = read_hf_checkpoint(ckpt)
    if dist.get_rank() == 0:
        assert_same(read_hf_checkpoint(out), ref, "save_pretrained from a 4.x config")

    no_layer3 = NameFilter(exclude=(r"^model\.layers\.3\.",))
    full, part = ex.plan(), ex.plan(name_filter=no_layer3)
    got = ex.state_dict(name_filter=no_layer3)
    assert_same(got, {k: v for k, v in ref.items() if not k.startswith("model.layers.3.")}, "filtered export")
    only_experts = NameFilter(include=(r"\.experts\.",))
    assert all(".experts." in n for n in ex.state_dict(name_filter=only_experts))
    with pytest.raises(ValueError, match="keeps only some"):
        ex.plan(name_filter=NameFilter(exclude=(r"k_proj",)))
    filtered_dir = os.path.join(tmp, "filtered")
    ex.save_pretrained(filtered_dir, name_filter=no_layer3, progress=False)
    if dist.get_rank() == 0:
        assert set(read_hf_checkpoint(filtered_dir)) == set(got)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    return dict(config=written, files=sorted(os.listdir(out)), full_bytes=full.total_bytes, logits=logits,
                filtered_bytes=part.total_bytes)


def reference_fp8(ref: dict, policy, ue8m0: bool) -> dict:
    """What an FP8 export must be: DeepGEMM's quantizer (not ours) applied to each full HF tensor the policy
    quantizes."""
    from oracle import fp8_reference

    from mcore2hf.quantize.fp8 import scale_name

    out = {}
    for name, t in ref.items():
        if policy.quantized(name, t.shape):
            out[name], out[scale_name(name)] = fp8_reference(t, ue8m0)
        else:
            out[name] = t
    return out


def fp8_matrix(ckpt: str, layout: Layout, dtype_name: str, out_root: str, save: bool = True) -> dict:
    """FP8 export at `layout` is bit-identical to the reference quantizer applied to the full HF tensors, in
    every receiver mode, with small buckets, for both scale formats, and through save_pretrained."""
    import json

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    cfg, chunks = build(ckpt, layout, dtype)
    load_hf_weights(chunks, ckpt)
    ref = read_hf_checkpoint(ckpt)
    ex = HFExporter(chunks, cfg)
    policy = ex.fp8_policy()
    want = {q: reference_fp8(ref, policy, q == "fp8-ue8m0") for q in ("fp8", "fp8-ue8m0")}
    quantized = sorted(n for n, t in want["fp8"].items() if t.dtype == torch.float8_e4m3fn)
    assert quantized and not any(("embed_tokens" in n or "lm_head" in n or "shared_head.head" in n
                                  or "eh_proj" in n or n.endswith("mlp.gate.weight")) for n in quantized), quantized
    for q, expect in want.items():
        assert_same(ex.state_dict(quantize=q), expect, f"{layout} {q} all ranks")
    overlapped = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, overlap=True, quantize="fp8-ue8m0")
                  for n, t in b}
    assert_same(overlapped, want["fp8-ue8m0"], f"{layout} fp8-ue8m0 4 KiB buckets, overlap")
    small = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, receivers=0, quantize="fp8") for n, t in b}
    agree(checked(lambda: assert_same(small, want["fp8"], f"{layout} fp8 receivers=[0] 4 KiB buckets"))
          if rank == 0 else (None if not small else "a non-receiver got tensors"))
    plan = ex.plan(4096, quantize="fp8")
    for b in plan.buckets:  # SGLang's flattened bucket: back to back, each entry aligned for its dtype view
        assert all(e.start % e.dtype.itemsize == 0 for e in b.output)
        assert sum(e.nbytes for e in b.output) == b.out_nbytes
    text = plan.describe()
    assert "quantized (fp8" in text and all(n + "_scale_inv" in text for n in quantized)
    if save:
        out = os.path.join(out_root, cfg.model_type, str(layout))
        ex.save_pretrained(out, max_shard_size=200_000, quantize="fp8-ue8m0", progress=False)
        for i, bucket in enumerate(ex.buckets(bucket_bytes=256 * 1024, quantize="fp8")):  # for the SGLang check
            if i == 0 and rank == 0:
                torch.save(dict(flat=bucket.flat.clone(), meta=[(m.name, tuple(m.shape), str(m.dtype), m.start_idx,
                                                                 m.end_idx) for m in bucket.metadata()]),
                           os.path.join(out_root, cfg.model_type, "bucket0.pt"))

        def saved_ok():
            assert_same(read_hf_checkpoint(out), want["fp8-ue8m0"], f"{layout} save_pretrained fp8-ue8m0")
            with open(os.path.join(out, "config.json")) as f:
                written = json.load(f)
            qc = written["quantization_config"]
            assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["scale_fmt"] == "ue8m0", qc
            assert qc["weight_block_size"] == [128, 128] and qc["activation_scheme"] == "dynamic", qc
            assert written.get("torch_dtype", written.get("dtype")) == dtype_name, written
            if cfg.model_type == "qwen3_moe":  # as Qwen3-30B-A3B-FP8's config.json lists them
                assert {"lm_head", "model.layers.0.input_layernorm", "model.layers.0.mlp.gate",
                        "model.layers.0.post_attention_layernorm"} <= set(qc["modules_to_not_convert"]), qc
            if policy.list_not_converted:
                assert set(qc["modules_to_not_convert"]) == {n.removesuffix(".weight") for n, t in ref.items()
                                                             if n.endswith(".weight") and t.dtype != torch.uint8
                                                             and not policy.quantized(n, t.shape)}, qc
            else:
                assert "modules_to_not_convert" not in qc, qc

        agree(checked(saved_ok) if rank == 0 else None)
    bf16 = ex.plan(quantize=None)
    fp8 = ex.plan(quantize="fp8")

    def wire(quantize) -> int:  # bytes this rank receives through the collectives of an all-ranks export
        return sum((st.axis.size - 1) * st.slot for p in ex.executor(quantize=quantize).programs for st in p.stages)

    return {"quantized": len(quantized), "tensors": len(want["fp8"]), "bytes": bf16.total_bytes,
            "fp8_bytes": fp8.total_bytes, "on_shards": len(fp8.prequantized_names()), "wire": wire(None),
            "fp8_wire": wire("fp8")}


def fp8_parity(ckpt: str, layout: Layout, out_root: str, tokens: torch.Tensor, quantize: tuple[str, ...]):
    """Load HF weights at `layout`, save them as FP8 with HFExporter in each format of `quantize`
    (out_root/<format>/<arch>), and return the Megatron logits."""
    cfg, chunks = build(ckpt, layout, mtp=False)
    load_hf_weights(chunks, ckpt)
    logits = megatron_logits(chunks, tokens, cfg.vocab_size)
    ex = HFExporter(chunks, cfg)
    for q in quantize:
        ex.save_pretrained(os.path.join(out_root, q, cfg.model_type), quantize=q, progress=False)
    return logits


def single_grouped_suite(ckpt: str, layout: Layout) -> dict:
    """megatron-core 0.19's single grouped expert parameter (`mlp.experts.linear_fc1.weight` [experts, ...]):
    loaded from HF into it and exported back bit-identical, with the names a 0.19 TE model shows. The oracle: the
    local-spec model's values, proven by the Megatron forward (`logits`, compared with transformers'), are what
    the single grouped model must hold: item i of each grouped parameter is local expert i's (megatron-core 0.19.2
    extensions/transformer_engine.py `_split_grouped_checkpoint_tensor`), every other parameter is the same one."""
    import re

    cfg, chunks = build(ckpt, layout)
    load_hf_weights(chunks, ckpt)
    logits = forward_oracle(ckpt, layout, chunks)
    by_id = {id(p): p.detach().clone() for c in chunks for p in c.parameters()}
    by_name = [{n: p.detach().clone() for n, p in c.named_parameters()} for c in chunks]
    ref = read_hf_checkpoint(ckpt)
    to_te_names(chunks, single_grouped=True)
    names = te_names_of(chunks)
    assert any(n.endswith(".mlp.experts.linear_fc1.weight") for n in names), names[:10]
    assert not any(".mlp.experts.linear_fc1.weight0" in n for n in names)
    zero_(chunks)
    load_hf_weights(chunks, ckpt)
    for c, before in zip(chunks, by_name):
        for n, p in c.named_parameters():
            grouped = re.fullmatch(r"(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)", n)
            want = (torch.stack([before[f"{grouped[1]}.local_experts.{i}.{grouped[2]}.{grouped[3]}"]
                                 for i in range(p.shape[0])]) if grouped else by_id[id(p)])
            assert torch.equal(p.detach(), want), f"{layout} single grouped: {n} holds other values than the proven model"
    ex = HFExporter(chunks, cfg)
    assert_same(ex.state_dict(), ref, f"{layout} single grouped")
    assert_same({n: t.clone() for b in ex.buckets(bucket_bytes=4096) for n, t in b}, ref, f"{layout} 4 KiB")
    return {"tensors": len(ref), "logits": logits}


def load_imported(ckpt: str, layout: Layout, root: str, singleton: bool = False, resave: str | None = None,
                  model_class: str = "gpt", te_names: bool = False, built: tuple | None = None,
                  hf_names: set[str] | None = None, **config) -> int:
    """A model built at `layout` from zeros, loaded with Megatron's own `dist_checkpointing.load` from the
    checkpoint `mcore2hf import` wrote under root/<arch> (the sharded state dict Megatron-LM's load_checkpoint
    builds), then exported live: bit-identical to the HF source. With `resave`, Megatron then saves the model
    under resave/<arch> (to compare keys). `config`: TransformerConfig fields the model is built with over the
    spec's (`moe_layer_freq=1`: as Megatron-LM builds it by default). `te_names`: the model under Transformer
    Engine's names as Megatron-LM builds it by default (`to_te_names`, experts as `--moe-grouped-gemm` False keeps
    them) and without the local spec's `sharded_state_dict_keys_map`, so its sharded state dict has a TE model's
    tensor keys (not TE's own `_extra_state` objects, which a local model cannot hold); its forward is not run.
    `hf_names`: the HF tensors the model holds, where that is fewer than the checkpoint's (a model built without the
    config's MTP layers). Returns the number of tensors checked."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from mcore2hf.arch.registry import get_converter

    cfg, chunks = build(ckpt, layout, model_class=model_class, **config) if built is None else built
    zero_(chunks)
    if te_names:
        import dataclasses

        to_te_names(chunks, grouped=False)
        for c in chunks:  # the TE spec's layers have no keys map (gpt_layer_specs.py: only its op-fuser names)
            mtp = getattr(c, "mtp", None)
            layers = list(c.decoder.layers) + [m.transformer_layer for m in (mtp.layers if mtp is not None else [])]
            for layer in layers:
                layer.submodules_config = dataclasses.replace(layer.submodules_config, sharded_state_dict_keys_map={})
    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True), "singleton_local_shards": singleton}

    def sharded() -> dict:
        if len(chunks) == 1:
            return {"model": chunks[0].sharded_state_dict(metadata=md)}
        return {f"model{i}": c.sharded_state_dict(metadata=md) for i, c in enumerate(chunks)}

    sd = sharded()
    with open(os.path.join(root, cfg.model_type, "latest_checkpointed_iteration.txt")) as f:
        it = int(f.read())
    loaded = dist_checkpointing.load(sd, os.path.join(root, cfg.model_type, f"iter_{it:07d}"))
    for i, c in enumerate(chunks):
        c.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=True)
    conv = get_converter(cfg.model_type)  # Qwen3.5's vision tower is not imported (unless the model holds one)
    towered = built is not None or "vision_tower" in config
    ref = {n: t for n, t in read_hf_checkpoint(ckpt).items() if (towered or not conv.not_held_by_model(n))
           and (hf_names is None or n in hf_names)}
    assert_same(HFExporter(chunks, cfg).state_dict(), ref, f"{layout} imported")
    # what Megatron loaded is right: its forward is transformers' (not under TE names: that model does not run)
    logits = forward_oracle(ckpt, layout, chunks) if model_class == "gpt" and not te_names and built is None else None
    if resave is not None:
        out = os.path.join(resave, cfg.model_type)
        if dist.get_rank() == 0:
            os.makedirs(out, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(sharded(), out)
    return {"tensors": len(ref), "logits": logits}


def load_imports(ckpts: dict[str, str], layout: Layout, root: str, singleton: bool, resave: str,
                 built: dict[str, tuple[str, str, dict]] | None = None) -> dict:
    """load_imported for every architecture (models as build_model builds them), then for each entry of `built`
    ({name: (arch, root, TransformerConfig fields)}) the import under that root into a model built with those
    fields (Megatron re-saving it under resave-<name>/<arch>), in the same world."""
    import functools

    out = for_each_arch(load_imported, ckpts, layout, root, singleton, resave)
    for name, (mt, other_root, config) in (built or {}).items():
        out.update(for_each_arch(functools.partial(load_imported, **config), {name: ckpts[mt]}, layout, other_root,
                                 singleton, f"{resave}-{name}"))
    return out


def qwen3_5_suite(ckpt: str, layout: Layout, out_root: str, tokens: torch.Tensor | None,
                  te_specs: dict[str, dict]) -> dict:
    """Qwen3.5 (text model) from its multimodal checkpoint: loading skips what the converter declares not held
    (vision tower, MTP), every export mode is bit-identical to the language model's tensors, save_pretrained
    completed from the checkpoint as base equals the whole checkpoint; with `tokens` (PP 1), the logits; last,
    te_naming's names equal megatron-core's TE spec's (`te_specs[model_type]`)."""
    from mcore2hf.arch.registry import get_converter

    rank = dist.get_rank()
    cfg, chunks = build(ckpt, layout)
    report = load_hf_weights(chunks, ckpt)
    full = read_hf_checkpoint(ckpt)
    conv = get_converter(cfg.model_type)
    ref = {n: t for n, t in full.items() if not conv.not_held_by_model(n)}
    assert report.skipped == sorted(set(full) - set(ref)) and any(n.startswith("model.visual.") for n in report.skipped)
    ex = HFExporter(chunks, cfg)
    assert_same(ex.state_dict(), ref, f"{layout} all ranks")
    assert_same({n: t.clone() for b in ex.buckets(bucket_bytes=4096) for n, t in b}, ref, f"{layout} 4 KiB buckets")
    got0 = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, receivers=0) for n, t in b}
    agree(checked(lambda: assert_same(got0, ref, f"{layout} receivers=[0] 4 KiB") if rank == 0 else None)
          or (None if rank == 0 or not got0 else "a non-receiver got tensors"))
    engine = engine_matrix(ex, ref, layout, cfg.model_type)  # engine-sharded export (issue 15)

    out = os.path.join(out_root, cfg.model_type, str(layout))
    ex.save_pretrained(out, max_shard_size=20_000, base=ckpt)
    agree(checked(lambda: assert_same(read_hf_checkpoint(out), full, f"{layout} save_pretrained(base=)"))
          if rank == 0 else None)

    # an unknown tensor of the language model is still an error, named alone (the vision tower is skipped)
    bad = dict(full, **{"model.language_model.layers.0.foo": torch.zeros(2)})
    zero_(chunks)
    try:
        load_hf_weights(chunks, bad, ckpt)
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        assert "1 HF tensor(s)" in msg and "model.language_model.layers.0.foo" in msg and "visual" not in msg, msg
    else:
        raise AssertionError("an unknown language-model tensor was accepted")
    load_hf_weights(chunks, ckpt)
    logits = None
    if tokens is not None:
        from mcore2hf.arch.hf_config import text_config

        logits = megatron_logits(chunks, tokens, text_config(cfg).vocab_size)
    agree(te_renamed(chunks, te_specs[cfg.model_type]))
    return {"tensors": len(ref), "skipped": len(report.skipped), "logits": logits, "engine": engine}


def in_layouts(layouts: list[Layout], fn, *args) -> dict[str, object]:
    """fn(*args) at each layout in turn, in one world (one process start-up for all): Megatron's parallel state is
    torn down and initialized again between layouts (each layout must fit this world's size)."""
    from megatron.core import parallel_state as ps

    from mcore2hf.runtime.world import init_megatron

    out = {}
    for i, layout in enumerate(layouts):
        if i:
            ps.destroy_model_parallel()
            init_megatron(layout)
        out[str(layout)] = fn(*args, layout)
    return out


def qwen3_5_archs(ckpts: dict[str, str], out_root: str, tokens: torch.Tensor, dist_layout: Layout,
                  te_specs: dict[str, dict], layout: Layout) -> dict:
    """qwen3_5_suite for every architecture at `layout`; at `dist_layout` also a torch_dist checkpoint under
    out_root/dist/<arch>/ckpt."""
    out = for_each_arch(qwen3_5_suite, ckpts, layout, out_root, tokens, te_specs)
    if layout == dist_layout:
        out["dist"] = for_each_arch(save_dist_checkpoint, ckpts, layout, os.path.join(out_root, "dist"))
    return out


def contradicting_config(cfg):
    """An HF config whose hybrid pattern contradicts `cfg`'s (a multimodal config's language model, nested): HF
    layer 0's mixer the other kind (gated DeltaNet / attention) or its MLP the other kind (dense / MoE) through the
    architecture's own fields; a dense multimodal model one layer short; a dense text model as Qwen3-MoE's
    with the same sizes."""
    d = cfg.to_dict()
    nested = isinstance(d.get("text_config"), dict)
    text = d["text_config"] if nested else d

    def config(**changes):
        new = {**text, **changes}
        return load_hf_config({**d, "text_config": new} if nested else new)

    moe = bool(get_model_spec(cfg.model_type).dims(cfg).num_experts)
    if "linear_attention" in (text.get("layer_types") or []):
        types = list(text["layer_types"])
        types[0] = "full_attention" if types[0] == "linear_attention" else "linear_attention"
        return config(layer_types=types)
    if "mlp_only_layers" in text and moe:
        return config(mlp_only_layers=[0])
    if text.get("mlp_layer_types") and moe:  # explicit per-layer types win over first_k_dense_replace
        types = list(text["mlp_layer_types"])
        types[0] = "sparse" if types[0] == "dense" else "dense"
        return config(mlp_layer_types=types)
    if "first_k_dense_replace" in text and moe:
        return config(first_k_dense_replace=0 if text["first_k_dense_replace"] else 1)
    if nested:
        n = text["num_hidden_layers"] - 1
        return config(num_hidden_layers=n, **({"layer_types": text["layer_types"][:n]} if text.get("layer_types") else {}))
    return load_hf_config({**d, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                           "mlp_only_layers": [1, 2, 3], "num_key_value_heads": 2, "head_dim": 16,
                           "num_attention_heads": 4})


def hybrid_suite(ckpt: str, layout: Layout, dist_root: str | None = None, import_root: str | None = None,
                 mtp: bool = False) -> dict:
    """The HF weights in a hybrid model (megatron-core 0.16 MambaModel / 0.19 HybridModel, attention and MLP as
    separate Megatron layers) and in a GPTModel at `layout`: both export exactly the HF source; the hybrid model
    also loads the GPTModel's export, under Transformer Engine's names too; a pattern the HF config contradicts
    is refused; (with `tokens`) both forwards give the same logits; (with `dist_root`) the hybrid model's
    torch_dist checkpoint is saved under dist_root/<arch>/ckpt for the offline export; (with `import_root`) a
    hybrid model loads what `mcore2hf import --model-class hybrid` wrote under import_root/<arch> with Megatron's
    `dist_checkpointing.load` (strict) and exports the HF source. `mtp`: both models hold the HF config's MTP
    layers (megatron-core 0.19: HybridModel's '/' depths), else neither (the HF source's MTP tensors are then
    not compared)."""
    from mcore2hf.arch.hf_config import text_config
    from mcore2hf.arch.naming import hybrid_layout, model_config
    from mcore2hf.arch.registry import get_converter
    from mcore2hf.errors import ConfigMismatchError

    cfg, gpt = build(ckpt, layout, mtp=mtp)
    text = text_config(cfg)  # a multimodal config's language model (Qwen3.5)
    load_hf_weights(gpt, ckpt, strict=mtp)
    gpt_export = {n: t.clone() for n, t in HFExporter(gpt, cfg).state_dict().items()}
    ref = read_hf_checkpoint(ckpt)
    held = None
    if not mtp:  # the model without MTP layers holds all but the HF MTP layers' tensors
        held = set(gpt_export)
        mtp_layer = regex.compile(rf"(model\.layers\.(?:{'|'.join(map(str, range(text.num_hidden_layers, text.num_hidden_layers + 9)))})|mtp)\.")
        conv = get_converter(cfg.model_type)  # and what the Megatron model never holds (a vision tower)
        unheld = sorted(n for n in ref if n not in held and not mtp_layer.search(n) and not conv.not_held_by_model(n))
        assert not unheld, f"{layout}: the GPTModel without MTP lacks {unheld[:5]}"
        ref = {n: t for n, t in ref.items() if n in held}
    assert_same(gpt_export, ref, f"{layout} GPTModel")

    no_mtp = {} if mtp else {"mtp_num_layers": None}
    hybrid = build_model(ckpt, use_te=False, model_class="hybrid", **layout.config_overrides(), **no_mtp)
    layout_ = hybrid_layout(hybrid[0])
    assert layout_ is not None and model_config(hybrid).num_layers == text.num_hidden_layers
    megatron_layers = sum(len(c.decoder.layers) for c in hybrid)
    load_hf_weights(hybrid, gpt_export, cfg)  # the GPTModel's export, not the file
    ex = HFExporter(hybrid, cfg)
    got = ex.state_dict()
    plan = ex.plan(4096)  # the live plan, for the one-process dry run (`mcore2hf plan --model-class hybrid`)
    live_plan = (plan.describe(), plan.records, ex.executor(4096).memory_estimate())
    assert_same(got, gpt_export, f"{layout} hybrid vs GPTModel")
    assert_same(got, ref, f"{layout} hybrid vs HF source")
    # the oracle: the GPTModel's forward (compared with transformers' in the test) and the hybrid model's, which
    # must be the same network bit for bit (not with MTP layers: Megatron's MTP forward needs labels; the same
    # decoder runs without them)
    gpt_logits = logits = None
    if not mtp:
        gpt_logits = megatron_logits(gpt, TOKENS, text.vocab_size)
        logits = float((gpt_logits - megatron_logits(hybrid, TOKENS, text.vocab_size)).abs().max())

    to_te_names(hybrid)  # the same hybrid model under TE's names and attributes, reloaded from the file
    zero_(hybrid)
    load_hf_weights(hybrid, ckpt, strict=mtp)
    assert_same(HFExporter(hybrid, cfg).state_dict(), ref, f"{layout} hybrid, TE names")

    wrong = contradicting_config(cfg)  # a pattern the HF config contradicts: HF layer 0 dense where the model has MoE
    try:
        HFExporter(hybrid, wrong).state_dict()
        error = None
    except ConfigMismatchError as e:
        error = str(e)
    assert error and "hybrid layer pattern" in error, error
    if dist_root is not None:
        save_dist_checkpoint(ckpt, layout, dist_root, model_class="hybrid", **no_mtp)
    imported = (load_imported(ckpt, layout, import_root, model_class="hybrid", hf_names=held, **no_mtp)
                if import_root is not None else None)
    return {"imported_tensors": imported, "pattern": layout_.pattern, "megatron_layers_here": megatron_layers,
            "tensors": len(ref), "model_class": type(hybrid[0]).__name__, "logits_max_diff": logits,
            "logits": gpt_logits, "error": error, "mtp_pattern": layout_.mtp_pattern, "plan_4k": live_plan}


def hybrid_build_error(cfg: dict) -> str:
    """The ConfigMismatchError building `cfg`'s hybrid model (without MTP) raises on this rank, or ""."""
    from mcore2hf.errors import ConfigMismatchError

    try:
        build_model(cfg, use_te=False, model_class="hybrid", mtp_num_layers=None)
    except ConfigMismatchError as e:
        return str(e)
    return ""


def hybrid_dry_run(ckpts: dict[str, str], layout: Layout, mtp: bool) -> dict[str, tuple]:
    """The one-process dry run of each checkpoint's hybrid model at `layout` (run in a fresh process)."""
    from mcore2hf.dry_run import dry_run

    out = {}
    for mt, ckpt in ckpts.items():
        plan, memory = dry_run(ckpt, layout, bucket_bytes=4096, dtype="float32", model_class="hybrid", mtp=mtp)
        out[mt] = (plan.describe(), plan.records, memory)
    return out


#: ops whose Megatron TP split equals the engines' at equal TP (the engines replicate some tensors Megatron
#: splits, e.g. MTP's eh_proj, and pad the vocabulary differently: those may cross the wire)
TP_ALIGNED_OPS = {"Column", "Row", "QKV", "GatedQKV", "GatedColumn", "GDNInProj", "ColumnParts"}


def _masked_ok(full: torch.Tensor, name: str, t: torch.Tensor, got: dict) -> bool:
    """In the rank's regions of `name` (the keys of `got`) the full export's values, NaN elsewhere."""
    from mcore2hf.plan.engine_shards import region_slices

    inside = torch.zeros(full.shape, dtype=torch.bool)
    for (n, region) in got:
        if n == name:
            inside[region_slices(region)] = True
    return bool(torch.equal(t[inside], full[inside]) and t[~inside].isnan().all())


def engine_export_suite(ckpts: dict[str, str], layout: Layout, bucket_bytes: int) -> dict:
    """Issue 15 step 4: engine-sharded export of real megatron-core models (weights loaded) at `layout`, sglang
    and vllm at engine TP 1/2/4 (with EP for MoE), colocated: every rank's slices equal engine_slices of the
    full export (torch.equal), exactly its engine_regions arrive, debug masking leaves NaN elsewhere, and the
    bytes received equal the plan's wire bytes (= regions bytes - locally held bytes)."""
    from mcore2hf.plan.engine_shards import (
        EngineShardError,
        colocated_ranks,
        engine_regions,
        region_slices,
        sharding_kind,
    )

    me, out, logits = dist.get_rank(), {}, {}
    for model_type, ckpt in ckpts.items():
        cfg, chunks = build(ckpt, layout)
        load_hf_weights(chunks, ckpt)
        logits[model_type] = forward_oracle(ckpt, layout, chunks)  # what mcore2hf loaded is right (the oracle)
        ex = HFExporter(chunks, cfg)
        ref = read_hf_checkpoint(ckpt)  # the engines' slices are cut from the source, not from our own export
        assert_same(ex.state_dict(), ref, f"{layout} {model_type}")
        dims = ex.dims
        for engine in ("sglang", "vllm"):
            for tp in (1, 2, 4) if engine == "sglang" else (2, 4):  # at TP 1 both engines load everything
                eps = [1] + ([tp] if dims.num_experts and tp > 1 else []) \
                    + ([2] if dims.num_experts and engine == "sglang" and tp == 4 else [])
                for ep in eps:
                    key = f"{model_type} {engine} tp{tp} ep{ep}"
                    ranks = colocated_ranks(layout.size, engine, tp, ep)
                    mine = next(er for er in ranks if er.rank == me)
                    try:
                        eplan = ex.engine_plan(ranks, bucket_bytes)
                    except EngineShardError as e:
                        out[key] = f"refused: {str(e)[:80]}"
                        continue
                    want = {(n, region): ref[n][region_slices(region)]
                            for n in ref for region in engine_regions(n, ref[n].shape, dims, mine.placement,
                                                                      model_type)}

                    # raw slices (masked() on top of them), then the masked output written in place (debug NaN)
                    for output in ("slices", "masked"):
                        executor = ex.engine_executor(ranks, bucket_bytes, output=output, debug=output == "masked")
                        before = dict(executor.stats)
                        got: dict = {}
                        masked_nan_ok = True
                        for bucket in ex.engine_buckets(ranks, bucket_bytes, output=output, debug=output == "masked"):
                            for name, sl in bucket.slices():
                                got[(name, sl.region)] = sl.tensor.clone()
                            if output == "slices":
                                named = bucket.masked(debug=True)
                            else:
                                mb = bucket.as_bucket()
                                # every tensor of the bucket, in the export plan's layout (vLLM's packed IPC: one list for all workers)
                                assert mb.flat is bucket.flat and [e.name for e in mb.entries] == \
                                    [e.name for e in eplan.export.buckets[bucket.index].output], key
                                named = mb.named_tensors()
                            for name, t in named:
                                masked_nan_ok &= _masked_ok(ref[name], name, t, got)
                        stats = {k: v - before[k] for k, v in executor.stats.items()}
                        assert set(got) == set(want), (key, output, sorted(set(want) ^ set(got))[:4])
                        bad = [k for k in want if not torch.equal(got[k], want[k])]
                        assert not bad, (key, output, bad[:4])
                        assert masked_nan_ok, (key, output)
                        b = eplan.bytes_by_receiver()[me]
                        need = sum(v.numel() * v.element_size() for v in want.values())
                        assert stats["received_bytes"] == b["wire"] and stats["local_bytes"] == b["local"], \
                            (key, output, stats, b)
                        assert b["wire"] + b["local"] == need, (key, b, need)
                        sent = [None] * dist.get_world_size()
                        dist.all_gather_object(sent, (stats["sent_bytes"], stats["received_bytes"]))
                        assert sum(s for s, _ in sent) == sum(r for _, r in sent), (key, output, sent)
                    # TP-aligned (engine TP == Megatron TP, colocated): pieces of tensors both split the same way
                    # and this rank holds never cross the wire (engines replicate MTP's eh_proj, pad the vocab
                    # differently: those may)
                    aligned = []
                    if tp == layout.tp and ep == 1:
                        for routes in eplan.routes:
                            for r in routes:
                                src = ex.plan(bucket_bytes).sources[r.source]
                                held = any(r.receiver in hs for hs in src.holders.values())
                                split = sharding_kind(src.hf_names[0], model_type)[0] != "replicated"
                                if held and split and not r.local and src.count == tp and \
                                        type(src.resolved.op).__name__ in TP_ALIGNED_OPS:
                                    aligned.append(r.source)
                    assert not aligned, (key, sorted(set(aligned))[:4])
                    out[key] = dict(wire=b["wire"], local=b["local"], needed=need)
    return {"placements": out, "logits": logits}


def engine_group_transport(ckpt: str, bucket_bytes: int) -> dict:
    """Issue 15, transport: 3 gloo processes, the default world only spawns them (and builds a TP1 model on each);
    the pieces cross a separate ProcessGroupGloo (not registered in the default world) whose ranks differ from
    the global ranks. Group ranks 0 and 1 hold the model; group rank 2 is an engine-only process (ctx=None,
    local={}) fed as sglang engine TP rank 0; group rank 1 is engine TP rank 1 (partly local). Run twice, the
    second time after every parameter's storage was swapped (the compiled views must follow)."""
    from dataclasses import replace
    from datetime import timedelta

    from torch.distributed import PrefixStore, ProcessGroupGloo

    from mcore2hf.plan.engine import plan_engine_shards
    from mcore2hf.plan.engine_shards import EnginePlacement, EngineRank, engine_regions, region_slices
    from mcore2hf.transfer.engine import EngineExecutor

    me = dist.get_rank()
    cfg, chunks = build(ckpt, Layout(world_size=3))
    ex = HFExporter(chunks, cfg)
    ref = ex.state_dict()
    g = (me + 1) % 3  # this process's rank in the transport group
    store = dist.distributed_c10d._get_default_store()
    pg = ProcessGroupGloo(PrefixStore("engine15", store), g, 3, timedelta(seconds=60))
    export = ex.plan(bucket_bytes)
    # every source held by group ranks 0 and 1 only (the TP1 model is whole on each trainer)
    sources = {n: replace(s, holders={i: (0, 1) for i in s.holders}) for n, s in export.sources.items()}
    export = replace(export, sources=sources,
                     buckets=[replace(b, sources=[sources[s.name] for s in b.sources]) for b in export.buckets])
    ranks = [EngineRank(EnginePlacement("sglang", 0, 2), 0, 2), EngineRank(EnginePlacement("sglang", 1, 2), 0, 1)]
    eplan = plan_engine_shards(export, ranks, ex.dims)
    # the same plan over a group registered with torch.distributed (as the weight-update group is): batched P2P
    from mcore2hf.senders.process_group import join_weight_update_group

    registered = join_weight_update_group("", 0, g, 3, group_name="engine15", backend="gloo",
                                          store=PrefixStore("registered", store), timeout=timedelta(seconds=60))
    for group in (registered, pg):
        if g == 2:
            executor = EngineExecutor(eplan, None, {}, torch.device("cpu"), group=group, rank=2)
        else:
            executor = EngineExecutor(eplan, ex.ctx, ex._local, torch.device("cpu"), group=group, rank=g)
        assert executor.core.batched == (group is registered)
        got = {}
        for bucket in executor.run():
            for name, sl in bucket.slices():
                got[(name, sl.region)] = sl.tensor.clone()
        if group is registered:
            first = got
    assert set(first) == set(got) and all(torch.equal(first[k], got[k]) for k in got)
    for step in range(2):
        if step and g != 2:  # training swapped every parameter's storage (and the old one changed): views follow
            with torch.no_grad():
                for chunk in chunks:
                    for p in chunk.parameters():
                        old = p.data
                        p.data = old.clone()
                        old.zero_()
        got = {}
        for bucket in executor.run():
            for name, sl in bucket.slices():
                got[(name, sl.region)] = sl.tensor.clone()
    placement = next((er.placement for er in ranks if er.rank == g), None)
    want = {} if placement is None else \
        {(n, r): ref[n][region_slices(r)] for n in ref for r in engine_regions(n, ref[n].shape, ex.dims, placement,
                                                                              export.model_type)}
    assert set(got) == set(want), (g, sorted(set(got) ^ set(want))[:4])
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, (g, bad[:4])
    b = eplan.bytes_by_receiver().get(g, dict(wire=0, local=0))
    stats = {k: v // 3 for k, v in executor.stats.items()}  # three runs
    assert stats["received_bytes"] == b["wire"] and stats["local_bytes"] == b["local"], (g, stats, b)
    return dict(group_rank=g, **stats)


def direct_gather_suite(ckpts: dict[str, str], layout: Layout, bucket_bytes: int) -> dict:
    """Per architecture: the all-ranks export with its last all-gather landing in the output (BucketPlan.direct)
    and the same plan through staging (direct off), both bit-identical to the source; the bytes each moves and the
    transfers each posts."""
    from dataclasses import replace

    from mcore2hf.transfer.export import Executor

    out = {}
    for mt, ckpt in ckpts.items():
        cfg, chunks = build(ckpt, layout)
        load_hf_weights(chunks, ckpt)
        logits = forward_oracle(ckpt, layout, chunks)
        ref = read_hf_checkpoint(ckpt)
        ex = HFExporter(chunks, cfg)
        plan = ex.plan(bucket_bytes)
        staged = replace(plan, buckets=[replace(b, direct=None) for b in plan.buckets])
        stats = {}
        for what, p in (("direct", plan), ("staged", staged)):
            runner = Executor(p, ex.ctx, ex._local, None, ex.device)
            for k in range(2):  # plan once, run twice: the second run reuses the compiled copies and buffers
                got = {n: t.clone() for b in runner.run() for n, t in b}
                assert_same(got, ref, f"{mt} {layout} {what} export {k}")
            stats[what] = {k: v // 2 for k, v in runner.stats.items() if k.endswith("_bytes")}
            stats[what].update({k: v // 2 for k, v in runner.core.counts.items()})
            stats[what]["gathers"] = sum(len(r.stages) for cb in runner._compiled for r in cb.rounds or [cb])
            if what == "direct":  # slots filled by one concatenation (whole-shard layout ops), not per-tensor copies
                stats["cat_slots"] = sum(st.cat is not None for cb in runner._compiled for st in cb.stages)
        # sync() on the same exporter (its executor's byte counters must survive sync's per-sync phase times)
        from mcore2hf.senders import sync

        sink = _Collect()
        report = sync(ex, sink, bucket_bytes=bucket_bytes, progress=False)
        assert_same(sink.got, ref, f"{mt} {layout} sync")
        stats["sync_buckets"] = report.buckets
        out[mt] = dict(stats, direct_buckets=sum(b.direct is not None for b in plan.buckets),
                       buckets=len(plan.buckets), logits=logits)
    return out


class _Collect:
    """The minimal sender sync() takes (send and finish, as SafetensorsWriter): keeps a copy of every tensor."""

    def __init__(self):
        self.got: dict[str, torch.Tensor] = {}

    def send(self, bucket) -> None:
        self.got.update((n, t.clone()) for n, t in bucket)

    def finish(self) -> None:
        pass


#: Engine placements (engine, TP, EP, expert TP) the layout matrix exports to, colocated, per world size: spread
#: over the worlds (CI budget) so that every architecture meets engine TP 1 / 2 / 4, each engine with and without
#: EP (SGLang EP = TP and EP 2 x expert TP 2, vLLM EP = TP), TP 4 > its kv heads (2 in most tiny configs), one
#: bucket and many (64 KiB). The format-mates (conftest.FORMAT_MATES) run in the worlds of 4 ranks and the uneven
#: pipeline's 2: those three lists alone cover all of it too. Per world: the layouts of test_layout_matrix.
ENGINE_PLACEMENTS: dict[str, list[tuple[str, int, int, int | None]]] = {
    "w1": [("sglang", 1, 1, None), ("vllm", 1, 1, None)],
    # tp2-ep2-etp1 (engine TP == Megatron TP: the aligned check), ep2-etp2, uneven pp2 (engine TP 1: 2 instances)
    "w2": [("sglang", 2, 2, None), ("vllm", 2, 1, None), ("sglang", 1, 1, None)],
    "w2b": [("vllm", 2, 2, None), ("sglang", 2, 1, None), ("vllm", 1, 1, None)],
    # tp2-pp2-ep2 and pp2-vpp2-ep2
    "w4": [("sglang", 4, 1, None), ("vllm", 4, 4, None), ("sglang", 2, 2, None), ("vllm", 2, 1, None)],
    "w4b": [("sglang", 4, 4, None), ("sglang", 4, 2, 2), ("vllm", 4, 1, None), ("vllm", 2, 2, None),
            ("sglang", 2, 1, None)],
    # tp2-pp2-ep4 (bf16): two instances of engine TP 4 (8 ranks share this machine's cores: two placements only)
    "w8": [("vllm", 4, 1, None), ("sglang", 4, 2, 2)],
}


def engine_placements(layout: Layout) -> list[tuple[str, int, int, int | None]]:
    if layout.size == 1:
        return ENGINE_PLACEMENTS["w1"]
    if layout.size == 2:  # uneven PP and expert-TP > TP get the other half of TP 2
        return ENGINE_PLACEMENTS["w2b" if layout.pp > 1 or layout.expert_tp > layout.tp else "w2"]
    if layout.size == 4:
        return ENGINE_PLACEMENTS["w4b" if layout.vpp else "w4"]
    return ENGINE_PLACEMENTS["w8"]


def _engine_executor(ex: HFExporter, eplan):
    """The executor HFExporter.engine_buckets made for `eplan` (for its byte counters)."""
    found = [e for e in ex._engine_executors.values() if getattr(e, "eplan", None) is eplan]
    assert len(found) == 1, f"expected one engine executor for the plan, found {len(found)}"
    return found[0]


def engine_matrix(ex: HFExporter, ref: dict, layout: Layout, model_type: str) -> dict:
    """Engine-sharded export of this world's model (issue 15) at `engine_placements(layout)`, checked on this rank
    against `ref` (the full HF tensors, which the all-ranks export equals bit for bit). Per placement, compact:
    "refused" (the EngineShardError) or the slices that differ from engine_slices of `ref` (torch.equal), whether
    exactly the engine's regions arrived, and the byte counts (received / sent / copied locally by the executor,
    the plan's wire and local bytes, and the bytes of the engine's regions computed here from engine_regions)."""
    from mcore2hf.plan.engine_shards import (
        EngineShardError,
        colocated_ranks,
        engine_regions,
        region_slices,
        sharding_kind,
    )

    me, out = dist.get_rank(), {}
    placements = engine_placements(layout)
    if not ex.dims.num_experts:  # dense: EP changes nothing, its placements would repeat the EP 1 ones
        placements = [p for p in placements if p[2] == 1]
    for i, (engine, tp, ep, moe_tp) in enumerate(placements):
        key = f"{engine} tp{tp} ep{ep}" + (f" moe_tp{moe_tp}" if moe_tp else "")
        bucket_bytes = 65536 if i == 0 else None  # one placement per world in ~16 buckets, the others in one
        kw = {} if moe_tp is None else {"moe_tp": moe_tp}
        ranks = colocated_ranks(layout.size, engine, tp, ep, **kw)
        mine = next(er for er in ranks if er.rank == me)
        args = (ranks,) if bucket_bytes is None else (ranks, bucket_bytes)
        try:
            eplan = ex.engine_plan(*args)
        except EngineShardError as e:
            out[key] = {"refused": str(e)}
            continue
        got = {(name, sl.region): sl.tensor.clone() for b in ex.engine_buckets(*args) for name, sl in b.slices()}
        stats = _engine_executor(ex, eplan).stats
        want = {(n, region) for n, t in ref.items()
                for region in engine_regions(n, t.shape, ex.dims, mine.placement, model_type)}
        differ = sorted(k for k in set(got) & want if not torch.equal(got[k], ref[k[0]][region_slices(k[1])]))
        needed = sum(ref[n][region_slices(region)].nbytes for n, region in want)
        b = eplan.bytes_by_receiver()[me]
        # engine TP == Megatron TP, no engine EP: a piece of a tensor both split alike that this rank holds is
        # copied locally, never sent (engines replicate MTP's eh_proj and pad the vocabulary otherwise: those may)
        aligned = 0
        if tp == layout.tp and ep == 1:
            sources = eplan.export.sources
            for routes in eplan.routes:
                for r in routes:
                    src = sources[r.source]
                    aligned += (r.receiver == me and not r.local and src.count == tp
                                and any(r.receiver in hs for hs in src.holders.values())
                                and type(src.resolved.op).__name__ in TP_ALIGNED_OPS
                                and sharding_kind(src.hf_names[0], model_type)[0] != "replicated")
        out[key] = dict(missing=sorted(want - set(got))[:3], extra=sorted(set(got) - want)[:3], differ=differ[:3],
                        slices=len(got), received=stats["received_bytes"], sent=stats["sent_bytes"],
                        copied=stats["local_bytes"], wire=b["wire"], local=b["local"], needed=needed,
                        aligned_sent=aligned)
    return out


#: refusals the engine sharding rules must give in the layout matrix, by architecture: (placement test, the
#: message's words). gpt-oss's stacked experts under SGLang EP (no expert narrowing in weight_loader_fused);
#: the gated DeltaNet's 2 key heads at engine TP 4
ENGINE_REFUSALS = {
    "gpt_oss": (lambda engine, tp, ep: engine == "sglang" and ep > 1,
                r"mlp\.experts\.\w+: not declared for sglang with ep_size \d"),
    # Qwen3-VL-MoE's packed experts: the engines' loaders for them are not in the table (engine_shards.ARCH_KINDS)
    "qwen3_vl_moe": (lambda engine, tp, ep: True, r"(?s)have no engine sharding rule .*mlp\.experts\.gate_up_proj"),
    "qwen3_next": (lambda engine, tp, ep: tp == 4, r"linear_attn\.\w+(?:\.weight)?: expected tp_size 4 dividing the 2 "
                   r"linear key heads"),
}


def engine_problems(model_type: str, per_rank: list[dict], layout: Layout, refusals: dict | None = None) -> list[str]:
    """What is wrong in engine_matrix's results of every rank (empty: all checks pass): slices bit-identical and
    exactly the engine's regions; received = plan wire = needed - local, local copies = plan local; the world
    sends what it receives; refused exactly where ENGINE_REFUSALS (or `refusals`, by architecture, over it) says,
    with its message."""
    import re

    bad = []
    placements = per_rank[0]
    assert placements, f"{model_type} at {layout}: no engine placement ran"
    for key in placements:
        engine, tp, ep = key.split()[0], int(key.split()[1][2:]), int(key.split()[2][2:])
        when, words = {**ENGINE_REFUSALS, **(refusals or {})}.get(model_type, (lambda *a: False, ""))
        results = [r[key] for r in per_rank]
        if when(engine, tp, ep):
            msgs = [r.get("refused", "") for r in results]
            if not all(re.search(words, m) for m in msgs):
                bad.append(f"{key}: expected refused ({words}), found {msgs[0] or results[0]}")
            continue
        if any("refused" in r for r in results):
            bad.append(f"{key}: refused: {results[0].get('refused')}")
            continue
        for rank, r in enumerate(results):
            if r["missing"] or r["extra"] or r["differ"]:
                bad.append(f"{key} rank {rank}: regions missing {r['missing']}, extra {r['extra']}, "
                           f"differ {r['differ']}")
            if not r["received"] == r["wire"] == r["needed"] - r["local"] or r["copied"] != r["local"]:
                bad.append(f"{key} rank {rank}: received {r['received']}, plan wire {r['wire']}, needed "
                           f"{r['needed']}, plan local {r['local']}, copied {r['copied']}")
            if r["aligned_sent"]:
                bad.append(f"{key} rank {rank}: {r['aligned_sent']} TP-aligned pieces it holds crossed the wire")
        if sum(r["sent"] for r in results) != sum(r["received"] for r in results):
            bad.append(f"{key}: the world sent {[r['sent'] for r in results]}, received "
                       f"{[r['received'] for r in results]}")
    return [f"{model_type} at {layout}: {b}" for b in bad]


# --- DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) -------------------------------------------------------------

def indexer_rows_as_hf(chunks) -> None:
    """Overwrite each DSA indexer's wq_b / wk / k_norm rows with the rows moved as 0.16-0.18's layout is read back
    to HF's: on megatron-core 0.16-0.18 the HF order (what a converter that copied the indexer one to one would
    load), on 0.19 (whose order is HF's) the wrong move (what the 0.16 layout op would load there). The negative
    control of the sparse-regime parity test: its logits must then be far from transformers'."""
    from mcore2hf.layouts.ops import IndexerRope

    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if ".indexer." in name and "weights_proj" not in name:
                    cfg = chunk.config
                    op = IndexerRope(cfg.dsa_indexer_head_dim, cfg.qk_pos_emb_head_dim, interleave=True)
                    p.copy_(op.hf_tensors([p.data])[0])


def dsa_forward(ckpt: str, layout: Layout, scramble: bool = False) -> dict:
    """The Megatron logits of the weights mcore2hf loaded at `layout` (fp32), with `scramble` the indexer rows in
    HF order instead (indexer_rows_as_hf); and whether every TP rank holds the same indexer tensors (megatron-core
    builds them duplicated, parallel_mode="duplicated": one copy is exported)."""
    from megatron.core import parallel_state as ps

    _, chunks = build(ckpt, layout)
    load_hf_weights(chunks, ckpt)
    indexer = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters() if ".indexer." in n}
    copies: list = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(copies, indexer, group=ps.get_tensor_model_parallel_group())
    same = all(c.keys() == indexer.keys() and all(torch.equal(c[n], t) for n, t in indexer.items()) for c in copies)
    if scramble:
        indexer_rows_as_hf(chunks)
    from mcore2hf.arch.hf_config import text_config

    logits = megatron_logits(chunks, TOKENS, text_config(load_hf_config(ckpt)).vocab_size)
    layers = [layer for c in chunks for layer in c.decoder.layers]
    return {"logits": logits, "replicas_agree": same, "indexer_tensors": len(indexer),
            # which attention megatron-core built (0.16-0.18 MLASelfAttention, 0.19 AbsorbedMLASelfAttention), and
            # the HF layers of this rank that hold an indexer (IndexShare: not the shared ones)
            "attention": sorted({f"{type(lay.self_attention).__name__}/{type(lay.self_attention.core_attention).__name__}"
                                 for lay in layers}),
            "indexer_layers": [lay.layer_number - 1 for lay in layers
                               if lay.self_attention.core_attention.indexer is not None]}


def build_index_share(ckpt: str, layout: Layout):
    """A GLM-5.2 IndexShare model as megatron-core 0.19 builds it (dsa.py: `DSAttention.indexer = None` on the
    layers that reuse a previous layer's top-k): on megatron-core >= 0.19 the real model; simulated on 0.16-0.18,
    which have no IndexShare: the model of the same config with every indexer, whose shared layers' indexers are
    then removed. Names, shapes and parallel layout are 0.19's; its forward is not (0.16.1's DSAttention always
    runs its own indexer)."""
    import copy

    from mcore2hf.model_specs.deepseek_v3 import megatron_at_least
    from mcore2hf.model_specs.deepseek_v32 import shared_indexer_layers

    cfg = load_hf_config(ckpt)
    if megatron_at_least(0, 19):
        chunks = build_model(cfg, use_te=False, **layout.config_overrides())
        return cfg, chunks, [layer.layer_number - 1 for chunk in chunks for layer in chunk.decoder.layers]
    shared = set(shared_indexer_layers(cfg))
    full = copy.deepcopy(cfg)
    full.indexer_types = ["full"] * cfg.num_hidden_layers
    chunks = build_model(full, use_te=False, **layout.config_overrides())  # its MTP layer keeps its indexer
    held = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            held.append(layer.layer_number - 1)
            if layer.layer_number - 1 in shared:
                layer.self_attention.core_attention.indexer = None
    return cfg, chunks, held


def index_share_matrix(ckpt: str, layout: Layout, out_root: str) -> dict:
    """The IndexShare model (build_index_share) loaded at `layout` exports the HF checkpoint bit for bit (all
    ranks, 4 KiB buckets, a receiver, save_pretrained), shared layers without indexer tensors on both sides."""
    from megatron.core import parallel_state as ps

    cfg, chunks, held = build_index_share(ckpt, layout)
    stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, held, group=ps.get_pipeline_model_parallel_group())
    load_hf_weights(chunks, ckpt)
    ref = read_hf_checkpoint(ckpt)
    ex = HFExporter(chunks, cfg)
    assert_same(ex.state_dict(), ref, f"{layout} IndexShare all ranks")
    small = {n: t.clone() for b in ex.buckets(bucket_bytes=4096) for n, t in b}
    assert_same(small, ref, f"{layout} IndexShare 4 KiB buckets")
    got0 = ex.state_dict(receivers=0)
    agree(checked(lambda: assert_same(got0, ref, f"{layout} IndexShare receivers=[0]") if dist.get_rank() == 0
                  else None))
    out = os.path.join(out_root, str(layout))
    ex.save_pretrained(out)
    return {"stages": stages, "out": out, "indexers": sorted({n.split(".indexer.")[0] for n in ref if ".indexer." in n})}


#: the LoRA the tests train with Megatron-Bridge's PEFT (tests/harness/bridge_lora.py): every linear Bridge targets
#: by default (peft/lora.py:82-84), rank 8 (divisible by TP and expert-TP), alpha 16 (scale 2)
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_R, LORA_ALPHA = 8, 16


def lora_matrix(ckpt: str, layout: Layout, adapter_dir: str, bridge: str, targets: tuple[str, ...],
                out_root: str, save_dist: bool = False, canonical: bool = False,
                peft_checkpointing: str | None = None) -> dict:
    """A model of `ckpt` at `layout` wrapped by Megatron-Bridge's own LoRA (`targets`), its adapters loaded from the
    PEFT directory `adapter_dir`: the adapter-only export bit-identical to that source (every rank receiving; one
    receiver at 1 KiB buckets), the refusal without lora=, lora="base" equal to the HF source, no parameter
    modified by any export. Rank 0 returns the PEFT directory and the merged HF directory written under `out_root`
    and the Megatron forward with the adapters active; with `save_dist`, also a torch_dist checkpoint of the
    wrapped model written by megatron-core's dist_checkpointing from Bridge's own sharded_state_dict
    (out_root/dist, for the offline export); with `peft_checkpointing` (Bridge 0.3.1's training checkpointing,
    harness.bridge_lora.checkpointing_root) also the adapter-only checkpoint Bridge's own save_checkpoint writes
    for a PEFT run (out_root/peft_ckpt)."""
    from harness.bridge_lora import apply_lora
    from safetensors.torch import load_file

    from mcore2hf.arch.hf_config import text_config
    from mcore2hf.arch.lora import peft_name
    from mcore2hf.errors import UsageError

    cfg, chunks = build(ckpt, layout, mtp=False)
    apply_lora(bridge, chunks, list(targets), LORA_R, LORA_ALPHA, canonical=canonical)
    load_hf_weights(chunks, ckpt, strict=False)  # the base loads into the wrapped model (adapters left alone)
    load_hf_weights(chunks, adapter_dir, ckpt, lora=True)
    params = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    adapter_ref = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))

    for refused in (lambda: HFExporter(chunks, cfg).state_dict(), lambda: HFExporter(chunks, cfg, lora="x")):
        try:
            refused()
        except UsageError as e:
            assert "lora" in str(e), e
        else:
            raise AssertionError("a LoRA model exported without lora= was not refused")

    ex = HFExporter(chunks, cfg, lora="adapter")
    assert_same(ex.state_dict(), adapter_ref, f"{layout} adapters")
    small = {n: t.clone() for b in ex.buckets(bucket_bytes=1024, receivers=0) for n, t in b}
    agree(checked(lambda: assert_same(small, adapter_ref, f"{layout} adapters, 1 KiB buckets, receivers=[0]")
                  if dist.get_rank() == 0 else None))
    out = ex.save_pretrained(os.path.join(out_root, "adapter"), progress=False)
    from mcore2hf.plan.engine_shards import EngineShardError, colocated_ranks

    try:
        ex.engine_plan(colocated_ranks(layout.size, "sglang", 1))
    except EngineShardError as e:
        assert "not engine-sharded" in str(e), e
    else:
        raise AssertionError("an engine-sharded adapter export was not refused")
    merging = HFExporter(chunks, cfg, lora="merged")
    merged = merging.save_pretrained(os.path.join(out_root, "merged"), progress=False)
    # block-FP8 of the merged weights (quantized on the shards where blocks allow): the reference quantizer
    # applied to the full merged tensors
    merged_sd = merging.state_dict()
    assert_same(merging.state_dict(quantize="fp8"), reference_fp8(merged_sd, merging.fp8_policy(), False),
                f"{layout} lora='merged', fp8")
    if save_dist:  # (one layout per architecture, for CI time) engine-sharded merged export: each engine rank's
        # regions of the merged tensors, at the layout matrix's placements (refusals as for the base model)
        engine = engine_matrix(merging, merged_sd, layout, cfg.model_type)
        bad = {k: v for k, v in engine.items() if "refused" not in v and (v["missing"] or v["extra"] or v["differ"])}
        agree(f"engine-sharded lora='merged': {bad}" if bad else None)
    ref = read_hf_checkpoint(ckpt)
    # a training step, then the same merged exporter: every B doubled in place (its compiled merges read the same
    # views) and one A's storage swapped (`.data` replaced: that bucket is recompiled). Oracle: W + s (2 B) A on the
    # HF tensors of the source (fp32; the same products summed in the same order: measured 0.0, compared exactly)
    with torch.no_grad():
        factors = [(n, p) for c in chunks for n, p in c.named_parameters() if ".adapter." in n]
        for n, p in factors:
            if n.endswith("linear_out.weight"):
                p.mul_(2)
        swapped = next(p for n, p in factors if n.endswith("linear_in.weight"))
        swapped.data = swapped.data.clone()
    stepped = merging.state_dict()
    with torch.no_grad():
        for n, p in factors:
            if n.endswith("linear_out.weight"):
                p.div_(2)  # exact: a power of two
    scale, worst = LORA_ALPHA / LORA_R, 0.0
    for n in stepped:
        a, b = peft_name(n, "A"), peft_name(n, "B")
        if a not in adapter_ref:
            assert torch.equal(stepped[n], merged_sd[n]), f"{layout} {n}: no adapter, changed by a training step"
            continue
        expected = ref[n].float() + scale * (2 * adapter_ref[b].float()) @ adapter_ref[a].float()
        worst = max(worst, (stepped[n].float() - expected).abs().max().item())
    assert worst == 0.0, f"{layout} merged export after a training step: |diff| {worst:.2e} from W + s (2 B) A"
    stacked = None
    if save_dist and any(".experts." in n for n in adapter_ref):  # PEFT's 3-D expert form (lora_experts="stacked")
        stacked_ex = HFExporter(chunks, cfg, lora="adapter", lora_experts="stacked")
        stacked = stacked_ex.save_pretrained(os.path.join(out_root, "stacked"), progress=False)
        tiny = {n: t.clone() for b in stacked_ex.buckets(bucket_bytes=1024, receivers=0) for n, t in b}
        full = stacked_ex.state_dict()
        agree(checked(lambda: assert_same(tiny, full, f"{layout} stacked, 1 KiB buckets")
                      if dist.get_rank() == 0 else None))
        # loaded back (the ops' inverses), the per-expert export is the source again
        load_hf_weights(chunks, stacked, ckpt, lora=True)
        assert_same(ex.state_dict(), adapter_ref, f"{layout} adapters loaded from the stacked form")
    base = HFExporter(chunks, cfg, lora="base").state_dict()
    assert_same(base, {n: ref[n] for n in base}, f"{layout} lora='base'")
    after = {n: p for c in chunks for n, p in c.named_parameters()}
    assert all(torch.equal(after[n], params[n]) for n in params), "an export modified the model's parameters"
    logits = megatron_logits(chunks, TOKENS, text_config(cfg).vocab_size)
    structure = lora_structure(chunks)
    bridge_merge = bridge_merge_diff(chunks, cfg, merged_sd)
    if save_dist:
        from megatron.core import parallel_state as ps

        md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        save_megatron(model_state(chunks, lambda c: c.sharded_state_dict(metadata=md)), os.path.join(out_root, "dist"))
        if peft_checkpointing is not None:
            save_bridge_peft_checkpoint(chunks, bridge, peft_checkpointing, targets, os.path.join(out_root, "peft_ckpt"))
    grouped = None
    if cfg.model_type == "qwen3_moe":  # (one MoE architecture, for CI time)
        grouped = grouped_lora(ckpt, chunks, cfg, layout, adapter_ref, merged_sd, full if stacked else None, out_root,
                               save_dist)
    return {"logits": logits, "merged": merged, "dir": out, "stacked": stacked, "structure": structure,
            "bridge_merge": bridge_merge, "grouped": grouped} if dist.get_rank() == 0 else {}


def save_bridge_peft_checkpoint(chunks: list, bridge: str, checkpointing: str, targets: tuple[str, ...],
                                save_dir: str) -> None:
    """The adapter-only checkpoint Megatron-Bridge 0.3.1 writes when PEFT training saves (harness.bridge_lora
    .save_peft_checkpoint): its PEFT object's `set_params_to_save` on the model as its training leaves it (the
    adapters trainable, training/setup.py:442-443 after PEFT.__call__(training=True)), then its save path."""
    from harness.bridge_lora import import_bridge_peft, save_peft_checkpoint

    peft = import_bridge_peft(bridge).LoRA(target_modules=list(targets), dim=LORA_R, alpha=LORA_ALPHA)
    adapters = [p for c in chunks for n, p in c.named_parameters() if ".adapter." in n]
    for p in adapters:
        p.requires_grad_(True)
    try:
        peft.set_params_to_save(chunks)
        assert peft.params_to_save and all(".adapter." in n for n in peft.params_to_save), sorted(peft.params_to_save)[:3]
        save_peft_checkpoint(checkpointing, chunks, peft, save_dir, 5)
    finally:
        for p in adapters:
            p.requires_grad_(False)


def grouped_lora(ckpt: str, chunks, cfg, layout: Layout, adapter_ref: dict, merged_sd: dict, stacked_sd: dict | None,
                 out_root: str, save_dist: bool = False) -> dict:
    """The same adapters as Bridge 0.6.2's GroupedExpertLinearAdapter holds them on TEGroupedMLP (an equivalent built
    from megatron-core layers: tests/harness/bridge_grouped.py): Megatron's forward with its math, then, under TE's
    grouped names, the per-expert adapter export bit-identical to the SequentialMLP adapters' (the source), the
    merged export bit-identical to theirs, and (`stacked_sd`) PEFT's stacked form too; then with Bridge's default
    shared adapter (one ParallelLinearAdapter per grouped linear) each expert's adapter and merge are that one's. With
    `save_dist`, megatron-core's dist_checkpointing saves the grouped model (the grouped adapters' own
    sharded_state_dict, harness.bridge_grouped.grouped_sharded_state_dict) under out_root/grouped-dist for the
    offline export. Rank 0 returns the logits, the PEFT directory and the stacked directory."""
    import regex
    from harness.bridge_grouped import (
        grouped_sharded_state_dict,
        real_class_diff,
        share_first_expert,
        to_grouped_lora,
        to_grouped_names,
    )
    from megatron.bridge.peft.lora_layers import LoRALinear

    from mcore2hf.arch.hf_config import text_config
    from mcore2hf.arch.lora import peft_name

    layers = to_grouped_lora(chunks)
    real = real_class_diff(layers)  # Bridge 0.6.2's own class against the equivalent (None: 0.3.1)
    # measured 0.0 at the four layouts (dfa86fa): the same factors, the same products
    assert real is None or real == 0.0, f"{layout} Bridge 0.6.2's GroupedExpertLinearAdapter: |diff| {real:.2e}"
    logits = megatron_logits(chunks, TOKENS, text_config(cfg).vocab_size)
    if save_dist:  # (one layout, for CI time) the grouped model's torch_dist checkpoint
        from megatron.core import parallel_state as ps

        md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        save_megatron(model_state(chunks, lambda c: grouped_sharded_state_dict(c, layers, md)),
                      os.path.join(out_root, "grouped-dist"))
    to_grouped_names(layers, LoRALinear)
    names = [n for c in chunks for n, _ in c.named_parameters() if ".experts." in n and ".adapter." in n]
    assert names and all(".mlp.experts.linear_fc" in n and n.endswith(("adapter.linear_in.weight",
                                                                       "adapter.linear_out.weight")) for n in names)
    ex = HFExporter(chunks, cfg, lora="adapter")
    assert_same(ex.state_dict(), adapter_ref, f"{layout} grouped adapters, per expert")
    out = ex.save_pretrained(os.path.join(out_root, "grouped-adapter"), progress=False)
    merging = HFExporter(chunks, cfg, lora="merged")
    assert_same(merging.state_dict(), merged_sd, f"{layout} grouped adapters, merged")
    # a training step that replaces a 3-D factor's storage (.data, doubled): the same exporter reads the new one (a
    # grouped expert's factor is an item, read at each export), as a new exporter does
    p3 = next(p for c in chunks for n, p in c.named_parameters()
              if n.endswith("linear_fc1.adapter.linear_out.weight") and p.dim() == 3)
    kept = p3.data
    p3.data = kept * 2
    stepped = merging.state_dict()
    fresh = HFExporter(chunks, cfg, lora="merged").state_dict()
    p3.data = kept
    assert_same(stepped, fresh, f"{layout} grouped adapters, merged after a 3-D factor's .data was replaced")
    assert any(not torch.equal(stepped[n], merged_sd[n]) for n in stepped), "the replaced factor changed nothing"
    stacked = None
    if stacked_sd is not None:
        stacked_ex = HFExporter(chunks, cfg, lora="adapter", lora_experts="stacked")
        assert_same(stacked_ex.state_dict(), stacked_sd, f"{layout} grouped adapters, stacked")
        stacked = stacked_ex.save_pretrained(os.path.join(out_root, "grouped-stacked"), progress=False)
    # Bridge's default for grouped experts: one ParallelLinearAdapter for every local expert (share_expert_adapters;
    # here each EP rank's local expert 0's): every expert's adapter is that one's, merged W_e + s B_0 A_0
    share_first_expert(layers)
    num_local = (cfg.num_experts // layout.ep) if layout.ep > 1 else cfg.num_experts
    first = regex.compile(r"(.*\.mlp\.experts\.)(\d+)(\..*)")

    def of_first(name: str) -> str:
        m = first.fullmatch(name)
        return name if m is None else f"{m.group(1)}{int(m.group(2)) // num_local * num_local}{m.group(3)}"

    shared = {n: adapter_ref[of_first(n)] for n in adapter_ref}
    assert_same(HFExporter(chunks, cfg, lora="adapter").state_dict(), shared, f"{layout} shared grouped adapters")
    ref, scale, worst = read_hf_checkpoint(ckpt), LORA_ALPHA / LORA_R, 0.0
    for n, t in HFExporter(chunks, cfg, lora="merged").state_dict().items():
        a = peft_name(n, "A")
        want = ref[n] + scale * shared[peft_name(n, "B")] @ shared[a] if a in shared else ref[n]
        worst = max(worst, (t - want).abs().max().item())
    assert worst == 0.0, f"{layout} shared grouped adapters, merged: |diff| {worst:.2e} from W + s B A"
    return {"logits": logits, "dir": out, "stacked": stacked, "real_class_diff": real}


def lora_structure(chunks: list) -> list[dict]:
    """Collective: every rank's Bridge LoRA wrappers as Bridge built them, to compare releases (rank order): per
    wrapped module its base and factor parameters (name, local shape, megatron-core's `partition_dim` where
    tensor-parallel) and its adapter's class, split flags and the classes / gather flags of linear_in and
    linear_out (what decides how A and B are split and gathered: ParallelLinearAdapter.__init__)."""
    mine = {}
    for vp, chunk in enumerate(chunks):
        for name, m in chunk.named_modules():
            if not (hasattr(m, "to_wrap") and hasattr(m, "adapter")):
                continue
            params = {n: [list(p.shape), getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False)
                          else None] for n, p in m.named_parameters()}
            # canonical LoRA: a ModuleDict of adapters (adapter_q, ...); plain LoRA: one
            units = m.adapter.items() if isinstance(m.adapter, torch.nn.ModuleDict) else [("", m.adapter)]
            mine[f"chunk{vp}.{name}"] = {"wrapper": type(m).__name__, "params": params, "adapters": {
                part: [type(ad).__name__, bool(ad.input_is_parallel), bool(ad.is_expert), int(ad.dim), float(ad.alpha),
                       [[type(lin).__name__, getattr(lin, "gather_output", None), getattr(lin, "input_is_parallel", None)]
                        for lin in (ad.linear_in, ad.linear_out)]]
                for part, ad in units if ad is not None}}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def bridge_merge_diff(chunks: list, cfg, merged_sd: dict) -> float | None:
    """Megatron-Bridge's own merge against the merged export: from 0.6.2, `LoRALinear.weight` is the effective
    weight W + alpha/r B A of a rank's shard (peft/lora_layers.py:35-58 -> lora_merge.py:65-87, the factor split on
    the other axis gathered over the adapter's TP group). Each base weight is set to it, the model exported with
    lora="base", and the base weights restored. Returns max |that - merged export| (None: a release without it)."""
    wrappers = [m for c in chunks for _, m in c.named_modules()
                if hasattr(m, "to_wrap") and isinstance(getattr(type(m), "weight", None), property)]
    if not wrappers:
        return None
    with torch.no_grad():
        effective = [m.weight.detach().clone() for m in wrappers]  # collective in each adapter's TP group
        saved = [m.to_wrap.weight.detach().clone() for m in wrappers]
        for m, w in zip(wrappers, effective):
            m.to_wrap.weight.copy_(w)
        try:
            bridge = HFExporter(chunks, cfg, lora="base").state_dict()
        finally:
            for m, w in zip(wrappers, saved):
                m.to_wrap.weight.copy_(w)
    assert sorted(bridge) == sorted(merged_sd)
    return max((bridge[n].float() - merged_sd[n].float()).abs().max().item() for n in merged_sd)


def lora_refusals(ckpt: str, layout: Layout, bridge: str, out_root: str) -> list[str]:
    """Each refusal's message (rank 0): DoRA (Bridge's own), adapters disagreeing on r, an adapter on a linear the
    table maps with no PEFT form (output_layer: VocabRows), lora= without adapters; nothing written."""
    from harness.bridge_lora import apply_lora, import_bridge_peft

    from mcore2hf.errors import Mcore2HFError

    def model(*wraps):
        cfg, chunks = build(ckpt, layout)
        for targets, dim, kind in wraps:
            if kind == "dora":
                import_bridge_peft(bridge)
                from megatron.bridge.peft.dora import DoRA

                DoRA(target_modules=list(targets), dim=dim, alpha=dim)(chunks, training=False)
            elif kind == "grouped":
                from megatron.bridge.peft.lora_layers import LoRALinear
                from megatron.bridge.peft.utils import GroupedExpertLinearAdapter

                mlp = chunks[0].decoder.layers[0].mlp
                fc1 = mlp.linear_fc1
                mlp.linear_fc1 = LoRALinear(fc1, GroupedExpertLinearAdapter(
                    fc1.input_size, fc1.output_size, dim, num_local_experts=1, activation="identity",
                    base_linear_name="decoder.layers.0.mlp.linear_fc1", model_parallel_config=fc1.config, alpha=dim))
            else:
                apply_lora(bridge, chunks, list(targets), dim, 2 * dim)
        return cfg, chunks

    cases = {
        "dora": [(("linear_proj",), 8, "dora")],
        "rank": [(("linear_qkv",), 8, "lora"), (("linear_fc2",), 4, "lora")],
        "unmapped": [(("linear_qkv", "output_layer"), 8, "lora")],
        "none": [],
    }
    import_bridge_peft(bridge)
    from megatron.bridge.peft import utils as bridge_utils

    if hasattr(bridge_utils, "GroupedExpertLinearAdapter"):  # 0.6.2: its grouped-expert adapter class, built
        # without its TE base (which this stack cannot build: mcore2hf/lora.py GROUPED_ADAPTERS), in a LoRALinear
        cases["grouped"] = [(("linear_fc1",), 8, "grouped")]
    messages = []
    for name, wraps in cases.items():
        cfg, chunks = model(*wraps)
        out = os.path.join(out_root, f"refused-{name}")
        try:
            HFExporter(chunks, cfg, lora="adapter").save_pretrained(out, progress=False)
        except Mcore2HFError as e:
            messages.append(f"{name}: {e}")
        else:
            raise AssertionError(f"{name}: not refused")
        assert not os.path.exists(out), f"{name}: {out} was written"
    return messages



def native_vl_archs(ckpts: dict[str, str], everywhere: str, out_root: str, tokens: torch.Tensor, images: dict,
                    first: Layout, bridge_root: str, bridge_vlm: str, layout: Layout) -> dict:
    """native_vl_suite at `layout` for the architecture `everywhere`, and at `first` for every architecture (and
    there, for `everywhere`, Megatron-Bridge 0.6.2's own tower from `bridge_root` too); for `everywhere`, its
    torch_dist checkpoints at `first`, TP2 and PP2 (native_checkpoints), and at `first` and TP1 the image forward
    of Megatron-Bridge 0.3.1's Qwen3VLModel from `bridge_vlm` (layout 2: transformers' tower embedded)."""
    chosen = {mt: c for mt, c in ckpts.items() if mt == everywhere or layout == first}
    out = for_each_arch(native_vl_suite, chosen, out_root, tokens, images, layout)
    if layout in (first, Layout()):
        out["bridge_image"] = bridge_image_logits(ckpts[everywhere], bridge_vlm, tokens, images, layout)
    if layout == first:
        out["bridge"] = bridge_native_tower(ckpts[everywhere], bridge_root, layout)
    if layout in (first, Layout(tp=2), Layout(pp=2)):
        out["dist"] = native_checkpoints(ckpts[everywhere], os.path.join(out_root, "dist"), layout == first, layout)
    return out


def bridge_image_logits(ckpt: str, bridge_root: str, tokens: torch.Tensor, images: dict, layout: Layout):
    """Layout 2's image forward: Megatron-Bridge 0.3.1's own Qwen3VLModel (transformers' tower embedded on the first
    stage, harness.bridge_vlm) at `layout`, loaded by mcore2hf from the HF checkpoint, on text + images (its own
    forward: the tower, its merger and deepstack features, Bridge's Qwen3-VL rope positions and Qwen3VLGPTModel);
    the fp32 logits, for transformers' in the test."""
    from harness.bridge_vlm import build_qwen3_vl_model, transformers_5_forward
    from megatron.core import parallel_state as ps

    from mcore2hf.model_specs.common import padded_vocab_size

    cfg = load_hf_config(ckpt)
    vocab = padded_vocab_size(cfg.text_config.vocab_size, ps.get_tensor_model_parallel_world_size())
    chunks = build_qwen3_vl_model(bridge_root, cfg, vocab, **layout.config_overrides())
    load_hf_weights(chunks, ckpt)
    for c in chunks:
        transformers_5_forward(c)
    return megatron_logits(chunks, tokens, cfg.text_config.vocab_size, images=images, causal_mask=False)


def native_checkpoints(ckpt: str, root: str, first: bool, layout: Layout) -> dict:
    """Layout 1 offline (docs/vlm.md): with `first`, Megatron saves the native-tower model (megatron-core's
    dist_checkpointing of its sharded_state_dict, with Adam state) under root/<arch>/ckpt beside its live export
    root/<arch>/live, and rank 0 runs `mcore2hf import --vision-tower native --transformer-impl local` of the HF
    checkpoint into root/import/<arch>; at every layout a model built from zeros loads that import with Megatron's
    own `dist_checkpointing.load` (strict) and exports the whole HF checkpoint bit for bit (load_imported)."""
    from mcore2hf.importer import import_checkpoint

    saved = None
    if first:
        saved = save_dist_checkpoint(ckpt, layout, root, vision_tower="native")["base"]
        if dist.get_rank() == 0:
            import_checkpoint(ckpt, os.path.join(root, "import", load_hf_config(ckpt).model_type), progress=False,
                              vision_tower="native", transformer_impl="local")
        dist.barrier()
    loaded = load_imported(ckpt, layout, os.path.join(root, "import"), vision_tower="native")
    return {"base": saved, "tensors": loaded["tensors"]}


def sharded_layout(module, prefix: str) -> dict:
    """What Megatron's dist_checkpointing saves of `module` on this rank: per ShardedTensor its key, global shape
    and offset, fragmentation, replica id and dtype; per ShardedObject (`_extra_state`) its unique key."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    md = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    out = {}
    for v in module.sharded_state_dict(prefix=prefix, metadata=md).values():
        if isinstance(v, ShardedTensor):
            out[(v.key, v.global_offset)] = (tuple(v.global_shape), tuple(v.axis_fragmentations), v.replica_id,
                                             str(v.dtype), tuple(v.local_shape))
        elif isinstance(v, ShardedObject):
            out[(v.unique_key, ())] = ("object", v.replica_id)
        else:
            out[(type(v).__name__, ())] = None
    return out


def bridge_native_tower(ckpt: str, bridge_root: str, layout: Layout) -> dict:
    """Megatron-Bridge 0.6.2's own Qwen3VLVisionModel (harness.bridge_vision) in place of mcore2hf's tower: the same
    parameter names, shapes and TP attributes (tensor_model_parallel, partition_dim) on every rank, and the HF
    checkpoint loads into it and exports back bit for bit (its forward needs TE's attention: not run)."""
    from harness.bridge_vision import build_bridge_tower

    cfg, chunks = build(ckpt, layout, vision_tower="native")

    def described(module) -> dict:
        return {n: (tuple(p.shape), bool(getattr(p, "tensor_model_parallel", False)), getattr(p, "partition_dim", None))
                for n, p in module.named_parameters()}

    compared, keys, error = 0, 0, None
    for c in chunks:
        if c.vision_model is not None:
            bridge = build_bridge_tower(bridge_root, cfg, c.config)
            mine, theirs = described(c.vision_model), described(bridge)
            if mine != theirs:
                error = f"Bridge's tower differs: {sorted(set(mine.items()) ^ set(theirs.items()))[:4]}"
            compared += len(theirs)
            # and what Megatron saves of it: the same checkpoint keys, shapes, offsets, replicas (layout 1 offline)
            mine, theirs = sharded_layout(c.vision_model, "vision_model."), sharded_layout(bridge, "vision_model.")
            if mine != theirs:
                diff = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k] != theirs[k]]
                error = error or f"Bridge's tower saves other checkpoint keys: {diff[:4]}"
            c.vision_model, keys = bridge, keys + len(theirs)
    agree(error)  # every rank, towers or not: the collectives stay in step
    load_hf_weights(chunks, ckpt)
    assert_same(HFExporter(chunks, cfg).state_dict(), read_hf_checkpoint(ckpt), f"{layout} Bridge 0.6.2 tower")
    return {"compared": compared, "keys": keys}


def native_vl_suite(ckpt: str, out_root: str, tokens: torch.Tensor, images: dict, layout: Layout) -> dict:
    """Qwen3-VL with the native Megatron vision tower (build_model(vision_tower="native"), layout 1 of issue 26)
    at `layout`: the whole HF checkpoint loads (nothing skipped), every export mode gives it back bit for bit
    (tower included: fused QKV, replicated patch / position embeddings, TP-split mergers), save_pretrained writes
    it; the Megatron forward of a text + image input and of text alone, for the transformers oracle."""
    from mcore2hf.arch.hf_config import text_config

    rank = dist.get_rank()
    cfg, chunks = build(ckpt, layout, vision_tower="native")
    report = load_hf_weights(chunks, ckpt)
    full = read_hf_checkpoint(ckpt)
    assert not report.skipped, report.skipped[:3]
    ex = HFExporter(chunks, cfg)
    assert_same(ex.state_dict(), full, f"{layout} all ranks")
    assert_same({n: t.clone() for b in ex.buckets(bucket_bytes=4096) for n, t in b}, full, f"{layout} 4 KiB buckets")
    got0 = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, receivers=0) for n, t in b}
    agree(checked(lambda: assert_same(got0, full, f"{layout} receivers=[0] 4 KiB") if rank == 0 else None)
          or (None if rank == 0 or not got0 else "a non-receiver got tensors"))
    out = os.path.join(out_root, cfg.model_type, str(layout))
    ex.save_pretrained(out, max_shard_size=20_000)
    agree(checked(lambda: assert_same(read_hf_checkpoint(out), full, f"{layout} save_pretrained"))
          if rank == 0 else None)
    if cfg.model_type == "qwen3_vl":  # block-FP8: the language model as the reference quantizer, the tower kept
        fp8 = ex.state_dict(quantize="fp8")
        assert_same(fp8, reference_fp8(full, ex.fp8_policy(), False), f"{layout} fp8")
        assert all(fp8[n].dtype == full[n].dtype for n in full if n.startswith("model.visual.")), "tower quantized"
    # engine-sharded export at this world's placements, the tower as both engines shard it (engine_shards.
    # QWEN3_VL_TOWER), checked in the test by engine_problems (at a layout of the whole world: engine ranks are
    # colocated with every trainer rank, data-parallel replicas have none)
    engine = engine_matrix(ex, full, layout, cfg.model_type) if layout.size == dist.get_world_size() else None
    plan = ex.plan(4096)  # the live plan, for the one-process dry run (`mcore2hf plan --vision-tower native`)
    live_plan = (plan.describe(), plan.records, ex.executor(4096).memory_estimate())
    vocab = text_config(cfg).vocab_size
    held = sum(1 for c in chunks if c.vision_model is not None)
    # with a virtual pipeline the embedding chunk holds one decoder layer, fewer than the deepstack features need
    # (Bridge asserts the same, model.py:357-364): text only there
    deep = len(getattr(cfg.vision_config, "deepstack_visual_indexes", None) or [])
    image = len(chunks[0].language_model.decoder.layers) >= deep if chunks[0].vision_model is not None else None
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, image)
    logits = {"image": megatron_logits(chunks, tokens, vocab, images=images) if all(f is not False for f in flags)
              else None, "text": megatron_logits(chunks, TOKENS, vocab)}
    # the tower as Bridge 0.6.2 builds it (Transformer Engine's ViT spec: fused LayerNorms) exports the same
    to_te_names(chunks)
    assert_same(ex.state_dict(), full, f"{layout} TE names")
    tower = sorted(n for c in chunks for n, _ in c.named_parameters() if n.startswith("vision_model."))
    return dict(logits, towers=held, dir=out, te_tower=tower, plan_4k=live_plan, engine=engine)


def native_dry_run(ckpt: str, layout: Layout, bucket_bytes: int, vision_tower: str = "native") -> tuple:
    """The one-process dry run of the model holding its tower (`vision_tower`: "native", or "hf" for Megatron-Bridge's
    wrappers of transformers' tower) at `layout` (run in a fresh process)."""
    from mcore2hf.dry_run import dry_run

    plan, memory = dry_run(ckpt, layout, bucket_bytes=bucket_bytes, dtype="float32", vision_tower=vision_tower)
    return plan.describe(), plan.records, memory


# --- vision-language models (docs/vlm.md) --------------------------------------------------------------------------

class RecordingSender:
    """A sender as `sync()` drives one (send / finish, `receivers`): it keeps what each sync handed it on this rank,
    so a test counts every tensor it was sent (none of our engine protocols is involved)."""

    def __init__(self, receivers=(0,)):
        self.receivers = receivers
        self.syncs: list[list[tuple[str, torch.Tensor]]] = [[]]

    def send(self, bucket) -> None:
        self.syncs[-1] += [(n, t.clone()) for n, t in bucket]

    def finish(self) -> None:
        self.syncs.append([])


def _counted(pairs: list[tuple[str, torch.Tensor]], want: dict, what: str) -> str | None:
    """None if `pairs` hold every tensor of `want` exactly once, bit for bit, and nothing else; else the problem."""
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"{what}: sent more than once: {twice[:4]}"
    return checked(lambda: assert_same(dict(pairs), want, what))


def frozen_tower(chunks, cfg, ckpt: str, ref: dict, full: dict, layout: Layout) -> dict:
    """Layout 3 (the trainer holds the language model, the tower comes from the checkpoint): HFExporter(base=...)
    delivers the tower's tensors as stored, after the model's, with the first export only or with every export;
    to every rank (receivers "all": each rank reads them, nothing is gathered) or only to the receivers, and
    exactly once per delivery. Returns the bytes of tower buckets each sync handed the sender on this rank."""
    from mcore2hf.errors import UsageError
    from mcore2hf.plan.engine_shards import EngineShardError, colocated_ranks
    from mcore2hf.senders import sync

    rank = dist.get_rank()
    tower = {n: t for n, t in full.items() if n not in ref}
    ex = HFExporter(chunks, cfg, base=ckpt)  # base_sync="first"
    for attempt, words in ((lambda: ex.engine_executor(colocated_ranks(layout.size, "vllm", 1)),
                            "engine sharding with a base checkpoint"),
                           (lambda: next(iter(ex.buckets(quantize="fp8"))), "not completed from a base")):
        try:  # refused before anything moves, naming what it refuses
            attempt()
        except (EngineShardError, UsageError) as e:
            assert words in str(e) and (words.startswith("not") or any(n in str(e) for n in tower)), str(e)
        else:
            raise AssertionError(f"not refused: {words}")
    first = [(n, t.clone()) for b in ex.buckets(bucket_bytes=4096) for n, t in b]
    agree(_counted(first, full, f"{layout} base first export, rank {rank}"))
    again = [(n, t.clone()) for b in ex.buckets(bucket_bytes=4096) for n, t in b]
    agree(_counted(again, ref, f"{layout} base second export (first only)"))
    out = {}
    for mode in ("first", "every"):
        ex = HFExporter(chunks, cfg, base=ckpt, base_sync=mode)
        sender = RecordingSender(receivers=(0,))
        for _ in range(3):
            sync(ex, sender, bucket_bytes=4096, pause=False, progress=False)
        got = sender.syncs[:3]
        for k, pairs in enumerate(got):
            want = {} if rank else (full if mode == "every" or k == 0 else ref)
            agree(_counted(pairs, want, f"{layout} sync {k} base_sync={mode}, rank {rank}"))
        out[mode] = [sum(t.nbytes for n, t in pairs if n in tower) for pairs in got]
    return out


def bridge_tower(ckpt: str, layout: Layout, bridge_root: str, out_root: str, family: str = "qwen3_vl") -> dict:
    """Layout 2 (an HF tower embedded in the Megatron model): Megatron-Bridge 0.3.1's own wrapper at `layout`
    (`family` "qwen3_vl": Qwen3VLModel, its `vision_model` transformers' Qwen3VLVisionModel; "glm4v_moe":
    GLM45VModel, its `visual` transformers' Glm4vVisionModel; "kimi_k25": 0.6.2's KimiK25VLModel rebuilt, its
    `vision_tower` and `mm_projector`; first stage, every TP rank) loaded and exported
    through the pass-through rule: the export equals the whole checkpoint bit for bit; each tower tensor is one
    source, replicated (never gathered over TP), held by the first stage's ranks only, sent exactly once to each
    receiver; engine sharding refuses naming the tower's tensors."""
    import re

    from harness.bridge_vlm import build_glm45v_model, build_kimi_k25_equivalent, build_qwen3_vl_model
    from megatron.core import parallel_state as ps

    from mcore2hf.model_specs.common import padded_vocab_size
    from mcore2hf.plan.engine_shards import EngineShardError, colocated_ranks
    from mcore2hf.senders import sync

    rank = dist.get_rank()
    cfg = load_hf_config(ckpt)
    full = read_hf_checkpoint(ckpt)
    vocab = padded_vocab_size(cfg.text_config.vocab_size, ps.get_tensor_model_parallel_world_size())
    # the wrapper, its tower's attribute(s), the tower's HF prefix(es), a tower tensor engine sharding names
    hf, named = ("model.visual.",), "model.visual.blocks.0.attn.qkv.weight"
    if family == "qwen3_vl":
        prefix = ("vision_model.",)

        def make():
            return build_qwen3_vl_model(bridge_root, cfg, vocab, **layout.config_overrides())
    elif family == "glm4v_moe":
        prefix = ("visual.",)

        def make():
            return build_glm45v_model(bridge_root, cfg, **layout.config_overrides())
    else:  # Bridge 0.6.2's KimiK25VLModel, rebuilt (harness.bridge_vlm.build_kimi_k25_equivalent says why)
        prefix = hf = ("vision_tower.", "mm_projector.")
        named = "mm_projector.proj.0.weight"

        def make():
            return build_kimi_k25_equivalent(cfg, **layout.config_overrides())
    chunks = make()
    names = [n for c in chunks for n, _ in c.named_parameters()]
    zero_(chunks)
    report = load_hf_weights(chunks, ckpt)
    assert not report.skipped, report.skipped  # the tower is held: nothing skipped
    ex = HFExporter(chunks, cfg)
    every = [(n, t.clone()) for b in ex.buckets(bucket_bytes=4096) for n, t in b]
    agree(_counted(every, full, f"{layout} Bridge {family}, all ranks, rank {rank}"))
    sources = ex.plan(4096).sources
    first_stage = {r.rank for r in ex.planner.records if r.pp == 0}
    tower = {s.name: s for s in sources.values() if s.name.startswith(prefix)}
    # the merger linears share their names with a native tower's TP-split ones: WholeOrSplit, whole here (count 1)
    bad = [s.name for s in tower.values() if s.count != 1 or s.stages != (0,) or type(s.resolved.op).__name__ not in
           ("Replicated", "WholeOrSplit") or set(s.holders[0]) != first_stage
           or not s.hf_names[0].startswith(hf)]
    assert tower and not bad, bad[:4]
    sender = RecordingSender(receivers=(0,))
    sync(ex, sender, bucket_bytes=4096, pause=False, progress=False)
    agree(_counted(sender.syncs[0], {} if rank else full, f"{layout} Bridge {family} sync to rank 0, rank {rank}"))
    try:  # Qwen3-VL's tower: the engines split its attention by heads, 3 do not divide over engine TP 2
        ex.engine_plan(colocated_ranks(layout.size, "sglang", 2))
    except EngineShardError as e:
        refused = str(e)
    else:
        refused = ""
    if family == "qwen3_vl":
        assert re.search(r"model\.visual\.blocks\.\d+\.attn\.qkv\.(weight|bias): expected tp_size 2 dividing the 3 "
                         r"vision heads", refused), refused
    else:  # GLM-4.5V's and Kimi-K2.5's towers: not in the engine sharding table
        assert named in refused and "no engine sharding rule" in refused, refused
    # block-FP8: the language model's weights quantized as the reference quantizer does, the tower kept as it is
    fp8 = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, quantize="fp8") for n, t in b}
    agree(checked(lambda: assert_same(fp8, reference_fp8(full, ex.fp8_policy(), False), f"{layout} Bridge {family} fp8")))
    assert all(fp8[n].dtype == full[n].dtype for n in full if n.startswith(hf)), "tower quantized"
    out = os.path.join(out_root, "bridge", family, str(layout))
    ex.save_pretrained(out, max_shard_size=20_000, progress=False)
    agree(checked(lambda: assert_same(read_hf_checkpoint(out), full, f"{layout} Bridge {family} save_pretrained"))
          if rank == 0 else None)
    plan = ex.plan(4096)  # the live plan, for the dry run (`mcore2hf plan --vision-tower hf`) to equal
    return {"names": names, "tower_sources": len(tower), "dir": out, "plan_4k": (plan.describe(), plan.records),
            "dist": bridge_checkpoints(ckpt, layout, (cfg, chunks), make, os.path.join(out_root, "bridge_dist"))}


def bridge_checkpoints(ckpt: str, layout: Layout, built: tuple, make, root: str) -> dict:
    """Layout 2 offline (docs/vlm.md): Megatron saves the Bridge wrapper `built` (dist_checkpointing of its
    sharded_state_dict: the GPT model under `language_model.`, transformers' tower under its child's name,
    `vision_model.` / `visual.` / `vision_tower.` + `mm_projector.`, replicated, on the first stage) under
    root/<arch>/ckpt with its live export; rank 0 runs `mcore2hf import --vision-tower hf --transformer-impl local`;
    a fresh wrapper (`make()`) loads that with Megatron's `dist_checkpointing.load` (strict) and exports the whole
    checkpoint bit for bit."""
    from mcore2hf.importer import import_checkpoint

    cfg = built[0]
    saved = save_dist_checkpoint(ckpt, layout, root, built=built)["base"]
    if dist.get_rank() == 0:
        import_checkpoint(ckpt, os.path.join(root, "import", cfg.model_type), progress=False, vision_tower="hf",
                          transformer_impl="local")
    dist.barrier()
    loaded = load_imported(ckpt, layout, os.path.join(root, "import"), built=(cfg, make()))
    return {"base": saved, "tensors": loaded["tensors"]}


def vlm_suite(ckpt: str, layout: Layout, out_root: str) -> dict:
    """A vision-language model's language model built by build_model at `layout` from its (multimodal) checkpoint:
    loading skips the tower (declared not held), every export equals the language model's tensors bit for bit,
    engine-sharded export at this world's placements, save_pretrained completed from the checkpoint equals it;
    then the frozen tower delivered live (`frozen_tower`)."""
    from mcore2hf.arch.registry import get_converter

    rank = dist.get_rank()
    cfg, chunks = build(ckpt, layout)
    full = read_hf_checkpoint(ckpt)
    conv = get_converter(cfg.model_type)
    ref = {n: t for n, t in full.items() if not conv.not_held_by_model(n)}
    report = load_hf_weights(chunks, ckpt)
    assert report.skipped == sorted(set(full) - set(ref)) and report.skipped, report.skipped[:3]
    ex = HFExporter(chunks, cfg)
    assert_same(ex.state_dict(), ref, f"{layout} all ranks")
    got0 = {n: t.clone() for b in ex.buckets(bucket_bytes=4096, receivers=0) for n, t in b}
    agree(checked(lambda: assert_same(got0, ref, f"{layout} receivers=[0] 4 KiB") if rank == 0 else None)
          or (None if rank == 0 or not got0 else "a non-receiver got tensors"))
    engine = engine_matrix(ex, ref, layout, cfg.model_type)
    out = os.path.join(out_root, cfg.model_type, str(layout))
    ex.save_pretrained(out, max_shard_size=20_000, base=ckpt, progress=False)
    agree(checked(lambda: assert_same(read_hf_checkpoint(out), full, f"{layout} save_pretrained(base=)"))
          if rank == 0 else None)
    tower = frozen_tower(chunks, cfg, ckpt, ref, full, layout)
    plan = HFExporter(chunks, cfg).plan(4096)  # the live plan, for the dry run (`mcore2hf plan`) to equal
    logits = megatron_logits(chunks, TOKENS, cfg.text_config.vocab_size)  # text tokens: transformers' VLM class
    return {"tensors": len(ref), "skipped": len(report.skipped), "engine": engine, "dir": out, "tower": tower,
            "plan_4k": (plan.describe(), plan.records), "logits": logits}


def vlm_archs(ckpts: dict[str, str], out_root: str, bridge_root: str | None, dist_layout: Layout,
              layout: Layout) -> dict:
    """vlm_suite for every architecture at `layout`; with `bridge_root` (a layout without virtual PP) also
    Megatron-Bridge's Qwen3VLModel, GLM45VModel and KimiK25VLModel (`bridge_tower`); at `dist_layout` also a torch_dist checkpoint of each
    language model under out_root/dist/<arch>/ckpt (the offline export's input)."""
    out = for_each_arch(vlm_suite, ckpts, layout, out_root)
    if bridge_root is not None and not layout.vpp:
        out["bridge"] = bridge_tower(ckpts["qwen3_vl"], layout, bridge_root, out_root)
        out["bridge_glm"] = bridge_tower(ckpts["glm4v_moe"], layout, bridge_root, out_root, "glm4v_moe")
        out["bridge_kimi"] = bridge_tower(ckpts["kimi_k25"], layout, bridge_root, out_root, "kimi_k25")
    if layout == dist_layout:
        out["dist"] = for_each_arch(save_dist_checkpoint, ckpts, layout, os.path.join(out_root, "dist"))
    return out


def lora_sync(ckpt: str, layout: Layout, adapter_dir: str, bridge: str, targets: tuple[str, ...],
              urls: dict[str, str], engine: str = "sglang") -> dict:
    """Adapter-only syncs of a Megatron-Bridge LoRA model into an engine's own code (harness.sglang_real /
    harness.vllm_real --serve-lora servers of engine TP = the world size, colocated senders): refused by a server
    without LoRA before anything is paused; then (SGLang) the base weights (v1); the adapter; a training step
    (every B doubled) and the adapter again, replacing the first; (vLLM) the doubled adapter into an engine of TP 1
    through the distributed sender. Rank 0 returns the refusal, the versions and (vLLM) the adapter directories:
    loaded from, kept after the second sync, left after close()."""
    from harness.bridge_lora import apply_lora

    from mcore2hf.errors import EngineError, UnsupportedEngine, UsageError
    from mcore2hf.senders import SGLangColocatedSender, VLLMColocatedSender, sync

    cfg, chunks = build(ckpt, layout, mtp=False)
    apply_lora(bridge, chunks, list(targets), LORA_R, LORA_ALPHA)
    load_hf_weights(chunks, ckpt, strict=False)
    load_hf_weights(chunks, adapter_dir, ckpt, lora=True)
    first, tp, out = dist.get_rank() == 0, dist.get_world_size(), {}

    def sender(url):
        if engine == "sglang":
            return SGLangColocatedSender(url if first else None, tp, timeout=60, lora_name="policy")
        return VLLMColocatedSender(url if first else None, tp, timeout=60, lora_name="policy")

    adapter = HFExporter(chunks, cfg, lora="adapter")
    refused = sender(urls["nolora"])
    try:
        sync(adapter, refused, progress=False)
    except UnsupportedEngine as e:
        out["refused"], out["refused_version"] = str(e), refused.version
    else:
        raise AssertionError("an adapter-only sync into an engine without LoRA was not refused")
    s = sender(urls["lora"])
    if engine == "sglang":
        sync(HFExporter(chunks, cfg, lora="base"), s, progress=False)  # the first sync: the base weights
    out["adapter_bytes"] = sync(adapter, s, progress=False).bytes
    out["paths"] = [s.adapter_path] if engine == "vllm" else []
    with torch.no_grad():  # a training step
        for c in chunks:
            for n, p in c.named_parameters():
                if n.endswith("adapter.linear_out.weight"):
                    p.mul_(2)
    # SGLang checks each adapter tensor's sha256 as it loads it (expected_checksums); the rest refuse verify
    for mode in ("proof", "checksum") if engine != "sglang" else ("proof",):
        try:
            sync(adapter, s, progress=False, verify=mode)
        except UsageError as e:
            out.setdefault("verify_refused", []).append(str(e))
    sync(adapter, s, progress=False, verify="checksum" if engine == "sglang" else None)
    out["version"] = s.version
    moe = any(".experts." in n for n in adapter.state_dict())
    if engine == "sglang":  # a restarted trainer: its sender did not load "policy", the engine still has it
        again = sender(urls["lora"])
        sync(adapter, again, progress=False)
        out["restarted_version"] = again.version
        if moe:  # PEFT's stacked expert form: SGLang loads experts one by one
            try:
                sync(HFExporter(chunks, cfg, lora="adapter", lora_experts="stacked"), again, progress=False)
            except UsageError as e:
                out["stacked_refused"] = str(e)
    elif moe:  # vLLM: PEFT's stacked expert form as its 3-D form (is_3d_lora_weight)
        s3 = VLLMColocatedSender(urls["lora"] if first else None, tp, timeout=60, lora_name="policy3d")
        sync(HFExporter(chunks, cfg, lora="adapter", lora_experts="stacked"), s3, progress=False)
        s3.close()
    if engine == "vllm":
        out["paths"].append(s.adapter_path)
        root = os.path.dirname(s.adapter_path)
        out["kept"] = sorted(os.listdir(root)) if first else None
        s.close()
        out["closed"] = os.path.exists(root)
        # an engine of TP 1 elsewhere: the distributed sender (rank 0 drives it; no weight-transfer group formed)
        from mcore2hf.senders import VLLMDistributedSender

        d = VLLMDistributedSender([urls["tp1"]] if first else None, [1], timeout=60, lora_name="policy")
        sync(adapter, d, progress=False)
        out["tp1_version"] = d.version
        d.close()
        # an engine whose load fails (its max LoRA rank below r): every rank raises, the version stays, the
        # engine is resumed (an adapter sync leaves the base weights as they were), and the directory is removed
        d = VLLMDistributedSender([urls["small"]] if first else None, [1], timeout=60, lora_name="policy")
        try:
            sync(adapter, d, progress=False)
        except EngineError as e:
            out["failed"], out["failed_version"] = str(e), d.version
            out["failed_left"] = os.listdir(d.adapter_root) if first else None  # the failed version removed
        else:
            raise AssertionError("a failed adapter load did not fail the sync")
        d.close()
    return out if first else {}


def collective_schedule(model_type: str, layout: Layout, bucket_bytes: list[int]) -> dict:
    """Every rank's all-ranks programs of a tiny model at `layout` (one-process dry run), as the collectives each
    issues: per bucket (and round) and group (its ranks), when the rank issues it (when the bucket starts, or when
    it completes; also with overlap=True) and its slot. Returns the number of collectives checked, and every group
    whose members disagree or miss one: NCCL matches a group's collectives by the order they are issued in, so
    members must issue each at the same point of the bucket loop (a consumer may run collectives between buckets)."""
    from mcore2hf.dry_run import dry_run, rank_contexts
    from mcore2hf.runtime.tiny import tiny_config
    from mcore2hf.transfer.builders import bucket_program

    contexts = rank_contexts(layout)
    checked, bad = 0, []
    for bb in bucket_bytes:
        plan, _ = dry_run(tiny_config(model_type), layout, bucket_bytes=bb, dtype="float32")
        for b in plan.buckets:
            seen: dict[tuple, dict[int, tuple]] = {}
            for ctx in contexts:
                prog = bucket_program(b, ctx, None)
                for r, p in enumerate(prog.rounds or [prog]):
                    waits = overlap_waits = False
                    for st in p.stages:
                        waits = waits or st.depends
                        overlap_waits = overlap_waits or st.depends or not st.striped
                        when = ("complete" if waits else "start", "complete" if overlap_waits else "start")
                        seen.setdefault((r, st.axis.ranks), {})[ctx.rank] = (when, st.slot, st.direct)
            for (r, ranks), by_rank in seen.items():
                checked += 1
                if set(by_rank) != set(ranks) or len(set(by_rank.values())) > 1:
                    bad.append(dict(bucket_bytes=bb, bucket=b.index, round=r, group=ranks, members=by_rank))
    return {"checked": checked, "bad": bad}


def collective_schedules(cases: list[tuple[str, Layout]], bucket_bytes: list[int]) -> list[dict]:
    """`collective_schedule` of each (model type, layout), in one process."""
    return [collective_schedule(mt, layout, bucket_bytes) for mt, layout in cases]


def load_transformers_saved(ckpts: dict[str, tuple[str, str]], layout: Layout) -> dict:
    """load_hf_weights from a checkpoint as transformers' own save_pretrained writes it (packed experts
    transposed, renamed layers: the registered published_layout), per architecture {model_type: (its dir, the published
    dir of the same weights)}: the model holds what loading the published one gives, every export equal to the
    published tensors bit for bit."""
    from mcore2hf.arch.registry import get_converter

    out = {}
    for mt, (own, published) in ckpts.items():
        cfg, chunks = build(published, layout)
        load_hf_weights(chunks, own)
        conv = get_converter(cfg.model_type)
        ref = {n: t for n, t in read_hf_checkpoint(published).items() if not conv.not_held_by_model(n)}
        assert_same(HFExporter(chunks, cfg).state_dict(), ref, f"{mt} {layout} loaded from transformers' own save")
        out[mt] = len(ref)
    return out


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def export_peak_growth(exports: list[tuple[str, str, str]], bucket_bytes: int) -> list[int]:
    """Per (torch_dist checkpoint, output directory, HF config): how far the offline export raised this process'
    peak RSS (VmHWM) above its RSS before it, the peak reset before each (/proc/self/clear_refs 5). Run in a fresh
    process; a first, unmeasured export of the first checkpoint imports and allocates what every export needs
    once (measured alone, one export grew the peak by 39 MiB where the same one after it grew it by 16-31 MiB)."""
    from mcore2hf.offline import export_checkpoint

    ckpt, out, hf = exports[0]
    export_checkpoint(ckpt, out + "-warm", hf, bucket_bytes=bucket_bytes, progress=False)
    growth = []
    for ckpt, out, hf in exports:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status_bytes("VmRSS")
        export_checkpoint(ckpt, out, hf, bucket_bytes=bucket_bytes, progress=False)
        growth.append(_status_bytes("VmHWM") - before)
    return growth
