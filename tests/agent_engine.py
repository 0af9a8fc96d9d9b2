"""A tiny Qwen3-MoE checkpoint that plays one agent turn and its follow-up, for driving agent
harnesses (Claude Code, OpenCode) against `ftc run --serve` without a trained model: asked
anything, it calls one scripted tool; once a tool result is in the conversation, it answers one
scripted sentence and ends its turn, so that a harness's session ends by itself.

The model is a bigram machine with one switch. Its hidden state at a position is that token's
embedding, plus a fixed "after a tool result" direction where a `<tool_response>` token is
earlier in the context: an attention head puts all its weight on such a token (its key alone
points where every query points; every other embedding is orthogonal to it) and copies that
direction out; the experts' down projections are nearly zero. `lm_head` row r sums the normalized
embeddings of the tokens that r follows, in the tool-call chain, and of the tokens it follows in
the answer chain mixed with the switch direction: random embeddings in 256 dimensions are nearly
orthogonal, so the next token is the chain's by a margin that survives sampling at temperature 1.

The tokenizer is a real byte-level BPE trained here with the `tokenizers` library, with Qwen3's
special tokens and tag tokens. Its pre-tokenizer splits text after whitespace runs, so that every
piece of the scripted texts is its own pre-token and BPE merges each into one token: a bigram
chain needs every token of its text to be distinct (`script_chains` checks it).
"""

from __future__ import annotations

import itertools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
VOCAB = 8192  # BPE tokens before the tag tokens: enough to keep agents' long prompts near 3.5 chars a token

