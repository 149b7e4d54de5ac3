"""How a task's prompt text becomes the token ids the hub leases: plain, or through a chat template.

`PromptFormat.encode(tokenizer, prompt)` is the one function from prompt text to prompt ids. The
hub calls it once per problem and leases the ids; its evaluation, the synchronous baseline and
the spot-check benches call it too, so every part of a run scores and samples the same ids. Peers
never render a prompt themselves: they take the ids from the lease.

- "plain": the text as the tokenizer encodes it, no special tokens added (the built-in model);
- "chat": the text as the user message of `tokenizer.apply_chat_template`, with the system
  prompt before it and the generation prompt after (`add_generation_prompt=True`), and
  `template_args` passed to the template as variables (Qwen3's `enable_thinking=False`);
- "auto": "chat" when the tokenizer has a chat template, else "plain".
A prompt may also be a conversation (TRL's conversational format: {"role", "content"}
messages): under "chat" the template renders it as it is (after the system prompt, unless it
has its own system message); under "plain" its contents, one per line. An environment's
observations that are user turns (the Gymnasium and verifiers adapters') are wrapped in the
template's turn markup under "chat" (`observation_turn`).
The template's own text decides the special tokens: a template that writes `{{ bos_token }}`
gets one BOS, never a second from the tokenizer. Knows nothing of tasks, peers or files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from echo2p2p.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODES = ("auto", "chat", "plain")
Prompt = str | Sequence[Mapping[str, str]]  # text, or {"role", "content"} messages


class Prompted(Protocol):
    """What has a prompt: a `Problem`, or a bench's stand-in with its text alone."""

    @property
    def prompt(self) -> str: ...


def prompt_of(problem: Prompted) -> Prompt:
    """What a problem's prompt is rendered from: a conversational row's messages
    (`Problem.messages`), else its text (a stand-in problem may carry text alone)."""
    return getattr(problem, "messages", None) or problem.prompt


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` carries a chat template (a string, or a dict of named ones)."""
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptFormat:
    """How prompts are rendered; check it against the run's tokenizer at start-up (`check`)."""

    mode: str = "auto"
    system_prompt: str = ""
    template_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError("prompt_format", f"one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.template_args, Mapping) or not all(
                isinstance(k, str) for k in self.template_args):
            raise ConfigError("chat_template_args", "must be a mapping of names to values")

    def uses_chat(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        """Whether prompts go through `tokenizer`'s chat template under this format."""
        return self.mode == "chat" or (self.mode == "auto" and has_chat_template(tokenizer))

    def check(self, tokenizer: PreTrainedTokenizerBase, model: str = "the model") -> PromptFormat:
        """This format, if `tokenizer` can render it; else ConfigError naming the field to fix.
        Call at start-up, before any prompt is leased."""
        if self.mode == "chat" and not has_chat_template(tokenizer):
            raise ConfigError("prompt_format", f"'chat' needs a chat template, and the tokenizer "
                              f"of {model} has none: set prompt_format = \"plain\" (or \"auto\"), "
                              f"or give the model one (chat_template.jinja beside its tokenizer)")
        if not self.uses_chat(tokenizer):
            for name, value in (("system_prompt", self.system_prompt),
                                ("chat_template_args", self.template_args)):
                if value:
                    raise ConfigError(name, f"is only rendered through a chat template, and the "
                                      f"tokenizer of {model} has none: remove it, or use a "
                                      f"model whose tokenizer has a chat template")
        return self

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The conversation a prompt becomes under "chat": [system,] user; a conversation
        [system,] as it is."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if isinstance(prompt, str):
            return [*system, {"role": "user", "content": prompt}]
        own = any(m["role"] == "system" for m in prompt)
        return [*([] if own else system), *prompt]

    def encode(self, tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
        """The prompt ids of `prompt` (text or a conversation), exactly as the hub leases them."""
        if not self.uses_chat(tokenizer):
            # here, not at the top: the tasks package brings math-verify, which --help skips
            from echo2p2p.tasks.records import conversation_text

            text = prompt if isinstance(prompt, str) else conversation_text(prompt)
            return list(tokenizer.encode(text, add_special_tokens=False))
        if not has_chat_template(tokenizer):
            self.check(tokenizer)  # raises: "chat" without a template
        # The template is tokenized without the tokenizer's special tokens (transformers does
        # so itself): a BOS comes from the template's text or not at all.
        ids = list(tokenizer.apply_chat_template(
            self.messages(prompt), add_generation_prompt=True, tokenize=True, return_dict=False,
            **dict(self.template_args)))
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and ids[:2] == [bos, bos]:  # a template that writes BOS twice
            ids = ids[1:]
        return ids

    def observation_turn(self, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
        """(before, after): the text that makes an environment's observation a user turn of the
        chat template, after a model turn that ended with EOS: before it, the template's close
        of the assistant turn (less the EOS the model wrote) and the user turn's opening; after
        it, the user turn's close and the next assistant turn's opening (the generation
        prompt). ("", "") when prompts are plain (the observation is appended as it is)."""
        if not self.uses_chat(tokenizer):
            return "", ""
        said, seen = "ECHO2ASSISTANTTURN", "ECHO2OBSERVATION"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "ECHO2PROMPT"}, {"role": "assistant", "content": said},
             {"role": "user", "content": seen}], add_generation_prompt=True, tokenize=False,
            **dict(self.template_args))
        if text.count(said) != 1 or text.count(seen) != 1 or text.index(said) > text.index(seen):
            raise ConfigError("prompt_format", "the chat template does not render a user turn "
                              "after the model's turn as it was given, so an environment's "
                              "observations cannot be its user turns: use --prompt-format plain")
        before, after = text[text.index(said) + len(said):].split(seen)
        eos = getattr(tokenizer, "eos_token", None) or ""
        return before.removeprefix(eos) if eos else before, after


PLAIN = PromptFormat(mode="plain")
