"""The Llama-3.1 tool-call format: chosen from the target's chat template, drafted with
"parameters" (bare and after <|python_tag|>), lossless. The target is a tiny random Llama with a
Llama-3.1-style chat template written for this test, trained for a moment to write one call."""

from __future__ import annotations

import pytest
import torch
from toolcall_cases import CITY_TOOLS
from toolcall_cases import qwen_tok as qwen_tok

from toolspec_core.drafters.methods import RequestInfo, make_method
from toolspec_core.drafters.toolcall.parse import parse_tool_calls
from toolspec_core.engine.budget import CostModel
from toolspec_core.engine.loop import DecodeConfig, generate
from toolspec_core.model.prompting import render_prompt
from toolspec_core.model.target import from_model
from toolspec_core.spec.labels import CALL_KEY
from toolspec_core.spec.layouts import LAYOUTS, LLAMA, LLAMA_LAYOUTS, LLAMA_TAG, layouts_for, opened_by

# The shape of Llama 3.1's template: tools in the first user message, the "parameters" format asked
# for, calls rendered as that JSON, tool results in the ipython role.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- message.content }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for tc in message.tool_calls %}"
    "{{- '{\"name\": \"' + tc.function.name + '\", \"parameters\": ' + tc.function.arguments | tojson + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIAL = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
TOOLS = CITY_TOOLS[:1]
MESSAGES = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'


@pytest.fixture(scope="module")
def llama_tok():
    from transformers import AutoTokenizer

    from toolspec_core.model.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.bos_token = "<|begin_of_text|>"
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA31_TEMPLATE
    return tok


def _parrot(tok, prompt: list[int], out: list[int]):
    """A tiny random Llama trained (Adam, its input embeddings frozen, loss on the output only: a
    few seconds) until greedy decoding after ``prompt`` writes ``out``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.model.embed_tokens.weight.requires_grad_(False)
    ids = torch.tensor([prompt + out])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(300):
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]  # [len(out), H]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), ids[0, len(prompt) :])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    return from_model(model.eval(), tok, "tiny-llama")


def test_the_llama_layouts_come_from_the_chat_template(llama_tok, qwen_tok):
    assert layouts_for(llama_tok) is LLAMA_LAYOUTS and layouts_for(qwen_tok) is LAYOUTS
    assert opened_by("", LLAMA_LAYOUTS) is LLAMA and opened_by("<|python_tag|>", LLAMA_LAYOUTS) is LLAMA_TAG
    assert "parameters" in llama_tok.decode(render_prompt(llama_tok, MESSAGES, TOOLS))


@pytest.mark.parametrize("tag", ["", "<|python_tag|>"], ids=["bare", "python_tag"])
def test_llama_calls_are_drafted_with_parameters_and_greedy_is_unchanged(llama_tok, tag):
    tok = llama_tok
    prompt = render_prompt(tok, MESSAGES, TOOLS)
    end = tok.convert_tokens_to_ids("<|eom_id|>" if tag else "<|eot_id|>")
    out = tok.encode(tag + CALL, add_special_tokens=False) + [end]
    tg = _parrot(tok, prompt, out)
    cfg = DecodeConfig(max_new_tokens=len(out) + 4)
    plain = generate(tg, prompt, None, cfg)
    assert plain.tokens == out, tok.decode(plain.tokens)  # the parrot writes the call
    method = make_method("toolspec_schema", tok)
    assert method.layouts is LLAMA_LAYOUTS
    spec = generate(tg, prompt, method.drafter(RequestInfo(prompt, TOOLS)), cfg, CostModel.flat())
    assert spec.tokens == plain.tokens and spec.text == plain.text
    assert spec.stats.label_accepted.get(CALL_KEY, 0) > 0  # '", "parameters": {"' drafted and kept
    assert sum(spec.stats.accepted) > len(out) // 3 and spec.stats.forwards < len(out) // 2
    ((call,),) = [parse_tool_calls(spec.text).calls]
    assert call.name == "get_weather" and call.arguments == {"city": "Paris", "unit": "celsius"}


def test_a_forced_llama_call_uses_parameters(llama_tok):
    """tool_choice "required" on a Llama target: the grammar's call object takes "parameters"."""
    from toolspec_core.engine.grammar import make_tool_constraint

    c = make_tool_constraint(llama_tok, TOOLS, "required", len(llama_tok))
    for t in llama_tok.encode('{"name": "get_weather", "', add_special_tokens=False):
        c.consume(t)
    ok = llama_tok.encode("parameters", add_special_tokens=False)[0]
    bad = llama_tok.encode("arguments", add_special_tokens=False)[0]
    assert bool(c.mask()[ok]) and not bool(c.mask()[bad])
