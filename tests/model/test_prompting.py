"""The chat template's turn-end tokens: which ids end an assistant turn and stop generation."""

from __future__ import annotations

from types import SimpleNamespace

from toolspec_core.model.prompting import eos_ids_of, turn_end_ids, turn_end_tokens


class Vocab:
    """A tokenizer's special-token lookup: unknown tokens map to ``unk_token_id``."""

    unk_token_id = 0

    def __init__(self, ids: dict[str, int], eos: int | None = None):
        self.ids, self.eos_token_id = ids, eos

    def convert_tokens_to_ids(self, tok: str) -> int:
        return self.ids.get(tok, self.unk_token_id)


def test_turn_end_ids_are_the_templates_tokens_then_the_eos():
    llama = Vocab({"<|eot_id|>": 7, "<|eom_id|>": 8, "<|end_of_text|>": 9}, eos=9)
    assert turn_end_tokens(llama) == [7, 8]  # in TURN_END_TOKENS' order; the unknown ones (unk) left out
    assert turn_end_ids(llama) == [7, 8, 9]
    qwen = Vocab({"<|im_end|>": 5, "<|endoftext|>": 6}, eos=5)
    assert turn_end_ids(qwen) == [5, 6]  # the EOS once, though it is also a turn-end token


def test_eos_ids_add_the_generation_configs():
    tok = Vocab({"<|im_end|>": 5}, eos=None)
    assert eos_ids_of(SimpleNamespace(), tok) == (5,)
    assert eos_ids_of(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=3)), tok) == (3, 5)
    assert eos_ids_of(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[9, 5])), tok) == (5, 9)
