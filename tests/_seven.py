"""A judge model whose answer the test sets by hand: a tiny Qwen2 that answers "7" to anything."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlkit.models import tiny_lm


def always_seven(out, **tiny: object) -> str:
    """Save to ``out`` a tiny Qwen2 (``tiny_lm`` options ``tiny``) that answers "7" to anything: every token embeds
    to one vector, the blocks add nothing to the residual stream, and only the "7" row of the (untied) output
    layer points along it."""
    src = tiny_lm(**{"arch": "qwen2", "size": "test", **tiny})
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    (seven_id,) = tok.encode("7")
    with torch.no_grad():
        v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.copy_(v.expand_as(model.model.embed_tokens.weight))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(model.config.vocab_size, model.config.hidden_size)
        head[seven_id] = 10 * v
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)
