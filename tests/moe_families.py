"""A tiny config per mlx-lm MoE family, built from each family's own `ModelArgs` fields.

Modelled on mlx-lm's tests/test_models.py: hidden 64, expert width 32 (so every weight
packs at group size 32), 8 experts routed top-2 where the family allows, two or three
decoder layers of which at least two hold routed experts. `FAMILIES` maps model_type ->
config.json dict; docs/models.md's list of supported model types is checked against its keys.
"""

H, FF, E, K, V = 64, 32, 8, 2, 64
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5}
_BASE = {"hidden_size": H, "vocab_size": V, "max_position_embeddings": 256, "rope_theta": 1e4}
_BASE |= _ATTN | {"tie_word_embeddings": False}
# DeepSeek-style MoE: n_routed_experts, shared experts, group-limited top-k.
_DS = _BASE | {
    "intermediate_size": 2 * FF,
    "moe_intermediate_size": FF,
    "n_routed_experts": E,
    "num_experts_per_tok": K,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
}
# Multi-head latent attention.
_MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}
_YARN = {
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 4,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64,
        "type": "yarn",
    }
}
_QWEN = _BASE | {
    "num_hidden_layers": 2,
    "intermediate_size": 2 * FF,
    "moe_intermediate_size": FF,
    "num_experts": E,
    "num_experts_per_tok": K,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "head_dim": 16,
}
_LINEAR_ATTN = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 3,
    "shared_expert_intermediate_size": FF,
    "partial_rotary_factor": 0.5,
    "full_attention_interval": 2,
}

