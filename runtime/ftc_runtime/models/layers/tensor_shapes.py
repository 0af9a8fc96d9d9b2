"""Checkpoint tensor names and shapes that several families share: the embedding, final norm and LM
head, and a SwiGLU MLP's projections."""

from __future__ import annotations

from ftc_runtime.spec import ModelSpec


def end_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The embedding, the final norm and (untied) the LM head, by checkpoint name."""
    h = spec.hidden_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def mlp_tensor_shapes(prefix: str, intermediate: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's gate, up and down projections under `prefix` (e.g. `model.layers.3.mlp.`)."""
    return {prefix + "gate_proj.weight": (intermediate, hidden), prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


