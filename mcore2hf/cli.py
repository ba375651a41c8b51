"""Command line: `mcore2hf demo | list | plan | export | import | verify`.

Nothing heavy (torch, transformers, megatron-core) is imported until a command runs, so `--help`, `--version`
and argument errors answer at once. Every error this library raises on purpose, and every bad argument, is one
line on stderr of at most MAX_ERROR characters (exit 2 for usage errors, 1 otherwise; lists of problems arrive
grouped, `errors.problem_list`); `--debug` prints the traceback and the whole message instead. What the output
directories' guard removed (`mcore2hf.formats.paths`: a killed run's staging directory) is one line on stderr too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from . import __version__
from .dtypes import DTYPE_NAMES as DTYPES
from .errors import SPELLING, Mcore2HFError, UsageError
from .sizes import parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _size(what: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{what}: ")) from None

    parse.__name__ = what  # argparse names the type in its message
    return parse


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _non_negative(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not x >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return x


def _layout_args(p: argparse.ArgumentParser, tp=1, pp=1, ep=1, etp=None) -> None:
    g = p.add_argument_group("parallel layout (as the Megatron model is trained)")
    g.add_argument("--tp", type=_positive, default=tp, help=f"tensor-parallel size (default {tp})")
    g.add_argument("--pp", type=_positive, default=pp, help=f"pipeline-parallel size (default {pp})")
    g.add_argument("--vpp", type=_positive, default=None, help="virtual pipeline stages per rank (default: none)")
    g.add_argument("--ep", type=_positive, default=ep, help=f"expert-parallel size (default {ep})")
    g.add_argument("--etp", type=_positive, default=etp,
                   help=f"expert tensor-parallel size (default {etp})" if etp else
                   "expert tensor-parallel size (default: Megatron's, which is --tp)")
    g.add_argument("--first-stage-layers", type=_positive, default=None,
                   help="uneven pipeline: decoder layers on the first stage")
    g.add_argument("--last-stage-layers", type=_positive, default=None,
                   help="uneven pipeline: decoder layers on the last stage")


def _layout(a):
    from .runtime.world import Layout

    return Layout(tp=a.tp, pp=a.pp, vpp=a.vpp, ep=a.ep, etp=a.etp, first_stage_layers=a.first_stage_layers,
                  last_stage_layers=a.last_stage_layers)


def _filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--include", action="append", default=None, metavar="REGEX",
                   help="only HF tensors whose name matches (re.search; repeatable)")
    p.add_argument("--exclude", action="append", default=None, metavar="REGEX",
                   help="skip HF tensors whose name matches (re.search; repeatable), e.g. MTP layers")


def _name_filter(a):
    from .arch.naming import NameFilter

    return NameFilter.of(include=a.include, exclude=a.exclude)


def cmd_list(a) -> int:
    """The catalog (arch.catalog, the registry's snapshot: no converter, torch or transformers import, so it answers
    at once), a line per architecture cut to the terminal's width; with a model_type, what is verified in full."""
    import shutil
    import textwrap

    from .arch.catalog import catalog

    listing = catalog()
    width = shutil.get_terminal_size().columns
    if a.model_type is not None:
        listed = listing.get(a.model_type)
        if listed is None:
            raise UsageError(f"model_type must be one of {', '.join(listing)}, got {a.model_type!r}")
        print(f"{a.model_type}: {listed.hf_class}, FP8 export {'yes' if listed.fp8 else 'no'}"
              + (f", the format of {listed.format_of}" if listed.format_of else ""))
        print(textwrap.fill(f"verified (docs/architectures.md): {listed.verified}", width=min(width, 100),
                            subsequent_indent="  "))
        return 0

    def fit(line: str) -> str:
        return line if len(line) <= width else line[:width - 3] + "..."

    print(fit(f"{'model_type':<13} {'HF class':<34} {'FP8':<3}  verified (mcore2hf list MODEL_TYPE: in full)"))
    for name, listed in listing.items():
        what = f"as {listed.format_of} (the same format)" if listed.format_of else listed.verified
        print(fit(f"{name:<13} {listed.hf_class:<34} {'yes' if listed.fp8 else 'no':<3}  {what}"))
    return 0


