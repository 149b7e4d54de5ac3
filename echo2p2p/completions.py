"""What text a completion's token ids stand for: the one rule the engines and the hub share.

A completion is the token ids sampled after the prompt, through the first end-of-sequence token
(kept: the learner also trains on when to stop); ids after it are no part of it. Its text is
`tokenizer.decode(ids, skip_special_tokens=True)`. The peer's engines build their `text` with
`CompletionDecoder.completion`, and the hub decodes every submitted sample with the same method
before scoring, so the reward is always that of what the learner trains on; a peer's own `text`
is only a hint.

Knows nothing of tensors or tasks: a tokenizer is anything with `decode(ids,
skip_special_tokens=...)` and `eos_token_id`, and for checking ids from the wire `len()` (a
transformers tokenizer has all three).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .messages import unpack_ids


class Tokenizer(Protocol):
    """What the completion rule asks of a tokenizer (a transformers one has it; the core never
    imports transformers)."""

    eos_token_id: int | None

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class DecodedCompletion:
    """One completion as the protocol defines it."""

    token_ids: list[int]  # through the first EOS, which is kept; all of them without one
    text: str  # decoded without special tokens: what a reward function scores
    stopped: bool  # the completion ends with EOS (finish_reason "stop"), else it hit the cap


class CompletionDecoder:
    """A tokenizer seen through the completion rule; picklable whenever the tokenizer is
    (transformers tokenizers are), so a scoring worker process can hold one."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer: Tokenizer | None = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id  # looked up once: it is not cheap
        # Ids the tokenizer can decode (others it would drop); only `from_wire` needs it.
        self.vocab_size: int | None = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        self._backend = _backend(tokenizer)
        self._decode = tokenizer.decode if self._backend is None else self._backend.decode

    def completion(self, row: Sequence[int]) -> DecodedCompletion:
        """`row` (sampled ids, possibly padded after EOS) cut after its first EOS, and its text."""
        ids = row if type(row) is list else list(row)  # never modified, so not copied
        stopped = self.eos_id is not None and self.eos_id in ids
        if stopped:
            ids = ids[:ids.index(self.eos_id) + 1]
        return DecodedCompletion(ids, self._decode(ids, skip_special_tokens=True), stopped)

    def encode(self, text: str) -> list[int]:
        """`text`'s ids, no special tokens added: how an environment's observation becomes
        tokens (`echo2p2p.episodes`)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def turn_text(self, ids: list[int]) -> str | None:
        """A model turn's action text, or None if `ids` are no turn (ids after an EOS)."""
        done = self.completion(ids)
        return done.text if len(done.token_ids) == len(ids) else None

    def ids_from_wire(self, packed_ids: bytes) -> list[int] | None:
        """The ids packed on the wire, or None: empty, or one outside the vocabulary."""
        if self.vocab_size is None:
            raise TypeError("checking ids needs a tokenizer with len(), its vocabulary size")
        if not packed_ids or len(packed_ids) % 4:
            return None
        ids = unpack_ids(packed_ids)
        return ids if max(ids) < self.vocab_size else None  # uint32: never negative

    def from_wire(self, packed_ids: bytes) -> DecodedCompletion | None:
        """The completion packed on the wire as `packed_ids`, or None if it is not one: empty,
        an id outside the tokenizer's vocabulary (which `decode` would silently skip), or ids
        after an EOS (the learner would train on tokens the score never saw)."""
        ids = self.ids_from_wire(packed_ids)
        if ids is None:
            return None
        done = self.completion(ids)
        return done if len(done.token_ids) == len(ids) else None

    def __getstate__(self) -> dict[str, Any]:
        if self._backend is None:
            return {"tokenizer": self.tokenizer}
        # Only the Rust backend travels: a scoring worker then starts without transformers.
        return {"backend": self._backend, "eos_id": self.eos_id, "vocab_size": self.vocab_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "tokenizer" in state:
            self.__init__(state["tokenizer"])
            return
        self.tokenizer = None
        self.eos_id, self.vocab_size, self._backend = (
            state["eos_id"], state["vocab_size"], state["backend"])
        self._decode = self._backend.decode


def _backend(tokenizer: Tokenizer) -> Any:  # Any: a `tokenizers.Tokenizer`, not imported here
    """The `tokenizers.Tokenizer` whose `decode` returns exactly what `tokenizer.decode` does,
    or None (then `tokenizer.decode` itself is called).

    A transformers fast tokenizer's `decode` converts every id to a Python object first (half
    its time on a 256-token completion, and the hub decodes every sample), then calls its Rust
    backend and, only if `clean_up_tokenization_spaces`, post-processes the text. Without that
    clean-up the backend's answer is `decode`'s, so it is asked directly.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None
