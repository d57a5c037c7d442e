"""Writes tests/reference/pretokenize.jsonl: how the regular expressions of Llama 3's and
Qwen2's tokenizer.json cut the texts of tests/reference/tokenizer-gpt2.jsonl into words, as
the lengths of the words in code points, one line per text (the first 1500 texts). Computed
with the `regex` package (pip install regex), whose \\p{L}, \\p{N} and \\s follow Unicode as
the Oniguruma engine of Hugging Face tokenizers does. tests/test_data.c compares litgpt.h's
hand-written matchers with it. Run from the repository root:
    python3 tests/make_pretokenizer_reference.py
"""
import json
import regex

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")

def lengths(pattern, text):
    return [len(m.group(0)) for m in regex.finditer(pattern, text)]

with open("tests/reference/tokenizer-gpt2.jsonl", encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f][:1500]
with open("tests/reference/pretokenize.jsonl", "w", encoding="utf-8") as out:
    for text in texts:
        out.write(json.dumps({"llama3": lengths(LLAMA3, text), "qwen2": lengths(QWEN2, text)},
                             separators=(",", ":")) + "\n")
print(f"wrote tests/reference/pretokenize.jsonl: {len(texts)} texts")
