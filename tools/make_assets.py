"""Regenerate the bundled assets: a small instruction dataset, a BPE tokenizer trained on it, a tiny Llama config.

    python tools/make_assets.py                      # everything
    python tools/make_assets.py --preferences_only   # only the preference set (the tokenizer stays as it is)

Writes zero_utils/assets/sft_tiny.jsonl and zero_utils/assets/tiny-llama/ (config.json, tokenizer files), and
zero_utils/assets/dpo_tiny.jsonl: preference pairs over the same tasks ({"prompt", "chosen", "rejected"}), the
chosen answer right, the rejected one a plausible mistake (the country's best-known other city, the operands
written side by side, the text reversed letter by letter, the numbers left in their order, the word unspelled,
another color, the digit) that a ~1M-parameter model learns to tell apart within 150 DPO steps.
Deterministic: the same seed gives the same files, so the committed assets can be checked by re-running this.
The dataset is synthetic on purpose: short, regular tasks a ~1M-parameter model learns within a few hundred
optimizer steps on a CPU, so "did fine-tuning work" is visible in minutes, with no download.
"""

import json
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "zero_utils" / "assets"
SEED = 1234
NUM_EXAMPLES = 4000

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Peru": "Lima", "Chile": "Santiago",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Austria": "Vienna", "Ireland": "Dublin", "Turkey": "Ankara", "Russia": "Moscow", "Australia": "Canberra",
}
COLORS = {
    "the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
    "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown", "ash": "grey",
}
WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket", "garden", "silver",
         "candle", "forest", "window", "bridge", "planet", "dragon", "pencil", "castle", "winter", "ocean"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def make_example(rng: random.Random) -> dict:
    kind = rng.randrange(7)
    if kind == 0:
        country = rng.choice(sorted(CAPITALS))
        templates = ["What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?"]
        prompt = rng.choice(templates).format(country)
        answer = f"The capital of {country} is {CAPITALS[country]}."
    elif kind == 1:
        a, b = rng.randrange(50), rng.randrange(50)
        prompt = rng.choice(["What is {} plus {}?", "Add {} and {}.", "Compute {} + {}."]).format(a, b)
        answer = f"{a} plus {b} is {a + b}."
    elif kind == 2:
        words = rng.sample(WORDS, rng.randint(3, 5))
        prompt = "Reverse the order of these words: " + " ".join(words)
        answer = " ".join(reversed(words))
    elif kind == 3:
        word = rng.choice(WORDS)
        prompt = rng.choice(["Spell the word {}.", "How do you spell {}?"]).format(word)
        answer = "-".join(word)
    elif kind == 4:
        numbers = [rng.randrange(100) for _ in range(rng.randint(3, 6))]
        prompt = "Sort these numbers from smallest to largest: " + ", ".join(map(str, numbers))
        answer = ", ".join(map(str, sorted(numbers)))
    elif kind == 5:
        thing = rng.choice(sorted(COLORS))
        prompt = f"What color is {thing}?"
        answer = f"{thing[0].upper() + thing[1:]} is {COLORS[thing]}."
    else:
        digit = rng.randrange(10)
        prompt = f"Write the number {digit} in words."
        answer = NUMBER_WORDS[digit]
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


PREFERENCE_SEED, NUM_PAIRS = 4321, 2000
# The city often mistaken for each capital: a larger or better-known city of the same country.
MISTAKEN_CAPITALS = {
    "France": "Lyon", "Germany": "Munich", "Italy": "Milan", "Spain": "Barcelona", "Portugal": "Porto",
    "Japan": "Osaka", "China": "Shanghai", "India": "Mumbai", "Egypt": "Alexandria", "Kenya": "Mombasa",
    "Canada": "Toronto", "Mexico": "Guadalajara", "Brazil": "Rio de Janeiro", "Peru": "Cusco", "Chile": "Valparaiso",
    "Norway": "Bergen", "Sweden": "Gothenburg", "Finland": "Tampere", "Poland": "Krakow", "Greece": "Thessaloniki",
    "Austria": "Salzburg", "Ireland": "Cork", "Turkey": "Istanbul", "Russia": "Saint Petersburg",
    "Australia": "Sydney",
}


def rejected_answer(example: dict, rng: random.Random) -> str:
    """A plausible wrong answer to one of `make_example`'s prompts (its kind read back from the prompt)."""
    prompt, answer = example["messages"][0]["content"], example["messages"][1]["content"]
    if "capital" in prompt:
        country = next(c for c in CAPITALS if c in prompt)
        return f"The capital of {country} is {MISTAKEN_CAPITALS[country]}."
    if "plus" in prompt or "Add" in prompt or "+" in prompt:
        a, b = (int(n) for n in answer.split(" is ")[0].split(" plus "))
        return f"{a} plus {b} is {a}{b}."  # the operands side by side, a classic slip
    if prompt.startswith("Reverse"):
        return answer[::-1]  # the text reversed letter by letter, not word by word
    if "pell" in prompt:
        return answer.replace("-", "")  # the word, not spelled out
    if prompt.startswith("Sort"):
        return prompt.split(": ", 1)[1]  # the numbers in their order
    if prompt.startswith("What color"):
        thing = prompt.removeprefix("What color is ").removesuffix("?")
        wrong = rng.choice(sorted(set(COLORS.values()) - {COLORS[thing]}))
        return f"{thing[0].upper() + thing[1:]} is {wrong}."
    return str(NUMBER_WORDS.index(answer))  # the digit, not the word


def make_pair(rng: random.Random) -> dict:
    example = make_example(rng)
    rejected = rejected_answer(example, rng)
    while rejected == example["messages"][1]["content"]:  # e.g. numbers already sorted: draw another task
        example = make_example(rng)
        rejected = rejected_answer(example, rng)
    return {"prompt": example["messages"][0]["content"], "chosen": example["messages"][1]["content"],
            "rejected": rejected}


def write_preferences() -> None:
    rng = random.Random(PREFERENCE_SEED)
    with open(ASSETS / "dpo_tiny.jsonl", "w") as f:
        for _ in range(NUM_PAIRS):
            f.write(json.dumps(make_pair(rng)) + "\n")
    print(f"wrote {NUM_PAIRS} preference pairs to {ASSETS / 'dpo_tiny.jsonl'}")


# A ChatML-style template: the assistant turn is what the loss is computed on (the data module masks the rest).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    rng = random.Random(SEED)
    examples = [make_example(rng) for _ in range(NUM_EXAMPLES)]
    ASSETS.mkdir(parents=True, exist_ok=True)
    with open(ASSETS / "sft_tiny.jsonl", "w") as f:
        for example in examples:
            f.write(json.dumps(example) + "\n")

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for ex in examples for m in ex["messages"]]
    tokenizer.train_from_iterator(corpus, trainer=trainer)

    out = ASSETS / "tiny-llama"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|end|>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=special[4:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=fast.vocab_size if len(fast) <= fast.vocab_size else len(fast),
        hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    )
    config.save_pretrained(out)
    print(f"wrote {len(examples)} examples and a {len(fast)}-token tokenizer to {ASSETS}")
    write_preferences()


if __name__ == "__main__":
    import sys

    write_preferences() if "--preferences_only" in sys.argv[1:] else main()
