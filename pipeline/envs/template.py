"""Token in, token out: the ids between an episode's turns, from the model's chat template.

An episode's next prompt is the ids already held (the prompt, every sampled id as
the engine returned it, earlier observations), then the ids that close the
assistant turn and open the observation turn, then the observation's ids, then
the ids that close it and open the next assistant turn. Sampled ids are never
decoded and re-encoded (decoding a turn to parse its tool call is reading only),
so the trainer and the preprocessor see exactly the engine's ids::

    prompt | sampled turn 0 | close, open obs | observation | close, open asst | sampled turn 1
             mask 1           mask 0           mask 0        mask 0            mask 1

:class:`TurnTemplate` finds the two boundary texts by rendering a conversation
with sentinel contents through ``apply_chat_template``, and refuses a template
that is not append-only (one whose rendering of a longer conversation does not
start with the rendering of the shorter one: a template that rewrites earlier
turns, e.g. drops past reasoning, cannot be continued from held ids).
:meth:`TurnTemplate.check` then compares the bridge's ids of a whole
multi-turn conversation with ``apply_chat_template`` over it; the actor runs it at
start-up and refuses to run episodes when they differ.
"""

from __future__ import annotations

from dataclasses import dataclass

ASSISTANT = "ASSISTANTSENTINELTEXT"
OBSERVATION = "OBSERVATIONSENTINELTEXT"


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )


def encode(tokenizer, text: str) -> list[int]:
    """Ids of template text (its special tokens parsed, no BOS added): as
    pipeline.tasks.build_prompt_ids encodes the prompt."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class TurnTemplate:
    """The boundary ids of one tokenizer's chat template for ``observation_role``."""

    tokenizer: object
    observation_role: str
    stop_ids: frozenset[int]
    close_assistant: list[int]  # closes the assistant turn and opens the observation turn
    open_assistant: list[int]  # closes the observation turn and opens the next assistant turn

    @classmethod
    def of(cls, tokenizer, observation_role: str = "user", stop_ids=()) -> TurnTemplate:
        """Read the boundaries from the template; ValueError when it is not append-only."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "episodes need the model's chat template (tokenizer.chat_template is empty): "
                "use an instruct model whose tokenizer has one"
            )
        opening = [{"role": "user", "content": "Q"}]
        turn = [
            {"role": "assistant", "content": ASSISTANT},
            {"role": observation_role, "content": OBSERVATION},
        ]
        head = render(tokenizer, opening, True)
        full = render(tokenizer, opening + turn, True)
        if not full.startswith(head + ASSISTANT) or OBSERVATION not in full:
            raise ValueError(
                "the model's chat template is not append-only: rendering the conversation "
                "with one more assistant and "
                f"{observation_role!r} turn does not start with the rendering before it "
                "(it rewrites earlier turns), so an episode cannot be continued from the "
                "ids it holds; use a template that only appends (e.g. ChatML), or another "
                "task.env observation role"
            )
        rest = full[len(head) + len(ASSISTANT) :]
        between, after = rest.split(OBSERVATION, 1)
        return cls(
            tokenizer,
            observation_role,
            frozenset(int(i) for i in stop_ids),
            encode(tokenizer, between),
            encode(tokenizer, after),
        )

    def prompt(self, messages: list[dict]) -> list[int]:
        """The episode's first prompt: its opening messages, ending where the assistant
        turn starts."""
        return encode(self.tokenizer, render(self.tokenizer, messages, True))

    def bridge(
        self, sampled: list[int], observation: str, max_tokens: int
    ) -> tuple[list[int], bool]:
        """The ids that follow a turn's ``sampled`` ids: the close of the assistant turn
        (less its first id when the model sampled that id itself, e.g. ``<|im_end|>``),
        the observation's ids (cut to ``max_tokens``), the opening of the next assistant
        turn. Returns (ids, whether the observation was cut)."""
        close = self.close_assistant
        if close and sampled and sampled[-1] == close[0] and close[0] in self.stop_ids:
            close = close[1:]
        obs = encode(self.tokenizer, observation)
        cut = len(obs) > max_tokens
        return close + obs[:max_tokens] + self.open_assistant, cut

    def check(self, opening: list[dict] | None = None) -> None:
        """Compare the bridge with ``apply_chat_template`` over a whole three-turn
        conversation (sampled text encoded as a model would emit it); raise ValueError
        naming the first id that differs."""
        opening = opening or [
            {"role": "system", "content": "Use the tool."},
            {"role": "user", "content": "What is 17*23+4?"},
        ]
        turns = ["<calc>17*23</calc>", "<calc>391+4</calc>", "The answer is 395."]
        observations = ["<result>391</result>", "<result>395</result>"]
        ids = self.prompt(opening)
        messages = list(opening)
        for k, text in enumerate(turns):
            sampled = encode(self.tokenizer, text)
            ids += sampled
            messages.append({"role": "assistant", "content": text})
            if k < len(observations):
                ids += self.bridge(sampled, observations[k], 1 << 30)[0]
                messages.append({"role": self.observation_role, "content": observations[k]})
        whole = encode(self.tokenizer, render(self.tokenizer, messages, False))
        if whole[: len(ids)] != ids:
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, whole, strict=False)) if a != b),
                min(len(ids), len(whole)),
            )
            raise ValueError(
                "token in, token out does not reproduce the model's chat template: over a "
                f"three-turn conversation the bridge's ids differ from apply_chat_template's "
                f"at position {at} of {len(ids)} (bridge {ids[at : at + 5]}, template "
                f"{whole[at : at + 5]}); the template's turn boundaries depend on the "
                "content around them, so episodes cannot be continued from held ids. Use a "
                "ChatML-style template or another observation role"
            )
