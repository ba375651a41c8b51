"""megatron-core 0.19's `moe_single_grouped_weight` / `_bias` (TEGroupedLinear with TE >= 2.14): all local experts
in one parameter `mlp.experts.linear_fc{1,2}.weight`, item i = tensor[i] (extensions/transformer_engine.py,
`_split_grouped_checkpoint_tensor`, megatron-core 0.19.2). Canonicalized like TE's `weight{i}` for every MoE
architecture: loaded into and exported from such a model bit-identical. The model here is the local spec renamed
(testing/te_naming.py, single_grouped=True), since neither TE nor 0.19 runs on this CPU machine."""

import worlds
from oracle import logit_problems

from mcore2hf.runtime.world import Layout, run_world

MOE = ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss"]


def test_single_grouped_expert_parameters_every_moe_architecture(ckpts):
    layout = Layout(tp=2, ep=2, etp=1)
    source = {mt: ckpts[mt] for mt in MOE}
    results = run_world(worlds.for_each_arch, layout, worlds.single_grouped_suite, source, layout)
    logits = [{mt: r["logits"] for mt, r in res.items()} for res in results]
    problems = logit_problems(logits, source, worlds.TOKENS, str(layout))
    assert not problems, "\n".join(problems)