def _check_model_type(model_type: str) -> None:
    from .arch.catalog import catalog  # the registered model types, without importing the converters

    if model_type not in catalog():
        raise UsageError(f"--model-type must be one of {', '.join(catalog())}, got {model_type!r}")


def cmd_demo(a) -> int:
    _check_model_type(a.model_type)
    print(f"mcore2hf demo: {a.model_type}; a line as each stage ends, the report last", flush=True)
    layout = _layout(a)
    from .runtime.tiny import tiny_config

    layout.check(tiny_config(a.model_type))
    if a.out is not None:  # refused before anything runs, not after the world's 20 s
        from .formats.safetensors import check_target

        check_target(a.out, a.overwrite)
    from .demo import format_report, run_demo

    report, ok = format_report(run_demo(a.model_type, layout, a.out, a.overwrite, progress=True))
    print()
    print(report)
    return 0 if ok else 1


def cmd_plan(a) -> int:
    import json

    from .arch.hf_config import load_hf_config
    from .dry_run import run_plan
    from .plan.report import render

    if a.hf_config.startswith("tiny:"):
        from .runtime.tiny import tiny_config

        _check_model_type(a.hf_config[5:])
        cfg = tiny_config(a.hf_config[5:])
    else:
        cfg = load_hf_config(a.hf_config)
    layout = _layout(a)
    report = run_plan(cfg, layout, bucket_bytes=a.bucket_size, dtype=DTYPES[a.dtype], te_names=a.te_names,
                      name_filter=_name_filter(a), quantize=a.quantize, vision_tower=a.vision_tower,
                      model_class=a.model_class, mtp=not a.no_mtp)
    print(json.dumps(report, indent=2) if a.json else render(report, a.limit))
    return 0


def _kinds(*paths: str) -> list[str | None]:
    """Each path as "hf" (an HF directory), "megatron" (a Megatron checkpoint) or None (neither, or absent)."""
    from .formats import is_megatron_checkpoint
    from .formats.hf_dir import has_weights

    return ["megatron" if is_megatron_checkpoint(p) else "hf" if has_weights(p) else None
            for p in paths]


def _swapped(what: str, path: str, is_: str, order: str) -> UsageError:
    """A positional argument that is the other kind of directory: most likely the two were given in the other
    command's order, so the error says the order that works."""
    return UsageError(f"{what} {path} is {is_}: were the arguments swapped? {order}")


def cmd_export(a) -> int:
    from .offline import export_checkpoint
    from .sizes import format_size

    if _kinds(a.ckpt_dir) == ["hf"]:
        raise _swapped("CKPT_DIR", a.ckpt_dir, "an HF directory, not a Megatron checkpoint",
                       "`mcore2hf export CKPT_DIR OUT_DIR --hf-config HF_DIR` writes an HF directory from a Megatron "
                       "checkpoint; `mcore2hf import HF_DIR CKPT_DIR` writes a Megatron checkpoint from an HF directory")

    r = export_checkpoint(a.ckpt_dir, a.out_dir, a.hf_config, iteration=a.iteration, dtype=a.dtype,
                          max_shard_size=a.shard_size, bucket_bytes=a.bucket_size, overwrite=a.overwrite,
                          progress=not a.quiet, name_filter=_name_filter(a),
                          make_vocab_size_divisible_by=a.make_vocab_size_divisible_by, quantize=a.quantize,
                          base=a.base, lora=a.lora, lora_alpha=a.lora_alpha)
    if not a.quiet:
        print(f"wrote {r.tensors} HF tensors ({format_size(r.bytes_written)}) to {r.out_dir} in {r.seconds:.1f} s; "
              f"checkpoint {format_size(r.checkpoint_bytes)}, {r.ignored_keys} non-model keys skipped; "
              f"peak RSS {format_size(r.peak_rss_bytes)}")
        for note in r.notes:
            print(f"note: {note}")
    return 0


