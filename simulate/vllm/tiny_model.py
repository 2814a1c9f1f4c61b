"""Build the tiny Llama that the real-engine tests serve: offline, deterministic, in seconds.

Run with the vLLM venv's Python (it needs ``tokenizers``, ``transformers`` and ``torch``, which spotdrain itself
never imports): ``python tiny_model.py OUT_DIR``. A byte-level BPE tokenizer is trained on a corpus generated here
from a fixed seed (with multi-byte characters, so some tokens are partial UTF-8 and vLLM streams them as empty text),
and a 2-layer Llama gets random weights from a fixed seed. Greedy output is then deterministic and the same on every
replica, which is what the continuation tests compare against.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 3000
SEED = 1234
_WORDS = (
    "the a stream token node spot drain engine replica gateway kube pod notice deadline cache model weights "
    "interruption capacity request response prompt text chunk finish reason usage server client queue "
    "naïve café Grüße straße crème brûlée façade über Ελλάδα данные узел 東京 節点 流れ 모델 토큰 🚀 ✓ — … «» "
    "0 1 2 3 42 128 2048 3.14 , . ; : ! ? ( ) [ ] { } \" ' - + = / * # @ % & _ ~"
)
WORDS = _WORDS.split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ("<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>")


def corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(lines)]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.token_to_id("<|bos|>"),
        eos_token_id=tokenizer.token_to_id("<|eos|>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider than the default init: greedy text varies instead of repeating one token
        for weight in model.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 2.0 * weight.shape[1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)
    (out / "recipe.json").write_text(json.dumps({"seed": SEED, "vocab_size": VOCAB_SIZE}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
