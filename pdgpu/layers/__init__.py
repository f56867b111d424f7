"""The model's layers: the dense families' (dense_blocks: RMSNorm, attention, SwiGLU MLP and
their block, weights fused) and the hybrid families' (gated DeltaNet linear attention, the
hybrids' attention with gated output, partial RoPE and sliding window, their norms and
blocks), with RoPE and the K/V ports they call."""
