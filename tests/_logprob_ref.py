"""The independent reference for sampled-token log-probs: one unpadded fp32 forward per sample through a
plain transformers model (what the actor recomputes), shared by the HF and vLLM engine tests."""

import torch


def forward_logprobs(model, batch, temperature):
    """Log-prob of each sampled token from one unpadded forward per sample (the actor's recomputation)."""
    temperature = temperature or 1.0
    out = torch.zeros_like(batch.response_logprobs)
    with torch.no_grad():
        for i in range(batch.num_samples):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
            n = int(batch.response_lengths[i])
            resp = batch.response_ids[i, :n]
            logits = model(torch.cat([prompt, resp])[None]).logits[0, len(prompt) - 1:-1].float()
            out[i, :n] = torch.log_softmax(logits / temperature, -1).gather(1, resp[:, None])[:, 0]
    return out


def max_masked_diff(a, b, mask):
    return (a - b)[mask.bool()].abs().max().item()


def layout_logprobs(model, batch, prompt_len):
    """Log-prob of each response token of a trainer batch (``[prompt left-padded to prompt_len | response
    right-padded]``, as ``SequenceLayout`` packs it) from one unpadded forward per sample: [batch, R]."""
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    out = torch.zeros(resp.shape)
    with torch.no_grad():
        for i in range(ids.shape[0]):
            p = int(attn[i, :prompt_len].sum())
            n = int(resp[i].sum())
            seq = ids[i][attn[i].bool()]
            logits = model(seq[None]).logits[0].float()
            out[i, :n] = torch.log_softmax(logits[p - 1:p + n - 1], -1).gather(1, seq[p:p + n, None])[:, 0]
    return out
