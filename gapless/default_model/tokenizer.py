"""A real byte-level BPE tokenizer, trained locally on a built-in corpus.

The default model and the test checkpoints need a tokenizer that behaves like a production one
(byte-level BPE, special tokens, a chat template, multi-byte characters split across tokens) but must
never touch the network. Training a
~1000-token BPE on a few KB of embedded text takes a fraction of a second, keeps the tiny models'
embedding tables small, and is deterministic, so every process gets the same vocabulary.

A model with a real model's vocabulary (the GPU benchmark's Qwen3-0.6B shape: 151,936 ids) gets the same
tokenizer with its vocabulary filled up to the model's (`build_tokenizer(vocab_size=...)`): each id past
the trained ones decodes to a text of its own (`FILLER_TEXT`), so whatever a random-weight model samples
streams as text, as a real model's tokens do. The filler entries have no merges, so encoding never
produces them and every text encodes as it does with the trained vocabulary alone.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 1000
# what an id past the trained vocabulary decodes to; as a byte-level token a space is "Ġ" (U+0120)
FILLER_TEXT = " tok{}"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# ChatML, as Qwen uses it. `add_generation_prompt` opens the assistant turn the model must complete.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Varied on purpose: prose for common merges, code and numbers for punctuation and digits, and
# accented Latin, Chinese, Japanese and emoji so that some characters become single tokens while
# rarer ones stay split across several byte tokens (streaming detokenizers must handle both).
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.",
    "Every morning he rowed out past the rocks, cast his nets, and waited for the tide to turn.",
    "She kept a garden of herbs and vegetables, and on market days she sold bread in the square.",
    "The weather was often cold and windy, but the people of the village were patient and kind.",
    "A language model predicts the next token given all the tokens that came before it.",
    "Inference engines batch many requests together so that the accelerator is never idle.",
    "While the device computes one batch, the host prepares the next one and processes the last.",
    "The key-value cache stores attention keys and values so that earlier tokens are not recomputed.",
    "A radix tree lets requests that share a prompt prefix reuse the same cached memory pages.",
    "Paged attention splits the cache into fixed-size blocks, much like virtual memory in an OS.",
    "Scheduling is a trade-off between latency for each user and throughput for the whole system.",
    "Chunked prefill breaks a long prompt into pieces so decoding requests keep making progress.",
    "When memory runs out, the scheduler may retract a request and recompute it later.",
    "Hello! How are you today? I'm fine, thanks. What would you like to talk about?",
    "Can you explain how photosynthesis works? Plants turn light, water and carbon dioxide into sugar.",
    "Please write a short poem about the moon, the stars, and the quiet night over the mountains.",
    "The history of mathematics is long: from counting stones to calculus, algebra, and geometry.",
    "In 1969, astronauts landed on the Moon; in 1989 the Berlin Wall fell; in 2007 phones got smarter.",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 42 64 100 128 256 512 1024 2048 4096 65536.",
    "Prices rose by 3.5% last year; the total was $1,234.56, or about 1.2e3 dollars.",
    "Phone: +1 (555) 010-9999. Date: 2024-05-17T12:34:56Z. Version 2.13.0, build #4821.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    'for i in range(10):\n    print(f"step {i}: loss={loss:.4f}")',
    "import torch\nx = torch.randn(4, 8)\ny = x @ x.T\nprint(y.shape)",
    "class Request:\n    def __init__(self, prompt_ids: list[int]) -> None:\n"
    "        self.prompt_ids = prompt_ids",
    'if (x != null && y >= 0) { return x[y] * 2; } else { throw new Error("bad index"); }',
    "SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;",
    '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": true}',
    "<html><body><p>Hello, world!</p></body></html>",
    "$ make test && make serve --port 8000 | tee log.txt",
    "Le café est très bon, mais la crème brûlée est meilleure. C'est un rêve naïf.",
    "Der Bär läuft über die Straße, und die Kinder spielen fröhlich im Schnee.",
    "¿Dónde está la estación? El niño comió una piña en la mañana.",
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир. Українська: дякую.",
    "café naïve résumé façade coöperate jalapeño Zürich São Paulo Kraków Ångström",
    "我们今天去公园散步，天气很好。你好，世界！人工智能正在改变我们的生活。",
    "中文文本用于测试多字节字符的分词和解码。北京上海广州深圳。",
    "こんにちは、世界。今日はいい天気ですね。日本語のテキストも少し入れておきます。",
    "カタカナとひらがなと漢字がまざっています。東京タワーへ行きましょう。",
    "한국어도 조금: 안녕하세요, 반갑습니다.",
    "Emoji: 😀 😃 🎉 🚀 👍 ❤️ 🔥 ✨ 🌍 🐍 🤖 👨‍👩‍👧 🇯🇵 🏳️‍🌈",
    "I love pizza 🍕 and coffee ☕ in the morning! 😂😂😂",
    "Math symbols: α + β = γ, ∑ x² ≤ ∞, √2 ≈ 1.414, π ≈ 3.14159, ∀x ∃y: x → y.",
    "Arrows and marks: ← ↑ → ↓ • … — – “quoted” ‘single’ « guillemets » © ® ™ € £ ¥.",
    "The committee will meet again next week to discuss the budget, the schedule, and the plan.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "To be, or not to be, that is the question: whether it is nobler in the mind to suffer.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "Call me Ishmael. Some years ago, never mind how long precisely, I thought I would sail about.",
    "The students read their books in the library until the lights were turned off at midnight.",
    "Researchers measured the temperature, pressure, and humidity every hour for three months.",
    "After dinner they walked along the river, talking about music, travel, and their families.",
    "The train to the city leaves at seven o'clock and arrives a little after nine.",
    "He opened the door slowly, looked around the empty room, and sat down by the window.",
    "Good software is simple, tested, and easy to change; bad software is none of these things.",
    "Question: what is the capital of France? Answer: Paris is the capital of France.",
    "Question: what is two plus two? Answer: two plus two is four.",
    "User: tell me a joke. Assistant: Why did the chicken cross the road? To get to the other side!",
    "The sun rises in the east and sets in the west; the seasons change and the years go by.",
    "Birds sing in the trees, children laugh in the park, and the city slowly wakes up.",
    "A good cup of tea needs fresh water, a warm pot, and a few minutes of patience.",
    "Tokens, tokens everywhere: tokenization, tokenizer, tokenized, detokenize, detokenization.",
    "Streaming responses send each new piece of text to the client as soon as it is ready.",
    "The server accepts HTTP requests, validates them, and returns JSON with the generated text.",
)


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """Train the BPE once per process and hand out its JSON; training is the slow part."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=4)
def tokenizer_json(vocab_size: int | None = None) -> str:
    """The trained tokenizer's JSON with its vocabulary filled up to `vocab_size` ids (None, or no more
    than it has: as trained); id i past the trained ones decodes to `FILLER_TEXT.format(i)`."""
    data = json.loads(trained_tokenizer_json())
    vocab: dict[str, int] = data["model"]["vocab"]
    if vocab_size is None or vocab_size <= len(vocab):
        return trained_tokenizer_json()
    byte_level_space = chr(0x100 + ord(" "))  # the byte-level alphabet's stand-in for a space
    for i in range(len(vocab), vocab_size):
        vocab[FILLER_TEXT.format(i).replace(" ", byte_level_space)] = i
    if len(vocab) != vocab_size:
        raise AssertionError(f"a filler token collided with a trained one: {len(vocab)} != {vocab_size}")
    return json.dumps(data, ensure_ascii=False)


def build_tokenizer(
    save_dir: str | Path | None = None, vocab_size: int | None = None
) -> PreTrainedTokenizerFast:
    """Return the built-in tokenizer (a fresh object each call), saving it to `save_dir` when given; with
    `vocab_size` above the trained vocabulary's size, filled up to it (see `tokenizer_json`).

    A fresh wrapper per call means callers may mutate it (padding side, template) without
    affecting others; only the trained vocabulary is shared.
    """
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json(vocab_size)),
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer
