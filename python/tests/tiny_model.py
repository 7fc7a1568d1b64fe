"""Builds a tiny random Llama model and a tiny trained tokenizer in a folder, for tests that run
real vLLM without downloading anything. Deterministic for a given seed.

    python tiny_model.py OUT_DIR [--kv-heads N]
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


def build(out: Path, kv_heads: int = 1, seed: int = 1234) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    stamp = out / "kvx-tiny.json"
    want = {"kv_heads": kv_heads, "seed": seed, "rev": 1}
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
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # Larger random weights than the default init, so that greedy decoding does not collapse
    # onto one token and the logprobs differ from token to token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(want))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--kv-heads", type=int, default=1)
    args = ap.parse_args()
    print(build(args.out, args.kv_heads))


if __name__ == "__main__":
    main()
