"""The hybrid families' layers: gated DeltaNet (linear attention), the hybrids' attention
(gated output, partial RoPE, sliding window), their norms and blocks."""
