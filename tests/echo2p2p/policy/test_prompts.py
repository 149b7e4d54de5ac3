"""Prompt rendering: plain text, or a tokenizer's chat template (system prompt, template switches),
on a tokenizer with a chat template saved to disk and loaded back, as a model directory holds it."""

from __future__ import annotations

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from echo2p2p.errors import ConfigError
from echo2p2p.hub.config import HubConfig
from echo2p2p.policy.model import build_char_tokenizer
from echo2p2p.policy.prompts import PLAIN, PromptFormat

# The shape of Qwen3's template: ChatML turns, and `enable_thinking=False` opening the assistant
# turn with an empty think block (Qwen3's own template does exactly this).
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
# Llama's shape: the template itself writes the BOS token.
BOS_TEMPLATE = ("{{ bos_token }}{%- for message in messages %}{{ '[' + message['role'] + '] ' + "
                "message['content'] + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                "{{ '[assistant] ' }}{%- endif %}")


def chat_tokenizer(directory, template: str = QWEN3_STYLE_TEMPLATE, *, adds_bos: bool = False):
    """The built-in character tokenizer with `template` as its chat template, saved to
    `directory` and loaded back with AutoTokenizer (as a model directory gives it)."""
    tokenizer = build_char_tokenizer()
    if adds_bos:  # a tokenizer that puts BOS in front of everything it encodes with specials
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture
def tok(tmp_path):
    return chat_tokenizer(tmp_path / "tok")


def test_chat_ids_are_the_templates_own(tok):
    """Under "chat" the ids are apply_chat_template's with the generation prompt, and the text
    is the ChatML turn the template writes."""
    ids = PromptFormat("chat").encode(tok, "3+4=")
    assert ids == tok.apply_chat_template([{"role": "user", "content": "3+4="}],
                                          add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


def test_auto_uses_the_template_when_there_is_one(tok):
    """"auto" renders through the template if the tokenizer has one, else the plain text."""
    assert PromptFormat().encode(tok, "3+4=") == PromptFormat("chat").encode(tok, "3+4=")
    plain = build_char_tokenizer()
    assert PromptFormat().encode(plain, "3+4=") == plain.encode("3+4=", add_special_tokens=False)
    assert PLAIN.encode(tok, "3+4=") == [tok.convert_tokens_to_ids(c) for c in "3+4="]


def test_system_prompt_and_thinking_switch_render_as_the_template_says(tok):
    """The system prompt is a turn before the user's; enable_thinking=False opens an empty think
    block, enable_thinking=True does not."""
    text = tok.decode(PromptFormat("chat", "Be brief.", {"enable_thinking": False})
                      .encode(tok, "3+4="))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tok.decode(PromptFormat("chat", template_args={"enable_thinking": True})
                          .encode(tok, "3+4="))
    assert thinking.endswith("<|im_start|>assistant\n") and "<think>" not in thinking


def test_bos_comes_once_from_the_template(tmp_path):
    """A template that writes BOS, on a tokenizer that adds BOS when asked to: one BOS."""
    tok = chat_tokenizer(tmp_path / "tok", BOS_TEMPLATE, adds_bos=True)
    bos = tok.bos_token_id
    assert tok.encode("x")[0] == bos  # the tokenizer would add one
    ids = PromptFormat("chat").encode(tok, "3+4=")
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(ids[1:]) == "[user] 3+4=\n[assistant] "


def test_chat_without_a_template_fails_at_start_up_naming_the_fix():
    """"chat" on a tokenizer without a template is a ConfigError naming prompt_format and the
    way out; a system prompt or template args without a template likewise."""
    plain = build_char_tokenizer()
    with pytest.raises(ConfigError, match="no.*set prompt_format = \"plain\"") as err:
        PromptFormat("chat").check(plain, "'tiny'")
    assert err.value.field == "prompt_format" and "'tiny'" in str(err.value)
    with pytest.raises(ConfigError, match="prompt_format"):
        PromptFormat("chat").encode(plain, "3+4=")
    with pytest.raises(ConfigError) as err:
        PromptFormat(system_prompt="Be brief.").check(plain)
    assert err.value.field == "system_prompt"
    with pytest.raises(ConfigError) as err:
        PromptFormat(template_args={"enable_thinking": False}).check(plain)
    assert err.value.field == "chat_template_args"
    assert PromptFormat().check(plain) == PromptFormat()


def test_hub_config_fields_make_the_format():
    """prompt_format, system_prompt and chat_template_args (JSON) become the PromptFormat; bad
    values are ConfigErrors naming the field."""
    cfg = HubConfig.from_flat(prompt_format="chat", system_prompt="Be brief.",
                    chat_template_args='{"enable_thinking": false}')
    assert cfg.tasks.prompts == PromptFormat("chat", "Be brief.", {"enable_thinking": False})
    assert HubConfig().tasks.prompts == PromptFormat("auto")
    for fields, name in [({"prompt_format": "markdown"}, "prompt_format"),
                         ({"chat_template_args": "{enable_thinking: false}"}, "chat_template_args"),
                         ({"chat_template_args": "[1]"}, "chat_template_args")]:
        with pytest.raises(ConfigError) as err:
            HubConfig.from_flat(**fields)
        assert err.value.field == name


def test_a_conversation_renders_through_the_template_as_it_is(tok):
    """A conversational prompt (TRL's format) is the template's messages as given: the run's
    system prompt goes before it unless it has its own; without a template, its contents."""
    convo = [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+4="}]
    ids = PromptFormat("chat", "Be brief.").encode(tok, convo)
    assert ids == tok.apply_chat_template(convo, add_generation_prompt=True, return_dict=False)
    user_only = convo[1:]
    assert tok.decode(PromptFormat("chat", "Be brief.").encode(tok, user_only)).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+4=")
    plain = build_char_tokenizer()
    assert PromptFormat().encode(plain, convo) == plain.encode("Add.\n3+4=", add_special_tokens=False)


def test_an_observation_becomes_a_user_turn_of_the_template(tmp_path):
    """The text around an observation: the template's close of the model's turn (less the EOS
    the model wrote itself), the user turn, and the next assistant turn's opening; nothing
    under plain prompts."""
    tok = chat_tokenizer(tmp_path / "tok")
    chat = PromptFormat("chat")
    assert chat.observation_turn(tok) == ("<|im_end|>\n<|im_start|>user\n",
                                          "<|im_end|>\n<|im_start|>assistant\n")
    tok.eos_token = "<|im_end|>"  # a ChatML model ends its turn with the template's close
    assert chat.observation_turn(tok)[0] == "\n<|im_start|>user\n"
    thinking_off = PromptFormat("chat", template_args={"enable_thinking": False})
    assert thinking_off.observation_turn(tok)[1].endswith("<think>\n\n</think>\n\n")
    assert PLAIN.observation_turn(tok) == ("", "")


def test_a_template_that_drops_the_models_turns_cannot_frame_observations(tmp_path):
    """A template that leaves assistant turns out (some do, for history) cannot make an
    observation a user turn after one: a ConfigError naming the way out, not a traceback."""
    drops = ("{%- for message in messages %}{%- if message['role'] != 'assistant' %}"
             "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
             "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
             "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(ConfigError, match="--prompt-format plain") as err:
        PromptFormat("chat").observation_turn(chat_tokenizer(tmp_path / "tok", drops))
    assert err.value.field == "prompt_format"
