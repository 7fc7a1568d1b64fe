"""Builds a tiny random Llama model (or, with ``mla``, a DeepSeek-V2-style model with multi-head
latent attention; with ``window``, a hybrid one whose layers alternate sliding-window and full
attention) and a tiny trained tokenizer in a folder, for tests that run real vLLM without
downloading anything. Deterministic for a given seed.

    python tiny_model.py OUT_DIR [--kv-heads N] [--mla] [--window TOKENS]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    words = (
        "the a prefill decode cache block token layer head push pull transfer memory write read "
        "engine request router lease heartbeat queue model vector key value attention latency "
        "time first output batch server client fabric region rank tensor parallel"
    ).split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12 + i % 9)))
    return lines


def build(out: Path, kv_heads: int = 1, seed: int = 1234, mla: bool = False,
          window: int | None = None) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    stamp = out / "kvx-tiny.json"
    want = {"kv_heads": kv_heads, "seed": seed, "mla": mla, "window": window, "rev": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    if mla:
        model = _mla_model(len(fast), fast.bos_token_id, fast.eos_token_id)
    else:
        model = _llama_model(len(fast), kv_heads, fast.bos_token_id, fast.eos_token_id, window)
    # Larger random weights than the default init, so that greedy decoding does not collapse
    # onto one token and the logprobs differ from token to token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out


def _mla_model(vocab: int, bos: int, eos: int):
    """DeepSeek-V2's attention (a 512-value latent and 64 rotary values per token, the sizes
    vLLM's CPU MLA kernel takes) in two small dense layers."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return DeepseekV2ForCausalLM(config)


def _llama_model(vocab: int, kv_heads: int, bos: int, eos: int, window: int | None = None):
    """Two layers of full attention; with ``window``, four that alternate a sliding window of
    that many tokens and full attention (vLLM's hybrid KV cache manager keeps each kind in a
    KV cache group of its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hybrid = {}
    if window is not None:
        hybrid = {
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": window,
        }
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4 if window is not None else 2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **hybrid,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--mla", action="store_true")
    ap.add_argument("--window", type=int)
    args = ap.parse_args()
    print(build(args.out, args.kv_heads, mla=args.mla, window=args.window))


if __name__ == "__main__":
    main()