# Qwen3's own chat template (Qwen3-30B-A3B): tools in the system turn, Hermes-style <tool_call>
# blocks, tool results as <tool_response> in user turns, an empty think block when thinking is off.
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with \
function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n\
</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]\
.lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# The ends of a generation prompt (thinking on, thinking off): the model's first token follows them.
PROMPT_ENDS = ("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@dataclass(frozen=True)
class ToolScript:
    """What the model says: one tool call, whatever it is asked; `answer` once a tool result is in."""

    tool: str
    arguments: dict[str, Any]
    answer: str = "Done: the command printed hi."

    @property
    def text(self) -> str:
        """The call as Qwen3 writes it (and as the template renders it back into the history)."""
        return f'<tool_call>\n{{"name": "{self.tool}", "arguments": {json.dumps(self.arguments)}}}\n</tool_call>'


@dataclass(frozen=True)
class TinyShape:
    hidden: int = 256  # near-orthogonal random embeddings need a few hundred dimensions
    layers: int = 1
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 16  # small heads keep 20k-token prefills quick on 2 cores
    experts: int = 4
    top_k: int = 2
    moe_intermediate: int = 32
    max_positions: int = 65536


def _corpus() -> list[str]:
    """Python's own sources: English docstrings, code and JSON-like punctuation, like agents' prompts."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        if size > 2_000_000:  # enough for a useful vocabulary; more only slows training
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
    return texts


def train_tokenizer(scripts: list[ToolScript]) -> Tokenizer:
    """A byte-level BPE in Qwen's structure (a split pre-tokenizer, then bytes), trained on the
    corpus plus the scripted texts and chat prompt ends, repeated so that BPE merges each of their
    pre-tokens into a single token."""
    tok = Tokenizer(models.BPE())
    # Split after each whitespace run: `"echo ` and `hi", ` are pre-tokens, so repeated JSON
    # punctuation stays inside distinct tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\S+\s*|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    drill = [s.text.replace("<tool_call>", "").replace("</tool_call>", "") for s in scripts]
    drill += [s.answer for s in scripts] + ["assistant\n", "\n\n"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus() + drill * 500, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


def _chain(tok: Tokenizer, text: str) -> dict[int, int]:
    """successor[token] for every prompt end and every token of `text`, up to <|im_end|>. Raises
    when a token would need two successors (the BPE did not merge the text into distinct tokens)."""
    ids = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|im_end|>")]
    ends = {tok.encode(end, add_special_tokens=False).ids[-1] for end in PROMPT_ENDS}
    if len(set(ids)) != len(ids) or ends & set(ids):
        pieces = [tok.id_to_token(i) for i in ids]
        raise AssertionError(f"the scripted text's tokens repeat, a bigram model cannot say it: {pieces}")
    return dict.fromkeys(ends, ids[0]) | dict(itertools.pairwise(ids))


def script_chains(tok: Tokenizer, script: ToolScript) -> tuple[dict[int, int], dict[int, int]]:
    """The successors of the tool-call turn and of the answer after a tool result."""
    return _chain(tok, script.text), _chain(tok, script.answer)


# The right next token's logit is about MARGIN·sqrt(hidden) = 96; the runner-up's is 25 or more lower.
MARGIN = 6.0


def bigram_weights(shape: TinyShape, vocab: int, chains: tuple[dict[int, int], dict[int, int]], switch: int,
                   seed: int) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE tensors (per-expert layout, attention biases) of the model described above:
    next token chains[0][t], or chains[1][t] where token `switch` is earlier in the context."""
    g = torch.Generator().manual_seed(seed)
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    slow = d // 2 - 1  # the head dimension RoPE turns slowest (1e-5 rad a token): keys match at any distance

    def randn(*size: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*size, generator=g) * std

    embed = randn(vocab, h, std=1.0)
    key = embed[switch] / embed[switch].norm()
    others = torch.arange(vocab) != switch
    embed[others] -= (embed[others] @ key)[:, None] * key  # no other token has a key
    unit = embed / embed.norm(dim=-1, keepdim=True)
    after = randn(h, std=1.0)
    after /= after.norm()
    lm_head = torch.zeros(vocab, h)
    for token, successor in chains[0].items():
        lm_head[successor] += MARGIN * unit[token]
    for token, successor in chains[1].items():
        lm_head[successor] += MARGIN * unit[token] / 2 ** 0.5
    for successor in set(chains[1].values()):  # once a row, however many tokens it follows
        lm_head[successor] += MARGIN * after / 2 ** 0.5
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": torch.ones(h)}
    head_norm = torch.ones(d)
    head_norm[slow] = 8.0  # query and key norms: the switch token's score is ~250, any other's ~0
    q_bias, k_bias, k_proj, v_proj, o_proj = torch.zeros(q), torch.zeros(kv), torch.zeros(kv, h), \
        torch.zeros(kv, h), torch.zeros(h, q)
    q_bias[slow::d] = 1.0  # every query: the same direction
    k_bias[0] = 4.0  # keys of other tokens: orthogonal to the queries
    k_proj[slow] = key  # the switch token's key: along the queries
    v_proj[0] = key  # its value: sqrt(hidden) in dimension 0, every other token's nothing
    o_proj[:, 0] = after  # head 0, dimension 0: the residual gets sqrt(hidden)·after
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                    p + "self_attn.q_proj.weight": torch.zeros(q, h), p + "self_attn.q_proj.bias": q_bias,
                    p + "self_attn.k_proj.weight": k_proj, p + "self_attn.k_proj.bias": k_bias,
                    p + "self_attn.v_proj.weight": v_proj, p + "self_attn.v_proj.bias": torch.zeros(kv),
                    p + "self_attn.o_proj.weight": o_proj if i == 0 else torch.zeros(h, q),
                    p + "self_attn.o_proj.bias": torch.zeros(h),
                    p + "self_attn.q_norm.weight": head_norm, p + "self_attn.k_norm.weight": head_norm,
                    p + "mlp.gate.weight": randn(shape.experts, h, std=0.5)}
        for e in range(shape.experts):
            x = f"{p}mlp.experts.{e}."
            # Not zero: `ftc compile` checks its expert kernel against torch by relative error.
            tensors |= {x + "gate_proj.weight": randn(shape.moe_intermediate, h, std=0.1),
                        x + "up_proj.weight": randn(shape.moe_intermediate, h, std=0.1),
                        x + "down_proj.weight": randn(h, shape.moe_intermediate, std=1e-4)}
    return {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}


def hf_config(shape: TinyShape, vocab: int, tok: Tokenizer) -> dict[str, Any]:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
            "hidden_size": shape.hidden, "intermediate_size": 4 * shape.hidden,
            "moe_intermediate_size": shape.moe_intermediate, "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "attention_bias": True, "num_experts": shape.experts, "num_experts_per_tok": shape.top_k,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "bos_token_id": tok.token_to_id("<|endoftext|>"),
            "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
            "torch_dtype": "bfloat16"}


def tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    added = {str(tok.token_to_id(t)): {"content": t, "special": t in SPECIAL_TOKENS, "normalized": False,
                                       "lstrip": False, "rstrip": False, "single_word": False}
             for t in SPECIAL_TOKENS + TAG_TOKENS}
    return {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 65536,
            "chat_template": QWEN3_CHAT_TEMPLATE}


def build_checkpoint(directory: Path, tok: Tokenizer, script: ToolScript, seed: int = 0,
                     shape: TinyShape = TinyShape()) -> Path:
    """An HF checkpoint directory (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json with Qwen3's chat template) for `ftc compile`."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    weights = bigram_weights(shape, vocab, script_chains(tok, script), tok.token_to_id("<tool_response>"), seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(shape, vocab, tok), indent=1))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=1))
    tok.save(str(directory / "tokenizer.json"))
    return directory
