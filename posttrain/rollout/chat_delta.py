r"""Token-in, token-out context for multi-turn rollouts: the ids of new messages, never a re-encoding.

A multi-turn episode is one token sequence ``prompt | action_0 | context_1 | action_1 | ...``. The
actions are the ids the engine sampled and are kept as they are: decoding them and encoding the
text again can give other ids (a BPE merge across a boundary, a normalized space), and then the
learner would train on tokens the sampler never drew (verl #3960, #6719; TRL #5144). New context
(an environment's reply, a tool result, and the template's glue around them) is tokenized as a
*difference* of two renderings of a fixed base conversation (the "fixed base" approach of SkyRL
and TRL's ``_get_tool_suffix_ids``)::

    A = ids(render([user "x", assistant "y"]))                       # ends with the end-of-turn token
    B = ids(render([user "x", assistant "y", *new], add_generation_prompt=True))
    context = B[len(A'):]   where A' = A cut after its last EOS

so whatever the template puts after the EOS the model sampled (ChatML's ``"\n"``) belongs to the
context, with loss mask 0. :class:`ChatDelta` checks at construction that the template is
prefix-preserving (rendering more messages only appends), for every role the environment uses, and
asserts the prefix again on every call.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

Message = dict[str, str]

_BASE: list[Message] = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]


class TemplateError(ValueError):
    """The tokenizer's chat template cannot carry a multi-turn episode token-in, token-out."""


class ChatDelta:
    """Renders an episode's first prompt and the token ids of context appended after a sampled turn."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, roles: Sequence[str] = ("user", "tool")) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "multi-turn rollouts need a chat template (the tokenizer has none): use an instruct model's "
                "tokenizer, or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        base = self._ids(_BASE)
        if self.eos_id not in base:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the EOS token {tokenizer.eos_token!r}: "
                "a sampled turn that stops at EOS could not be followed by the template's next message"
            )
        self._base_cut = len(base) - base[::-1].index(self.eos_id)  # A' = A up to and including its last EOS
        self._base = base[: self._base_cut]
        for role in roles:  # prefix-preserving for every role the environment appends, and for the next turn
            msg = {"role": role, "content": "3"}
            if role == "tool":  # tool templates (Hermes / Mistral in vLLM) refuse a result without its call
                msg |= {"name": "probe", "tool_call_id": "t00c00000"}
            after = self.context_ids([msg])
            longer = self._ids([*_BASE, msg, {"role": "assistant", "content": "4"}])
            if longer[: len(self._base) + len(after)] != self._base + after:
                raise TemplateError(
                    f"the chat template is not prefix-preserving after a {role!r} message and another assistant "
                    "turn (it rewrites earlier turns), so a multi-turn episode cannot be kept token-in, token-out; "
                    "use a template that only appends"
                )

    def _ids(self, messages: list[Message], generation_prompt: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The ids of the episode's first messages, ending with the generation prompt."""
        return self._ids(messages, generation_prompt=True)

    def context_ids(self, messages: list[Message]) -> list[int]:
        """The ids that follow a sampled turn ending in EOS: template glue, ``messages``, and the next
        generation prompt.
        """
        full = self._ids([*_BASE, *messages], generation_prompt=True)
        if full[: len(self._base)] != self._base:
            raise TemplateError(
                f"rendering {[m['role'] for m in messages]} after an assistant turn changed the tokens before it: "
                "the chat template is not prefix-preserving for these messages"
            )
        return full[len(self._base):]

    def transcript_ids(self, messages: list[Message]) -> tuple[list[int], list[int], list[float]]:
        """A whole conversation (first messages, then assistant turns and the replies between them) as
        an episode row: the prompt ids, the ids after it, and their loss mask (1 on each assistant turn's
        content and its EOS, 0 on context), laid out exactly as the ``multi_turn`` driver lays out a
        sampled episode. Used for multi-turn SFT demonstrations.
        """
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise ValueError("a transcript needs first messages, then at least one assistant turn")
        prompt, ids, mask = self.prompt_ids(messages[:first]), [], []
        i = first
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                turn = list(self.tokenizer(messages[i]["content"], add_special_tokens=False)["input_ids"])
                ids += [*turn, self.eos_id]
                mask += [1.0] * (len(turn) + 1)
                i += 1
                continue
            j = i
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j == len(messages):
                break  # replies after the last assistant turn teach nothing
            ctx = self.context_ids(messages[i:j])
            ids += ctx
            mask += [0.0] * len(ctx)
            i = j
        return prompt, ids, mask
