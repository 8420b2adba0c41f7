"""An offline byte-level BPE tokenizer with a ChatML chat template.

Nothing can be downloaded at run time, so the embedded policy trains its own tokenizer on a
small synthetic corpus of shell sessions, Python code and task instructions (generated
below, deterministic). Byte-level BPE means every string round-trips, whatever the corpus
missed. The result is a ``PreTrainedTokenizerFast`` that saves and loads with
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any hub tokenizer.
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMANDS = [
    "ls -la",
    "cat README.md",
    "grep -rn TODO src",
    "python -m pytest -q",
    "pip install -e .",
    "git diff",
    "git status",
    "sed -n '1,40p' main.py",
    "echo hello > out.txt",
    "wc -l *.py",
    "find . -name '*.py'",
    "head -n 20 data.csv",
    "mkdir -p build",
    "cd src && make",
    "tar -xzf archive.tar.gz",
    "sort input.txt | uniq -c",
    "python solve.py",
    "submit",
]
_WORDS = [
    "the",
    "test",
    "fails",
    "because",
    "function",
    "returns",
    "wrong",
    "value",
    "fix",
    "bug",
    "in",
    "file",
    "write",
    "script",
    "that",
    "prints",
    "count",
    "lines",
    "words",
    "task",
    "repository",
    "error",
    "traceback",
    "expected",
    "actual",
    "result",
    "output",
    "directory",
    "create",
    "read",
    "parse",
    "list",
    "number",
    "string",
    "sum",
    "total",
    "sort",
    "reverse",
    "files",
    "terminal",
]
_PY = [
    "def {f}(x, y):\n    return x {op} y\n",
    "for i in range(len({v})):\n    if {v}[i] {cmp} 0:\n        {v}[i] = -{v}[i]\n",
    "class {C}:\n    def __init__(self, {v}):\n        self.{v} = {v}\n",
    "import os\nimport sys\n\nprint(os.path.join(sys.argv[1], '{v}.txt'))\n",
    "assert {f}({n}, {m}) == {k}\n",
]


def synthetic_corpus(n_docs: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 25)))
        code = rng.choice(_PY).format(
            f=rng.choice(["add", "count", "parse", "total", "solve"]),
            op=rng.choice("+-*/%"),
            cmp=rng.choice(["<", ">", "==", "!="]),
            v=rng.choice(["items", "values", "data", "lines", "path"]),
            C=rng.choice(["Parser", "Counter", "Task", "Result"]),
            n=rng.randint(0, 99),
            m=rng.randint(0, 99),
            k=rng.randint(0, 200),
        )
        cmd = rng.choice(_COMMANDS)
        docs.append(
            f"{IM_START}user\n{words.capitalize()}.{IM_END}\n"
            f"{IM_START}assistant\n```bash\n{cmd}\n```{IM_END}\n{code}"
        )
    return docs


def build_tokenizer(vocab_size: int = 1024, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer; ``vocab_size`` is an upper bound."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
