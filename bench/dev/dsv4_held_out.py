"""DeepSeek-V4 at a shape the test suite never builds (held out from tests/hf_deepseek_v4_models.py):
another hidden size, head count and head dim, 2 streams, 3 Sinkhorn steps, CSA every 2 tokens, HCA
every 16, a window of 5, 6 layers beginning with CSA and with one hash layer, next to last. Compiled
from transformers' fused checkpoint and run against transformers: a prompt whole, in chunks, then
one-token steps.

    python bench/dev/dsv4_held_out.py [--seed N]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from ftc.compile.pipeline import CompileOptions, compile_engine  # noqa: E402
from ftc_runtime import Engine  # noqa: E402

from families import reference_logits, rel  # noqa: E402
from hf_deepseek_v4_models import VOCAB, deepseek_v4_fields, random_model, save_deepseek_v4_checkpoint  # noqa: E402

HELD_OUT = {"hidden_size": 96, "num_attention_heads": 6, "head_dim": 48, "q_lora_rank": 40, "o_groups": 3,
            "o_lora_rank": 24, "index_n_heads": 6, "index_head_dim": 24, "n_routed_experts": 12,
            "num_experts_per_tok": 3, "moe_intermediate_size": 48, "hc_mult": 2, "hc_sinkhorn_iters": 3,
            "sliding_window": 5, "index_topk": 256, "num_hidden_layers": 6,
            "layer_types": ["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
            "mlp_layer_types": ["moe", "moe", "moe", "moe", "hash_moe", "moe"],
            "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
            "swiglu_limit": 1.5}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng, g = random.Random(a.seed), torch.Generator().manual_seed(a.seed)
    fields = deepseek_v4_fields() | HELD_OUT
    fields["rope_parameters"] = {k: v | {"partial_rotary_factor": 0.25} for k, v in fields["rope_parameters"].items()}
    model = random_model(fields, g)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_deepseek_v4_checkpoint(model, Path(tmp) / "ckpt", "fused")
        engine_dir = compile_engine(CompileOptions(source=ckpt, target="cpu", output=Path(tmp) / "engine"))
        ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(60, 100))]
        want = reference_logits(model, ids)
        whole = Engine.load(engine_dir).logits(ids)
        chunked = Engine.load(engine_dir, prefill_chunk=rng.randrange(5, 17)).logits(ids)
        engine = Engine.load(engine_dir)
        cache = engine.model.new_cache()
        engine.prefill(torch.tensor(ids[:40]), cache)
        steps = torch.stack([engine.model.forward(torch.tensor([t]), cache)[-1] for t in ids[40:]])
    print(f"seed {a.seed}, {len(ids)} tokens: whole {rel(whole, want):.2e}, chunked {rel(chunked, want):.2e}, "
          f"steps {rel(steps, want[40:]):.2e} (relative to transformers, fp32)")


if __name__ == "__main__":
    main()
