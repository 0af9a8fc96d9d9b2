"""An HF `config.json` as the families' mappings read it: required and defaulted fields, RoPE
parameters and the dense (non-MoE) layers, each error naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from ftc_runtime.spec import MAX_LAYERS, SpecError


class HfConfig:
    def __init__(self, config: dict[str, Any], where: Path):
        self.config, self.where = config, where

    @property
    def model_type(self) -> Any:
        return self.config.get("model_type")

    def get(self, key: str, default: Any = ...) -> Any:
        """The field's value; `default` where it is absent or null (no default: an error)."""
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if default is ...:
            raise SpecError(f"{self.where}: missing required field '{key}'")
        return default

    def rope(self, partial_default: float) -> dict[str, float]:
        """The spec's `rope` section: plain RoPE only (a scaled variant is refused by name)."""
        rope = self.config.get("rope_parameters") or self.config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise SpecError(f"{self.where}: rope type {rope_type!r} is not supported yet (only 'default')")
        theta = rope.get("rope_theta", self.config.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", self.config.get("partial_rotary_factor", partial_default))
        return {"theta": float(theta), "partial_rotary_factor": float(partial)}

    def dense_layers(self, n_layers: Any, n_experts: Any) -> list[int]:
        """Layers with a dense MLP instead of experts (`mlp_only_layers`, `decoder_sparse_step`)."""
        if not isinstance(n_layers, int) or not 0 < n_layers <= MAX_LAYERS:
            return []  # ModelSpec.from_dict then names num_layers and its value, without looping over it
        step, mlp_only = self.get("decoder_sparse_step", 1), set(self.get("mlp_only_layers", []))
        return [i for i in range(n_layers) if i in mlp_only or n_experts == 0 or (i + 1) % step != 0]

    def decoder_fields(self) -> dict[str, Any]:
        """The spec fields every decoder-only MoE config names alike (sizes, attention heads)."""
        if self.config.get("use_sliding_window"):
            raise SpecError(f"{self.where}: field 'use_sliding_window' = true: sliding-window attention "
                            "is not supported yet")
        heads, hidden = self.get("num_attention_heads"), self.get("hidden_size")
        return {
            "num_layers": self.get("num_hidden_layers"),
            "hidden_size": hidden,
            "vocab_size": self.get("vocab_size"),
            "max_position_embeddings": self.get("max_position_embeddings", 32768),
            "tie_word_embeddings": self.get("tie_word_embeddings", False),
            "expert_format": "bf16",
            "name": self.where.parent.resolve().name,
            "checkpoint": str(self.where.parent.resolve()),
            "tokens": self.tokens(),
            "attention": {"num_heads": heads, "head_dim": self.get("head_dim", hidden // heads)},
        }

    def tokens(self) -> dict[str, Any]:
        """Special tokens from the directory's tokenizer.json when there is one; the eos ids by name."""
        eos = self.get("eos_token_id", [])
        eos = [eos] if isinstance(eos, int) else list(eos)
        tok_json = self.where.parent / "tokenizer.json"
        if tok_json.is_file():
            added = read_tokenizer(tok_json).get_added_tokens_decoder()
            special = {t.content: i for i, t in added.items() if t.special}
            by_id = {v: k for k, v in special.items()}
            return {"special": special, "eos": [by_id[i] for i in eos if i in by_id]}
        return {"special": {f"<|special_{i}|>": i for i in eos}, "eos": [f"<|special_{i}|>" for i in eos]}


def read_tokenizer(path: Path) -> Tokenizer:
    """A checkpoint's tokenizer.json as the engine will read it (through `tokenizers`), or a
    SpecError naming the file: a damaged one must not surface later as a library traceback."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception for every parse error
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(f"{path}: not a readable tokenizer ({reason})") from None
