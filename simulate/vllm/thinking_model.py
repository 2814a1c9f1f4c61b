"""Build the thinking model: a tiny Llama trained to give the fixed chats of ``transcripts.py`` under greedy decoding.

Run with the vLLM venv's Python (``tokenizers``, ``transformers``, ``torch``): ``python thinking_model.py OUT_DIR``.
The tiny random model never writes ``</think>`` or ``<tool_call>``, so vLLM's reasoning and tool-call parsers never
act on it; this one reasons, answers and calls tools, every time the same way. A byte-level BPE tokenizer is trained
on the transcripts' own text, the four markers are added to it as single non-special tokens, and the model is trained
on each chat as the template renders it (loss on the completion and its end-of-turn token only) until every next
token of every completion is the model's first choice by a clear margin: greedy decoding is then that teacher-forced
first choice, token by token, on vLLM's kernels too. A few hundred steps, one to three minutes on two cores.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the transcripts' package
from simulate.vllm.transcripts import CHAT_TEMPLATE, END_OF_TURN, MARKERS, SPECIAL, TOOLS, TRANSCRIPTS

SEED = 4321
VOCAB_SIZE = 700
MAX_STEPS = 1500
MARGIN = 3.0  # logits: the right token leads the next by this much, so other kernels' rounding cannot swap them
THREADS = 2


def corpus() -> list[str]:
    texts = [t.completion for t in TRANSCRIPTS] + [t.user for t in TRANSCRIPTS]
    return texts + [json.dumps(tool["function"]) for tool in TOOLS] + [CHAT_TEMPLATE]


def tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    bpe.add_tokens([AddedToken(marker, special=False, normalized=False) for marker in MARKERS])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END_OF_TURN, pad_token=SPECIAL[0])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def examples(fast: Any) -> list[tuple[list[int], list[int]]]:
    """Each chat's prompt ids (as vLLM renders and encodes it) and completion ids, end of turn included."""
    out = []
    for t in TRANSCRIPTS:
        prompt = fast.apply_chat_template(t.messages, tools=t.tools, add_generation_prompt=True, tokenize=False)
        completion = [*fast.encode(t.completion, add_special_tokens=False), fast.eos_token_id]
        assert fast.decode(completion, skip_special_tokens=True) == t.completion
        out.append((fast.encode(prompt, add_special_tokens=False), completion))
    return out


def train(fast: Any, pairs: list[tuple[list[int], list[int]]]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=6,
        max_position_embeddings=2048,
        bos_token_id=fast.convert_tokens_to_ids(SPECIAL[0]),
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), width), fast.pad_token_id)
    labels = torch.full((len(pairs), width), -100)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for row, (prompt, completion) in enumerate(pairs):
        whole = prompt + completion
        ids[row, : len(whole)] = torch.tensor(whole)
        labels[row, len(prompt) : len(whole)] = torch.tensor(completion)
        mask[row, : len(whole)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    started = time.monotonic()
    for step in range(MAX_STEPS):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 19:
            margin = _margin(model, ids, mask, labels)
            print(f"step {step + 1} loss {loss.item():.4f} margin {margin:.2f} {time.monotonic() - started:.0f} s")
            if margin >= MARGIN:
                return model
    raise RuntimeError(f"the model did not learn its transcripts in {MAX_STEPS} steps")


def _margin(model: Any, ids: Any, mask: Any, labels: Any) -> float:
    """The smallest lead of the right next token's logit over any other's, across every completion token."""
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    wanted = labels[:, 1:]
    scored = wanted != -100
    right = logits.gather(-1, wanted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, wanted.clamp(min=0).unsqueeze(-1), float("-inf")).max(-1).values
    return float((right - others)[scored].min())


def build(out: Path) -> None:
    fast = tokenizer()
    model = train(fast, examples(fast))
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    (out / "recipe.json").write_text(json.dumps({"seed": SEED, "transcripts": [t.name for t in TRANSCRIPTS]}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
