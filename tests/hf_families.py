"""The decoder families users train, as tiny transformers configs (random weights, nothing downloaded), and
what trainyard does with each: equal to the model, or refused naming why.

    model = build("gemma2")              # Gemma2ForCausalLM, 4 blocks, 32 wide, sliding window 5
    FAMILIES["gemma2"].window            # 5: the check runs past it
    REFUSED["mixtral-router-loss"]       # the words the refusal must contain

Windows are short (5 tokens) so that a sequence of 24 is well past them; head_dim is set where a family's
default would not fit 32 wide. The table was made with transformers 5.24 (the dev extra pins it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=0, pad_token_id=None)
WINDOW = 5


@dataclass
class Family:
    model_type: str
    extra: dict = field(default_factory=dict)
    window: int = 0

    def config(self):
        from transformers import AutoConfig
        kwargs = {**SMALL, **self.extra}
        if self.model_type == "falcon":   # Falcon names its key-value heads num_kv_heads
            kwargs.pop("num_key_value_heads")
        return AutoConfig.for_model(self.model_type, **kwargs)


W = {"sliding_window": WINDOW}
FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral", W, WINDOW),
    "mistral-no-window": Family("mistral", {"sliding_window": None}),
    "qwen2": Family("qwen2"),
    "qwen2-sliding-layers": Family("qwen2", {"use_sliding_window": True, "max_window_layers": 2, **W}, WINDOW),
    "qwen3": Family("qwen3"),
    "gemma": Family("gemma", {"head_dim": 8}),
    "gemma2": Family("gemma2", {"head_dim": 8, **W}, WINDOW),   # eager attention, logit softcaps, tied
    "gemma3-text": Family("gemma3_text", {"head_dim": 8, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                          **W}, WINDOW),   # a rotary table per layer type
    "phi": Family("phi"),
    "phi3": Family("phi3", W, WINDOW),
    "gpt2": Family("gpt2"),
    "gpt-neox": Family("gpt_neox"),
    "gptj": Family("gptj", {"rotary_dim": 4}),
    "opt": Family("opt", {"ffn_dim": 64, "word_embed_proj_dim": 16}),   # learned positions, project_in/out
    "falcon": Family("falcon"),
    "falcon-alibi": Family("falcon", {"alibi": True}),
    "bloom": Family("bloom"),   # ALiBi, an embedding layernorm
    "starcoder2": Family("starcoder2", W, WINDOW),
    "olmo2": Family("olmo2"),
    "granite": Family("granite", {"embedding_multiplier": 3.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.3}),
    "cohere": Family("cohere", {"logit_scale": 0.5}),
    "mixtral": Family("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, **W}, WINDOW),
    "qwen2-moe": Family("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 32}),
    "smollm3": Family("smollm3"),   # no rotary on every fourth layer (no_rope_layers)
    "deepseek-v3": Family("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                                          "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                                          "first_k_dense_replace": 1}),
    "ministral": Family("ministral", {"head_dim": 8, **W}, WINDOW),
    # refused: what they do is not reproduced, and the refusal names it
    "mixtral-router-loss": Family("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                              "output_router_logits": True}),
    "gemma3-bidirectional": Family("gemma3_text", {"head_dim": 8, "use_bidirectional_attention": True}),
}
REFUSED = {"mixtral-router-loss": "output_router_logits", "gemma3-bidirectional": "use_bidirectional_attention"}


def build(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(FAMILIES[name].config())