def cmd_import(a) -> int:
    from .importer import import_checkpoint
    from .sizes import format_size

    source, target = _kinds(a.hf_dir, a.ckpt_dir)
    if source == "megatron" or (target == "hf" and source != "hf"):
        path, is_ = (a.hf_dir, "a Megatron checkpoint, not an HF directory") if source == "megatron" else (
            a.ckpt_dir, "an HF directory (the output must be a Megatron checkpoint directory)")
        raise _swapped("HF_DIR" if path == a.hf_dir else "CKPT_DIR", path, is_,
                       "`mcore2hf import HF_DIR CKPT_DIR` writes a Megatron checkpoint from an HF directory; "
                       "`mcore2hf export CKPT_DIR OUT_DIR --hf-config HF_DIR` the other way")

    r = import_checkpoint(a.hf_dir, a.ckpt_dir, iteration=a.iteration, dtype=a.dtype, tp=a.tp,
                          make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                          singleton_local_shards=a.singleton_local_shards, moe_layer_freq=a.moe_layer_freq,
                          non_homogeneous_layers=a.non_homogeneous_layers, file_size=a.file_size,
                          overwrite=a.overwrite, progress=not a.quiet, model_class=a.model_class,
                          transformer_impl=a.transformer_impl, vision_tower=a.vision_tower)
    if not a.quiet:
        print(f"wrote {r.tensors} Megatron tensors ({r.keys} keys, {format_size(r.bytes_written)}) to "
              f"{r.ckpt_dir}/iter_{r.iteration:07d} in {r.seconds:.1f} s; peak RSS {format_size(r.peak_rss_bytes)}")
        print(f"decoder layer keys: {r.layer_keys}")
        print(f"norm keys: as a model built with --transformer-impl {r.transformer_impl} saves them")
    return 0


def cmd_verify(a) -> int:
    from .verify import compare, format_table

    if _kinds(a.a, a.b) == ["megatron", "hf"]:
        raise _swapped("A", a.a, "a Megatron checkpoint", f"verify takes the HF directory first: "
                       f"`mcore2hf verify {a.b} {a.a}`")

    result = compare(a.a, a.b, hf_config=a.hf_config, iteration=a.iteration, atol=a.atol, fp8=a.fp8)
    print(format_table(result, a.limit))
    return 0 if result.identical else 1


#: `mcore2hf COMMAND --help` ends with these (shown as written)
EXAMPLES = {
    "demo": """\
  mcore2hf demo                                      # qwen3_moe at TP2 x EP4: 4 gloo processes on CPU
  mcore2hf demo --model-type deepseek_v3 --tp 1 --pp 2 --ep 2
  mcore2hf demo --out exported/                      # keep the exported HF directory""",
    "list": """\
  mcore2hf list
  mcore2hf list qwen3_vl                             # what is verified for one, in full""",
    "plan": """\
  mcore2hf plan --hf-config path/to/hf_dir --tp 8 --pp 4 --ep 8 --limit 20
  mcore2hf plan --hf-config tiny:qwen3_moe --tp 2 --ep 2 --json""",
    "export": """\
  mcore2hf export /ckpts/run1 out_hf/ --hf-config path/to/hf_dir
  mcore2hf export /ckpts/run1 out_hf/ --hf-config path/to/hf_dir --iteration 2000 --dtype bf16
  mcore2hf export /ckpts/lora out_adapter/ --hf-config path/to/hf_dir --lora adapter --lora-alpha 32
  mcore2hf export /ckpts/lora out_merged/ --hf-config path/to/hf_dir --lora merged --lora-alpha 32 \\
      --base path/to/hf_dir                          # an adapter-only checkpoint: the base from here""",
    "import": """\
  mcore2hf import path/to/hf_dir /ckpts/start
  mcore2hf import path/to/hf_dir /ckpts/start --dtype bf16 --transformer-impl local""",
    "verify": """\
  mcore2hf verify out_hf/ path/to/hf_dir
  mcore2hf verify out_hf/ /ckpts/run1 --hf-config path/to/hf_dir
  mcore2hf verify bf16_hf/ fp32_hf/ --atol 4e-3""",
}


