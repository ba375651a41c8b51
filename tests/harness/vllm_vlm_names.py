"""vLLM 0.33.0's own name handling of Qwen3-VL and Qwen3.5 checkpoints, run on the names mcore2hf exports
(`python -m harness.vllm_vlm_names IN.json OUT.json`, in a subprocess with the unpacked wheel on sys.path).

The model classes (vllm/model_executor/models/qwen3_vl.py Qwen3VLForConditionalGeneration, qwen3_5.py
Qwen3_5ForConditionalGeneration) cannot be imported here: they import transformers' Qwen2-VL image processor,
which needs torchvision (not installed). Their `hf_to_vllm_mapper` is a literal `WeightsMapper(...)` in the class
body; it is read from the wheel's source (ast, the class's own assignment, `A.hf_to_vllm_mapper | WeightsMapper(...)`
followed) and built with the wheel's own `WeightsMapper` (model_executor/models/utils.py), whose `_map_name` is
what `AutoWeightsLoader.load_weights(weights, mapper=...)` applies to every checkpoint name. The mapped names must
land in the modules the class builds: `visual.` (Qwen3_VisionTransformer), `language_model.model.` and
`language_model.lm_head.` (Qwen3LLMForCausalLM's model and lm_head, qwen3_vl.py:1910-1915, 2011, 2043), or be
dropped (None: Qwen3.5's `mtp.`)."""

from __future__ import annotations

import ast
import json
import sys

#: what each class builds (qwen3_vl.py Qwen3VLForConditionalGeneration.__init__, Qwen3LLMForCausalLM.__init__)
MODULES = ("visual.", "language_model.model.", "language_model.lm_head.")


def _class_mapper(files: dict[str, str], cls: str):
    """The WeightsMapper expression assigned to `cls.hf_to_vllm_mapper`, evaluated with the wheel's WeightsMapper."""
    from vllm.model_executor.models.utils import WeightsMapper

    for path in files.values():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "hf_to_vllm_mapper"
                                                            for t in stmt.targets):
                        return _evaluate(stmt.value, files, WeightsMapper)
    raise LookupError(f"{cls}.hf_to_vllm_mapper not found in {list(files)}")


def _evaluate(expr, files, weights_mapper):
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
        return _evaluate(expr.left, files, weights_mapper) | _evaluate(expr.right, files, weights_mapper)
    if isinstance(expr, ast.Attribute) and expr.attr == "hf_to_vllm_mapper":
        return _class_mapper(files, expr.value.id)
    if isinstance(expr, ast.Call) and getattr(expr.func, "id", "") == "WeightsMapper":
        return weights_mapper(**{k.arg: ast.literal_eval(k.value) for k in expr.keywords})
    raise ValueError(f"unexpected mapper expression: {ast.dump(expr)[:200]}")


def main(inp: str, out: str) -> None:
    import os

    import vllm

    root = os.path.join(os.path.dirname(vllm.__file__), "model_executor", "models")
    files = {m: os.path.join(root, f"{m}.py") for m in ("qwen3_vl", "qwen3_5", "qwen3_next")}
    with open(inp) as f:
        names = json.load(f)
    result = {"vllm": vllm.__version__, "file": files["qwen3_vl"]}
    for cls, key in (("Qwen3VLForConditionalGeneration", "qwen3_vl"), ("Qwen3_5ForConditionalGeneration", "qwen3_5")):
        mapper = _class_mapper(files, cls)
        result[key] = {n: mapper._map_name(n) for n in names[key]}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    from harness.vllm_real import install_gpu_stubs

    install_gpu_stubs()
    main(sys.argv[1], sys.argv[2])
