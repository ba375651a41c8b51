"""A training loop that hands its weights to an inference engine after every optimizer step, on CPU.

    torchrun --nproc-per-node 2 examples/train_and_sync.py          # TP 2 (gloo); --hf-dir DIR for your model

Megatron-Core trains (its DistributedDataParallel, optimizer, pipeline schedule and gradient finalization, as
Megatron-LM's loop calls them); after each step `HFExporter.buckets()` streams the new weights, as HF-named
tensors, to a consumer on rank 0: here a transformers model standing in for an inference engine, which copies
each tensor into its parameter of that name (an engine's `load_weights`). At the end the consumer's logits must
equal Megatron's on the same tokens: the engine serves what was trained. With SGLang or vLLM the loop is the same
with `sync(exporter, sender)` in place of the bucket loop (README, docs/engines.md).

Without --hf-dir, rank 0 first writes a random tiny Qwen3 checkpoint with transformers (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", default=None, help="an HF directory of a dense registered architecture (default: "
                                                  "a random tiny Qwen3)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun's environment; "nccl" on GPUs (one per rank)
    rank = dist.get_rank()
    hf_dir = args.hf_dir or _tiny_checkpoint(rank)

    from megatron.core import parallel_state as ps

    import mcore2hf

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp or dist.get_world_size())
    model = mcore2hf.build_model(hf_dir)  # the Megatron model of the HF config, at this parallel layout
    mcore2hf.load_hf_weights(model, hf_dir)
    model, optimizer = _wrap_for_training(model)
    exporter = mcore2hf.HFExporter(model, hf_dir)  # the plan is built on the first export, then reused

    engine = _Engine(hf_dir) if rank == 0 else None  # the inference side, on rank 0 only
    vocab = exporter.hf_config.vocab_size
    gen = torch.Generator().manual_seed(0)  # the same batches on every rank (one data-parallel replica)
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (2, 17), generator=gen)
        loss = _train_step(model, optimizer, tokens)
        received = 0
        for bucket in exporter.buckets(bucket_bytes=2**20, receivers=[0]):  # collective: every rank iterates
            if engine is not None:
                received += engine.load_weights(bucket)  # (HF name, full tensor) pairs
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}; {received} HF tensors into the engine", flush=True)

    from mcore2hf.runtime.forward import logit_tolerance, megatron_logits

    tokens = torch.randint(0, vocab, (2, 16), generator=gen)
    logits = megatron_logits([m.module for m in model], tokens, vocab)  # every rank runs the forward
    if rank == 0:
        diff = (engine.logits(tokens) - logits).abs().max().item()
        tol = logit_tolerance(exporter.hf_config.model_type)
        moved = engine.moved()
        ok = diff <= tol and moved > 0
        print(f"engine vs Megatron after {args.steps} steps: weights moved up to {moved:.2e} from the checkpoint, "
              f"max |logit diff| {diff:.2e} (tolerance {tol:g}): {'PASS' if ok else 'FAIL'}", flush=True)
        if not ok:
            raise SystemExit(1)
    dist.destroy_process_group()


def _tiny_checkpoint(rank: int) -> str:
    """A random tiny Qwen3 written by transformers on rank 0 into a temporary directory every rank reads (one
    machine; removed at exit)."""
    path = [None]
    if rank == 0:
        import atexit
        import shutil

        from mcore2hf.runtime.tiny import make_hf_checkpoint, tiny_config

        path[0] = tempfile.mkdtemp(prefix="mcore2hf-example-")
        atexit.register(shutil.rmtree, path[0], ignore_errors=True)
        make_hf_checkpoint(tiny_config("qwen3"), path[0])
    dist.broadcast_object_list(path, src=0)
    return path[0]


def _wrap_for_training(chunks):
    """Megatron-Core's DistributedDataParallel around the model chunks (gradients in its fp32 buffers), and Adam
    over the parameters. Megatron's own optimizer (get_megatron_optimizer) puts its loss scale on CUDA, so on a
    CPU-only torch this is torch's AdamW fed the buffers' gradients, as Megatron's FP32Optimizer does."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=False)
    model = [DistributedDataParallel(c.config, ddp, c) for c in chunks]
    optimizer = torch.optim.AdamW([p for m in model for p in m.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def _train_step(model, optimizer, tokens: torch.Tensor) -> float:
    """One optimizer step on a batch: forward (Megatron returns the per-token loss, vocab-parallel cross-entropy,
    given labels), backward into DDP's buffers, Megatron's gradient finalization (the data-parallel reduction and
    the TP all-reduce of replicated q/k-norm weights, as Megatron-LM's loop calls it), Adam. With pipeline
    parallelism Megatron's schedule (get_forward_backward_func) runs the forward and backward; it needs CUDA."""
    from megatron.core.distributed import finalize_model_grads

    for m in model:
        m.zero_grad_buffer()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    mask = torch.triu(torch.ones(1, 1, inputs.shape[1], inputs.shape[1], dtype=torch.bool), diagonal=1)
    model[0].train()
    loss = model[0](inputs, pos, mask, labels=labels).float().mean()
    loss.backward()
    finalize_model_grads(model)
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        p.grad = p.main_grad  # the reduced gradient, in DDP's buffer
    optimizer.step()
    return loss.item()


class _Engine:
    """An inference engine's weight intake, with a transformers model as the engine: each (HF name, tensor) is
    copied into the parameter of that name, as SGLang's and vLLM's load_weights do for a dense model."""

    def __init__(self, hf_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.params = dict(self.model.named_parameters())
        self.loaded = {n: p.detach().clone() for n, p in self.params.items()}  # as served before training

    def moved(self) -> float:
        """How far the weights it serves moved from the checkpoint's (max |difference|)."""
        return max((p - self.loaded[n]).abs().max().item() for n, p in self.params.items())

    def load_weights(self, pairs) -> int:
        n = 0
        with torch.no_grad():
            for name, tensor in pairs:
                self.params[name].copy_(tensor)
                n += 1
        return n

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=tokens).logits.float()


if __name__ == "__main__":
    main()
