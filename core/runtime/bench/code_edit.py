"""Code-editing chat prompts for ``runtime bench latency --dataset code-edit``.

Each prompt gives a short Python function and asks for it back with a small change, so the
answer rewrites most of the given code: the workload where speculative decoding pays
(ngram finds the answer's next tokens in the prompt; a small draft model of the same family
predicts them). Prompts are chat-templated with the model's own tokenizer.
"""

from __future__ import annotations

SNIPPETS = [
    '''def count_words(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.lower().strip(".,;:!?")
                if word in counts:
                    counts[word] = counts[word] + 1
                else:
                    counts[word] = 1
    return counts
''',
    '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)
''',
    '''def binary_search(values, target):
    low = 0
    high = len(values) - 1
    while low <= high:
        middle = (low + high) // 2
        if values[middle] == target:
            return middle
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
''',
    '''def parse_config(lines):
    config = {}
    section = None
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            config[section] = {}
            continue
        key, value = line.split("=", 1)
        config[section][key.strip()] = value.strip()
    return config
''',
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
''',
]

INSTRUCTIONS = [
    "Rename the variable `{name}` to `{new}` everywhere and reply with the whole code only.",
    "Add type hints to every function signature and reply with the whole code only.",
]
RENAMES = [("counts", "frequencies"), ("merged", "result"), ("items", "elements"), ("middle", "mid"),
           ("section", "current_section"), ("total", "running_sum")]


def code_edit_messages() -> list[list[dict]]:
    """One chat per (snippet, instruction), snippets first: a batch of n takes n snippets."""
    chats = []
    for kind in range(len(INSTRUCTIONS)):
        for snippet, (name, new) in zip(SNIPPETS, RENAMES):
            task = INSTRUCTIONS[kind].format(name=name, new=new)
            chats.append([{"role": "user", "content": f"{task}\n\n```python\n{snippet}```"}])
    return chats


def code_edit_prompts(model: str, num_prompts: int, trust_remote_code: bool = False) -> list[list[int]]:
    """``num_prompts`` chat-templated prompts as token ids (cycling when more are asked for)."""
    from runtime.model_loader import get_tokenizer, resolve_model

    tokenizer = get_tokenizer(resolve_model(model, trust_remote_code=trust_remote_code))
    chats = code_edit_messages()
    texts = [tokenizer.apply_chat_template(chats[i % len(chats)], tokenize=False, add_generation_prompt=True)
             for i in range(num_prompts)]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]  # as LLM.chat encodes them
