"""ModelSpec: exact parameter counts (published numbers) and HF-config parsing."""

import json

import pytest

from rlkit import PlanError
from rlkit.plan import ModelSpec, ParallelPlan, bundled_models

# Published parameter counts (model cards / safetensors metadata); tied embeddings counted once.
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
}


# mixture-of-experts configs: their total / active counts are checked in tests/test_plan_moe.py
MOE = ("deepseek-v3", "mixtral-8x7b", "qwen3-235b-a22b", "qwen3-30b-a3b")


VISION = ("qwen2.5-vl-7b",)  # tests/test_plan_vision.py checks its count


def test_bundled_list():
    assert sorted([*PUBLISHED, *MOE, *VISION]) == bundled_models()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_exact_param_counts(name):
    assert ModelSpec.from_name(name).num_params == PUBLISHED[name]


def test_counts_match_transformers_on_meta_device():
    """The formula equals a real HF model built on the meta device (deduplicating tied weights)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlkit.plan.spec import CONFIG_DIR

    for name in ("qwen2.5-0.5b", "llama-3-8b"):
        cfg = AutoConfig.for_model(**json.loads((CONFIG_DIR / f"{name}.json").read_text()))
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(cfg)
        spec = ModelSpec.from_config(cfg)
        counted = sum(p.numel() for p in model.parameters())
        if spec.tie_word_embeddings:  # meta init does not tie (shared/PLATFORM.md): count once
            counted -= spec.embedding_params
        assert spec.num_params == counted
        layer0 = sum(p.numel() for p in model.model.layers[0].parameters())
        assert spec.layer_params == layer0


def test_per_layer_and_stage_counts():
    spec = ModelSpec.from_name("qwen2.5-0.5b")
    # hand count: q 896*896+896, k,v 896*128+128 each, o 896*896, mlp 3*896*4864, 2 norms 2*896
    assert spec.layer_params == (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    stages = spec.stage_params(ParallelPlan(pp=2))
    # 12 layers each; first stage + embedding; last stage + norm + its own copy of the tied embedding
    assert stages[0] == 12 * spec.layer_params + spec.embedding_params
    assert stages[1] == 12 * spec.layer_params + 896 + spec.embedding_params
    assert sum(ModelSpec.from_name("llama-2-7b").stage_params(ParallelPlan(pp=4))) == PUBLISHED["llama-2-7b"]


def test_from_local_path_and_model(tmp_path):
    from rlkit.models import load, tiny_lm

    path = tiny_lm("qwen2", size="test")
    spec = ModelSpec.from_pretrained(path)
    model, _ = load(path)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    from rlkit.plan import as_spec

    assert as_spec(model).num_params == spec.num_params
    assert as_spec(path).num_layers == 4


def test_unknown_model_errors():
    with pytest.raises(PlanError, match="no bundled model named 'gpt-9'"):
        ModelSpec.from_name("gpt-9")
    with pytest.raises(PlanError, match="model path '/nonexistent/x' does not exist"):
        ModelSpec.from_pretrained("/nonexistent/x")