def _command(sub, name: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, epilog="examples:\n" + EXAMPLES[name],
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mcore2hf", description="Megatron-Core weights as Hugging Face tensors: export, import, verify, demo.",
                epilog="start with `mcore2hf demo`; `mcore2hf COMMAND --help` shows examples")
    p.add_argument("--version", action="version", version=f"mcore2hf {__version__}")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="COMMAND")

    d = _command(sub, "demo", help="export a built-in tiny model at a multi-rank layout and verify it end to end")
    d.add_argument("--model-type", default="qwen3_moe", help="a registered architecture (see `mcore2hf list`)")
    d.add_argument("--out", default=None, help="keep the exported HF directory here (default: nothing is kept)")
    d.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    _layout_args(d, tp=2, ep=4, etp=1)
    d.set_defaults(fn=cmd_demo)

    ls = _command(sub, "list", help="registered architectures (HF model_type)")
    ls.add_argument("model_type", nargs="?", default=None, help="one of them: what is verified for it, in full")
    ls.set_defaults(fn=cmd_list)

    pl = _command(sub, "plan", help="dry run: every HF tensor with shape, dtype, Megatron source and bucket, "
                                     "and each rank's extra memory")
    pl.add_argument("--hf-config", required=True, help="config.json, an HF directory, or tiny:<model_type>")
    pl.add_argument("--bucket-size", type=_size("--bucket-size"), default="512MiB",
                    help="bytes per bucket, e.g. 512MiB, 1GB (default 512MiB)")
    pl.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype (default bf16)")
    pl.add_argument("--limit", type=_positive, default=None, help="list at most this many tensors")
    pl.add_argument("--json", action="store_true", help="machine-readable output (every tensor, memory per rank)")
    pl.add_argument("--te-names", action="store_true",
                    help="show Transformer Engine parameter names as Megatron sources (fused norms, grouped experts)")
    pl.add_argument("--quantize", choices=["fp8", "fp8-ue8m0"], default=None,
                    help="plan a block-FP8 export: which weights are quantized (and where), their scale shapes")
    pl.add_argument("--vision-tower", choices=["native", "hf"], default=None,
                    help="a vision-language model with its vision tower: 'native' built natively in Megatron "
                         "(Megatron-Bridge 0.6.2's layout: qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe), 'hf' "
                         "transformers' tower embedded (Bridge 0.3.1's Qwen3VLModel for those, its GLM45VModel: "
                         "glm4v_moe, 0.6.2's KimiK25VLModel: kimi_k25)")
    pl.add_argument("--model-class", choices=("gpt", "hybrid"), default="gpt",
                    help="the Megatron model: GPTModel (default) or hybrid (megatron-core 0.19 HybridModel / 0.16 "
                         "MambaModel, as build_model(..., model_class='hybrid') builds it)")
    pl.add_argument("--no-mtp", action="store_true",
                    help="a model built without the HF config's MTP layers (mtp_num_layers=None; RL runs often train "
                         "without them, and a megatron-core < 0.19 hybrid model has none)")
    _filters(pl)
    _layout_args(pl)
    pl.set_defaults(fn=cmd_plan)

    ex = _command(sub, "export", help="Megatron checkpoint (torch_dist, or legacy torch: mp_rank_*/model_optim_rng.pt) "
                                       "-> HF directory, offline (CPU, bounded memory)")
    ex.add_argument("ckpt_dir", help="checkpoint directory (with latest_checkpointed_iteration.txt) or an iter_* dir")
    ex.add_argument("out_dir", help="the HF directory to write (must not overlap the inputs)")
    ex.add_argument("--hf-config", default=None, help="config.json or an HF directory (its tokenizer files are copied); "
                                                      "without it, the error says what the checkpoint's args lack")
    ex.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the latest)")
    ex.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: keep)")
    ex.add_argument("--shard-size", type=_size("--shard-size"), default="5GB",
                    help="largest *.safetensors file, e.g. 5GB, 2GiB (default 5GB)")
    ex.add_argument("--bucket-size", type=_size("--bucket-size"), default="1GiB",
                    help="bytes converted at a time, bounds memory (default 1GiB)")
    ex.add_argument("--make-vocab-size-divisible-by", type=_positive, default=128,
                    help="Megatron's vocab padding divisor used in training (default 128)")
    ex.add_argument("--quantize", choices=["fp8", "fp8-ue8m0"], default=None,
                    help="write a block-FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8 format: float8_e4m3fn weights + "
                         "float32 weight_scale_inv per 128x128 block; fp8-ue8m0: power-of-two scales)")
    ex.add_argument("--base", default=None, metavar="DIR",
                    help="complete the output from this HF directory: copy every tensor the checkpoint does not "
                         "produce (e.g. the vision tower of a text-only model) and its tokenizer/preprocessor files; "
                         "for --lora merged / base of an adapter-only checkpoint (Megatron-Bridge's PEFT training "
                         "saves its adapters alone): the base weights, an HF directory or a Megatron checkpoint")
    ex.add_argument("--lora", choices=["adapter", "merged", "base"], default=None,
                    help="a checkpoint of a Megatron-Bridge LoRA model: write a PEFT adapter directory (adapter), "
                         "the HF directory of W + alpha/r B A (merged) or of the base weights (base)")
    ex.add_argument("--lora-alpha", type=float, default=None,
                    help="LoRA's alpha, for --lora adapter / merged (the checkpoint does not hold it)")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    ex.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    _filters(ex)
    ex.set_defaults(fn=cmd_export)

    im = _command(sub, "import", help="HF directory -> Megatron torch_dist checkpoint, offline (CPU, bounded memory)")
    im.add_argument("hf_dir", help="an HF directory (config.json + safetensors)")
    im.add_argument("ckpt_dir", help="Megatron checkpoint directory: iter_NNNNNNN/ and latest_checkpointed_iteration.txt "
                                     "are written in it")
    im.add_argument("--iteration", type=int, default=0, help="iteration number of the checkpoint (default 0)")
    im.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors (default: keep)")
    im.add_argument("--tp", type=_positive, default=None,
                    help="not needed to load at any layout (default: exactly vocab_size rows, which Megatron pads "
                         "on load); pad the vocab to a multiple of --make-vocab-size-divisible-by x TP and chunk it "
                         "by TP, exactly as training at that TP saves it")
    im.add_argument("--make-vocab-size-divisible-by", type=_positive, default=128,
                    help="Megatron's vocab padding divisor, with --tp (default 128)")
    im.add_argument("--singleton-local-shards", action="store_true",
                    help="per-expert keys and GLU fc1 as _w/_v (for training with singleton_local_shards)")
    im.add_argument("--moe-layer-freq", default=None, metavar="FREQ",
                    help="the --moe-layer-freq the Megatron model is built with: an int or a list expression such as "
                         "'[0]+[1]*47' (default: Megatron-LM's 1 where every layer is MoE, else the HF config's "
                         "pattern). Decides stacked (the int 1) or per-layer (a list, an int > 1) layer keys, as "
                         "megatron-core does")
    im.add_argument("--non-homogeneous-layers", action="store_true",
                    help="per-layer keys, for code that builds its sharded state dict with the metadata flag "
                         "non_homogeneous_layers=True (Megatron-LM does not)")
    im.add_argument("--model-class", choices=("gpt", "hybrid"), default="gpt",
                    help="the Megatron model that will load it: GPTModel (default) or hybrid (megatron-core 0.19 "
                         "HybridModel / 0.16 MambaModel, as build_model(..., model_class='hybrid') builds it)")
    # checkpoint_keys.TRANSFORMER_IMPLS (not imported here: it imports torch; tests/test_import.py test_cli pins them)
    im.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default="transformer_engine",
                    help="the --transformer-impl the Megatron model is built with (default: Megatron-LM's "
                         "transformer_engine): where the norms Transformer Engine fuses into linears are keyed")
    im.add_argument("--vision-tower", choices=("native", "hf"), default=None,
                    help="a vision-language model as Megatron-Bridge's wrapper holds it (language model under "
                         "language_model.): 'native' its native Megatron tower (Bridge >= 0.6's Qwen3VLModel, "
                         "build_model(..., vision_tower='native')), 'hf' transformers' tower embedded (Bridge 0.3.1's "
                         "Qwen3VLModel under vision_model., GLM45VModel under visual., 0.6.2's KimiK25VLModel under "
                         "vision_tower. and mm_projector.); default: the language model alone, the tower skipped "
                         "(docs/vlm.md)")
    im.add_argument("--file-size", type=_size("--file-size"), default="5GB",
                    help="largest .distcp file, e.g. 5GB (default 5GB)")
    im.add_argument("--overwrite", action="store_true", help="replace an existing iter_NNNNNNN of this iteration")
    im.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    im.set_defaults(fn=cmd_import)

    ve = _command(sub, "verify", help="compare two HF directories, or an HF directory and a Megatron checkpoint, "
                                       "tensor by tensor (exit 1 on any difference)")
    ve.add_argument("a", help="an HF directory")
    ve.add_argument("b", help="an HF directory or a Megatron checkpoint (torch_dist or legacy torch)")
    ve.add_argument("--hf-config", default=None, help="HF config for a Megatron checkpoint (default: A's)")
    ve.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    ve.add_argument("--atol", type=_non_negative, default=0.0,
                    help="largest absolute difference accepted, compared in fp32 whatever the dtypes (bf16 vs "
                         "fp32 passes); default 0: exact, dtypes included")
    ve.add_argument("--fp8", choices=("reference", "bound"), default="reference",
                    help="an FP8 weight (with its weight_scale_inv) against an unquantized one: 'reference' "
                         "(default): the unquantized one, quantized by the reference quantizer, gives the same fp8 "
                         "bytes and scales; 'bound': dequantized within half an FP8 step of its block scale (+ "
                         "--atol), for checkpoints quantized by other tools")
    ve.add_argument("--limit", type=_positive, default=10,
                    help="tensors shown per kind of difference (default 10; the rest are counted)")
    ve.set_defaults(fn=cmd_verify)
    return p