_LONGCAT = (
    _MLA
    | {"vocab_size": V, "hidden_size": H, "max_position_embeddings": 256}
    | {"attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 2 * FF}
    | {"moe_topk": K, "expert_ffn_hidden_size": FF, "n_routed_experts": E}
    | {"zero_expert_num": 2, "num_layers": 2, "num_hidden_layers": 2}
    | {"num_attention_heads": 4, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5}
    | {"rope_theta": 1e4, "mla_scale_q_lora": True, "mla_scale_kv_lora": True}
    | {"attention_bias": False}
)

_GEMMA4 = (
    _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF, "head_dim": 16}
    | {"global_head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2}
    | {"layer_types": ["sliding_attention", "full_attention"], "num_kv_shared_layers": 0}
    | {"hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": E}
    | {"top_k_experts": K, "moe_intermediate_size": FF, "vocab_size_per_layer_input": V}
)

_CONFIGS = {
    "qwen3_moe": _QWEN,
    "qwen2_moe": _QWEN | {"shared_expert_intermediate_size": FF},
    "qwen3_next": _QWEN | _LINEAR_ATTN,
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe",
        "text_config": _QWEN | _LINEAR_ATTN | {"model_type": "qwen3_5_moe_text"},
    },
    "qwen3_vl_moe": {
        "model_type": "qwen3_vl_moe",
        "text_config": _QWEN | {"model_type": "qwen3_moe"},
    },
    "Klear": _QWEN | {"attention_bias": False, "n_shared_experts": 1},
    "mixtral": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF, "num_local_experts": E}
    | {"num_experts_per_tok": K},
    "phimoe": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF, "num_local_experts": E}
    | {"num_experts_per_tok": K},
    "minimax": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF, "num_local_experts": E}
    | {"num_experts_per_tok": K, "shared_intermediate_size": FF, "rotary_dim": 8},
    "olmoe": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF, "num_experts": E}
    | {"num_experts_per_tok": K},
    # Its quant_predicate packs "*mlp.down_proj" (the experts' too) at group size 64.
    "granitemoe": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF}
    | {"num_local_experts": E, "num_experts_per_tok": K, "attention_bias": False}
    | {"logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0}
    | {"residual_multiplier": 1.0},
    "deepseek": _DS,
    "deepseek_v2": _DS | _MLA | _YARN | {"topk_method": "group_limited_greedy"},
    "deepseek_v3": _DS | _MLA | _YARN,
    "deepseek_v32": _DS
    | _MLA
    | _YARN
    | {"index_n_heads": 2, "index_head_dim": 16}
    | {"index_topk": 4},
    "kimi_k2": _DS | _MLA | _YARN,
    "glm4_moe": _DS
    | {"head_dim": 16, "use_qk_norm": True, "attention_bias": False}
    | {"partial_rotary_factor": 0.5, "rope_scaling": None},
    "glm4_moe_lite": _DS
    | _MLA
    | {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    | {"moe_layer_freq": 1, "rope_scaling": None, "attention_bias": False}
    | {"partial_rotary_factor": 1.0},
    "dots1": _DS,
    "gpt_oss": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF}
    | {"num_local_experts": E, "num_experts_per_tok": K, "head_dim": 16}
    | {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "ernie4_5_moe": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF}
    | {"moe_num_experts": E, "moe_k": K, "moe_intermediate_size": FF, "use_bias": False}
    | {"moe_layer_start_index": 0, "moe_layer_interval": 1},
    "hunyuan": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF, "num_experts": E}
    | {"moe_topk": K, "num_shared_expert": 1, "use_mixed_mlp_moe": True}
    | {"use_qk_norm": True, "attention_bias": False, "use_cla": False, "cla_share_factor": 1}
    | {"rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}},
    "llama4": {
        "model_type": "llama4",
        "text_config": _BASE
        | {"num_hidden_layers": 4, "intermediate_size": FF, "intermediate_size_mlp": 2 * FF}
        | {"num_local_experts": E, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}
        | {"head_dim": 16, "attention_chunk_size": 8, "use_qk_norm": True}
        | {"attention_bias": False, "rope_scaling": None, "model_type": "llama4_text"},
    },
    "jamba": _BASE
    | {"num_hidden_layers": 4, "intermediate_size": FF, "num_experts": E}
    | {"num_experts_per_tok": K, "attn_layer_offset": 1, "attn_layer_period": 2}
    | {"expert_layer_offset": 0, "expert_layer_period": 2, "mamba_d_conv": 4}
    | {"mamba_d_state": 8, "mamba_expand": 2},
    "afmoe": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF, "head_dim": 16}
    | {"num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": FF}
    | {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}
    | {"num_dense_layers": 0, "num_shared_experts": 1},
    "bailing_moe": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF}
    | {"moe_intermediate_size": FF, "num_experts": E, "num_shared_experts": 1}
    | {"norm_topk_prob": True, "num_experts_per_tok": K, "first_k_dense_replace": 1},
    "bailing_moe_linear": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF}
    | {"moe_intermediate_size": FF, "num_experts": E, "num_shared_experts": 1}
    | {"norm_topk_prob": True, "num_experts_per_tok": K, "first_k_dense_replace": 1}
    | {"layer_group_size": 2, "group_norm_size": 1},
    "exaone_moe": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF, "head_dim": 16}
    | {"moe_intermediate_size": FF, "num_experts": E, "num_experts_per_tok": K}
    | {"num_shared_experts": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}
    | {"norm_topk_prob": True, "sliding_window": 8, "is_moe_layer": [False, True, True]}
    | {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "granitemoehybrid": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF}
    | {"attention_bias": False, "embedding_multiplier": 1.0, "attention_multiplier": 0.25}
    | {"logits_scaling": 1.0, "residual_multiplier": 1.0, "num_local_experts": E}
    | {"num_experts_per_tok": K, "shared_intermediate_size": FF, "mamba_n_heads": 4}
    | {"mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4}
    | {"mamba_n_groups": 1, "mamba_conv_bias": False, "layer_types": ["mamba", "attention"]},
    "kimi_linear": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF, "head_dim": 16}
    | {"linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1]}}
    | {"model_max_length": 256, "num_experts": E, "num_experts_per_token": K}
    | {"moe_intermediate_size": FF, "first_k_dense_replace": 0}
    | {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16},
    "kimi_vl": {
        "model_type": "kimi_vl",
        "text_config": _DS | _MLA | _YARN | {"model_type": "deepseek_v3"},
    },
    "laguna": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF, "head_dim": 16}
    | {"sliding_window": 8, "partial_rotary_factor": 0.5, "num_experts": E}
    | {"num_experts_per_tok": K, "moe_intermediate_size": FF}
    | {"shared_expert_intermediate_size": FF, "moe_routed_scaling_factor": 2.5}
    | {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    | {"mlp_layer_types": ["dense", "sparse", "sparse"]}
    | {"num_attention_heads_per_layer": [4, 4, 4]},
    "lfm2_moe": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF}
    | {"moe_intermediate_size": FF, "num_experts": E, "num_experts_per_tok": K}
    | {"norm_topk_prob": True, "use_expert_bias": True, "num_dense_layers": 1}
    | {"norm_eps": 1e-5, "conv_bias": True, "conv_L_cache": 3, "full_attn_idxs": [0, 2]},
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": _LONGCAT
    | {"ngram_vocab_size_ratio": 2, "emb_neighbor_num": 2}
    | {"emb_split_num": 2},
    "mimo_v2_flash": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF}
    | {"hybrid_layer_pattern": [0, 1, 0], "moe_layer_freq": [0, 1, 1]}
    | {"add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False}
    | {"sliding_window_size": 8, "moe_intermediate_size": FF, "n_shared_experts": 1}
    | {"n_routed_experts": E, "num_experts_per_tok": K, "routed_scaling_factor": None}
    | {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True}
    | {"n_group": 2, "topk_group": 1, "layernorm_epsilon": 1e-5, "swa_rope_theta": 1e4}
    | {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "head_dim": 16}
    | {"v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16}
    | {"partial_rotary_factor": 0.5},
    "step3p5": _BASE
    | {"num_hidden_layers": 3, "num_attention_groups": 2, "head_dim": 16}
    | {"intermediate_size": 2 * FF, "rope_theta": [1e4, 1e4, 1e4], "sliding_window": 8}
    | {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    | {"partial_rotary_factors": [0.5, 1.0, 0.5], "use_head_wise_attn_gate": True}
    | {"attention_other_setting": {"num_attention_heads": 4, "num_attention_groups": 2}}
    | {"moe_num_experts": E, "moe_top_k": K, "moe_intermediate_size": FF}
    | {"share_expert_dim": FF, "moe_layers_enum": "1,2"},
    "mellum": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF, "head_dim": 16}
    | {"num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": FF}
    | {"norm_topk_prob": True, "sliding_window": 8}
    | {"layer_types": ["sliding_attention", "full_attention"]}
    | {
        "rope_parameters": {t: {"rope_theta": 1e4} for t in ("sliding_attention", "full_attention")}
    },
    "phixtral": {"num_vocab": V, "model_dim": H, "num_heads": 4, "num_layers": 2}
    | {"rotary_dim": 8, "num_experts_per_tok": K, "num_local_experts": E},
    "nemotron_h": _BASE
    | {"num_hidden_layers": 4, "intermediate_size": 2 * FF}
    | {"attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16}
    | {"mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 3, "n_groups": 2}
    | {"mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False}
    | {"use_conv_bias": True, "hybrid_override_pattern": ["M", "E", "*", "E"]}
    | {"moe_intermediate_size": FF, "moe_shared_expert_intermediate_size": FF}
    | {"n_group": 1, "n_routed_experts": E, "n_shared_experts": 1, "topk_group": 1}
    | {"num_experts_per_tok": K, "norm_topk_prob": True, "routed_scaling_factor": 1.0}
    | {"time_step_limit": [0.0, 1e9]},
    "gemma4_text": _GEMMA4,
    "mistral4": _DS
    | _MLA
    | {
        "rope_parameters": {
            "rope_theta": 1e4,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 64,
        }
    },
    "solar_open": _DS | {"head_dim": 16, "partial_rotary_factor": 1.0},
    "glm_moe_dsa": _DS
    | _MLA
    | {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 4}
    | {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
    | {"attention_bias": False, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}},
    "bailing_hybrid": _BASE
    | {"num_hidden_layers": 3, "intermediate_size": 2 * FF}
    | {"moe_intermediate_size": FF, "num_experts": E, "num_experts_per_tok": K}
    | {"num_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1}
    | {"layer_group_size": 3, "group_norm_size": 1, "routed_scaling_factor": 2.5}
    | {"head_dim": 16}
    | _MLA,
    "gemma4": {
        "model_type": "gemma4",
        "vocab_size": V,
        "text_config": {"model_type": "gemma4_text"} | _GEMMA4,
    },
    "joyai_llm_flash": _DS | _MLA | _YARN,
    "kimi_k3": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF, "head_dim": 16}
    | {
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 16,
            "kda_layers": [1],
            "short_conv_kernel_size": 3,
        }
    }
    | {"num_experts": E, "num_experts_per_token": K, "moe_intermediate_size": FF}
    | {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16},
    "minimax_m3_vl": {
        "model_type": "minimax_m3_vl",
        "text_config": _BASE
        | {"num_hidden_layers": 2, "intermediate_size": FF}
        | {"dense_intermediate_size": 2 * FF, "shared_intermediate_size": FF}
        | {"num_local_experts": E, "num_experts_per_tok": K, "head_dim": 16}
        | {"rotary_dim": 8, "model_type": "minimax_m3"},
    },
    "deepseek_v41": _BASE
    | {"num_hidden_layers": 2, "head_dim": 16, "q_lora_rank": 16}
    | {"qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": FF}
    | {"n_routed_experts": E, "num_experts_per_tok": K, "sliding_window": 8}
    | {"compress_ratios": [0, 0], "hc_mult": 2, "index_n_heads": 2, "index_head_dim": 16}
    | {"index_topk": 4},
    "bailing_moe_v3": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": 2 * FF}
    | {"moe_intermediate_size": FF, "moe_shared_expert_intermediate_size": FF}
    | {"num_experts": E, "num_experts_per_tok": K, "first_k_dense_replace": 0}
    | {"n_group": 2, "topk_group": 1, "layer_group_size": 2, "head_dim": 16}
    | _MLA,
    "minimax_m2": _BASE
    | {"num_hidden_layers": 2, "intermediate_size": FF}
    | {"num_local_experts": E, "num_experts_per_tok": K, "shared_intermediate_size": FF}
    | {"rotary_dim": 8, "head_dim": 16, "use_qk_norm": True},
}

_CONFIGS["deepseek_v41_text"] = _CONFIGS["deepseek_v41"]
FAMILIES = {name: {"model_type": name} | config for name, config in _CONFIGS.items()}
