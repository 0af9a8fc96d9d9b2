"""Layers shared by the model families: norms, RoPE, attention, MLPs, routers, Gated DeltaNet."""
