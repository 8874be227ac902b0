"""Triton row kernels (RMSNorm, LayerNorm, RoPE, SwiGLU, GeGLU) and model patching."""