def _quiet_libraries() -> None:
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core warns about apex and TE on import
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


MAX_ERROR = 2000  # characters of an error line: grouped problem lists fit; a longer one is cut, --debug has it all


def one_line(e: BaseException, limit: int = MAX_ERROR) -> str:
    """The error in one line: its lines joined by '; ' (a problem list's items stay apart), at most `limit`."""
    parts = [part.strip() for part in str(e).splitlines() if part.strip()]
    text = parts[0] if parts else ""
    for part in parts[1:]:
        text += (" " if text.endswith(":") else "; ") + part
    if len(text) > limit:
        cut = " ... (cut; --debug shows all)"
        text = text[:limit - len(cut)] + cut
    return text or type(e).__name__


class _StderrLine(logging.Handler):
    """A message of the library's output guard as one line on stderr, under the command's name."""

    def __init__(self, prog: str):
        super().__init__(logging.INFO)
        self.prog = prog

    def emit(self, record: logging.LogRecord) -> None:
        print(f"{self.prog}: {record.getMessage()}", file=sys.stderr)


def _interrupted(e: BaseException, seen: list) -> bool:
    """Whether the user interrupted: SIGINT arrived (torch's writers, unwinding, can raise an error of their own
    instead of the KeyboardInterrupt), or a KeyboardInterrupt is in the exception's chain."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__context__
    return bool(seen)


def main(argv: list[str] | None = None) -> int:
    import signal

    a = build_parser().parse_args(argv)
    prog = f"mcore2hf {a.cmd}"
    seen: list = []

    from .formats import paths

    def on_sigint(signum, frame):
        seen.append(signum)
        paths.interrupt_requested.set()  # what the KeyboardInterrupt cannot stop if code swallows it
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    paths_log = logging.getLogger("mcore2hf.paths")
    handler = _StderrLine(prog)
    paths_log.addHandler(handler)
    spelling = SPELLING.set("cli")  # errors name --flags, not Python keywords
    try:
        _quiet_libraries()
        return a.fn(a)
    except BaseException as e:  # noqa: BLE001 - every outcome is one line on stderr (the traceback with --debug)
        return _report(a, prog, e, _interrupted(e, seen))
    finally:
        SPELLING.reset(spelling)
        paths_log.removeHandler(handler)
        signal.signal(signal.SIGINT, previous)
        paths.interrupt_requested.clear()


def _report(a, prog: str, e: BaseException, interrupted: bool) -> int:
    if interrupted:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    if isinstance(e, SystemExit):
        raise e
    try:
        raise e
    except UsageError as e:
        if a.debug:
            raise
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except (Mcore2HFError, OSError, ValueError) as e:
        if a.debug:
            raise
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line, the traceback on request
        if a.debug:
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {one_line(e)} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
