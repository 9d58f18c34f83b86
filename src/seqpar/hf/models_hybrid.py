"""The hybrid part of the tiny test models (hf.models.tiny_config): each recurrent family's layer shapes and layer
pattern, small enough for CPU tests and longer sequences than the recurrences' chunks."""

from __future__ import annotations

from typing import Any

__all__ = ["hybrid_kwargs", "mamba2_kwargs"]


def mamba2_kwargs(arch: str, num_layers: int) -> dict[str, Any]:
    """Mamba2 shapes: 8 heads of dim 4 in 2 groups, state 8, conv kernel 4, SSD chunk 16. Nemotron-H: blocks
    Mamba2, MoE (4 experts, top-2, a shared expert), attention, MLP (repeated: 2 blocks per layer); Granite 4:
    layers alternate Mamba2 / attention, each with a 4-expert top-2 MoE and a shared MLP; Bamba: the same
    alternation with a dense MLP per layer."""
    if arch == "nemotron_h":
        kinds = ["linear_attention", "moe", "full_attention", "mlp"]
        return dict(layers_block_type=[kinds[i % 4] for i in range(2 * num_layers)], num_hidden_layers=None,
                    mamba_num_heads=8, mamba_head_dim=4, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=16,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                    moe_shared_expert_intermediate_size=24, n_group=1, topk_group=1)
    mamba = dict(mamba_n_heads=8, mamba_d_head=4, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
                 mamba_chunk_size=16, mamba_expand=1)
    if arch == "bamba":
        return dict(attn_layer_indices=[i for i in range(num_layers) if i % 2], **mamba)
    if arch == "falcon_h1":  # Mamba2 beside attention in every layer; muP multipliers all != 1, the gated norm on
        return dict(mamba_d_ssm=32, mamba_n_heads=8, mamba_d_head=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                    mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=False,
                    ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7], ssm_in_multiplier=0.9, ssm_out_multiplier=1.1,
                    attention_in_multiplier=0.8, attention_out_multiplier=1.3, key_multiplier=0.7,
                    embedding_multiplier=1.2, lm_head_multiplier=0.9, mlp_multipliers=[0.6, 1.4])
    if arch == "zamba2":  # Mamba2 layers, then a hybrid one (the shared attention block with its LoRA adapter + Mamba2)
        return dict(layers_block_type=["hybrid" if i % 2 else "linear_attention" for i in range(num_layers)],
                    n_mamba_heads=8, mamba_expand=1, mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4, chunk_size=16,
                    num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
                    num_key_value_heads=None)  # = the heads: upstream's k / v adapters have the q width
    return dict(layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)], **mamba,
                num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=24,
                position_embedding_type="rope")


def hybrid_kwargs(arch: str, num_layers: int) -> dict[str, Any]:
    """Gated DeltaNet shapes: 4 k heads with 2 v heads each, k/v head dims 8 / 12; layers alternate
    linear / full attention (linear first). Qwen3-Next's and Qwen3.5-MoE's MLPs are MoE (4 experts, top-2, a
    shared expert). Mamba2 hybrids: mamba2_kwargs."""
    if arch in ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2"):
        return mamba2_kwargs(arch, num_layers)
    if arch == "jamba":  # Mamba1 (64 channels, state 8, dt rank 4) then attention; MoE (4 experts, top-2) in layer 1
        return dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                    num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                    mamba_dt_rank=4, output_router_logits=False)
    if arch in ("falcon_mamba", "mamba"):  # Mamba1 blocks only (64 channels, state 8, dt rank 4, conv kernel 4)
        return dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=4)
    if arch == "kimi_linear":  # KDA (4 heads of 8) then MLA attention (v head dim 4); layer 1's MLP a 4-expert MoE
        return dict(layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)],
                    linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4, num_key_value_heads=None,
                    q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4,
                    num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                    mlp_layer_types=["dense" if i % 2 == 0 else "sparse" for i in range(num_layers)])
    if arch == "minimax":  # lightning attention (blocks of 16 tokens) then softmax attention; 4-expert top-2 MoE
        return dict(layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)],
                    block_size=16, num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
                    linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.1)
    if arch == "recurrent_gemma":  # RG-LRU blocks (conv kernel 4) then local attention (a window of 16 tokens)
        return dict(block_types=["recurrent", "attention"], conv1d_width=4, attention_window_size=16)
    if arch == "lfm2":  # short convs of kernel 3 (with bias) first, then attention
        return dict(layer_types=["full_attention" if i % 2 else "conv" for i in range(num_layers)], conv_L_cache=3,
                    conv_bias=True, block_auto_adjust_ff_dim=False)
    if arch == "lfm2_moe":  # LFM2's layers; a dense MLP in layer 0, then 4-expert top-2 MoEs
        return dict(layer_types=["full_attention" if i % 2 else "conv" for i in range(num_layers)], conv_L_cache=3,
                    conv_bias=True, num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    if arch == "lfm3":  # conv, sliding-window attention (tiny_config's sliding_window), full attention, repeated
        kinds = ["conv", "sliding_attention", "full_attention"]
        return dict(layer_types=[kinds[i % 3] for i in range(num_layers)])
    kw: dict[str, Any] = dict(
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(num_layers)],
    )
    if arch == "qwen3_next":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                  decoder_sparse_step=1, output_router_logits=False)
    if arch == "qwen3_5_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                  output_router_logits=False)
    return kw
