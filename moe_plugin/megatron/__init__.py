"""megatron-core integration: CPU compatibility, and the latent MoE layer on megatron's dispatcher."""
